"""The two latency-bound kernels of a decode step, alone: ``moe_lora.decode_attention``'s flash-decoding kernel and
``moe_lora.route``'s router kernel, at batch 1 and 8, GPT-OSS-20B and Qwen3-30B-A3B geometries.

Each figure is the ``triton.testing.do_bench`` median of a CUDA graph of 20 calls on the same inputs, divided by 20
(us a call; the inputs stay in L2, so this times the kernels' latency, launch included, not HBM bandwidth). Attention:
a static cache of 640 slots, the query at slot 575, full or a 128-slot sliding window (GPT-OSS's two layer kinds).
Meant for A/B runs of two trees, one process each, the first argument naming the tree in the output lines:

    PYTHONPATH=/path/to/tree_a python3 benchmarks/bench_decode_kernels.py a
    PYTHONPATH=/path/to/tree_b python3 benchmarks/bench_decode_kernels.py b

On a machine without CUDA it runs each kernel once in Triton's interpreter (fp32) and prints 0 us: a smoke test.
``bench_attention.py`` times the attention kernel against the compiled eager attention and SDPA, L2 flushed.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():  # the smoke test: Triton's interpreter (read when triton is first imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moe_lora_compile.ops.triton.attention_launch import decode_attention_triton  # noqa: E402
from moe_lora_compile.ops.triton.router_launch import route_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPE = torch.bfloat16 if CUDA else torch.float32
CACHE, POSITION = 640, 575
# name, query heads, KV heads, head dim, sinks, windows
ATTENTION = (("gpt-oss-20b", 64, 8, 64, True, (None, 128)), ("qwen3-30b-a3b", 32, 4, 128, False, (None,)))
# name, experts, hidden, top-k, scoring
ROUTERS = (("gpt-oss-20b", 32, 2880, 4, "topk_softmax"), ("qwen3-30b-a3b", 128, 2048, 8, "softmax_topk"))


def us_per_call(fn, calls: int = 20) -> float:
    if not CUDA:
        fn()
        return 0.0
    import triton

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return triton.testing.do_bench(graph.replay, warmup=50, rep=300, return_mode="median") * 1e3 / calls


def main(tag: str) -> None:
    for name, H, Hkv, D, sinks, windows in ATTENTION:
        for B in (1, 8):
            for window in windows:
                q = torch.randn(B, H, 1, D, device=DEVICE, dtype=DTYPE)
                k = torch.randn(B, Hkv, CACHE, D, device=DEVICE, dtype=DTYPE)
                v = torch.randn_like(k)
                slots = torch.arange(CACHE, device=DEVICE)
                seen = slots <= POSITION
                if window:
                    seen &= slots > POSITION - window
                mask = torch.zeros(B, 1, 1, CACHE, device=DEVICE, dtype=DTYPE).masked_fill(~seen,
                                                                                          torch.finfo(DTYPE).min)
                s = torch.randn(H, device=DEVICE, dtype=DTYPE) if sinks else None
                us = us_per_call(lambda: decode_attention_triton(q, k, v, mask, D ** -0.5, s))
                print(f"{tag} attention {name} B={B} window={window}: {us:.2f} us", flush=True)
    for name, E, hidden, top_k, scoring in ROUTERS:
        for T in (1, 8):
            x = torch.randn(T, hidden, device=DEVICE, dtype=DTYPE)
            w = torch.randn(E, hidden, device=DEVICE, dtype=DTYPE) * 0.02
            us = us_per_call(lambda: route_triton(x, w, None, top_k=top_k, scoring=scoring, renormalize=True,
                                                  scores_dtype=DTYPE))
            print(f"{tag} router {name} T={T}: {us:.2f} us", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this")
