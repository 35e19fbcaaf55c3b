"""Dense multi-LoRA linear at decode sizes on a CUDA GPU (a script, not a test): ``torch.ops.moe_lora.lora_linear``
(base GEMM with the LoRA expand in its epilogue + per-token shrink) against cuBLAS's base ``F.linear`` alone and
the unfused torch form (``F.linear`` + gathered per-token shrink/expand), on the attention projections of the decode
benchmark's models (q/k/v/o shapes from :data:`moe_lora_compile.shapes.DECODE_MODELS`).

Times are medians of ``triton.testing.do_bench`` over CUDA-graph replays with the L2 flushed (weights cold);
``floor`` = bytes (weight + the batch's distinct adapters' A and B + x, y) at ``--hbm-tbs``. ``--configs`` also times
alternative kernel configs per shape at T = 1 and 8 (column tile x K step x split-K; what the heuristic in
``launch.default_linear_config`` is chosen from).

    python benchmarks/bench_lora_linear.py --tokens 1 8 32 64 --json lin.json --md lin.md [--configs]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
import triton

import moe_lora_compile  # noqa: F401  (registers torch.ops.moe_lora)
from moe_lora_compile.ops.triton.launch import _num_sms, default_linear_config, lora_linear_triton
from moe_lora_compile.shapes import DECODE_MODELS


def projections(name: str) -> dict[str, tuple[int, int]]:
    """``{proj: (in, out)}`` of one attention layer of a decode model (``qkv``: the fused q/k/v of
    ``attach(fuse_qkv=True)``)."""
    m = DECODE_MODELS[name]
    H, q, kv = m.moe.H, m.heads * m.head_dim, m.kv_heads * m.head_dim
    return {"q": (H, q), "k": (H, kv), "qkv": (H, q + 2 * kv), "o": (q, H)}


def graph_time_us(fn, flush: torch.Tensor) -> float:
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()

    def run():
        flush.zero_()
        g.replay()
    base = triton.testing.do_bench(lambda: flush.zero_(), rep=100, return_mode="median")
    return 1e3 * (triton.testing.do_bench(run, rep=200, return_mode="median") - base)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DECODE_MODELS))
    p.add_argument("--projs", nargs="+", default=["q", "k", "qkv", "o"], choices=["q", "k", "qkv", "o"],
                   help="projections to time, in this order")
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--hbm-tbs", type=float, default=4.3)
    p.add_argument("--configs", action="store_true", help="also time alternative kernel configs")
    p.add_argument("--json"), p.add_argument("--md")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device=dev)
    rows = []
    for model in args.models:
        for proj in args.projs:
            n_in, n_out = projections(model)[proj]
            g = torch.Generator(device=dev).manual_seed(0)
            w = torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16, generator=g) * n_in ** -0.5
            a = torch.randn(args.slots, args.rank, n_in, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
            b = torch.randn(args.slots, n_out, args.rank, device=dev, dtype=torch.bfloat16, generator=g) * 0.02
            for T in args.tokens:
                x = torch.randn(T, n_in, device=dev, dtype=torch.bfloat16, generator=g)
                ids = (torch.arange(T, device=dev) % args.slots).to(torch.int32)
                distinct = min(T, args.slots)
                nbytes = 2 * (n_in * n_out + distinct * args.rank * (n_in + n_out) + T * (n_in + n_out))
                floor_us = nbytes / (args.hbm_tbs * 1e12) * 1e6
                row = dict(model=model, proj=proj, n_in=n_in, n_out=n_out, T=T, floor_us=floor_us)
                row["cublas_base_us"] = graph_time_us(lambda: F.linear(x, w), flush)
                row["ours_us"] = graph_time_us(lambda: torch.ops.moe_lora.lora_linear(x, w, a, b, ids), flush)
                row["ours_base_us"] = graph_time_us(
                    lambda: torch.ops.moe_lora.lora_linear(x, w, a, b, torch.full_like(ids, -1)), flush)

                def unfused():
                    s = torch.bmm(a[ids.long()], x.unsqueeze(-1))
                    return F.linear(x, w) + torch.bmm(b[ids.long()], s).squeeze(-1)
                row["unfused_us"] = graph_time_us(unfused, flush)
                if args.configs and T in (1, 8):
                    base_cfg = default_linear_config(T, n_in, n_out, _num_sms(dev))
                    alts = {}
                    for bn in (32, 64, 128):
                        for bk in (128, 256):
                            for split in (1, 2, 4, 8):
                                cfg = json.loads(json.dumps(base_cfg))
                                cfg["gemm"].update(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split)
                                key = f"n{bn}k{bk}x{split}"
                                try:
                                    alts[key] = graph_time_us(
                                        lambda: lora_linear_triton(x, w, a, b, ids, config=cfg), flush)
                                except Exception:  # a config that does not compile (shared memory)
                                    alts[key] = float("nan")
                    best = min(alts, key=lambda k: alts[k] if alts[k] == alts[k] else 1e9)
                    row.update(best_config=best, best_us=alts[best], default_config=base_cfg["gemm"], configs=alts)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    md = ["| model | proj | in->out | T | ours (LoRA, 8 slots) | ours base (-1) | cuBLAS base | unfused torch | floor |"
          " ours % floor |", "|" + "---|" * 10]
    for r in rows:
        md.append(f"| {r['model']} | {r['proj']} | {r['n_in']}->{r['n_out']} | {r['T']} | {r['ours_us']:.1f} | "
                  f"{r['ours_base_us']:.1f} | {r['cublas_base_us']:.1f} | {r['unfused_us']:.1f} | "
                  f"{r['floor_us']:.1f} | {100 * r['floor_us'] / r['ours_us']:.0f} |")
    print("\n".join(md))
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
