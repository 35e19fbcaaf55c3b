"""One MoE layer for the layer benchmarks (``bench_fused_moe_lora.py`` and its decode ablation, ``decode_ablation.py``):
weight sets, LoRA stacks, batches, the unfused plain-torch baseline, HF's experts, the HBM bytes a perfect kernel
moves, and CUDA-graph timing. CUDA only; a module, not a script.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

import moe_lora_compile  # noqa: F401  (registers torch.ops.moe_lora)
from moe_lora_compile.ops.contract import NO_ADAPTER
from moe_lora_compile.ops.layout import is_interleaved, is_transposed, split_gate_up, w13_shape, w2_shape
from moe_lora_compile.shapes import MoEGeometry


@dataclass
class Layer:
    """One full weight set of a model (bf16): base weights in the model's layout, biases, and LoRA stacks per (L, R)."""

    geometry: MoEGeometry
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    hf: torch.nn.Module | None
    lora: dict


def make_layer(g: MoEGeometry, seed: int) -> Layer:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s, std: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16) * std
    w13 = rnd(*w13_shape(g.layout, g.E, g.H, g.I), std=g.H ** -0.5)
    w2 = rnd(*w2_shape(g.layout, g.E, g.H, g.I), std=g.I ** -0.5)
    b13 = rnd(g.E, 2 * g.I, std=0.1) if g.bias else None
    b2 = rnd(g.E, g.H, std=0.1) if g.bias else None
    layer = Layer(g, w13, w2, b13, b2, None, {})
    try:
        layer.hf = make_hf_experts(layer)
    except Exception as exc:  # an HF version without these classes: the column is left empty
        print(f"# hf experts unavailable: {exc!r}", flush=True)
    return layer


def lora_stacks(layer: Layer, L: int, R: int):
    """(A13 [L,E,R,H], B13 [L,E,2I,R], A2 [L,E,R,I], B2 [L,E,H,R]) bf16, contiguous, cached per (L, R)."""
    if (L, R) not in layer.lora:
        g = layer.geometry
        gen = torch.Generator(device="cuda").manual_seed(L * 1000 + R)
        rnd = lambda *s, std: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16) * std
        layer.lora[(L, R)] = (rnd(L, g.E, R, g.H, std=g.H ** -0.5), rnd(L, g.E, 2 * g.I, R, std=0.1 * R ** -0.5),
                              rnd(L, g.E, R, g.I, std=g.I ** -0.5), rnd(L, g.E, g.H, R, std=0.1 * R ** -0.5))
    return layer.lora[(L, R)]


def make_hf_experts(layer: Layer) -> torch.nn.Module:
    """transformers' experts module of this geometry on our weights, dispatched to its ``grouped_mm`` forward."""
    g = layer.geometry
    if g.name.startswith("gpt-oss"):
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls
        cfg = GptOssConfig(hidden_size=g.H, intermediate_size=g.I, num_local_experts=g.E, num_experts_per_tok=g.k)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls
        cfg = Qwen3MoeConfig(hidden_size=g.H, moe_intermediate_size=g.I, num_experts=g.E, num_experts_per_tok=g.k)
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        module = cls(cfg)
    params = {"gate_up_proj": layer.w13, "down_proj": layer.w2, "gate_up_proj_bias": layer.w13_bias,
              "down_proj_bias": layer.w2_bias}
    for name, _ in list(module.named_parameters()):
        setattr(module, name, torch.nn.Parameter(params[name], requires_grad=False))
    return module


def make_batch(g: MoEGeometry, T: int, L: int, no_lora_fraction: float, seed: int):
    """x [T,H] bf16, topk_ids [T,k] int32 (softmax-top-k of random logits), topk_weights bf16, lora ids [T] int32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, g.H, device="cuda", generator=gen, dtype=torch.bfloat16)
    logits = torch.randn(T, g.E, device="cuda", generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, -1), g.k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    lora_ids = torch.randint(0, L, (T,), device="cuda", generator=gen, dtype=torch.int32)
    no_lora = torch.rand(T, device="cuda", generator=gen) < no_lora_fraction
    lora_ids = torch.where(no_lora, NO_ADAPTER, lora_ids).to(torch.int32)
    return x, ids.to(torch.int32), weights, lora_ids


def bytes_moved(g: MoEGeometry, R: int, batch, expert_nbytes: int | None = None) -> int:
    """HBM bytes a perfect kernel moves: active experts' weights and biases (bf16, or ``expert_nbytes`` per
    expert: MXFP4), active (slot, expert) LoRA factors (A13, B13, A2, B2 at rank R), x in and y out (bf16)."""
    x, ids, _, lora_ids = batch
    experts = ids.long()
    n_experts = int(torch.unique(experts).numel())
    base = n_experts * 3 * g.I * g.H * 2 + (n_experts * (2 * g.I + g.H) * 2 if g.bias else 0)
    if expert_nbytes is not None:
        base = n_experts * expert_nbytes
    slots = lora_ids.long()[:, None].expand_as(experts)
    has = slots >= 0
    n_pairs = int(torch.unique((slots * g.E + experts)[has]).numel())
    lora = n_pairs * R * (g.H + 2 * g.I + g.I + g.H) * 2
    return base + lora + 2 * x.numel() * 2


def _grouped_mm(a, b, offs):
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def unfused_layer(layer: Layer, lora, x, topk_ids, topk_weights, lora_ids):
    """Plain torch: grouped_mm base GEMMs, LoRA as grouped_mm over (slot, expert) groups (pairs without adapter
    sorted past the last group and masked), gathers and scatters between the two orders. y [T, H] bf16."""
    g = layer.geometry
    a13, b13, a2, b2 = lora
    L, R = a13.shape[0], a13.shape[2]
    T, k = topk_ids.shape
    experts = topk_ids.reshape(-1)
    slots = lora_ids.repeat_interleave(k)
    order = torch.argsort(experts)
    offs = torch.cumsum(torch.histc(experts.int(), bins=g.E, min=0, max=g.E - 1), 0).to(torch.int32)
    key = torch.where(slots >= 0, slots * g.E + experts, L * g.E)
    korder = torch.argsort(key)
    koffs = torch.cumsum(torch.histc(key.int(), bins=L * g.E, min=0, max=L * g.E - 1), 0).to(torch.int32)
    kmask = (key[korder] < L * g.E).to(x.dtype)[:, None]
    transposed = is_transposed(g.layout)
    w13 = layer.w13 if transposed else layer.w13.transpose(1, 2)  # [E, H, 2I]
    w2 = layer.w2 if transposed else layer.w2.transpose(1, 2)  # [E, I, H]

    def lora_delta(inp_pairs, a, b):  # inp_pairs [P, in] in pair order -> [P, out] in pair order
        s = _grouped_mm(inp_pairs[korder], a.reshape(L * g.E, R, -1).transpose(1, 2), koffs)
        d = _grouped_mm(s, b.reshape(L * g.E, -1, R).transpose(1, 2), koffs) * kmask
        out = torch.empty_like(d)
        out[korder] = d
        return out

    x_pairs = x.repeat_interleave(k, dim=0)
    h = _grouped_mm(x_pairs[order], w13, offs)
    h_pairs = torch.empty_like(h)
    h_pairs[order] = h
    h_pairs = h_pairs + lora_delta(x_pairs, a13, b13)
    if layer.w13_bias is not None:
        h_pairs = h_pairs + layer.w13_bias[experts]
    gate, up = split_gate_up(h_pairs, g.layout)
    if is_interleaved(g.layout):  # GPT-OSS: its clamped swiglu
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    else:
        act = torch.nn.functional.silu(gate) * up
    o = _grouped_mm(act[order].contiguous(), w2, offs)
    o_pairs = torch.empty_like(o)
    o_pairs[order] = o
    o_pairs = o_pairs + lora_delta(act, a2, b2)
    if layer.w2_bias is not None:
        o_pairs = o_pairs + layer.w2_bias[experts]
    return (o_pairs * topk_weights.reshape(-1, 1)).view(T, k, g.H).sum(1)


def time_graph(calls, warmup_ms: int, rep_ms: int) -> float:
    """Median us per call of ``calls`` (a list of thunks) captured into one CUDA graph, L2 flushed per replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(graph.replay, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    del graph
    return ms * 1e3 / len(calls)


def op_call(layer: Layer, lora, batch):
    g = layer.geometry
    x, ids, w, lora_ids = batch
    return lambda: torch.ops.moe_lora.fused_moe_lora(
        x, ids, w, lora_ids, layer.w13, layer.w2, *lora, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        layout=g.layout, activation=g.activation)


def launcher_call(layer: Layer, lora, batch, cfg):
    """The Triton launcher itself with config ``cfg`` (a MoEKernelConfig): one call per config, no tuned lookup."""
    from moe_lora_compile.ops.triton.launch import fused_moe_lora_triton
    g = layer.geometry
    x, ids, w, lora_ids = batch
    return lambda: fused_moe_lora_triton(
        x, ids, w, lora_ids, layer.w13, layer.w2, *lora, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        layout=g.layout, activation=g.activation, config=cfg)


def no_adapter(batch):
    """The batch with every token at NO_ADAPTER (base layer only)."""
    return (*batch[:3], torch.full_like(batch[3], NO_ADAPTER))


def fmt(v) -> str:
    """A table cell: '-' for None, 3 significant digits."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"
    return str(v)


def copy_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of 20 copies of 1 GiB."""
    if device.type != "cuda":
        return float("nan")
    import triton
    src = torch.empty(2**30 // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)
