"""MoE router at decode sizes on a CUDA GPU (a script, not a test): ``torch.ops.moe_lora.route`` (one Triton launch)
against transformers' aten sequence (``F.linear`` + ``softmax`` / ``topk``: :func:`moe_lora_compile.ops.router.
route_reference`), and with ``--inductor`` that sequence compiled by Inductor (what a compiled decode step ran).

Each timing is the median of ``triton.testing.do_bench`` over replays of one CUDA graph that routes through
``--mb`` MiB of distinct router weights (as many layers' worth as that takes: more than the L2 holds), divided by
the number of calls; GB/s = the weight bytes of one call over that time.

    python benchmarks/bench_router.py [--tokens 1 8 32 64] [--mb 256] [--inductor] [--splits 2 4 8]

``--splits``: also the kernel with its H split forced to each count (the launcher picks about one program per SM
per token block: 23 slices for GPT-OSS-20B, 16 for Qwen3-30B-A3B), to see where the last program's serial sum of
the slices outweighs the parallel weight reads.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton

import moe_lora_compile  # noqa: F401  (registers torch.ops.moe_lora)
from moe_lora_compile.ops.router import route_reference
from moe_lora_compile.ops.triton.router_launch import route_triton

# (name, E, H, top_k, scoring, renormalize, bias): the routers of the decode benchmark's models
GEOMETRIES = [
    ("gpt-oss-20b", 32, 2880, 4, "topk_softmax", False, True),
    ("qwen3-30b-a3b", 128, 2048, 8, "softmax_topk", True, False),
]


def graph_time_us(calls) -> float:
    """Median us of one replay of a CUDA graph running every ``calls[i]()`` once."""
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
    return 1e3 * triton.testing.do_bench(graph.replay, rep=200, return_mode="median")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--mb", type=float, default=256.0, help="MiB of distinct router weights per graph")
    p.add_argument("--inductor", action="store_true", help="also time the aten sequence compiled by Inductor")
    p.add_argument("--splits", nargs="*", type=int, default=[], help="also the kernel with each forced H split")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_router: needs a CUDA device", file=sys.stderr)
        return 1
    dev, dt = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, bf16, {args.mb:.0f} MiB of router weights per graph; us per call "
          f"(GB/s of the weight)")
    header = f"{'model':<14} {'T':>3} {'calls':>5} {'moe_lora.route':>20} {'aten':>20}"
    print(header + (f" {'inductor':>20}" if args.inductor else "") + f" {'speedup':>8}"
          + "".join(f" {'split ' + str(s):>20}" for s in args.splits))
    for name, E, H, k, scoring, renormalize, has_bias in GEOMETRIES:
        w_bytes = E * H * 2
        n = max(1, int(args.mb * 2**20 // w_bytes))
        weights = [torch.randn(E, H, device=dev, dtype=dt) / H ** 0.5 for _ in range(n)]
        biases = [torch.randn(E, device=dev, dtype=dt) if has_bias else None for _ in range(n)]
        opts = dict(top_k=k, scoring=scoring, renormalize=renormalize)
        compiled = torch.compile(route_reference, dynamic=False) if args.inductor else None
        for T in args.tokens:
            x = torch.randn(T, H, device=dev, dtype=dt)
            impls = {
                "op": lambda w, b: torch.ops.moe_lora.route(x, w, b, k, scoring, renormalize),
                "aten": lambda w, b: route_reference(x, w, b, **opts),
            }
            if compiled is not None:
                impls["inductor"] = lambda w, b: compiled(x, w, b, **opts)
            for s in args.splits:
                impls[f"split {s}"] = lambda w, b, s=s: route_triton(x, w, b, scores_dtype=dt, split_k=s, **opts)
            times = {key: graph_time_us([lambda w=w, b=b, f=f: f(w, b) for w, b in zip(weights, biases)]) / n
                     for key, f in impls.items()}
            cells = [f"{times[key]:7.2f} us ({w_bytes / times[key] / 1e3:5.0f} GB/s)" for key in impls]
            n_main = 3 if compiled is not None else 2
            print(f"{name:<14} {T:>3} {n:>5} " + " ".join(f"{c:>20}" for c in cells[:n_main])
                  + f" {times['aten'] / times['op']:7.2f}x " + " ".join(f"{c:>20}" for c in cells[n_main:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
