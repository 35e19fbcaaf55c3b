"""torch.ops.moe_lora.lora_linear against an independent float64 loop reference (CPU)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loop_reference import TOLERANCES, linear_lora_loop

import moe_lora_compile as mlc


def make_linear(T, n_in, n_out, L, R, ids="mixed", bias=False, dtype=torch.float32, ranks=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n_in, generator=g).to(dtype)
    weight = (torch.randn(n_out, n_in, generator=g) * 0.3).to(dtype)
    lora_a = (torch.randn(L, R, n_in, generator=g) * 0.3).to(dtype)
    lora_b = (torch.randn(L, n_out, R, generator=g) * 0.3).to(dtype)
    if ranks is not None:
        for slot, r in enumerate(ranks):
            lora_a[slot, r:] = 0
            lora_b[slot, :, r:] = 0
    low = {"mixed": -1, "none": -1, "all": 0}[ids]
    high = 0 if ids == "none" else L
    token_lora_ids = torch.randint(low, high, (T,), generator=g, dtype=torch.int32)
    b = (torch.randn(n_out, generator=g) * 0.3).to(dtype) if bias else None
    return (x, weight, lora_a, lora_b, token_lora_ids), b


ROWS = [
    dict(T=1, n_in=16, n_out=8, L=2, R=4),  # one token
    dict(T=0, n_in=16, n_out=8, L=2, R=4),  # empty batch
    dict(T=9, n_in=16, n_out=24, L=3, R=4, ids="none"),  # every token -1: plain linear
    dict(T=9, n_in=16, n_out=24, L=3, R=4, ids="all"),  # every token has an adapter
    dict(T=9, n_in=16, n_out=24, L=1, R=2),  # a single slot
    dict(T=9, n_in=16, n_out=24, L=3, R=8, ranks=(8, 1, 3)),  # per-slot ranks zero-padded
    dict(T=7, n_in=12, n_out=20, L=3, R=4, bias=True),  # with bias
    dict(T=7, n_in=12, n_out=20, L=3, R=4, bias=True, dtype=torch.bfloat16),  # bf16, fp32 accumulation
    dict(T=5, n_in=12, n_out=20, L=2, R=4, dtype=torch.float64),  # float64 end to end
]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items()))
def test_matches_loop_reference(row):
    dtype = row.get("dtype", torch.float32)
    args, bias = make_linear(**row)
    y = mlc.lora_linear(*args, bias=bias)
    assert y.shape == (row["T"], row["n_out"]) and y.dtype == dtype
    torch.testing.assert_close(y.double(), linear_lora_loop(*args, bias=bias), **TOLERANCES[dtype])


def test_grads_match_autograd_of_loop():
    args, bias = make_linear(6, 10, 12, 3, 4, bias=True, dtype=torch.float64)
    leaves = [0, 2, 3]
    a1 = [t.clone().requires_grad_(i in leaves) for i, t in enumerate(args[:4])] + [args[4]]
    a2 = [t.clone().requires_grad_(i in leaves) for i, t in enumerate(args[:4])] + [args[4]]
    g = torch.randn(6, 12, dtype=torch.float64)
    got = torch.autograd.grad(mlc.lora_linear(*a1, bias=bias), [a1[i] for i in leaves], g)
    want = torch.autograd.grad(linear_lora_loop(*a2, bias=bias), [a2[i] for i in leaves], g)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 10), n_in=st.integers(1, 12), n_out=st.integers(1, 12), L=st.integers(1, 4),
       R=st.integers(1, 5), bias=st.booleans(), seed=st.integers(0, 1000))
def test_random_cases(T, n_in, n_out, L, R, bias, seed):
    args, b = make_linear(T, n_in, n_out, L, R, bias=bias, seed=seed)
    torch.testing.assert_close(mlc.lora_linear(*args, bias=b).double(), linear_lora_loop(*args, bias=b),
                               **TOLERANCES[torch.float32])
