"""``moe_lora.decode_attention`` (flash-decoding Triton kernel over the static KV cache) against independent references.

CPU: the kernel in Triton's interpreter (fp32, tiny shapes) against a float64 oracle, the folded eager attention
(:func:`~moe_lora_compile.models.attention.folded_gqa_attention_forward`) and transformers' GPT-OSS
``eager_attention_forward``; the op through opcheck; argument errors. GPU (``-m gpu``): bf16 at GPT-OSS-20B and
Qwen3-30B-A3B geometries against the fp32 oracle, and replayed from a CUDA graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_lora_compile.models.attention import folded_gqa_attention_forward
from moe_lora_compile.ops.decode_attention import decode_attention, decode_attention_reference
from moe_lora_compile.ops.triton.attention_launch import counters_clear, decode_attention_triton

F64 = torch.float64


def decode_mask(positions, S: int, L: int, window=None, dtype=torch.float32, masked=None) -> torch.Tensor:
    """Additive mask [B, 1, S, L] as RowGraphs builds it: query ``s`` of row ``b`` sits at slot ``positions[b] + s``
    and sees slots ``<=`` it (and ``> slot - window``); ``masked``: the value of hidden slots (default dtype min)."""
    slots = torch.arange(L)
    query_at = torch.as_tensor(positions)[:, None, None, None] + torch.arange(S)[None, None, :, None]
    seen = slots <= query_at
    if window is not None:
        seen &= slots > query_at - window
    fill = torch.finfo(dtype).min if masked is None else masked
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, fill)


def make_case(B, H, Hkv, S, D, L, *, positions, window=None, sinks=False, masked=None, dtype=torch.float32,
              device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, H, D, generator=g).transpose(1, 2)  # [B, H, S, D] strided, as transformers passes it
    k, v = torch.randn(B, Hkv, L, D, generator=g), torch.randn(B, Hkv, L, D, generator=g)
    s = torch.randn(H, generator=g) * 2 if sinks else None
    mask = None if positions is None else decode_mask(positions, S, L, window, dtype, masked)
    to = lambda t: None if t is None else t.to(device=device, dtype=dtype)
    return to(q), to(k), to(v), None if mask is None else mask.to(device), to(s)


def oracle(q, k, v, mask, scaling, sinks):
    """The op's semantics in float64 (decode_attention_reference on float64 copies; the mask in its own dtype, which
    says what counts as masked)."""
    f = lambda t: None if t is None else t.to(F64)
    return decode_attention_reference(f(q), f(k), f(v), mask, scaling, f(sinks))


# (B, H, Hkv, S, D, L, positions, options): options = window, sinks, masked, block_n, num_splits
KERNEL_CASES = [
    # decode (S=1), GPT-OSS-like n_rep=8 with sinks, one row, auto plan
    pytest.param((1, 8, 1, 1, 16, 40, [30], dict(sinks=True)), id="S1-nrep8-sinks"),
    # spec decode S=3, n_rep=4, rows at different positions, L=50 not a multiple of the 16-slot block, 3 splits
    pytest.param((3, 8, 2, 3, 16, 50, [0, 21, 46], dict(block_n=16, num_splits=3)), id="S3-rows-differ-L50"),
    # sliding window of 8 with sinks: most blocks fully masked (skipped), 4 splits, some splits see nothing
    pytest.param((2, 8, 2, 1, 16, 64, [5, 37], dict(window=8, sinks=True, block_n=16, num_splits=4)),
                 id="window8-sinks-empty-splits"),
    # spec decode in a sliding window, sinks: the window boundary cuts through a block
    pytest.param((2, 4, 1, 3, 16, 48, [10, 30], dict(window=6, sinks=True, block_n=16, num_splits=2)),
                 id="S3-window6-sinks"),
    # n_rep=1 (MHA), masked with -inf instead of the dtype's minimum
    pytest.param((2, 2, 2, 1, 32, 33, [32, 3], dict(masked=float("-inf"), block_n=32, num_splits=2)),
                 id="nrep1-neg-inf-mask"),
    # no mask at all: every slot seen
    pytest.param((2, 4, 2, 1, 16, 20, None, dict(sinks=True, block_n=16, num_splits=2)), id="no-mask"),
    # head dim 8 (the tiny models'), padded to a 16-wide tile; one split (direct store, no combine)
    pytest.param((1, 4, 2, 1, 8, 24, [11], dict(sinks=True, block_n=16, num_splits=1)), id="D8-one-split"),
    # head dim 24 (not a power of two), n_rep=8 S=3: 24 rows in a 32-row tile
    pytest.param((1, 16, 2, 3, 24, 40, [20], dict(block_n=16, num_splits=2)), id="D24-rows24"),
    # position 0: only slot 0 seen (one block live of many), with and without sinks
    pytest.param((1, 4, 1, 1, 16, 64, [0], dict(block_n=16, num_splits=4)), id="first-token"),
    pytest.param((1, 4, 1, 1, 16, 64, [0], dict(sinks=True, block_n=16, num_splits=4)), id="first-token-sinks"),
    # 11 splits (an odd count, padded to 16 in the m/l tile), rows at different positions, sinks
    pytest.param((2, 8, 2, 1, 16, 176, [170, 90], dict(sinks=True, block_n=16, num_splits=11)), id="11-splits"),
    # sliding window of 20 over 11 splits: most splits see nothing (max -inf, sum 0: weight 0 in the combine)
    pytest.param((1, 8, 1, 3, 16, 176, [100], dict(window=20, block_n=16, num_splits=11)), id="11-splits-window"),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_float64_oracle(case):
    B, H, Hkv, S, D, L, positions, options = case
    launch = {key: options.pop(key) for key in ("block_n", "num_splits") if key in options}
    q, k, v, mask, sinks = make_case(B, H, Hkv, S, D, L, positions=positions, **options)
    scaling = D ** -0.5
    out = decode_attention_triton(q, k, v, mask, scaling, sinks, **launch)
    assert out.shape == (B, S, H, D) and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.to(F64), oracle(q, k, v, mask, scaling, sinks), rtol=1e-5, atol=1e-5)
    assert counters_clear(q.device), "arrival counters not reset"


@pytest.mark.parametrize("case", [KERNEL_CASES[1], KERNEL_CASES[2], KERNEL_CASES[3]], ids=["S3", "window", "S3-window"])
def test_kernel_matches_folded_eager_attention(case):
    """Against the folded eager attention (transformers' eager math: mask added, then softmax) on the same inputs."""
    B, H, Hkv, S, D, L, positions, options = case
    launch = {key: options.pop(key) for key in ("block_n", "num_splits") if key in options}
    q, k, v, mask, sinks = make_case(B, H, Hkv, S, D, L, positions=positions, **options)
    module = SimpleNamespace(training=False, **({"sinks": sinks} if sinks is not None else {}))
    want, _ = folded_gqa_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)
    got = decode_attention_triton(q, k, v, mask, D ** -0.5, sinks, **launch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 8], ids=["full", "sliding"])
def test_kernel_matches_transformers_gpt_oss_eager(window):
    """transformers' GPT-OSS eager_attention_forward (repeat_kv, sinks concatenated to the logits) as the reference."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v, mask, sinks = make_case(2, 8, 2, 1, 16, 40, positions=[12, 33], window=window, sinks=True)
    module = SimpleNamespace(training=False, sinks=sinks, num_key_value_groups=4)
    want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.25)
    got = decode_attention_triton(q, k, v, mask, 0.25, sinks, block_n=16, num_splits=2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fully_masked_row_gives_zeros():
    """A row with every slot masked (never in a decode step) gives zeros, with and without sinks."""
    q, k, v, mask, sinks = make_case(2, 4, 2, 1, 16, 32, positions=[10, 20], sinks=True)
    mask[1] = torch.finfo(torch.float32).min
    for s in (None, sinks):
        out = decode_attention_triton(q, k, v, mask, 0.25, s, block_n=16, num_splits=2)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out.to(F64), oracle(q, k, v, mask, 0.25, s), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_unseen_cache_slots_never_reach_the_result(poison):
    """What the static cache holds in slots no query row sees (stale or garbage K/V past a row's position) does not
    change the output, in the kernel and in the reference (the CPU op): slots in a block with seen slots (21, 27),
    and in blocks no row sees (40, 63). Row 1 (position 45) sees slot 40 and must still see its value."""
    q, k, v, mask, sinks = make_case(2, 4, 2, 2, 16, 64, positions=[19, 45], sinks=True)
    clean_kernel = decode_attention_triton(q, k, v, mask, 0.25, sinks, block_n=16, num_splits=2)
    clean_ref = decode_attention_reference(q, k, v, mask, 0.25, sinks)
    k2, v2 = k.clone(), v.clone()
    for slot in (21, 27, 40, 63):
        k2[0, :, slot] = poison
        v2[0, :, slot] = poison
    v2[1, :, 40] = 0.0  # row 1 sees slot 40: changing it changes row 1 (the mask is not ignored)
    got_kernel = decode_attention_triton(q, k2, v2, mask, 0.25, sinks, block_n=16, num_splits=2)
    got_ref = decode_attention_reference(q, k2, v2, mask, 0.25, sinks)
    for got, clean in ((got_kernel, clean_kernel), (got_ref, clean_ref)):
        assert torch.equal(got[0], clean[0])
        assert torch.isfinite(got).all() and not torch.allclose(got[1], clean[1])
    torch.testing.assert_close(got_kernel.to(F64), oracle(q, k2, v2, mask, 0.25, sinks), rtol=1e-5, atol=1e-5)


def test_mask_broadcast_and_longer_than_cache():
    """A mask [1, 1, S, L + 5] (batch broadcast, longer than the cache: its first L columns count)."""
    q, k, v, _, _ = make_case(3, 4, 2, 2, 16, 30, positions=None)
    mask = decode_mask([17], 2, 35)
    out = decode_attention_triton(q, k, v, mask, 0.3, None, block_n=16, num_splits=2)
    torch.testing.assert_close(out.to(F64), oracle(q, k, v, mask.expand(3, 1, 2, 35), 0.3, None), rtol=1e-5,
                               atol=1e-5)


# --- the op ---------------------------------------------------------------------------------------------------------
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("sinks", [False, True])
def test_opcheck(sinks):
    q, k, v, mask, s = make_case(2, 4, 2, 3, 8, 20, positions=[5, 12], sinks=sinks)
    torch.library.opcheck(torch.ops.moe_lora.decode_attention.default, (q, k, v, mask, 0.35, s),
                          test_utils=OPCHECK_TESTS)


def test_op_runs_kernel_and_refuses_backward():
    q, k, v, mask, s = make_case(2, 4, 2, 1, 8, 20, positions=[5, 12], sinks=True)
    out = decode_attention(q, k, v, mask, scaling=0.35, sinks=s)  # the kernel (TRITON_INTERPRET=1 on CPU)
    torch.testing.assert_close(out.to(F64), oracle(q, k, v, mask, 0.35, s), rtol=1e-5, atol=1e-5)
    q.requires_grad_(True)
    with pytest.raises(RuntimeError, match="no backward"):
        decode_attention(q, k, v, mask, scaling=0.35, sinks=s).sum().backward()


@pytest.mark.parametrize("change, match", [
    (dict(q=torch.zeros(2, 4, 1)), "query must be 4-D"),  # 3-D query
    (dict(k=torch.zeros(2, 3, 20, 8), v=torch.zeros(2, 3, 20, 8)), "multiple of key/value heads"),  # 4 % 3
    (dict(v=torch.zeros(2, 2, 19, 8)), "value must have key's shape"),  # value shorter than key
    (dict(k=torch.zeros(2, 2, 20, 8, dtype=F64), v=torch.zeros(2, 2, 20, 8, dtype=F64)), "query's dtype"),
    (dict(mask=torch.zeros(2, 1, 1, 19)), "mask must be"),  # mask shorter than the cache
    (dict(mask=torch.zeros(2, 1, 1, 20, dtype=torch.bool)), "additive floating mask"),  # boolean mask
    (dict(s=torch.zeros(3)), "sinks must be"),  # one sink short
    (dict(k=torch.zeros(2, 2, 0, 8), v=torch.zeros(2, 2, 0, 8), mask=None), "at least one cache position"),  # L=0
])
def test_bad_arguments(change, match):
    q, k, v, mask, s = make_case(2, 4, 2, 1, 8, 20, positions=[5, 12], sinks=True)
    args = dict(q=q, k=k, v=v, mask=mask, s=s) | change
    with pytest.raises((ValueError, TypeError), match=match):
        decode_attention(args["q"], args["k"], args["v"], args["mask"], scaling=0.35, sinks=args["s"])


def test_integer_sinks_are_a_type_error():
    """A wrong dtype is a TypeError, as for every other argument (integer sinks were a ValueError)."""
    q, k, v, mask, _ = make_case(2, 4, 2, 1, 8, 20, positions=[5, 12], sinks=True)
    with pytest.raises(TypeError, match="sinks must be a floating tensor, got torch.int32"):
        decode_attention(q, k, v, mask, scaling=0.35, sinks=torch.zeros(4, dtype=torch.int32))


# --- GPU ------------------------------------------------------------------------------------------------------------
GPU_GEOMETRIES = [  # (H, Hkv, D, window, sinks): GPT-OSS-20B full / sliding layers, Qwen3-30B-A3B
    pytest.param((64, 8, 64, None, True), id="gptoss-full"),
    pytest.param((64, 8, 64, 128, True), id="gptoss-sliding"),
    pytest.param((32, 4, 128, None, False), id="qwen3"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", GPU_GEOMETRIES)
@pytest.mark.parametrize("B, S, L", [(1, 1, 640), (8, 1, 640), (64, 1, 2048), (4, 3, 1000)])
def test_gpu_bf16_matches_fp32_oracle(geometry, B, S, L):
    H, Hkv, D, window, sinks = geometry
    g = torch.Generator().manual_seed(B * L)
    positions = torch.randint(0, L - S, (B,), generator=g).tolist()
    positions[0] = L - S  # one row at the end of the cache
    q, k, v, mask, s = make_case(B, H, Hkv, S, D, L, positions=positions, window=window, sinks=sinks,
                                 dtype=torch.bfloat16, device="cuda")
    out = decode_attention(q, k, v, mask, scaling=D ** -0.5, sinks=s)
    want = decode_attention_reference(q.float(), k.float(), v.float(), mask.float(), D ** -0.5,
                                      None if s is None else s.float())
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert counters_clear(q.device)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_mask_data():
    """Captured once, replayed with the mask moved on (the position is data): each replay equals the oracle."""
    q, k, v, mask, s = make_case(2, 64, 8, 1, 64, 512, positions=[0, 0], window=128, sinks=True,
                                 dtype=torch.bfloat16, device="cuda")
    decode_attention(q, k, v, mask, sinks=s)  # warm-up: compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, mask, sinks=s)
    for positions in ([3, 100], [300, 511], [130, 7]):
        mask.copy_(decode_mask(positions, 1, 512, 128, torch.bfloat16).cuda())
        graph.replay()
        want = decode_attention_reference(q.float(), k.float(), v.float(), mask.float(), 64 ** -0.5, s.float())
        torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
