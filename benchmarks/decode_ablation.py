"""The decode ablation of the layer benchmark (``bench_fused_moe_lora.py --decode-ablation``): per model, T in {1, 8,
32}, L=4, R in {16, 64}, every token with an adapter, the whole layer timed with one thing of its own config
changed at a time (split-K, w13 overlap, PDL off / early, top-k sum unfused, the per-pair path forced, the other
LoRA shrink kernel: per pair / per row block) and base-only; the same conditions as the grid (:mod:`moe_layer`).
"""

from __future__ import annotations

import time

import torch

from moe_layer import (bytes_moved, fmt, launcher_call, lora_stacks, make_batch, make_layer, no_adapter, op_call,
                       time_graph)
from moe_lora_compile.shapes import MODELS

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
# per-pair path forced (fused w2 shrink and top-k sum, PDL late, block shrink as its heuristic has it) where the
# tuned/heuristic config is sorted
FORCED_PER_PAIR = {"per_pair": True, "fuse_shrink2": True, "fuse_topk_sum": True, "pdl": "late",
                   "per_pair_shrink": False}
ABLATION_COLUMNS = ["model", "T", "L", "R", "path", "split13", "split2", "pair_shrink", "op_us"] + [
    v[0] for v in ABLATION_VARIANTS] + ["pair_shrink_off", "pair_shrink_on", "forced_per_pair", "base",
                                        "base_nosplit", "floor_us", "op_vs_floor", "best", "best_us",
                                        "best_vs_floor", "lora_overhead"]


def decode_ablation(models, tokens, ranks, L: int, sets: int, hbm_tbs: float, warmup_ms: int, rep_ms: int,
                    on_row=None) -> list[dict]:
    """One row per (model, T, R): us of the op and of each variant, base-only, the HBM floor and the best."""
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
            base_batches = [no_adapter(b) for b in batches]
            for R in ranks:
                t0 = time.time()
                stacks = [lora_stacks(lay[s % 2], L, R) for s in range(sets)]
                cfg = get_config(torch.device("cuda"), g.E, g.H, g.I, R, T, g.k)

                def timed(overrides, bs=batches):
                    c = cfg.replace(**overrides)
                    return time_graph([launcher_call(lay[s % 2], stacks[s], bs[s], c) for s in range(sets)],
                                      warmup_ms, rep_ms)

                pair_shrink = cfg.uses_per_pair_shrink(T * g.k)
                row = {"model": model, "T": T, "L": L, "R": R, "path": "per-pair" if cfg.per_pair else "sorted",
                       "split13": cfg.w13.SPLIT_K, "split2": cfg.w2.SPLIT_K if cfg.per_pair else 1,
                       "pair_shrink": pair_shrink}
                row["op_us"] = time_graph([op_call(lay[s % 2], stacks[s], batches[s]) for s in range(sets)],
                                          warmup_ms, rep_ms)
                for name, overrides, per_pair_only in ABLATION_VARIANTS:
                    row[name] = None if per_pair_only and not cfg.per_pair else timed(overrides)
                # the other shrink kernel (per pair <-> per row block), in the column of what it turns on or off
                row["pair_shrink_off"] = timed({"per_pair_shrink": False}) if pair_shrink else None
                row["pair_shrink_on"] = None if pair_shrink else timed({"per_pair_shrink": True})
                row["forced_per_pair"] = None if cfg.per_pair else timed(FORCED_PER_PAIR)
                row["base"] = timed({}, base_batches)
                row["base_nosplit"] = timed(NO_SPLIT, base_batches)
                nbytes = sum(bytes_moved(g, R, b) for b in batches) / sets
                row["floor_us"] = nbytes / (hbm_tbs * 1e12) * 1e6
                row["op_vs_floor"] = row["op_us"] / row["floor_us"]
                candidates = {k: row[k] for k in ["op_us"] + [v[0] for v in ABLATION_VARIANTS]
                              + ["pair_shrink_off", "pair_shrink_on", "forced_per_pair"] if row[k] is not None}
                row["best"] = min(candidates, key=candidates.get)
                row["best_us"] = candidates[row["best"]]
                row["best_vs_floor"] = row["best_us"] / row["floor_us"]
                row["lora_overhead"] = row["op_us"] / row["base"] - 1
                results.append(row)
                if on_row is not None:
                    on_row(results)
                print(f"[{len(results)}/{total}] " + " ".join(f"{k}={fmt(row.get(k))}" for k in ABLATION_COLUMNS)
                      + f"  ({time.time() - t0:.1f}s)", flush=True)
        lay = None  # free the weight sets before the next model
    return results


def ablation_markdown(results) -> str:
    lines = ["| " + " | ".join(ABLATION_COLUMNS) + " |", "|" + "---|" * len(ABLATION_COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in ABLATION_COLUMNS) + " |" for r in results]
    notes = [
        "",
        "us per layer call (median of CUDA-graph replays, L2 flushed, weights alternating two sets), bf16, every "
        "token with an adapter. `op_us`: torch.ops.moe_lora.fused_moe_lora with its own config (`split13`/`split2`: "
        "its w13 / w2 split-K); the other columns change one thing of that config: `nosplit` no split-K, `split` "
        "w13 split-K 4 and w2 split-K 2, `no_overlap` w13 waits for shrink13 before its main loop, `nopdl` "
        "PDL off, `early` PDL triggered at program start, `unfused_sum` per-pair w2 rows + a torch top-k sum, "
        "`pair_shrink` whether the config runs the per-pair LoRA shrink (one program per (token, expert) pair) "
        "rather than the block shrink, `pair_shrink_off` / `pair_shrink_on` the other one, "
        "`forced_per_pair` the per-pair path where the config is sorted; `base` / `base_nosplit`: every token -1; "
        "`lora_overhead` = op_us / base - 1; `*_vs_floor`: over the HBM floor (goal <= 1.3).",
    ]
    return "\n".join(lines + notes)
