"""Hypothesis fuzz of both ops (CPU, float64) against the float64 oracle (``tests/support``): random shapes, layouts,
activations, biases, ``-1`` mixes, duplicate experts within a token, and optionally one slot poisoned with Inf/NaN
(issue 11): rows that do not use the poisoned slot must still match the oracle on clean weights. ~20 s on 2 cores."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cases import TOLERANCES
from support.oracle import TRANSPOSED, lora_linear_oracle, moe_lora_oracle

import moe_lora_compile as mlc

TOL = TOLERANCES[torch.float64]
POISON = st.sampled_from([None, float("inf"), -float("inf"), float("nan")])
_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _rows_without(ids: torch.Tensor, slot) -> torch.Tensor:
    return torch.ones_like(ids, dtype=torch.bool) if slot is None else ids != slot


@_FUZZ
@given(data=st.data(), T=st.integers(0, 7), H=st.integers(1, 9), I=st.integers(1, 7), E=st.integers(1, 5),
       k=st.integers(1, 3), L=st.integers(1, 3), R=st.integers(1, 4),
       layout=st.sampled_from(["concat", "interleaved", "transposed_concat", "transposed_interleaved"]),
       activation=st.sampled_from(["silu", "gptoss_swiglu"]), w13_bias=st.booleans(), w2_bias=st.booleans(),
       on_input=st.booleans(), poison=POISON, seed=st.integers(0, 2**16))
def test_fused_moe_lora_fuzz(data, T, H, I, E, k, L, R, layout, activation, w13_bias, w2_bias, on_input, poison,
                             seed):
    g = torch.Generator().manual_seed(seed)
    d = torch.float64

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=d) * 0.4

    ids = data.draw(st.lists(st.integers(-1, L - 1), min_size=T, max_size=T), label="token_lora_ids")
    token_lora_ids = torch.tensor(ids, dtype=torch.int32).reshape(T)
    # experts drawn with replacement: a token may route twice to one expert (duplicates are summed like any pair)
    topk_ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int64)
    topk_weights = torch.rand(T, k, generator=g, dtype=d).softmax(-1)
    transposed = TRANSPOSED[layout]
    w13 = rnd(E, H, 2 * I) if transposed else rnd(E, 2 * I, H)
    w2 = rnd(E, I, H) if transposed else rnd(E, H, I)
    stacks = [rnd(L, E, R, H), rnd(L, E, 2 * I, R), rnd(L, E, R, I), rnd(L, E, H, R)]
    kwargs = dict(layout=layout, activation=activation, routing_weight_on_input=on_input,
                  w13_bias=rnd(E, 2 * I) if w13_bias else None, w2_bias=rnd(E, H) if w2_bias else None)
    x = rnd(T, H) / 0.4
    want = moe_lora_oracle(x, topk_ids, topk_weights, token_lora_ids, w13, w2, *stacks, **kwargs)
    slot = None
    if poison is not None:
        slot = data.draw(st.integers(0, L - 1), label="poisoned slot")
        which = data.draw(st.integers(0, 3), label="poisoned stack")
        stacks[which] = stacks[which].clone()
        stacks[which][slot].view(-1)[data.draw(st.integers(0, stacks[which][slot].numel() - 1))] = poison
    y = mlc.fused_moe_lora(x, topk_ids, topk_weights, token_lora_ids, w13, w2, *stacks, **kwargs)
    assert y.shape == (T, H) and y.dtype == d
    rows = _rows_without(token_lora_ids, slot)
    torch.testing.assert_close(y[rows], want[rows], **TOL)
    base = token_lora_ids == -1
    y_base = mlc.fused_moe_lora(x, topk_ids, topk_weights, torch.full_like(token_lora_ids, -1), w13, w2, *stacks,
                                **kwargs)
    assert torch.equal(y[base], y_base[base])  # -1 rows: exactly the base result, whatever the slots hold


@_FUZZ
@given(data=st.data(), T=st.integers(0, 9), n_in=st.integers(1, 10), n_out=st.integers(1, 10),
       L=st.integers(1, 4), R=st.integers(1, 5), bias=st.booleans(), poison=POISON, seed=st.integers(0, 2**16))
def test_lora_linear_fuzz(data, T, n_in, n_out, L, R, bias, poison, seed):
    g = torch.Generator().manual_seed(seed)
    d = torch.float64
    x = torch.randn(T, n_in, generator=g, dtype=d)
    weight, b_vec = torch.randn(n_out, n_in, generator=g, dtype=d), torch.randn(n_out, generator=g, dtype=d)
    a, b = torch.randn(L, R, n_in, generator=g, dtype=d), torch.randn(L, n_out, R, generator=g, dtype=d)
    ids = data.draw(st.lists(st.integers(-1, L - 1), min_size=T, max_size=T), label="token_lora_ids")
    token_lora_ids = torch.tensor(ids, dtype=torch.int32).reshape(T)
    bias_t = b_vec if bias else None
    want = lora_linear_oracle(x, weight, a, b, token_lora_ids, bias=bias_t)
    slot = None
    if poison is not None:
        slot = data.draw(st.integers(0, L - 1), label="poisoned slot")
        target = data.draw(st.sampled_from(["a", "b"]), label="poisoned stack")
        t = (a if target == "a" else b).clone()
        t[slot].view(-1)[data.draw(st.integers(0, t[slot].numel() - 1))] = poison
        a, b = (t, b) if target == "a" else (a, t)
    y = mlc.lora_linear(x, weight, a, b, token_lora_ids, bias=bias_t)
    assert y.shape == (T, n_out) and y.dtype == d
    rows = _rows_without(token_lora_ids, slot)
    torch.testing.assert_close(y[rows], want[rows], **TOL)
