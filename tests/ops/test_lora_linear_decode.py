"""``lora_linear`` at decode sizes: the GEMM's grouped B expand (``expand_slots``: the B tiles of several distinct
adapter slots of a row block in one gathered load, :func:`moe_lora_compile.ops.triton.dense_kernels.
_lora_expand_grouped`), its expand spread over the split-K slices (``spread_expand``) and the GEMV's narrow/wide
tiles (BLOCK_N down to 2, K steps up to 1024, prefetch, split-K on and off), the variants the tuner
(:mod:`moe_lora_compile.ops.triton.tune_linear`) chooses from.

CPU: Triton's interpreter, float32, tiny shapes, against the float64 oracle (``tests/support``). GPU (``-m gpu``):
bf16 at the q/k/v and o shapes of GPT-OSS-20B and Qwen3-30B-A3B, and a CUDA graph replayed with new ids.
"""

from __future__ import annotations

import pytest
import torch

from support.oracle import lora_linear_oracle

from moe_lora_compile.ops.triton import configs as C
from moe_lora_compile.ops.triton.configs import GemmConfig, LinearKernelConfig, ShrinkConfig
from moe_lora_compile.ops.triton.launch import lora_linear_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def config(gemv=False, block_n=16, block_k=16, split_k=1, expand_slots=8, prefetch=False, block_m=16,
           per_token=True, spread_expand=False) -> LinearKernelConfig:
    return LinearKernelConfig(BLOCK_M=block_m, per_token=per_token, gemv=gemv, expand_slots=expand_slots,
                              spread_expand=spread_expand,
                              gemm=GemmConfig(BLOCK_N=block_n, BLOCK_K=block_k, GROUP_SIZE_M=1, num_warps=4,
                                              num_stages=2 if prefetch else 1, SPLIT_K=split_k),
                              shrink=ShrinkConfig(BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=1))


def make(T, n_in, n_out, ids, L=6, R=8, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    a = torch.randn(L, R, n_in, generator=g) * n_in ** -0.5
    b = torch.randn(L, n_out, R, generator=g) * R ** -0.5
    bv = torch.randn(n_out, generator=g) if bias else None
    return (x, w, a, b, torch.tensor(ids, dtype=torch.int32)), bv


def run(args, bias, cfg):
    return lora_linear_triton(*(t.to(DEVICE) for t in args), bias=None if bias is None else bias.to(DEVICE),
                              config=cfg)


def _ids(T, kind):
    if kind == "none":
        return [-1] * T
    if kind == "one_slot":
        return [3] * T
    if kind == "mixed":  # six slots out of order, repeats and -1s: more distinct slots than a group of 2 or 4
        pattern = [5, -1, 0, 3, 3, 1, -1, 4, 2, 0, 5]
        return [pattern[t % len(pattern)] for t in range(T)]
    raise ValueError(kind)


@pytest.mark.parametrize("T,n_in,n_out,kind,split_k", [
    (1, 32, 16, "mixed", 1),      # one token (one slot in the block)
    (2, 32, 16, "mixed", 1),      # two tokens: slot 5 and -1
    (8, 40, 24, "mixed", 1),      # 8 tokens, 5 distinct slots; K = 40 and N = 24 not multiples of 16 (masked)
    (8, 48, 32, "mixed", 3),      # split-K 3: only slice 0 expands, the last arrival sums
    (8, 32, 16, "none", 2),       # all -1: no B load, no expand (the group is empty)
    (8, 32, 16, "one_slot", 1),   # every token on one slot: one group of one
    (33, 40, 32, "mixed", 2),     # three row blocks (the last one of one token), ragged K, split-K
])
@pytest.mark.parametrize("expand_slots", [1, 2, 4, 8])  # serial / rounds of 2 and 4 / all in one round
def test_gemm_grouped_expand_matches_oracle(T, n_in, n_out, kind, split_k, expand_slots):
    args, bv = make(T, n_in, n_out, _ids(T, kind))
    y = run(args, bv, config(split_k=split_k, expand_slots=expand_slots))
    torch.testing.assert_close(y.cpu().double(), lora_linear_oracle(*args, bias=bv), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,n_in,n_out,kind,split_k", [
    (8, 48, 32, "mixed", 3),      # 5 distinct slots over 3 slices: 2, 2 and 1 slots a slice
    (8, 64, 16, "mixed", 8),      # more slices than slots: some slices expand nothing
    (11, 48, 16, "mixed", 2),     # all 6 slots of the pattern (0-5), repeats and -1s, over 2 slices
    (8, 32, 16, "one_slot", 4),   # one slot: slice 0 expands it, the other three nothing
    (8, 32, 16, "none", 2),       # all -1: no slice expands
    (33, 40, 32, "mixed", 2),     # three row blocks, each with its own slot order; ragged K
])
@pytest.mark.parametrize("expand_slots", [1, 4])  # serial / grouped rounds within a slice's share
def test_gemm_spread_expand_matches_oracle(T, n_in, n_out, kind, split_k, expand_slots):
    """``spread_expand``: a row block's i-th distinct slot is expanded by K slice i % SPLIT_K (the last arriver
    sums the slices): the result is the oracle's, each slot's delta counted once."""
    args, bv = make(T, n_in, n_out, _ids(T, kind))
    y = run(args, bv, config(split_k=split_k, expand_slots=expand_slots, spread_expand=True))
    torch.testing.assert_close(y.cpu().double(), lora_linear_oracle(*args, bias=bv), rtol=1e-4, atol=1e-4)


def test_spread_expand_config():
    """``spread_expand`` must be a bool; its dict form round-trips; a table entry without it (every entry written
    before it) takes the default, True, and a True config writes no key (tables stay as they were)."""
    with pytest.raises(ValueError, match="spread_expand"):
        config(spread_expand=1)
    off = config(spread_expand=False)
    assert off.to_dict()["spread_expand"] is False and LinearKernelConfig.of(off.to_dict()) == off
    on = config(spread_expand=True)
    assert "spread_expand" not in on.to_dict() and LinearKernelConfig.of(on.to_dict()).spread_expand is True
    assert LinearKernelConfig.of({k: v for k, v in off.to_dict().items() if k != "spread_expand"}) == on


@pytest.mark.parametrize("expand_slots", [2, 8])
def test_gemm_grouped_expand_nonfinite_slot_stays_in_its_rows(expand_slots):
    """An inf in slot 3's B reaches only the rows of slot 3, also when it shares a round with other slots."""
    args, _ = make(8, 32, 16, _ids(8, "mixed"), bias=False, seed=2)
    ref = lora_linear_oracle(*args)
    b = args[3].clone()
    b[3, 0, 0] = float("inf")
    y = run(args[:3] + (b, args[4]), None, config(expand_slots=expand_slots)).cpu().double()
    mine = args[4] == 3
    torch.testing.assert_close(y[~mine], ref[~mine], rtol=1e-4, atol=1e-4)
    assert not torch.isfinite(y[mine]).all()


@pytest.mark.parametrize("T,n_in,n_out,kind,block_n,block_k,split_k", [
    (1, 64, 16, "mixed", 2, 32, 1),     # 2-column tiles, no split
    (1, 40, 16, "mixed", 4, 32, 1),     # ragged K (40 = 32 + 8): a masked last step, no split
    (2, 64, 20, "mixed", 4, 16, 3),     # ragged N (20 = 5 tiles of 4), split-K 3
    (2, 64, 16, "none", 2, 64, 1),      # all -1, one K step covering K
    (4, 48, 16, "mixed", 4, 16, 2),     # four tokens of three slots and a -1, split-K 2
    (8, 32, 8, "one_slot", 2, 16, 2),   # eight tokens on one slot (GEMV_MAX_T), split-K 2
])
@pytest.mark.parametrize("prefetch", [False, True], ids=["no_prefetch", "prefetch"])
def test_gemv_narrow_and_wide_tiles_match_oracle(T, n_in, n_out, kind, block_n, block_k, split_k, prefetch):
    args, bv = make(T, n_in, n_out, _ids(T, kind))
    y = run(args, bv, config(gemv=True, block_n=block_n, block_k=block_k, split_k=split_k, prefetch=prefetch))
    torch.testing.assert_close(y.cpu().double(), lora_linear_oracle(*args, bias=bv), rtol=1e-4, atol=1e-4)


def test_expand_slots_config():
    """A bad ``expand_slots`` is a ValueError naming it; the dict form round-trips it; entries without it (tuned
    before it existed) take the default, one slot at a time."""
    with pytest.raises(ValueError, match="expand_slots"):
        config(expand_slots=3)
    cfg = config(expand_slots=4)
    assert cfg.to_dict()["expand_slots"] == 4 and LinearKernelConfig.of(cfg.to_dict()) == cfg
    old = {k: v for k, v in cfg.to_dict().items() if k != "expand_slots"}
    assert LinearKernelConfig.of(old).expand_slots == 1


@pytest.mark.parametrize("block_n,R,warps,asked,used", [
    (64, 32, 4, 8, 4),    # rank 32, 64 columns, 4 warps: 4 slots' B tiles = 64 elements a thread
    (32, 32, 4, 8, 8),    # half the columns: all 8
    (128, 32, 4, 8, 2),   # 128 columns: 2
    (64, 32, 8, 8, 8),    # 8 warps: twice the budget
    (64, 32, 4, 1, 1),    # serial asked: serial
])
def test_expand_slots_register_cap(block_n, R, warps, asked, used):
    from moe_lora_compile.ops.triton.launch import _expand_slots

    assert _expand_slots(config(expand_slots=asked), block_n, R, warps) == used


def test_tuner_candidates_cover_the_new_variants():
    """Stage 1 offers split-K-free GEMV tiles with and without prefetch at T=1, none at T=8; stage 2 the expand
    groups around a GEMM config."""
    from moe_lora_compile.ops.triton import tune_linear as TL

    shape = TL.Shape("m", "qkv", 2880, 5120, bias=True)
    gemv = [c for label, c in TL.stage1(1, shape, 132) if label == "gemv"]
    assert any(c.gemm.SPLIT_K == 1 and c.gemm.num_stages == 2 and c.gemm.BLOCK_N <= 4 for c in gemv)
    assert any(c.gemm.SPLIT_K > 1 for c in gemv) and any(c.gemm.num_stages == 1 for c in gemv)
    assert not [c for label, c in TL.stage1(8, shape, 132) if label == "gemv"]
    gemm = C.default_linear_config(8, 2880, 5120, 132)
    assert gemm.gemm.SPLIT_K > 1 and gemm.spread_expand  # the default
    assert {c.expand_slots for _, c in TL.stage2([gemm])} >= {1, 4}
    assert [c for label, c in TL.stage2([gemm]) if label == "spread"] == [gemm.replace(spread_expand=False)]


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 at real decode shapes
# ----------------------------------------------------------------------------------------------------------------

DECODE_SHAPES = [  # (in, out): fused q/k/v and o of GPT-OSS-20B and Qwen3-30B-A3B
    pytest.param(2880, 5120, id="gpt-oss-qkv"), pytest.param(4096, 2880, id="gpt-oss-o"),
    pytest.param(2048, 5120, id="qwen3-qkv"), pytest.param(4096, 2048, id="qwen3-o"),
]


def _bf16_case(T, n_in, n_out, L=8, R=32, seed=0):
    args, bias = make(T, n_in, n_out, [t % L for t in range(T)], L=L, R=R, seed=seed)
    x, w, a, b, ids = args
    ids[::5] = -1
    return [t.bfloat16().cuda() for t in (x, w, a, b)] + [ids.cuda(), bias.bfloat16().cuda()]


def _check(y, x, w, a, b, ids, bias):
    ref = lora_linear_oracle(*(t.cpu() for t in (x, w, a, b, ids)), bias=bias.cpu())
    err = ((y.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("n_in,n_out", DECODE_SHAPES)
@pytest.mark.parametrize("T", [8, 33, 64])
@pytest.mark.parametrize("expand_slots", [1, 4, 8])
def test_gpu_gemm_grouped_expand_at_decode_shapes(T, n_in, n_out, expand_slots):
    x, w, a, b, ids, bias = _bf16_case(T, n_in, n_out)
    cfg = C.default_linear_config(T, n_in, n_out, 132).replace(gemv=False, expand_slots=expand_slots)
    _check(lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg), x, w, a, b, ids, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("n_in,n_out", DECODE_SHAPES)
@pytest.mark.parametrize("T", [8, 33])
@pytest.mark.parametrize("split_k", [3, 6])
def test_gpu_gemm_spread_expand_at_decode_shapes(T, n_in, n_out, split_k):
    x, w, a, b, ids, bias = _bf16_case(T, n_in, n_out)
    cfg = C.default_linear_config(T, n_in, n_out, 132).replace(gemv=False, spread_expand=True,
                                                                **{"gemm.SPLIT_K": split_k})
    _check(lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg), x, w, a, b, ids, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("n_in,n_out", DECODE_SHAPES)
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("tile", [(4, 512, 2, 1), (2, 1024, 1, 1), (8, 256, 2, 4), (16, 128, 1, 4)],
                         ids=["N4K512-prefetch", "N2K1024", "N8K256-prefetch-split4", "N16K128-split4"])
def test_gpu_gemv_tiles_at_decode_shapes(T, n_in, n_out, tile):
    block_n, block_k, stages, split = tile
    x, w, a, b, ids, bias = _bf16_case(T, n_in, n_out)
    cfg = C.default_linear_config(T, n_in, n_out, 132).replace(gemv=True, **{
        "gemm.BLOCK_N": block_n, "gemm.BLOCK_K": block_k, "gemm.num_stages": stages, "gemm.SPLIT_K": split})
    _check(lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg), x, w, a, b, ids, bias)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, "early", "late"])
def test_gpu_gemm_in_a_cuda_graph_follows_the_ids(pdl):
    """The GEMM (waiting for the shrink only after its main loop and first B group) captured once and replayed
    after the ids change in place: each replay gives the new ids' result."""
    x, w, a, b, ids, bias = _bf16_case(16, 2880, 5120)
    cfg = C.default_linear_config(16, 2880, 5120, 132).replace(pdl=pdl)
    assert not cfg.gemv
    lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lora_linear_triton(x, w, a, b, ids, bias=bias, config=cfg)
    for new in ([7 - t % 8 for t in range(16)], [-1] * 16, [2] * 16):
        ids.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        _check(y, x, w, a, b, ids, bias)
