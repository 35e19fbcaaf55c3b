"""torch.ops.moe_lora.lora_linear against the independent float64 oracle (``tests/support``), on the CPU."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.cases import TOLERANCES, make_linear
from support.oracle import lora_linear_oracle

import moe_lora_compile as mlc


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
def test_matches_oracle(row):
    dtype = row.get("dtype", torch.float32)
    args, bias = make_linear(**row)
    y = mlc.lora_linear(*args, bias=bias)
    assert y.shape == (row["T"], row["n_out"]) and y.dtype == dtype
    torch.testing.assert_close(y.double(), lora_linear_oracle(*args, bias=bias), **TOLERANCES[dtype])


def test_grads_match_autograd_of_oracle():
    args, bias = make_linear(6, 10, 12, 3, 4, bias=True, dtype=torch.float64)
    leaves = [0, 2, 3]
    a1 = [t.clone().requires_grad_(i in leaves) for i, t in enumerate(args[:4])] + [args[4]]
    a2 = [t.clone().requires_grad_(i in leaves) for i, t in enumerate(args[:4])] + [args[4]]
    g = torch.randn(6, 12, dtype=torch.float64)
    got = torch.autograd.grad(mlc.lora_linear(*a1, bias=bias), [a1[i] for i in leaves], g)
    want = torch.autograd.grad(lora_linear_oracle(*a2, bias=bias), [a2[i] for i in leaves], g)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 10), n_in=st.integers(1, 12), n_out=st.integers(1, 12), L=st.integers(1, 4),
       R=st.integers(1, 5), bias=st.booleans(), seed=st.integers(0, 1000))
def test_random_cases(T, n_in, n_out, L, R, bias, seed):
    args, b = make_linear(T, n_in, n_out, L, R, bias=bias, seed=seed)
    torch.testing.assert_close(mlc.lora_linear(*args, bias=b).double(), lora_linear_oracle(*args, bias=b),
                               **TOLERANCES[torch.float32])
