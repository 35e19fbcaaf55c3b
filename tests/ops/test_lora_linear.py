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


@pytest.mark.parametrize("factor", [2, 3])  # a NaN in A / in B
def test_grads_keep_a_nonfinite_slot_in_its_rows(factor):
    """Backward isolates tenants as the forward does: a NaN in slot 0's factors leaves the gradients of the other
    slots' and the no-adapter rows (x, their slots' A and B) as they are with a clean slot 0."""
    args, bias = make_linear(8, 10, 12, 3, 4, bias=True, dtype=torch.float64)
    ids = torch.tensor([0, 1, -1, 2, 1, -1, 0, 2], dtype=torch.int32)
    poisoned = [t.clone() for t in args[:4]]
    poisoned[factor][0, 1, 2] = float("nan")
    g = torch.randn(8, 12, dtype=torch.float64)

    def grads(tensors):
        leaves = [t.clone().requires_grad_() for t in (tensors[0], tensors[2], tensors[3])]
        y = mlc.lora_linear(leaves[0], tensors[1], leaves[1], leaves[2], ids, bias=bias)
        return torch.autograd.grad(y, leaves, g)

    clean, dirty = grads(args[:4]), grads(poisoned)
    others = ids != 0
    torch.testing.assert_close(dirty[0][others], clean[0][others], rtol=0, atol=0)
    for got, want in zip(dirty[1:], clean[1:]):  # the A and B gradients of slots 1 and 2
        torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 10), n_in=st.integers(1, 12), n_out=st.integers(1, 12), L=st.integers(1, 4),
       R=st.integers(1, 5), bias=st.booleans(), seed=st.integers(0, 1000))
def test_random_cases(T, n_in, n_out, L, R, bias, seed):
    args, b = make_linear(T, n_in, n_out, L, R, bias=bias, seed=seed)
    torch.testing.assert_close(mlc.lora_linear(*args, bias=b).double(), lora_linear_oracle(*args, bias=b),
                               **TOLERANCES[torch.float32])
