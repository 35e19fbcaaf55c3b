"""MXFP4 rows of the layer benchmark (``bench_fused_moe_lora.py --mxfp4``): GPT-OSS-20B's MoE layer with its experts
in MXFP4 (the checkpoint's format; random weights quantized by :func:`moe_lora_compile.ops.mxfp4.quantize_mxfp4`),
every token with an adapter, timed like the grid (:mod:`moe_layer`: CUDA-graph replays, L2 flushed, weights
alternating between two sets):

- ``mxfp4_us``: ``torch.ops.moe_lora.fused_moe_lora_mxfp4`` (the kernels decode the 4-bit values in their loads);
- ``mxfp4_base_us``: the same with every token at -1 (base only);
- ``bf16_us``: ``fused_moe_lora`` on the same weights dequantized to bf16 (what a dense copy costs);
- ``mx_cfg``: whether the MXFP4 kernels ran a tuned entry (``tune --mxfp4``, shape key ``...,W=mxfp4``) or the
  heuristic (:func:`moe_lora_compile.ops.triton.configs.default_mxfp4_config`);
- ``floor_us``: the HBM floor of the MXFP4 layer (active experts' blocks + scales + bf16 biases, active LoRA
  factors, x and y) at ``--hbm-tbs``; ``pct_floor`` = floor / mxfp4; ``vs_bf16`` = mxfp4 / bf16.

    python benchmarks/bench_fused_moe_lora.py --mxfp4 [--quick] --json mxfp4.json --md mxfp4.md
"""

from __future__ import annotations

import time

import torch

from moe_layer import Layer, bytes_moved, fmt, lora_stacks, make_batch, make_layer, no_adapter, op_call, time_graph
from moe_lora_compile.ops.mxfp4 import gpt_oss_mxfp4_expert_nbytes, quantize_mxfp4
from moe_lora_compile.ops.triton import configs as kernel_configs
from moe_lora_compile.shapes import GPT_OSS_20B

MXFP4_COLUMNS = ["T", "L", "R", "mx_cfg", "mxfp4_us", "mxfp4_base_us", "bf16_us", "floor_us", "pct_floor", "vs_bf16",
                 "floor_ratio"]


def _quantized_layer(seed: int):
    """(the dense bf16 Layer holding the dequantized weights, (w13, w2) as Mxfp4Weight)."""
    layer = make_layer(GPT_OSS_20B, seed)
    w13, w2 = quantize_mxfp4(layer.w13.float()), quantize_mxfp4(layer.w2.float())
    layer.w13, layer.w2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    layer.hf = None
    torch.cuda.empty_cache()
    return layer, (w13, w2)


def _mxfp4_call(layer: Layer, weights, lora, batch):
    g = layer.geometry
    x, ids, w, lora_ids = batch
    w13, w2 = weights
    return lambda: torch.ops.moe_lora.fused_moe_lora_mxfp4(
        x, ids, w, lora_ids, w13.blocks, w13.scales, w2.blocks, w2.scales, *lora, w13_bias=layer.w13_bias,
        w2_bias=layer.w2_bias, layout=g.layout, activation=g.activation)


def mxfp4_grid(tokens, adapters, ranks, sets: int, hbm_tbs: float, warmup_ms: int, rep_ms: int,
               on_row=None) -> list[dict]:
    g = GPT_OSS_20B
    sets_ = [_quantized_layer(seed) for seed in (1, 2)]
    expert_nbytes = gpt_oss_mxfp4_expert_nbytes(g.H, g.I)
    results, base_cache = [], {}
    configs = [(T, L, R) for T in tokens for L in adapters for R in ranks]
    for i, (T, L, R) in enumerate(configs):
        t0 = time.time()
        batches = [make_batch(g, T, L, 0.0, seed=100 + s) for s in range(sets)]
        layers = [sets_[s % 2] for s in range(sets)]
        stacks = [lora_stacks(lay, L, R) for lay, _ in layers]
        tuned = kernel_configs.pick_bucket(kernel_configs._rank_buckets(  # the entry the op reads at this T, if any
            kernel_configs._load(kernel_configs.table_gpu(torch.device("cuda"))), g.E, g.H, g.I, R, mxfp4=True), T)
        row = {"T": T, "L": L, "R": R, "mx_cfg": "tuned" if tuned else "heuristic"}
        row["mxfp4_us"] = time_graph([_mxfp4_call(lay, w, st, b) for (lay, w), st, b in zip(layers, stacks, batches)],
                                     warmup_ms, rep_ms)
        if T not in base_cache:
            base_cache[T] = time_graph([_mxfp4_call(lay, w, st, no_adapter(b))
                                        for (lay, w), st, b in zip(layers, stacks, batches)], warmup_ms, rep_ms)
        row["mxfp4_base_us"] = base_cache[T]
        row["bf16_us"] = time_graph([op_call(lay, st, b) for (lay, _), st, b in zip(layers, stacks, batches)],
                                    warmup_ms, rep_ms)
        nbytes = sum(bytes_moved(g, R, b, expert_nbytes) for b in batches) / sets
        row["floor_us"] = nbytes / (hbm_tbs * 1e12) * 1e6
        row["pct_floor"] = 100 * row["floor_us"] / row["mxfp4_us"]
        row["floor_ratio"] = row["mxfp4_us"] / row["floor_us"]
        row["vs_bf16"] = row["mxfp4_us"] / row["bf16_us"]
        results.append(row)
        if on_row is not None:
            on_row(results)
        print(f"[{i + 1}/{len(configs)}] " + " ".join(f"{k}={fmt(row.get(k))}" for k in MXFP4_COLUMNS)
              + f"  ({time.time() - t0:.1f}s)", flush=True)
    return results


def mxfp4_markdown(results) -> str:
    lines = ["| " + " | ".join(MXFP4_COLUMNS) + " |", "|" + "---|" * len(MXFP4_COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(k)) for k in MXFP4_COLUMNS) + " |" for r in results]
    lines.append("")
    for r in results:  # the target: MXFP4 whole layer with LoRA at T=1 <= 1.4x its own floor
        if r["T"] == 1:
            lines.append(f"- T=1 L={r['L']} R={r['R']}: {r['mxfp4_us']:.1f} us / floor {r['floor_us']:.1f} us = "
                         f"{r['floor_ratio']:.2f}x (goal <= 1.4x): {'met' if r['floor_ratio'] <= 1.4 else 'missed'}")
    return "\n".join(lines)
