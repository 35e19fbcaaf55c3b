"""CUDA-graph capture and replay of the ``moe_lora`` ops equal eager calls, also after the static inputs (tokens,
routing, adapter ids with -1) are rewritten in place, with programmatic dependent launch on and off
(``MOE_LORA_PDL``). GPU only (``pytest -m gpu``)."""

from __future__ import annotations

import pytest
import torch

from moe_lora_compile.shapes import GPT_OSS_20B, QWEN3_30B_A3B

from support.cases import MoECase

pytestmark = pytest.mark.gpu


def _capture(fn):
    """Warm up on a side stream, then capture ``fn()`` -> (graph, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _refill(static_args, fresh_args):
    for dst, src in zip(static_args, fresh_args):
        if torch.is_tensor(dst) and dst.dtype == src.dtype:
            dst.copy_(src)


@pytest.fixture(params=["0", "1"], ids=["pdl-off", "pdl-on"])
def pdl_env(request, set_switch):
    from moe_lora_compile import settings

    set_switch(settings.PDL, request.param)
    return request.param == "1"


@pytest.mark.parametrize("geometry,T", [
    (GPT_OSS_20B, 1),     # decode: per-pair path (w2 + top-k sum fused), interleaved layout + biases
    (QWEN3_30B_A3B, 1),   # decode: per-pair path, k=8, concat layout
    (QWEN3_30B_A3B, 8),   # sorted path, concat layout
    (QWEN3_30B_A3B, 96),  # sorted path, larger blocks
])
def test_fused_moe_lora_graph_replay_equals_eager(geometry, T, pdl_env):
    case = MoECase.of_geometry(geometry, T, L=4, R=16, lora="alternate")
    args, kwargs = case.make("cuda", dtype=torch.bfloat16)
    static = [a.clone() for a in args]
    graph, y_static = _capture(lambda: torch.ops.moe_lora.fused_moe_lora(*static, **kwargs))
    graph.replay()
    eager = torch.ops.moe_lora.fused_moe_lora(*args, **kwargs)
    torch.testing.assert_close(y_static, eager)

    # new tokens, new routing, new adapter ids (other tokens at -1): same graph, new result
    fresh, _ = case.make("cuda", dtype=torch.bfloat16, scale=0.5)
    fresh = list(fresh)
    fresh[1] = torch.roll(args[1], 1, dims=0)
    fresh[3] = torch.where(args[3] >= 0, -1, (torch.arange(T, device="cuda") % 4).to(torch.int32))
    _refill(static[:4], fresh[:4])
    graph.replay()
    eager = torch.ops.moe_lora.fused_moe_lora(*fresh[:4], *args[4:], **kwargs)
    torch.testing.assert_close(y_static, eager)
    assert not torch.equal(y_static, torch.ops.moe_lora.fused_moe_lora(*args, **kwargs))


@pytest.mark.parametrize("T", [1, 8])
def test_graph_of_chained_layers_with_pdl(T, pdl_env):
    """Three layers back to back in one graph, each reading the previous one's output (the first kernel of a
    layer's chain depends on the last kernel of the previous one): replays equal eager, and stay stable."""
    case = MoECase.of_geometry(QWEN3_30B_A3B, T, L=4, R=16, lora="alternate")
    args, kwargs = case.make("cuda", dtype=torch.bfloat16)
    static = [a.clone() for a in args]

    def layers():
        y = static[0]
        for _ in range(3):
            y = torch.ops.moe_lora.fused_moe_lora(y, *static[1:], **kwargs)
        return y

    graph, y_static = _capture(layers)
    for _ in range(3):
        static[0].copy_(args[0])
        graph.replay()
        y = args[0]
        for _ in range(3):
            y = torch.ops.moe_lora.fused_moe_lora(y, *args[1:], **kwargs)
        torch.testing.assert_close(y_static, y)
    static[0].mul_(-1)
    graph.replay()
    y = -args[0]
    for _ in range(3):
        y = torch.ops.moe_lora.fused_moe_lora(y, *args[1:], **kwargs)
    torch.testing.assert_close(y_static, y)


def test_lora_linear_graph_replay_equals_eager():
    T, n_in, n_out, L, R = 32, 512, 768, 4, 16
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
    x, w, a, b, bias = mk(T, n_in), mk(n_out, n_in) * n_in ** -0.5, mk(L, R, n_in), mk(L, n_out, R), mk(n_out)
    ids = torch.randint(-1, L, (T,), device="cuda", dtype=torch.int32)
    graph, y_static = _capture(lambda: torch.ops.moe_lora.lora_linear(x, w, a, b, ids, bias=bias))
    x.copy_(mk(T, n_in))
    ids.copy_(torch.randint(-1, L, (T,), device="cuda", dtype=torch.int32))
    graph.replay()
    torch.testing.assert_close(y_static, torch.ops.moe_lora.lora_linear(x, w, a, b, ids, bias=bias))
