"""torch.ops.moe_lora.fused_moe_lora against the independent float64 oracle (``tests/support``), on the CPU."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.cases import TOLERANCES, MoECase
from support.oracle import moe_lora_oracle

import moe_lora_compile as mlc

CASES = [
    MoECase(T=1),  # a single token (decode)
    MoECase(T=0),  # empty batch
    MoECase(T=6, routing="one_expert"),  # every token routed to expert 0
    MoECase(T=6, E=5, experts=(0, 1, 2, 3)),  # an expert (4) that receives no tokens
    MoECase(T=6, lora="none"),  # every token -1: base MoE only
    MoECase(T=7, lora="mixed"),  # mixed -1 and adapters
    MoECase(T=5, L=1, lora="all"),  # a single adapter slot
    MoECase(T=8, L=4, R=8, ranks=(8, 2, 5, 1)),  # per-slot ranks zero-padded to the slot rank
    MoECase(T=5, k=1),  # top-1 routing
    MoECase(T=5, k=4, E=6),  # k > 2
    MoECase(T=5, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True),  # GPT-OSS layout + biases
    MoECase(T=5, layout="transposed_interleaved", activation="silu"),  # interleaved gate/up with plain silu
    MoECase(T=5, layout="interleaved", activation="gptoss_swiglu", bias=True),  # vLLM's GPT-OSS: [E, 2I, H] rows
    MoECase(T=6, layout="interleaved", activation="silu", lora="alternate"),  # non-transposed interleaved, silu
    MoECase(T=5, layout="concat", activation="gptoss_swiglu", bias=True),  # clamped swiglu on concat layout
    MoECase(T=5, layout="transposed_concat", routing_weight_on_input=True, k=1),  # Llama-4: weight on the input
    MoECase(T=5, routing_weight_on_input=True, k=2),  # weight on the input with k > 1
    MoECase(T=6, dtype=torch.bfloat16),  # bf16 in, fp32 accumulation, bf16 out
    MoECase(T=6, dtype=torch.bfloat16, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True),
    MoECase(T=6, dtype=torch.bfloat16, layout="interleaved", activation="gptoss_swiglu", bias=True),  # vLLM bf16
    MoECase(T=4, dtype=torch.float64),  # float64 end to end
]


@pytest.mark.parametrize("case", CASES, ids=MoECase.label)
def test_matches_oracle(case):
    args, kwargs = case.make()
    y = mlc.fused_moe_lora(*args, **kwargs)
    expected = moe_lora_oracle(*args, **kwargs)
    assert y.shape == (case.T, case.H) and y.dtype == case.dtype
    torch.testing.assert_close(y.double(), expected, **TOLERANCES[case.dtype])


def test_gptoss_clamp_is_active():
    """Large activations exercise both clamps; the op must still equal the oracle (not just the unclamped formula)."""
    case = MoECase(T=4, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True)
    args, kwargs = case.make(scale=3.0)
    y = mlc.fused_moe_lora(*args, **kwargs)
    torch.testing.assert_close(y.double(), moe_lora_oracle(*args, **kwargs), atol=1e-2, rtol=1e-4)
    unclamped = moe_lora_oracle(*args, **{**kwargs, "limit": 1e9})
    assert not torch.allclose(y.double(), unclamped, atol=1e-2), "the test inputs never reach the clamp"


@pytest.mark.parametrize("budget_tokens", [1, 3])  # one token a chunk; chunks of 3 that do not divide T = 7
def test_eager_op_gathers_in_bounded_chunks(monkeypatch, budget_tokens):
    """The CPU op gathers each (token, expert) pair's weights; it takes the tokens in chunks so those gathers stay
    under ``GATHER_BYTES_PER_CHUNK`` (they grow with T * k: a prefill ran out of memory), same result."""
    from moe_lora_compile.ops import reference

    case = MoECase(T=7, k=2, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True, lora="mixed")
    args, kwargs = case.make()
    whole = mlc.fused_moe_lora(*args, **kwargs)
    per_token = reference._tokens_per_chunk(args[0], case.k, args[4:10])
    monkeypatch.setattr(reference, "GATHER_BYTES_PER_CHUNK", reference.GATHER_BYTES_PER_CHUNK // per_token
                        * budget_tokens)
    seen = []
    pair_matmul = reference._pair_matmul
    monkeypatch.setattr(reference, "_pair_matmul", lambda xp, *a: seen.append(xp.shape[0]) or pair_matmul(xp, *a))
    y = mlc.fused_moe_lora(*args, **kwargs)
    assert max(seen) == budget_tokens * case.k and sum(seen) == 2 * case.T * case.k  # w13 and w2 per pair
    torch.testing.assert_close(y, whole)  # equal up to rounding: a batched matmul may sum in another order
    torch.testing.assert_close(y.double(), moe_lora_oracle(*args, **kwargs), **TOLERANCES[case.dtype])


def test_no_adapter_tokens_ignore_lora_weights():
    """A -1 token's output depends on the base weights only: changing every LoRA stack leaves it unchanged."""
    args, kwargs = MoECase(T=6).make()
    y0 = mlc.fused_moe_lora(*args, **kwargs)
    changed = list(args)
    for i in range(6, 10):
        changed[i] = torch.randn_like(args[i])
    y1 = mlc.fused_moe_lora(*changed, **kwargs)
    base = args[3] == -1
    assert base.any() and (~base).any()
    torch.testing.assert_close(y1[base], y0[base])
    assert not torch.allclose(y1[~base], y0[~base])


def test_routing_invariants():
    """Permuting the k routed experts of a token does not change its output; tokens are independent."""
    args, kwargs = MoECase(T=6, k=3, E=6).make()
    y = mlc.fused_moe_lora(*args, **kwargs)
    perm = torch.tensor([2, 0, 1])
    permuted = list(args)
    permuted[1], permuted[2] = args[1][:, perm], args[2][:, perm]
    torch.testing.assert_close(mlc.fused_moe_lora(*permuted, **kwargs), y)
    rows = torch.tensor([4, 1])
    sub = [args[0][rows], args[1][rows], args[2][rows], args[3][rows], *args[4:]]
    torch.testing.assert_close(mlc.fused_moe_lora(*sub, **kwargs), y[rows])


def test_grads_flow_to_lora_and_match_autograd_of_oracle():
    args, kwargs = MoECase(T=5, dtype=torch.float64).make()
    leaves = [0, 2, 6, 7, 8, 9]  # x, topk_weights, the four LoRA stacks
    a1 = [t.clone().requires_grad_(i in leaves) if t.is_floating_point() else t for i, t in enumerate(args)]
    a2 = [t.clone().requires_grad_(i in leaves) if t.is_floating_point() else t for i, t in enumerate(args)]
    g = torch.randn(5, 16, dtype=torch.float64)
    got = torch.autograd.grad(mlc.fused_moe_lora(*a1, **kwargs), [a1[i] for i in leaves], g)
    want = torch.autograd.grad(moe_lora_oracle(*a2, **kwargs), [a2[i] for i in leaves], g)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("stack", [6, 7, 8, 9])  # a NaN in a13 / b13 / a2 / b2
def test_grads_keep_a_nonfinite_slot_in_its_rows(stack):
    """Backward isolates tenants as the forward does: a NaN in slot 0's factors leaves the gradients of the rows
    of the other slot and of the no-adapter rows (x, topk_weights, slot 1's stacks) as they are with a clean
    slot 0 (``-1`` rows once read slot 0's factors, multiplied by zero on the way back)."""
    args, kwargs = MoECase(T=6, dtype=torch.float64).make()
    args = list(args)
    args[3] = torch.tensor([0, -1, 1, -1, 0, 1], dtype=args[3].dtype)
    poisoned = list(args)
    poisoned[stack] = args[stack].clone()
    poisoned[stack][0].view(-1)[3] = float("nan")
    leaves = [0, 2, 6, 7, 8, 9]
    g = torch.randn(6, args[0].shape[1], dtype=torch.float64)

    def grads(tensors):
        inputs = [t.clone().requires_grad_(i in leaves) if t.is_floating_point() else t for i, t in enumerate(tensors)]
        return torch.autograd.grad(mlc.fused_moe_lora(*inputs, **kwargs), [inputs[i] for i in leaves], g)

    clean, dirty = grads(args), grads(poisoned)
    others = args[3] != 0
    for got, want in zip(dirty[:2], clean[:2]):  # x, topk_weights
        torch.testing.assert_close(got[others], want[others], rtol=0, atol=0)
    for got, want in zip(dirty[2:], clean[2:]):  # slot 1 of each stack
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_frozen_base_weights_refuse_grad():
    args, kwargs = MoECase(T=3).make()
    args = list(args)
    args[4] = args[4].clone().requires_grad_()
    with pytest.raises(ValueError, match="w13 requires grad"):
        mlc.fused_moe_lora(*args, **kwargs)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.integers(0, 9), E=st.integers(1, 6), k=st.integers(1, 3), L=st.integers(1, 4), R=st.sampled_from([1, 2, 4]),
    layout=st.sampled_from(["concat", "interleaved", "transposed_concat", "transposed_interleaved"]),
    activation=st.sampled_from(["silu", "gptoss_swiglu"]), bias=st.booleans(), on_input=st.booleans(),
    lora=st.sampled_from(["mixed", "none", "all"]),
)
def test_random_cases(T, E, k, L, R, layout, activation, bias, on_input, lora):
    k = min(k, E)
    case = MoECase(T=T, H=8, I=6, E=E, k=k, L=L, R=R, layout=layout, activation=activation, bias=bias,
                   routing_weight_on_input=on_input, lora=lora)
    args, kwargs = case.make()
    torch.testing.assert_close(mlc.fused_moe_lora(*args, **kwargs).double(), moe_lora_oracle(*args, **kwargs),
                               **TOLERANCES[torch.float32])
