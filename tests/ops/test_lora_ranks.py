"""Per-slot rank (``lora_ranks``): slots padded to ``R``, each slot read only up to its own rank.

The padding past each slot's rank is filled with NaN (never zeros), so a kernel or reference that read or
multiplied it would return NaN; the expected result is the float64 oracle (``tests/support``) on the same stacks
with the padding zeroed, i.e. the adapters at their true ranks. CPU: the op's reference and the Triton kernels in
the interpreter (float32, tiny shapes); GPU (``-m gpu``): bf16 at GPT-OSS-20B's geometry, ranks 8/16/64 in R=64.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from support.cases import TOLERANCES, MoECase, make_linear
from support.oracle import lora_linear_oracle, moe_lora_oracle
from support.ranks import NAN, poison_moe

import moe_lora_compile as mlc
from moe_lora_compile.ops.triton.configs import GemmConfig, LinearKernelConfig, MoEKernelConfig, ShrinkConfig
from moe_lora_compile.ops.triton.launch import fused_moe_lora_triton, lora_linear_triton
from moe_lora_compile.shapes import GPT_OSS_20B

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def moe_ranks(ranks13, ranks2, device=DEVICE):
    return torch.tensor([list(ranks13), list(ranks2)], dtype=torch.int32, device=device)


# R=16; slots of rank 4, 8, 16 (full) and an empty slot (0); w2 ranks differ from w13's.
RANKS13, RANKS2 = (4, 8, 16, 0), (16, 3, 8, 0)


def _tiny_config(per_pair, fuse_shrink2, per_pair_shrink=None, split13=1):
    gemm = GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
    return MoEKernelConfig(per_pair=per_pair, fuse_shrink2=fuse_shrink2, fuse_topk_sum=True, BLOCK_M=16,
                           w13=replace(gemm, SPLIT_K=split13), w2=gemm,
                           shrink=ShrinkConfig(BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=1),
                           per_pair_shrink=per_pair_shrink)


MOE_PATHS = [
    pytest.param(_tiny_config(False, False, per_pair_shrink=False), id="sorted-block-shrink"),  # block shrinks,
    # w2 expand in sorted blocks holding several slots
    pytest.param(_tiny_config(False, True, per_pair_shrink=True), id="sorted-pair-shrink-fused2"),  # per-pair shrink
    # in sorted mode, w2 shrink fused into the w13 epilogue
    pytest.param(_tiny_config(True, True, split13=2), id="per-pair-fused-split-k"),  # decode path, w13 split-K
    pytest.param(_tiny_config(True, False), id="per-pair-shrink2"),  # decode path, separate w2 shrink
]

MOE_CASES = [
    # mixed ranks, every token on a slot (the empty slot included), concat layout
    pytest.param(MoECase(T=8, H=32, I=16, E=4, k=2, L=4, R=16, lora="all", topk_dtype=torch.int32), id="all"),
    # -1 tokens among them, GPT-OSS layout and activation with biases
    pytest.param(MoECase(T=7, H=32, I=16, E=4, k=2, L=4, R=16, lora="mixed", layout="transposed_interleaved",
                         activation="gptoss_swiglu", bias=True, topk_dtype=torch.int32), id="mixed-gptoss"),
]


@pytest.mark.parametrize("path", MOE_PATHS)
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_kernels_stop_at_each_slots_rank(case, path):
    args, kwargs = case.make(DEVICE)
    clean, dirty = poison_moe(args, RANKS13, RANKS2)
    y = fused_moe_lora_triton(*dirty, **kwargs, lora_ranks=moe_ranks(RANKS13, RANKS2), config=path)
    torch.testing.assert_close(y.cpu().double(), moe_lora_oracle(*clean, **kwargs).cpu(), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_reference_stops_at_each_slots_rank(case):
    """The op on CPU (the reference): same truncation, whatever the padding holds."""
    args, kwargs = case.make("cpu")
    clean, dirty = poison_moe(args, RANKS13, RANKS2)
    y = mlc.fused_moe_lora(*dirty, **kwargs, lora_ranks=moe_ranks(RANKS13, RANKS2, "cpu"))
    torch.testing.assert_close(y.double(), moe_lora_oracle(*clean, **kwargs), **TOLERANCES[torch.float32])
    out = torch.empty_like(args[0])
    mlc.fused_moe_lora(*dirty, **kwargs, lora_ranks=moe_ranks(RANKS13, RANKS2, "cpu"), out=out)
    torch.testing.assert_close(out, y, rtol=0, atol=0)


@pytest.mark.parametrize("use_kernel", [False, True], ids=["reference", "kernel"])
def test_split_b13_ranks_cover_each_half(use_kernel):
    """Split gate/up form (B13 [L,E,2I,R/2]): row 0 of lora_ranks is the rank of each half (gate entries [0, r),
    up entries [R/2, R/2 + r)); the rest of both halves is NaN and must be ignored."""
    from test_split_b13_and_out import split_problem

    case = MoECase(T=6, H=32, I=16, E=4, k=2, L=3, R=16, lora="mixed", topk_dtype=torch.int32)
    split, kwargs, full, full_kwargs = split_problem(case, 8)
    r13, r2 = (3, 8, 0), (8, 5, 0)
    clean, dirty = poison_moe(split, r13, r2, split_half=8)
    # the oracle's block-diagonal B13 from the clean split one (entries of each half past r13 zero)
    from test_split_b13_and_out import block_diagonal
    oracle_args = (*clean[:7], block_diagonal(clean[7], case.layout), *clean[8:])
    expected = moe_lora_oracle(*oracle_args, **full_kwargs).cpu()
    ranks = moe_ranks(r13, r2, "cpu")
    if use_kernel:
        y = fused_moe_lora_triton(*(t.to(DEVICE) for t in dirty), **kwargs, lora_ranks=ranks.to(DEVICE),
                                  config=_tiny_config(True, True))
    else:
        y = mlc.fused_moe_lora(*dirty, **kwargs, lora_ranks=ranks)
    torch.testing.assert_close(y.cpu().double(), expected, **TOLERANCES[torch.float32])


def poison_linear(lora_a, lora_b, ranks, blocks=1):
    """``(clean, dirty)`` (A, B): slot entries past its rank in each of ``blocks`` rank blocks zeroed / NaN.
    ``ranks`` [blocks][L]."""
    R = lora_a.shape[1]
    block = R // blocks
    r = torch.arange(R)
    clean_a, clean_b, dirty_a, dirty_b = lora_a.clone(), lora_b.clone(), lora_a.clone(), lora_b.clone()
    for slot in range(lora_a.shape[0]):
        rank_of = torch.tensor([ranks[j][slot] for j in (r // block).tolist()])
        pad = ((r % block) >= rank_of).to(lora_a.device)
        clean_a[slot, pad], dirty_a[slot, pad] = 0.0, NAN
        clean_b[slot, :, pad], dirty_b[slot, :, pad] = 0.0, NAN
    return (clean_a, clean_b), (dirty_a, dirty_b)


_LIN_GEMM = GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
_LIN_SHRINK = ShrinkConfig(BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=1)
LINEAR_PATHS = [
    pytest.param(LinearKernelConfig(BLOCK_M=16, per_token=True, gemv=True, gemm=replace(_LIN_GEMM, SPLIT_K=2),
                                    shrink=_LIN_SHRINK), id="gemv-split-k"),  # decode GEMV, per-token shrink
    pytest.param(LinearKernelConfig(BLOCK_M=16, per_token=True, gemv=False, gemm=_LIN_GEMM, shrink=_LIN_SHRINK),
                 id="gemm-token-shrink"),  # GEMM, the grouped expand (a block's slots in rounds of 8)
    pytest.param(LinearKernelConfig(BLOCK_M=16, per_token=True, gemv=False, gemm=_LIN_GEMM, shrink=_LIN_SHRINK,
                                    expand_slots=1), id="gemm-expand-one-slot"),  # GEMM, one slot at a time
    pytest.param(LinearKernelConfig(BLOCK_M=16, per_token=True, gemv=False, gemm=_LIN_GEMM, shrink=_LIN_SHRINK,
                                    expand_slots=2), id="gemm-expand-pairs"),  # GEMM, more rounds than one
    pytest.param(LinearKernelConfig(BLOCK_M=16, per_token=False, gemv=False, gemm=_LIN_GEMM, shrink=_LIN_SHRINK),
                 id="gemm-block-shrink"),  # the MoE block shrink's DENSE mode
]
LINEAR_RANKS = [
    pytest.param([[4, 8, 16, 0]], id="ranks-L"),  # one rank per slot: 4, 8, full, empty
    pytest.param([[4, 8, 0, 2], [8, 1, 0, 8]], id="ranks-2xL"),  # two rank blocks of 8 (fused siblings)
    # three blocks of 8 (fused q/k/v): R = 24, not a power of two, BLOCK_R 32 past it; ranks 3 and 5 not multiples
    # of the 8-entry vector the B loads are rounded to
    pytest.param([[4, 8, 0, 2], [8, 1, 0, 8], [3, 0, 8, 5]], id="ranks-3xL"),
]


@pytest.mark.parametrize("ranks", LINEAR_RANKS)
@pytest.mark.parametrize("path", [*LINEAR_PATHS, pytest.param(None, id="reference")])
def test_lora_linear_stops_at_each_slots_rank(path, ranks):
    R = 16 if len(ranks) < 3 else 8 * len(ranks)  # blocks of 8 entries
    (x, weight, lora_a, lora_b, ids), bias = make_linear(T=6, n_in=32, n_out=24, L=4, R=R, ids="mixed", bias=True,
                                                         seed=3)
    (ca, cb), (da, db) = poison_linear(lora_a, lora_b, ranks, blocks=len(ranks))
    expected = lora_linear_oracle(x, weight, ca, cb, ids, bias)
    lora_ranks = torch.tensor(ranks if len(ranks) > 1 else ranks[0], dtype=torch.int32)
    if path is None:
        y = mlc.lora_linear(x, weight, da, db, ids, bias=bias, lora_ranks=lora_ranks)
    else:
        dev = [t.to(DEVICE) for t in (x, weight, da, db, ids, bias, lora_ranks)]
        y = lora_linear_triton(*dev[:5], bias=dev[5], lora_ranks=dev[6], config=path)
    torch.testing.assert_close(y.cpu().double(), expected, **TOLERANCES[torch.float32])


BAD_RANKS = [
    # a rank above the padded R
    pytest.param("moe", [[4, 17, 1, 0], [1, 1, 1, 1]], ValueError, "lora_ranks row 0 must lie in \\[0, 16\\]",
                 id="moe-rank-above-R"),
    # a negative rank
    pytest.param("moe", [[4, 1, 1, 0], [1, -1, 1, 1]], ValueError, "row 1 must lie in", id="moe-negative"),
    # [L] instead of [2, L]
    pytest.param("moe", [4, 1, 1, 0], ValueError, "lora_ranks must be 2-D", id="moe-1d"),
    # the wrong number of slots
    pytest.param("linear", [4, 1, 1], ValueError, "L = 4", id="linear-wrong-L"),
    # 3 rank blocks do not split R = 16
    pytest.param("linear", [[1, 1, 1, 1]] * 3, ValueError, "split the rank axis", id="linear-uneven-blocks"),
    # rank above the block size (8) of 2 blocks
    pytest.param("linear", [[1, 9, 1, 1], [1, 1, 1, 1]], ValueError, "\\[0, 8\\]", id="linear-above-block"),
]


@pytest.mark.parametrize("op,ranks,error,match", BAD_RANKS)
def test_bad_ranks_are_clear_errors(op, ranks, error, match):
    lora_ranks = torch.tensor(ranks, dtype=torch.int32)
    if op == "moe":
        args, kwargs = MoECase(T=3, L=4, R=16).make()
        call = lambda: mlc.fused_moe_lora(*args, **kwargs, lora_ranks=lora_ranks)  # noqa: E731
    else:
        (x, w, a, b, ids), _ = make_linear(T=3, n_in=16, n_out=8, L=4, R=16)
        call = lambda: mlc.lora_linear(x, w, a, b, ids, lora_ranks=lora_ranks)  # noqa: E731
    with pytest.raises(error, match=match):
        call()
    with pytest.raises(TypeError, match="lora_ranks must be int32 or int64"):
        mlc.lora_linear(*make_linear(T=3, n_in=16, n_out=8, L=4, R=16)[0], lora_ranks=torch.ones(4))


def test_rank_change_in_place_recompiles_nothing():
    """A compiled call over slot buffers and a ranks buffer: changing a slot's rank (and its factors) in place
    changes the result as the oracle says, with no Dynamo recompile."""
    from torch._dynamo.testing import CompileCounter

    (x, weight, lora_a, lora_b, ids), _ = make_linear(T=5, n_in=16, n_out=8, L=2, R=8, ids="all", seed=1)
    ranks = torch.tensor([8, 2], dtype=torch.int32)
    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def step(x):
        return mlc.lora_linear(x, weight, lora_a, lora_b, ids, lora_ranks=ranks)

    for new_ranks in ([8, 2], [3, 8], [0, 5]):
        ranks.copy_(torch.tensor(new_ranks))
        (ca, cb), _ = poison_linear(lora_a, lora_b, [new_ranks])
        torch.testing.assert_close(step(x).double(), lora_linear_oracle(x, weight, ca, cb, ids),
                                   **TOLERANCES[torch.float32])
    assert counter.frame_count == 1


def test_opcheck_with_ranks():
    """Both ops with lora_ranks through opcheck (schema, autograd registration, fake tensors, AOT dispatch)."""
    args, kwargs = MoECase(T=4, L=4, R=16).make()
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    ranks = moe_ranks(RANKS13, RANKS2, "cpu")
    torch.library.opcheck(torch.ops.moe_lora.fused_moe_lora.default, args, dict(kwargs, lora_ranks=ranks),
                          test_utils=utils)
    (x, w, a, b, ids), bias = make_linear(T=4, n_in=16, n_out=8, L=4, R=16, bias=True)
    torch.library.opcheck(torch.ops.moe_lora.lora_linear.default, (x, w, a, b, ids, bias, ranks[0]),
                          test_utils=utils)


# --- GPU: real shapes, bf16 -----------------------------------------------------------------------------------

GPU_RANKS = (8, 16, 64, 8, 0, 16, 64, 8)  # max_rank 64, eight slots: 8/16/64 mixed, one empty


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 32, 128])
def test_gpu_gpt_oss_mixed_ranks(T):
    """GPT-OSS-20B's MoE layer in bf16, slots of rank 8/16/64 padded to 64 with NaN past each rank: the op with
    lora_ranks matches the float64 oracle on the zero-padded stacks."""
    case = MoECase.of_geometry(GPT_OSS_20B, T=T, L=len(GPU_RANKS), R=64, lora="mixed", dtype=torch.bfloat16)
    args, kwargs = case.make("cuda")
    clean, dirty = poison_moe(args, GPU_RANKS, GPU_RANKS)
    y = mlc.fused_moe_lora(*dirty, **kwargs, lora_ranks=moe_ranks(GPU_RANKS, GPU_RANKS, "cuda"))
    expected = moe_lora_oracle(*clean, **kwargs)
    assert torch.isfinite(y).all()
    rel = (y.double() - expected).norm() / expected.norm()
    assert rel < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 32])
def test_gpu_lora_linear_mixed_ranks(T):
    """GPT-OSS-20B's q_proj shape in bf16 with slots of rank 8/16/64 (NaN padding) vs the oracle, row by row
    relative to each row's norm: the GEMM path (T > 4) feeds the expand's ``tl.dot`` the rank vector rounded to
    bf16 (as PEFT's bf16 LoRA does), so rows of |y| ~ 100 carry ~0.1-0.6 absolute error, and an elementwise
    atol fails where y crosses zero (H200 2026-12-04, T=32: 768 of 131072 elements; an emulation that rounds the
    rank vector to bf16 gives the same 768, one that keeps it in fp32 gives 0). A row given another slot's delta,
    or none, is off by O(1) of its norm."""
    H = GPT_OSS_20B.H
    L = len(GPU_RANKS)
    (x, w, a, b, ids), bias = make_linear(T=T, n_in=H, n_out=4096, L=L, R=64, ids="mixed", bias=True,
                                          dtype=torch.bfloat16)
    (ca, cb), (da, db) = poison_linear(a, b, [GPU_RANKS])
    expected = lora_linear_oracle(x, w, ca, cb, ids, bias).cuda()
    y = mlc.lora_linear(*(t.cuda() for t in (x, w, da, db, ids)), bias=bias.cuda(),
                        lora_ranks=torch.tensor(GPU_RANKS, dtype=torch.int32, device="cuda"))
    assert torch.isfinite(y).all()
    row_err = (y.double() - expected).norm(dim=1) / expected.norm(dim=1)
    assert row_err.max() < 1e-2, row_err
