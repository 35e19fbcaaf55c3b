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

``--mxfp4`` (about 3 minutes; ``--quick``: T in {1, 32, 512}, L=4, R=16) instead times GPT-OSS-20B with MXFP4
experts: ``fused_moe_lora_mxfp4`` vs ``fused_moe_lora`` on the same weights in bf16 vs the MXFP4 HBM floor, T in
{1, 8, 32, 128, 512}, L in {1, 4, 16}, R in {16, 64} (``bench_mxfp4.py``):

    python benchmarks/bench_fused_moe_lora.py --mxfp4 --json mxfp4.json --md mxfp4.md

``--mixed-ranks`` instead times slots of rank 8/16/64 padded to ``max_rank`` 64 (L = 8) at T in {1, 8, 32}: with
``lora_ranks`` (each slot read up to its rank) vs the same stacks all read at 64 (``lora_ranks=None``) vs every slot
at rank 64, per model (``bench_mixed_ranks.py``):

    python benchmarks/bench_fused_moe_lora.py --mixed-ranks --json ranks.json --md ranks.md

Files: this script (the grid, its report and the targets against vLLM's numbers), ``moe_layer.py`` (the layer's
weights, batches, baselines, bytes and CUDA-graph timing, shared), ``decode_ablation.py`` (the ablation).
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

from bench_mixed_ranks import mixed_ranks_grid, mixed_ranks_markdown
from bench_mxfp4 import mxfp4_grid, mxfp4_markdown
from decode_ablation import ablation_markdown, decode_ablation
from moe_layer import (Layer, bytes_moved, copy_bandwidth, fmt, lora_stacks, make_batch, make_layer, no_adapter,
                       op_call, time_graph, unfused_layer)
from moe_lora_compile.shapes import BENCHMARK_GRID, MODELS

# vLLM's fused MoE LoRA delta (w13 + w2 of one layer, LoRA only) on this H200, bf16, CUDA graphs (measured with
# vLLM ~0.22's kernels, outside this repository: vLLM does not install in the GPU image): (model, T, L, R) -> us.
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
            base_batches = [no_adapter(b) for b in batches]
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


def fmt_row(row) -> str:
    return " ".join(f"{k}={fmt(row.get(k))}" for k in COLUMNS)


def markdown(results) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in COLUMNS) + " |" for r in results]
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


def _json_writer(path):
    """-> ``on_row(results)`` writing the results so far, with the device and versions, to ``path`` (None: no-op):
    a grid cut short keeps its rows."""
    def write(results):
        if path:
            with open(path, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "triton": triton.__version__, "argv": sys.argv, "results": results}, f, indent=1)
    return write


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
    p.add_argument("--hbm-tbs", type=float, default=None,
                   help="HBM floor bandwidth, TB/s (default: this GPU's device-to-device copy rate, measured; a "
                        "fixed 4.3 once gave an H100's floors at the H200's bandwidth)")
    p.add_argument("--warmup-ms", type=int, default=5)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="T in {1, 32, 512}, L=4, R=16, no -1 tokens")
    p.add_argument("--profile", action="store_true", help="per-kernel times (torch.profiler) instead of timing")
    p.add_argument("--decode-ablation", action="store_true",
                   help="PDL off/on x top-k sum fused/unfused (+ base-only) at decode sizes: T in {1, 8, 32} "
                        "(or --tokens if given), L=4, R in {16, 64} (or --ranks), --models; a few minutes")
    p.add_argument("--mxfp4", action="store_true",
                   help="GPT-OSS-20B with MXFP4 experts: MXFP4 vs bf16 vs the MXFP4 floor, T in {1, 8, 32, 128, "
                        "512} (or --tokens), L in --adapters, R in --ranks; about 3 minutes (--quick: 1 minute)")
    p.add_argument("--mixed-ranks", action="store_true",
                   help="slots of rank 8/16/64 in max_rank 64: lora_ranks vs padded vs uniform 64 (T 1, 8, 32)")
    p.add_argument("--json")
    p.add_argument("--md")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the kernels' CPU runs are the tests: pytest tests/ops)")
    if a.hbm_tbs is None:
        a.hbm_tbs = copy_bandwidth(torch.device("cuda")) / 1e12
        print(f"# HBM floor at {a.hbm_tbs:.2f} TB/s (this GPU's copy rate)", flush=True)
    if a.mxfp4:
        tokens = a.tokens or ([1, 32, 512] if a.quick else [1, 8, 32, 128, 512])
        adapters, ranks = ([4], [16]) if a.quick else (a.adapters, a.ranks)
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; MXFP4 "
              f"gpt-oss-20b T={tokens} L={adapters} R={ranks}", flush=True)

        results = mxfp4_grid(tokens, adapters, ranks, a.sets, a.hbm_tbs, a.warmup_ms, a.rep_ms,
                             on_row=_json_writer(a.json))
        text = mxfp4_markdown(results) + "\n"
        print(text)
        if a.md:
            with open(a.md, "w") as f:
                f.write(text)
        return
    if a.mixed_ranks:
        tokens = a.tokens or [1, 8, 32]
        print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}; mixed ranks "
              f"{a.models} T={tokens}", flush=True)

        results = mixed_ranks_grid(a.models, tokens, a.sets, a.hbm_tbs, a.warmup_ms, a.rep_ms,
                                   on_row=_json_writer(a.json))
        text = mixed_ranks_markdown(results) + "\n"
        print(text)
        if a.md:
            with open(a.md, "w") as f:
                f.write(text)
        return
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
