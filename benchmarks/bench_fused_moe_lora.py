"""Benchmark of one MoE layer with per-token multi-LoRA on a CUDA GPU (a script, not a test).

For each config (model geometry from :mod:`moe_lora_compile.shapes`, tokens T, adapter slots L, rank R, fraction of
tokens without adapter) it times, as medians of ``triton.testing.do_bench`` over CUDA-graph replays (L2 flushed
before each replay; each replay runs the layer on ``--sets`` different batches alternating between two full weight
sets, so expert weights are not L2-warm):

- ``ours``: ``torch.ops.moe_lora.fused_moe_lora`` (Triton: base + LoRA, the whole layer);
- ``base``: the same op with every token at id -1 (base layer only; the LoRA kernels early-exit);
- ``unfused``: plain torch: ``grouped_mm`` base + LoRA as grouped_mm over (slot, expert) groups, gathers, scatter;
- ``hf``: transformers' ``grouped_mm`` experts forward (base only, HF's default path);
- ``delta = ours - base``: the time LoRA adds to our layer (our LoRA is fused into the base GEMMs);
- bytes: active experts' weights (+biases) + active (slot, expert) LoRA factors + x and y; ``floor`` = bytes at
  ``--hbm-tbs`` TB/s; GB/s and % of floor for ``ours``.

    python benchmarks/bench_fused_moe_lora.py --json results.json --md results.md [--quick]

``--decode-ablation`` (a few minutes) instead times, per model, T in {1, 8, 32}, L=4, R in {16, 64} (every token
with an adapter), in the same run and conditions: the whole layer with programmatic dependent launch off/on and,
where the config's path is per-pair, the w2 + top-k sum fused/unfused; the per-pair path forced where the config
picks the sorted one; the op's default; and base-only (every token -1) with PDL off/on:

    python benchmarks/bench_fused_moe_lora.py --decode-ablation --json ablation.json --md ablation.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass

import torch
import triton

import moe_lora_compile  # noqa: F401  (registers torch.ops.moe_lora)
from moe_lora_compile.ops.contract import NO_ADAPTER
from moe_lora_compile.ops.layout import is_interleaved, is_transposed, split_gate_up, w13_shape, w2_shape
from moe_lora_compile.shapes import BENCHMARK_GRID, MODELS, MoEGeometry

# vLLM's fused MoE LoRA delta (w13 + w2 of one layer, LoRA only) on this H200, bf16, CUDA graphs (shared/FACTS.md):
# (model, T, L, R) -> us.
VLLM_LORA_DELTA_US = {
    ("gpt-oss-20b", 1, 4, 16): 52, ("gpt-oss-20b", 1, 4, 64): 123, ("gpt-oss-20b", 32, 16, 64): 172,
    ("gpt-oss-20b", 512, 4, 16): 156, ("gpt-oss-20b", 512, 16, 64): 728,
    ("qwen3-30b-a3b", 1, 4, 16): 28, ("qwen3-30b-a3b", 32, 4, 16): 54, ("qwen3-30b-a3b", 512, 16, 64): 1120,
}


@dataclass(frozen=True)
class BenchConfig:
    model: str
    T: int
    L: int
    R: int
    no_lora_fraction: float


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


def bytes_moved(g: MoEGeometry, R: int, batch) -> int:
    """HBM bytes a perfect kernel moves: active experts' weights and biases, active (slot, expert) LoRA factors
    (A13, B13, A2, B2 at rank R), x in and y out (bf16)."""
    x, ids, _, lora_ids = batch
    experts = ids.long()
    n_experts = int(torch.unique(experts).numel())
    base = n_experts * 3 * g.I * g.H * 2 + (n_experts * (2 * g.I + g.H) * 2 if g.bias else 0)
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


def run(configs, sets: int, hbm_tbs: float, warmup_ms: int, rep_ms: int, columns: set, on_row=None):
    results = []
    layers: dict[str, list[Layer]] = {}
    base_cache: dict = {}
    for i, c in enumerate(configs):
        g = MODELS[c.model]
        if c.model not in layers:
            layers.clear()
            torch.cuda.empty_cache()
            layers[c.model] = [make_layer(g, seed) for seed in (1, 2)]
        lay = layers[c.model]
        batches = [make_batch(g, c.T, c.L, c.no_lora_fraction, seed=100 + s) for s in range(sets)]
        stacks = [lora_stacks(lay[s % 2], c.L, c.R) for s in range(sets)]
        t0 = time.time()
        row = dataclasses.asdict(c)
        row["ours_us"] = time_graph([op_call(lay[s % 2], stacks[s], batches[s]) for s in range(sets)],
                                    warmup_ms, rep_ms)
        base_key = (c.model, c.T)
        if base_key not in base_cache:
            base_batches = [(b[0], b[1], b[2], torch.full_like(b[3], NO_ADAPTER)) for b in batches]
            base_cache[base_key] = {"base_us": time_graph(
                [op_call(lay[s % 2], stacks[s], base_batches[s]) for s in range(sets)], warmup_ms, rep_ms)}
            if "hf" in columns and lay[0].hf is not None:
                try:
                    base_cache[base_key]["hf_us"] = time_graph(
                        [(lambda m=lay[s % 2].hf, b=batches[s]: m(b[0], b[1].long(), b[2])) for s in range(sets)],
                        warmup_ms, rep_ms)
                except Exception as exc:
                    print(f"# hf failed: {exc!r}", flush=True)
        row.update(base_cache[base_key])
        if "unfused" in columns:
            try:
                row["unfused_us"] = time_graph(
                    [(lambda lyr=lay[s % 2], st=stacks[s], b=batches[s]: unfused_layer(lyr, st, *b))
                     for s in range(sets)], warmup_ms, rep_ms)
            except Exception as exc:
                print(f"# unfused failed: {exc!r}", flush=True)
        row["delta_us"] = row["ours_us"] - row["base_us"]
        nbytes = sum(bytes_moved(g, c.R, b) for b in batches) / sets
        row["bytes"] = nbytes
        row["floor_us"] = nbytes / (hbm_tbs * 1e12) * 1e6
        row["ours_gbs"] = nbytes / (row["ours_us"] * 1e-6) / 1e9
        row["pct_floor"] = 100 * row["floor_us"] / row["ours_us"]
        row["vllm_delta_us"] = VLLM_LORA_DELTA_US.get((c.model, c.T, c.L, c.R))
        results.append(row)
        if on_row is not None:
            on_row(results)
        print(f"[{i + 1}/{len(configs)}] {fmt_row(row)}  ({time.time() - t0:.1f}s)", flush=True)
    return results


COLUMNS = ["model", "T", "L", "R", "no_lora_fraction", "ours_us", "base_us", "delta_us", "unfused_us", "hf_us",
           "vllm_delta_us", "floor_us", "ours_gbs", "pct_floor"]


def _fmt(v):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 10 else f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}"
    return str(v)


def fmt_row(row) -> str:
    return " ".join(f"{k}={_fmt(row.get(k))}" for k in COLUMNS)


def markdown(results) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k in COLUMNS) + " |" for r in results]
    return "\n".join(lines)


def targets(results) -> str:
    """The targets of the task, met or missed, with ratios."""
    out = ["", "Targets:"]
    for r in results:
        v = r["vllm_delta_us"]
        if v is not None and r["no_lora_fraction"] == 0.0:
            goal = 0.5 if r["T"] <= 8 else 0.8
            ratio = r["delta_us"] / v
            out.append(f"- LoRA delta vs vLLM {r['model']} T={r['T']} L={r['L']} R={r['R']}: ours "
                       f"{r['delta_us']:.1f} us / vLLM {v} us = {ratio:.2f}x (goal <= {goal}x): "
                       f"{'met' if ratio <= goal else 'missed'}")
    for r in results:
        if r["T"] <= 32 and r["no_lora_fraction"] == 0.0 and r["L"] == 4 and r["R"] == 16:
            ratio = r["ours_us"] / r["floor_us"]
            out.append(f"- whole layer vs HBM floor {r['model']} T={r['T']} L=4 R=16: {r['ours_us']:.1f} us / "
                       f"{r['floor_us']:.1f} us = {ratio:.2f}x (goal <= 1.3x): {'met' if ratio <= 1.3 else 'missed'}")
    for r in results:
        if r["T"] <= 8 and r["no_lora_fraction"] == 0.0:
            ov = r["delta_us"] / r["base_us"]
            out.append(f"- LoRA overhead over base {r['model']} T={r['T']} L={r['L']} R={r['R']}: {100 * ov:.1f}% "
                       f"(goal <= 15%): {'met' if ov <= 0.15 else 'missed'}")
    return "\n".join(out)


# --decode-ablation: (column, config overrides, per-pair configs only), each against the op's own config (tuned
# entry or heuristic); overrides are MoEKernelConfig.replace changes (dotted for a kernel's field: "w13.SPLIT_K").
# The launcher is called directly so that one run can switch them per call.
NO_SPLIT = {"w13.SPLIT_K": 1, "w2.SPLIT_K": 1}
ABLATION_VARIANTS = [
    ("nosplit", NO_SPLIT, False),                       # base GEMMs without split-K
    ("split", {"w13.SPLIT_K": 4, "w2.SPLIT_K": 2}, True),  # w13 K in 4 slices, w2 K in 2 (per-pair path)
    ("no_overlap", {"w13_overlap": False}, False),      # w13 waits for shrink13 before its main loop
    ("nopdl", {"pdl": False}, False),                   # no programmatic dependent launch
    ("early", {"pdl": "early"}, False),                 # PDL, next kernel launched at program start
    ("unfused_sum", {"fuse_topk_sum": False}, True),    # per-pair w2 rows + torch top-k sum
]
# per-pair path forced (fused w2 shrink and top-k sum, PDL late) where the tuned/heuristic config is sorted
FORCED_PER_PAIR = {"per_pair": True, "fuse_shrink2": True, "fuse_topk_sum": True, "pdl": "late"}
ABLATION_COLUMNS = ["model", "T", "L", "R", "path", "split13", "split2", "op_us"] + [
    v[0] for v in ABLATION_VARIANTS] + ["forced_per_pair", "base", "base_nosplit", "floor_us", "op_vs_floor",
                                        "best", "best_us", "best_vs_floor", "lora_overhead"]


def launcher_call(layer: Layer, lora, batch, cfg):
    from moe_lora_compile.ops.triton.launch import fused_moe_lora_triton
    g = layer.geometry
    x, ids, w, lora_ids = batch
    return lambda: fused_moe_lora_triton(
        x, ids, w, lora_ids, layer.w13, layer.w2, *lora, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        layout=g.layout, activation=g.activation, config=cfg)


def decode_ablation(models, tokens, ranks, L: int, sets: int, hbm_tbs: float, warmup_ms: int, rep_ms: int,
                    on_row=None):
    from moe_lora_compile.ops.triton.configs import get_config
    from moe_lora_compile.ops.triton.pdl import pdl_supported
    if not pdl_supported(torch.device("cuda")):
        print("# PDL is not supported here (pre-SM90 or this Triton lacks it): pdl columns equal nopdl", flush=True)
    results = []
    total = len(models) * len(tokens) * len(ranks)
    for model in models:
        g = MODELS[model]
        torch.cuda.empty_cache()
        lay = [make_layer(g, seed) for seed in (1, 2)]
        for T in tokens:
            batches = [make_batch(g, T, L, 0.0, seed=100 + s) for s in range(sets)]
            base_batches = [(b[0], b[1], b[2], torch.full_like(b[3], NO_ADAPTER)) for b in batches]
            for R in ranks:
                t0 = time.time()
                stacks = [lora_stacks(lay[s % 2], L, R) for s in range(sets)]
                cfg = get_config(torch.device("cuda"), g.E, g.H, g.I, R, T, g.k)

                def timed(overrides, bs=batches):
                    c = cfg.replace(**overrides)
                    return time_graph([launcher_call(lay[s % 2], stacks[s], bs[s], c) for s in range(sets)],
                                      warmup_ms, rep_ms)

                row = {"model": model, "T": T, "L": L, "R": R, "path": "per-pair" if cfg.per_pair else "sorted",
                       "split13": cfg.w13.SPLIT_K, "split2": cfg.w2.SPLIT_K if cfg.per_pair else 1}
                row["op_us"] = time_graph([op_call(lay[s % 2], stacks[s], batches[s]) for s in range(sets)],
                                          warmup_ms, rep_ms)
                for name, overrides, per_pair_only in ABLATION_VARIANTS:
                    row[name] = None if per_pair_only and not cfg.per_pair else timed(overrides)
                row["forced_per_pair"] = None if cfg.per_pair else timed(FORCED_PER_PAIR)
                row["base"] = timed({}, base_batches)
                row["base_nosplit"] = timed(NO_SPLIT, base_batches)
                nbytes = sum(bytes_moved(g, R, b) for b in batches) / sets
                row["floor_us"] = nbytes / (hbm_tbs * 1e12) * 1e6
                row["op_vs_floor"] = row["op_us"] / row["floor_us"]
                candidates = {k: row[k] for k in ["op_us"] + [v[0] for v in ABLATION_VARIANTS] + ["forced_per_pair"]
                              if row[k] is not None}
                row["best"] = min(candidates, key=candidates.get)
                row["best_us"] = candidates[row["best"]]
                row["best_vs_floor"] = row["best_us"] / row["floor_us"]
                row["lora_overhead"] = row["op_us"] / row["base"] - 1
                results.append(row)
                if on_row is not None:
                    on_row(results)
                print(f"[{len(results)}/{total}] " + " ".join(f"{k}={_fmt(row.get(k))}" for k in ABLATION_COLUMNS)
                      + f"  ({time.time() - t0:.1f}s)", flush=True)
        lay = None  # free the weight sets before the next model
    return results


def ablation_markdown(results) -> str:
    lines = ["| " + " | ".join(ABLATION_COLUMNS) + " |", "|" + "---|" * len(ABLATION_COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r.get(k)) for k in ABLATION_COLUMNS) + " |" for r in results]
    notes = [
        "",
        "us per layer call (median of CUDA-graph replays, L2 flushed, weights alternating two sets), bf16, every "
        "token with an adapter. `op_us`: torch.ops.moe_lora.fused_moe_lora with its own config (`split13`/`split2`: "
        "its w13 / w2 split-K); the other columns change one thing of that config: `nosplit` no split-K, `split` "
        "w13 split-K 4 and w2 split-K 2, `no_overlap` w13 waits for shrink13 before its main loop, `nopdl` "
        "PDL off, `early` PDL triggered at program start, `unfused_sum` per-pair w2 rows + a torch top-k sum, "
        "`forced_per_pair` the per-pair path where the config is sorted; `base` / `base_nosplit`: every token -1; "
        "`lora_overhead` = op_us / base - 1; `*_vs_floor`: over the HBM floor (goal <= 1.3).",
    ]
    return "\n".join(lines + notes)


def profile(configs):
    """Per-kernel CUDA time of our op (torch.profiler, eager, after a warm-up), one table per config."""
    from torch.profiler import ProfilerActivity, profile as torch_profile
    for c in configs:
        g = MODELS[c.model]
        layer = make_layer(g, 1)
        call = op_call(layer, lora_stacks(layer, c.L, c.R), make_batch(g, c.T, c.L, c.no_lora_fraction, 7))
        call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        print(f"## profile {c} (5 calls)")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt-oss-20b", "qwen3-30b-a3b"])
    p.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="default: 1 8 32 128 512 2048 (--decode-ablation: 1 8 32)")
    p.add_argument("--adapters", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--ranks", nargs="+", type=int, default=[16, 64])
    p.add_argument("--no-lora-fractions", nargs="+", type=float, default=list(BENCHMARK_GRID.no_lora_fraction))
    p.add_argument("--columns", nargs="+", default=["unfused", "hf"])
    p.add_argument("--sets", type=int, default=4, help="batches per graph replay (weights alternate 2 sets)")
    p.add_argument("--hbm-tbs", type=float, default=4.3, help="HBM floor bandwidth, TB/s (measured copy rate)")
    p.add_argument("--warmup-ms", type=int, default=5)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="T in {1, 32, 512}, L=4, R=16, no -1 tokens")
    p.add_argument("--profile", action="store_true", help="per-kernel times (torch.profiler) instead of timing")
    p.add_argument("--decode-ablation", action="store_true",
                   help="PDL off/on x top-k sum fused/unfused (+ base-only) at decode sizes: T in {1, 8, 32} "
                        "(or --tokens if given), L=4, R in {16, 64} (or --ranks), --models; a few minutes")
    p.add_argument("--json")
    p.add_argument("--md")
    a = p.parse_args(argv)
    if a.tokens is None:
        a.tokens = [1, 8, 32] if a.decode_ablation else [1, 8, 32, 128, 512, 2048]
    if a.decode_ablation:
        tokens = a.tokens
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; decode "
              f"ablation: {a.models} T={tokens} L=4 R={a.ranks}", flush=True)

        def save_ablation(results):
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "triton": triton.__version__, "argv": sys.argv, "results": results}, f, indent=1)

        results = decode_ablation(a.models, tokens, a.ranks, 4, a.sets, a.hbm_tbs, a.warmup_ms, a.rep_ms,
                                  on_row=save_ablation)
        text = ablation_markdown(results) + "\n"
        print(text)
        if a.md:
            with open(a.md, "w") as f:
                f.write(text)
        return
    if a.quick:
        a.tokens, a.adapters, a.ranks, a.no_lora_fractions = [1, 32, 512], [4], [16], [0.0]
    configs = [BenchConfig(m, T, L, R, f) for m in a.models for T in a.tokens for L in a.adapters
               for R in a.ranks for f in a.no_lora_fractions]
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; "
          f"{len(configs)} configs", flush=True)
    if a.profile:
        profile(configs)
        return

    def save(results):  # after every row, so a run cut short keeps what it measured
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "argv": sys.argv, "results": results}, f, indent=1)

    results = run(configs, a.sets, a.hbm_tbs, a.warmup_ms, a.rep_ms, set(a.columns), on_row=save)
    text = markdown(results) + "\n" + targets(results) + "\n"
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
