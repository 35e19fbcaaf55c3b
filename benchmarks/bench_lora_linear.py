"""Dense multi-LoRA linear at decode sizes on a CUDA GPU (a script, not a test): ``torch.ops.moe_lora.lora_linear``
(the tuned table's config, else the heuristic: the GEMV path for a handful of tokens, the split-K GEMM above) against
cuBLAS's base ``F.linear`` alone and the unfused torch form (``F.linear`` + gathered per-token shrink/expand), on
the attention projections of the decode benchmark's models (:data:`moe_lora_compile.shapes.DECODE_MODELS`; ``qkv``
is the fused q/k/v of ``attach(fuse_qkv=True)``).

Method (as the tuner's, :mod:`moe_lora_compile.ops.triton.tune_linear`): ONE CUDA graph holding one call per layer
over ``--layers`` distinct weight sets (the weights do not fit in L2; the replay overhead is amortised), median of
``triton.testing.do_bench`` over replays, divided by the number of calls. ``floor`` = bytes (weight + bias + the
batch's distinct adapters' A and B + x, y) at ``--hbm-tbs``. ``--configs`` also times the GEMV path and the GEMM
path forced (heuristic tiles) at T <= 8, and at every T the GEMM with its B expand one slot at a time
(``expand_slots=1``, the serial form) against the grouped one (``expand_slots=8``).

    python benchmarks/bench_lora_linear.py --tokens 1 2 4 8 32 --json lin.json --md lin.md [--configs]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton

import moe_lora_compile  # noqa: F401  (registers torch.ops.moe_lora)
from moe_layer import copy_bandwidth
from moe_lora_compile.ops.triton import tune_linear as TL
from moe_lora_compile.ops.triton.configs import GEMV_MAX_T, default_linear_config
from moe_lora_compile.ops.triton.launch import _num_sms, lora_linear_triton
from moe_lora_compile.shapes import DECODE_MODELS


def projections(name: str) -> dict[str, tuple[int, int]]:
    """``{proj: (in, out)}`` of one attention layer of a decode model."""
    m = DECODE_MODELS[name]
    H, q, kv = m.moe.H, m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {"q": (H, q), "k": (H, kv), "qkv": (H, q + 2 * kv), "o": (q, H)}


def graph_us(calls) -> float:
    """us per call: one CUDA graph of ``calls``, median over replays."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=40, return_mode="median")
    return ms * 1e3 / len(calls)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DECODE_MODELS))
    p.add_argument("--projs", nargs="+", default=["qkv", "o"], choices=["q", "k", "qkv", "o"],
                   help="projections to time, in this order")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 32, 64])
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hbm-tbs", type=float, default=None, help="TB/s of the floor (default: this GPU's copy rate)")
    p.add_argument("--configs", action="store_true", help="also time the GEMV and the GEMM path forced (T <= 8)")
    p.add_argument("--json"), p.add_argument("--md")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    if args.hbm_tbs is None:  # a fixed 4.8 read the floor 11 % low on the H200 (4.25 TB/s), 38 % on an H100
        args.hbm_tbs = copy_bandwidth(dev) / 1e12
        print(f"# HBM floor at {args.hbm_tbs:.2f} TB/s (this GPU's copy rate)", flush=True)
    sms = _num_sms(dev)
    rows = []
    for model in args.models:
        for proj in args.projs:
            n_in, n_out = projections(model)[proj]
            shape = TL.Shape(model, proj, n_in, n_out, bias=DECODE_MODELS[model].model_type == "gpt_oss")
            layers = [TL._layer(shape, args.rank, args.slots, seed) for seed in range(args.layers)]
            for T in args.tokens:
                xs = [TL._x(T, n_in) for _ in layers]
                ids, none = TL._ids(T, args.slots, True), TL._ids(T, args.slots, False)
                floor_us = TL.nbytes(shape, T, args.rank, args.slots, True) / (args.hbm_tbs * 1e12) * 1e6

                def ours(ids, config=None):
                    return [lambda w=w, x=x: lora_linear_triton(x, w["w"], w["a"], w["b"], ids, bias=w["bias"],
                                                                config=config) for w, x in zip(layers, xs)]

                def unfused(w, x):
                    s = torch.bmm(w["a"][ids.long()], x.unsqueeze(-1))
                    return F.linear(x, w["w"], w["bias"]) + torch.bmm(w["b"][ids.long()], s).squeeze(-1)

                row = dict(model=model, proj=proj, n_in=n_in, n_out=n_out, T=T, floor_us=floor_us)
                row["ours_us"] = graph_us(ours(ids))
                row["ours_base_us"] = graph_us(ours(none))
                row["cublas_base_us"] = graph_us([lambda w=w, x=x: F.linear(x, w["w"], w["bias"])
                                                  for w, x in zip(layers, xs)])
                row["unfused_us"] = graph_us([lambda w=w, x=x: unfused(w, x) for w, x in zip(layers, xs)])
                if args.configs and T <= GEMV_MAX_T:
                    cfg = default_linear_config(T, n_in, n_out, sms)
                    small = {} if T <= 4 else {"gemm.BLOCK_N": 16, "gemm.BLOCK_K": 64}  # 8 tokens: smaller tiles
                    row["gemv_us"] = graph_us(ours(ids, cfg.replace(gemv=True, **small)))
                    gemm = default_linear_config(max(T, 5), n_in, n_out, sms).gemm
                    row["gemm_us"] = graph_us(ours(ids, cfg.replace(gemv=False, gemm=gemm)))
                if args.configs:
                    gemm_cfg = default_linear_config(max(T, 5), n_in, n_out, sms)
                    row["expand1_us"] = graph_us(ours(ids, gemm_cfg.replace(expand_slots=1)))
                    row["expand8_us"] = graph_us(ours(ids, gemm_cfg.replace(expand_slots=8)))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    md = [f"| model | proj | in->out | T | ours (LoRA, {args.slots} slots) | ours base (-1) | cuBLAS base | "
          f"unfused torch | GEMV path | GEMM path | GEMM expand 1 slot | GEMM expand 8 slots | floor | "
          f"ours % floor |", "|" + "---|" * 14]
    for r in rows:
        md.append(f"| {r['model']} | {r['proj']} | {r['n_in']}->{r['n_out']} | {r['T']} | {r['ours_us']:.1f} | "
                  f"{r['ours_base_us']:.1f} | {r['cublas_base_us']:.1f} | {r['unfused_us']:.1f} | "
                  f"{r.get('gemv_us', float('nan')):.1f} | {r.get('gemm_us', float('nan')):.1f} | "
                  f"{r.get('expand1_us', float('nan')):.1f} | {r.get('expand8_us', float('nan')):.1f} | "
                  f"{r['floor_us']:.1f} | {100 * r['floor_us'] / r['ours_us']:.0f} |")
    print("\n".join(md))
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
