"""Decode attention of one layer over a static KV cache: the Triton kernel vs the Inductor-compiled folded attention
vs SDPA, on the H200.

Geometries: GPT-OSS-20B (64 query / 8 KV heads of 64, sinks; full layers and sliding-window-128 layers) and
Qwen3-30B-A3B (32 / 4 heads of 128, no sinks). For each batch and context ``c`` the cache has ``L = c + 128`` slots
(a static cache with room for 128 new tokens), every row's query sits at slot ``c``, the mask is eager's additive
bf16 mask. Columns (us per layer, median of CUDA-graph replays, triton.testing.do_bench, L2 flushed between
replays; one graph holds ``--layers`` calls on separate caches, so a launch costs what it costs inside a decode
step's graph):

- ``triton``: ``moe_lora.decode_attention`` (what ``DecodeGraphs(attention="triton")`` runs);
- ``folded``: ``folded_gqa_attention_forward`` compiled by Inductor (static shapes, default mode: the
  ``DecodeGraphs`` default);
- ``sdpa``: ``F.scaled_dot_product_attention(enable_gqa=True)`` with the float mask, eager (GPT-OSS: without its
  sinks, which SDPA cannot take: a reference point only);
- ``floor``: the K/V bytes the mask leaves visible, read once at ``--bandwidth`` TB/s.

Also checks the kernel against the fp32 reference (max abs error). Usage (H200, ~1 min, first run compiles):
``PYTHONPATH=. python benchmarks/bench_attention.py [--batches 1 8 32 64] [--contexts 512 2048] [--md out.md]``.
"""

from __future__ import annotations

import argparse
import time
import torch
import torch.nn.functional as F

from moe_lora_compile.models.attention import folded_gqa_attention_forward
from moe_lora_compile.ops.decode_attention import decode_attention, decode_attention_reference

GEOMETRIES = {  # name: (H, Hkv, D, window, sinks)
    "gptoss-full": (64, 8, 64, None, True),
    "gptoss-sliding": (64, 8, 64, 128, True),
    "qwen3": (32, 4, 128, None, False),
}
NEW_TOKENS = 128


def make_layer(B, geometry, context, dtype=torch.bfloat16, seed=0):
    H, Hkv, D, window, sinks = GEOMETRIES[geometry]
    L = context + NEW_TOKENS
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(B, Hkv, L, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, L, D, device="cuda", dtype=dtype, generator=g)
    slots = torch.arange(L, device="cuda")
    seen = slots <= context
    if window is not None:
        seen &= slots > context - window
    mask = torch.zeros(B, 1, 1, L, device="cuda", dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    s = torch.randn(H, device="cuda", dtype=dtype, generator=g) if sinks else None
    return q, k, v, mask, s, int(seen.sum())


def graph_time_us(fn, layers: int) -> float:
    """Median us per call of ``fn(i)`` for i < layers, captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    import triton.testing

    return triton.testing.do_bench(graph.replay, warmup=10, rep=40, return_mode="median") * 1e3 / layers


class _Layer:
    """What folded_gqa_attention_forward reads from an attention module (built inside the compiled function, so
    Dynamo guards on no module object)."""

    training = False

    def __init__(self, sinks):
        self.sinks = sinks


def _folded(q, k, v, mask, sinks, scaling):
    return folded_gqa_attention_forward(_Layer(sinks), q, k, v, mask, scaling)[0]


def run(args) -> list[dict]:
    folded = torch.compile(_folded, dynamic=False)
    rows = []
    for geometry in args.geometries:
        H, Hkv, D, window, has_sinks = GEOMETRIES[geometry]
        for context in args.contexts:
            for B in args.batches:
                t0 = time.perf_counter()
                layers = [make_layer(B, geometry, context, seed=i) for i in range(args.layers)]
                scaling = D ** -0.5
                q, k, v, mask, s, visible = layers[0]
                got = decode_attention(q, k, v, mask, scaling=scaling, sinks=s).float()
                want = decode_attention_reference(q.float(), k.float(), v.float(), mask, scaling,
                                                  None if s is None else s.float())
                err = (got - want).abs().max().item()
                t_triton = graph_time_us(lambda i: decode_attention(*layers[i][:3], layers[i][3], scaling=scaling,
                                                                    sinks=layers[i][4]), args.layers)
                torch._dynamo.reset()
                t_folded = graph_time_us(lambda i: folded(*layers[i][:5], scaling), args.layers)
                t_sdpa = graph_time_us(lambda i: F.scaled_dot_product_attention(
                    layers[i][0], layers[i][1], layers[i][2], attn_mask=layers[i][3], scale=scaling,
                    enable_gqa=True), args.layers)
                floor = 2 * B * Hkv * visible * D * 2 / (args.bandwidth * 1e12) * 1e6
                row = dict(geometry=geometry, context=context, batch=B, triton_us=t_triton, folded_us=t_folded,
                           sdpa_us=t_sdpa, floor_us=floor, max_err=err)
                rows.append(row)
                print(f"{geometry:15s} ctx {context:5d} B {B:3d}: triton {t_triton:7.1f} us  folded {t_folded:7.1f}"
                      f"  sdpa {t_sdpa:7.1f}  floor {floor:6.1f}  (x{t_folded / t_triton:4.1f} vs folded; "
                      f"err {err:.1e}; {time.perf_counter() - t0:.1f} s)", flush=True)
                layers.clear()  # free this case's caches before the next one
    return rows


def to_markdown(rows) -> str:
    lines = ["| geometry | context | batch | triton (us) | folded, Inductor (us) | SDPA (us) | K/V floor (us) | "
             "folded / triton |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['geometry']} | {r['context']} | {r['batch']} | {r['triton_us']:.1f} | "
                     f"{r['folded_us']:.1f} | {r['sdpa_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['folded_us'] / r['triton_us']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometries", nargs="+", default=list(GEOMETRIES), choices=list(GEOMETRIES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 64])
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048])
    p.add_argument("--layers", type=int, default=4, help="calls (on separate caches) per captured graph")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="HBM TB/s for the floor column (default: this GPU's copy rate)")
    p.add_argument("--md", help="write the table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA device")
    if args.bandwidth is None:
        from moe_layer import copy_bandwidth

        args.bandwidth = copy_bandwidth(torch.device("cuda")) / 1e12
        print(f"# K/V floor at {args.bandwidth:.2f} TB/s (this GPU's copy rate)", flush=True)
    with torch.no_grad():
        rows = run(args)
    table = to_markdown(rows)
    print(table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
