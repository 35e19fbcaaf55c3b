"""@triton.jit kernels of the fused MoE multi-LoRA layer (and lora_linear's block shrink, the shrink's DENSE mode with
E = k = 1; lora_linear's GEMM and per-token shrink are in :mod:`.dense_kernels`).

Rows: the kernels work on blocks of BLOCK_M rows; each block belongs to one expert. Row ``pid_m*BLOCK_M + m`` of
the intermediate buffers (``act [rows, I]``, shrink outputs ``s [rows, R]`` fp32) holds (token, slot) pair
``pair[m]`` (``NO_PAIR`` = padding). Three row modes (constexpr ``MODE``):

- ``SORTED``: pairs grouped per expert by :mod:`.routing` (``row_pair``, ``block_expert``, ``num_blocks``);
- ``PER_PAIR``: one pair per block (row 0), no routing at all: for tiny batches;
- ``DENSE``: block ``b`` holds pairs ``[b*BM, (b+1)*BM)`` and expert 0 (``lora_linear``'s block shrink; the w2
  kernel keeps the mode, which no launcher uses since lora_linear has a GEMM of its own).

LoRA: a block may hold rows of several adapters. The shrink and the expand loop over the distinct adapter slots
present in the block (data, not a Python branch) and keep each slot's small ``tl.dot`` only in that slot's rows
(``tl.where`` on the result, never a multiply by a 0/1 mask, so a non-finite value in one slot cannot reach other
rows); a block with no LoRA row does no LoRA work. Each row's rank vector is computed once by the shrink kernel
(split-K over the input dim, one fp32 slice per split, summed by the consumer while loading). At decode-sized
batches a block holds few pairs of many slots, and walking them serially with a mostly empty ``tl.dot`` each made the
block shrink latency-bound (~11 us a launch on the H200 at 8 tokens of 8 adapters, ~1.5 us of bytes): there
:func:`lora_shrink_pairs_kernel` runs one program per pair instead, writing the same rows.

Per-slot rank (``ranks_ptr``, data): every kernel that reads a slot's factors masks their rank axis, so the
entries past the slot's rank never reach a result, whatever they hold, and are not loaded: A's rows past it
(:func:`rank_mask`), B's entries past it rounded up to 8 (:func:`rank_load_masks`, which keeps B's 16-byte vector
loads; the 32-byte sectors read are the same). A rank-8 adapter in rank-64 slots reads 1/8 of A and of B. The ranks are read from memory, so loading an adapter of another rank into a slot recompiles
nothing and keeps captured CUDA graphs valid. ``ranks_ptr`` None (constexpr): every slot at the full padded rank.

Top-k sum (w2, PER_PAIR mode, ``TOPK_SUM``): the last-arriving program of a token's k pairs per N tile sums
their fp32 rows (see :func:`moe_w2_kernel`). PDL (``USE_PDL``): every kernel waits for its predecessor first
thing and lets its successor launch early (see :func:`grid_dependency_sync`, :mod:`.pdl`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..contract import NO_ADAPTER
from .mxfp4_kernels import MXFP4, mxfp4_expert_gemm

# Values of the kernels' constexpr switches, for the host (launchers); jit code compares with the tl.constexpr twins
# below (a @triton.jit function may only read globals that are constexprs).
SORTED, PER_PAIR, DENSE = 0, 1, 2  # MODE: row modes (see the module docstring)
SILU, GPTOSS_SWIGLU = 0, 1  # ACTIVATION of the w13 kernel
PDL_OFF, PDL_EARLY, PDL_LATE = 0, 1, 2  # USE_PDL (see grid_dependency_sync and .pdl)
NO_PAIR = -1  # a padding row of a block (row_pair, pair)

_SORTED, _PER_PAIR, _DENSE = tl.constexpr(SORTED), tl.constexpr(PER_PAIR), tl.constexpr(DENSE)
_SILU = tl.constexpr(SILU)
_PDL_EARLY, _PDL_LATE = tl.constexpr(PDL_EARLY), tl.constexpr(PDL_LATE)
_NO_PAIR = tl.constexpr(NO_PAIR)
_NO_ADAPTER = tl.constexpr(NO_ADAPTER)  # token_lora_ids of a token without adapter
_NO_SLOT = tl.constexpr(2147483647)  # "no slot" for min-reductions
RANK_VEC = tl.constexpr(8)  # rank entries a B load reads together: 16 bytes of bf16 (see rank_load_masks)
_MXFP4 = tl.constexpr(MXFP4)  # W_FORMAT: MXFP4 base weights (:mod:`.mxfp4_kernels`); else dense in x's dtype


@triton.jit
def grid_dependency_sync(USE_PDL: tl.constexpr):
    """Programmatic dependent launch (SM90+), first thing in every program of every kernel of a layer's chain,
    before any load, store or early exit (w13: after its main loop, see :func:`moe_w13_kernel`): wait until the
    previous kernel in the stream has finished and its writes are visible. Each kernel then completes only after
    its predecessor did, so one wait covers the whole chain (and the caching allocator's reuse of freed buffers).

    ``USE_PDL``: PDL_OFF (compiles to nothing: interpreter, pre-SM90, a Triton without GDC); PDL_EARLY = also let
    the next kernel launch right away (``gdc_launch_dependents`` here); PDL_LATE = let it launch from
    :func:`launch_dependents`, called after the main loop (its programs then land on SMs the main loops are
    leaving). Both instructions are no-ops in a kernel that was not launched with ``launch_pdl``."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        if USE_PDL == _PDL_EARLY:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """The late trigger of ``USE_PDL == PDL_LATE`` (see :func:`grid_dependency_sync`); a program that exits without
    it triggers at exit."""
    if USE_PDL == _PDL_LATE:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def load_expert(topk_ids_ptr, pair, num_experts):
    """(``topk_ids[pair]`` as int64, 0 where it lies outside ``[0, num_experts)``; whether it lies outside): the
    op's checks refuse such ids, but they are off inside CUDA graphs (and with ``MOE_LORA_CHECK_IDS=0``), and a
    kernel must never index an expert past the weights. Such a pair contributes nothing (see :func:`_block_rows`).
    The compare is on the id as loaded (an int64 id past 2**31 is not truncated into range first)."""
    expert = tl.load(topk_ids_ptr + pair)
    bad = (expert < 0) | (expert >= num_experts)
    return tl.where(bad, 0, expert).to(tl.int64), bad


@triton.jit
def _block_rows(pid_m, row_pair_ptr, block_expert_ptr, topk_ids_ptr, num_pairs, num_experts,
                BLOCK_M: tl.constexpr, MODE: tl.constexpr):
    """-> (pair [BLOCK_M] int32, NO_PAIR = padding; the block's expert, int64 scalar; whether the block's pair has
    an out-of-range expert, a bool scalar, PER_PAIR mode only: False in the others). PER_PAIR: a pair whose
    expert lies outside ``[0, num_experts)`` is NO_PAIR (no row of the block is valid) and its expert 0, so every
    address stays in bounds; the kernels skip its GEMMs, and the w2 kernel writes its output row as zeros. SORTED
    mode never sees such a pair (:mod:`.routing` leaves it out of the blocks)."""
    offs_m = tl.arange(0, BLOCK_M)
    if MODE == _SORTED:
        pair = tl.load(row_pair_ptr + pid_m * BLOCK_M + offs_m)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        bad = expert < 0  # False: the routing's block experts lie in [0, E)
    elif MODE == _PER_PAIR:
        expert, bad = load_expert(topk_ids_ptr, pid_m, num_experts)
        pair = tl.where((offs_m == 0) & ~bad, pid_m, _NO_PAIR)
    else:  # DENSE
        rows = pid_m * BLOCK_M + offs_m
        pair = tl.where(rows < num_pairs, rows, _NO_PAIR)
        expert = tl.full([], 0, tl.int64)
        bad = expert < 0
    return pair.to(tl.int32), expert, bad


@triton.jit
def load_slots(token_lora_ptr, index, mask, num_slots):
    """``token_lora_ids[index]`` as int32, ``-1`` where ``mask`` is off (None: a scalar load) or the id lies outside
    ``[0, num_slots)``: the op's checks refuse such ids, but they are off inside CUDA graphs (and with
    ``MOE_LORA_CHECK_IDS=0``), and a kernel must never index a slot past the stacks. The range test reads the id in
    its own dtype, before the cast: an int64 id of ``2**32 + s`` is no adapter, not slot ``s``."""
    if mask is None:
        lora = tl.load(token_lora_ptr + index)
    else:
        lora = tl.load(token_lora_ptr + index, mask=mask, other=_NO_ADAPTER)
    return tl.where((lora >= 0) & (lora < num_slots), lora, _NO_ADAPTER).to(tl.int32)


@triton.jit
def _slot_range(lora, has_lora):
    """Smallest and largest adapter slot among the rows with LoRA (first > last when there is none)."""
    first = tl.min(tl.where(has_lora, lora, _NO_SLOT), axis=0)
    last = tl.max(tl.where(has_lora, lora, _NO_ADAPTER), axis=0)
    return first, last


@triton.jit
def _within_rank(ranks_ptr, slot, offs_r, rank_block, rank_stride, ROUND: tl.constexpr, RANK_BLOCKS: tl.constexpr):
    """Whether rank entry ``offs_r`` of ``slot`` is inside the slot's rank, each rank rounded up to ROUND entries.
    RANK_BLOCKS 0: ``rank = ranks[slot]`` (one load), entries ``[0, rank)`` and ``[rank_block, rank_block + rank)``
    (one block, or the split gate/up form's two halves). RANK_BLOCKS n >= 1: block m (entries from
    ``m * rank_block``) uses its leading ``ranks[m, slot]`` (rows ``rank_stride`` apart), n loads unrolled: no
    per-entry gather or integer division, so the mask keeps the alignment a rank rounded to 8 gives it."""
    if RANK_BLOCKS == 0:
        rank = tl.load(ranks_ptr + slot)
        rank = (rank + ROUND - 1) // ROUND * ROUND
        return (offs_r < rank) | ((offs_r >= rank_block) & (offs_r < rank_block + rank))
    else:
        inside = (offs_r + slot * 0) < 0  # all False, in the broadcast shape
        for m in tl.static_range(RANK_BLOCKS):
            rank = tl.load(ranks_ptr + m * rank_stride + slot)
            rank = (rank + ROUND - 1) // ROUND * ROUND
            inside = inside | ((offs_r >= m * rank_block) & (offs_r < m * rank_block + rank))
        return inside


@triton.jit
def rank_mask(ranks_ptr, slot, offs_r, R, rank_block, rank_stride, RANK_BLOCKS: tl.constexpr = 0):
    """Which rank entries ``offs_r`` of slot ``slot`` (int tensors, broadcastable) are read: ``r < R`` and, with
    ``ranks_ptr``, inside the slot's rank: the rank axis in blocks of ``rank_block`` entries, each block using its
    leading ``rank`` ones (:func:`_within_rank`: RANK_BLOCKS 0, one rank for at most two blocks, as the MoE kernels'
    ``[L]`` rows and split gate/up form; n, ``ranks[m, slot]`` per block of ``[n, L]`` ranks, as fused sibling
    linears, each member its own rank). ``ranks_ptr`` None: ``r < R`` (every slot at the padded rank).

    For a tile whose rank axis is *not* its contiguous one (A [.., R, K]): an exact mask costs nothing there. Where
    the rank axis is contiguous (B [.., N, R]) use :func:`rank_load_masks`."""
    mask = offs_r < R
    if ranks_ptr is not None:
        mask = mask & _within_rank(ranks_ptr, slot, offs_r, rank_block, rank_stride, 1, RANK_BLOCKS)
    return mask


@triton.jit
def rank_load_masks(ranks_ptr, slot, offs_r, R, rank_block, rank_stride, RANK_BLOCKS: tl.constexpr = 0):
    """(load, keep) masks of a tile whose rank axis is its contiguous one (B [.., N, R]): ``keep`` is
    :func:`rank_mask`; ``load`` the same with each rank rounded up to :data:`RANK_VEC` entries. A mask bounded by a
    rank read from memory has no known alignment, so Triton would load such a tile one element at a time (sm_90
    SASS: 2-byte loads, +30-60 % instructions, registers up); rounded, it keeps 16-byte vector loads, reads nothing
    outside the 32-byte sectors the rank's entries occupy, and ``tl.where(keep, tile, 0)`` after the load drops
    the extra entries whatever they hold."""
    load = offs_r < R
    keep = load
    if ranks_ptr is not None:
        keep = load & _within_rank(ranks_ptr, slot, offs_r, rank_block, rank_stride, 1, RANK_BLOCKS)
        load = load & _within_rank(ranks_ptr, slot, offs_r, rank_block, rank_stride, RANK_VEC, RANK_BLOCKS)
    return load, keep


@triton.jit
def _load_rank_vectors(s_ptr, rows, has_lora, R, num_splits, split_stride, BLOCK_R: tl.constexpr):
    """Sum of the shrink's split-K slices for these rows -> [BLOCK_M, BLOCK_R] fp32 (zero where no LoRA).

    The slices load one at a time. Loading them a chunk at a time (one [chunk, BLOCK_M, BLOCK_R] load and a sum
    over the chunk, up to 32 slices: one L2 round trip instead of one per ~4 slices in the sm_90 SASS of the
    loop) was measured slower on the whole step (H200, 2026-12-05, GPT-OSS-20B b1 / b8 with 8 adapters: 3.36 /
    9.81 ms against 3.33 / 9.00, and 3.15 / 8.84 against 3.01 / 7.87 ms without adapters): taken back out."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = s_ptr + rows.to(tl.int64)[:, None] * R + offs_r[None, :]
    mask = has_lora[:, None] & (offs_r < R)[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    for split in range(1, num_splits):
        s += tl.load(ptrs + split * split_stride, mask=mask, other=0.0)
    return s


@triton.jit
def _lora_expand(s, lora, has_lora, b_ptr, stride_bl, b_offs, b_mask, ranks_ptr, R, rank_block, rank_stride,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 RANK_BLOCKS: tl.constexpr = 0):
    """sum over slots l in the block of ``s[rows of l] @ B[l]^T`` -> [BLOCK_M, BLOCK_N] fp32.

    s [BLOCK_M, BLOCK_R] fp32; b_ptr + l*stride_bl + b_offs addresses B[l]'s tile as [BLOCK_R, BLOCK_N], ``b_mask``
    its mask, narrowed per slot to the slot's rank (:func:`rank_load_masks`; ``R``, ``rank_block``,
    ``rank_stride``, RANK_BLOCKS).
    Each slot's product is kept only in its own rows (``tl.where`` on the result, as the shrink does): zeroing the
    other rows' ``s`` instead would still give ``0 * inf = NaN`` in them for a non-finite value in B[l]."""
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    slot, last = _slot_range(lora, has_lora)
    offs_r = tl.arange(0, BLOCK_R)
    while slot <= last:
        load_r, keep_r = rank_load_masks(ranks_ptr, slot, offs_r, R, rank_block, rank_stride, RANK_BLOCKS)
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + b_offs, mask=b_mask & load_r[:, None], other=0.0)
        if ranks_ptr is not None:
            b = tl.where(keep_r[:, None], b, 0.0)
        part = tl.dot(s.to(b.dtype), b, input_precision=DOT_PRECISION)
        delta += tl.where((has_lora & (lora == slot))[:, None], part, 0.0)
        slot = tl.min(tl.where(has_lora & (lora > slot), lora, _NO_SLOT), axis=0)
    return delta


@triton.jit
def _b13_tile(offs_r, cols, up, col_mask, R, stride_bn, SPLIT_B13: tl.constexpr):
    """Offsets (from B13[l, e]) and mask of the w13 expand's ``[BLOCK_R, len(cols)]`` B13 tile, rank rows by output
    columns ``cols`` (``up`` [len(cols)]: whether each is an up column). Full form: B13[n, r] for r < R. Split
    gate/up form (SPLIT_B13, B13 ``[.., 2I, R/2]``): a gate column reads B13[n, r] on rank rows r < R/2, an up
    column B13[n, r - R/2] on rows R/2 <= r < R; the other half is masked off (zero, never fetched), so one dot
    with the whole rank vector gives each column its own half."""
    if SPLIT_B13:
        half = R // 2
        rank = offs_r[:, None] - tl.where(up, half, 0)[None, :]
        mask = (rank >= 0) & (rank < half) & col_mask[None, :]
        return rank + cols[None, :] * stride_bn, mask
    return offs_r[:, None] + cols[None, :] * stride_bn, (offs_r < R)[:, None] & col_mask[None, :]


@triton.jit
def _gemm_tiles(a_ptrs, w_ptrs, offs_k, k_end, n_mask, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """One K step's tiles of :func:`_expert_gemm`: a [BLOCK_M, BLOCK_K] at ``a_ptrs``, w [BLOCK_K, BLOCK_N] at
    ``w_ptrs``; ``offs_k`` the step's K indices (masked from ``k_end`` on unless EVEN_K), ``n_mask`` the columns
    (unless EVEN_N)."""
    if EVEN_K:
        a = tl.load(a_ptrs)
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[None, :], other=0.0)
    else:
        k_mask = offs_k < k_end
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
    return a, w


@triton.jit
def _expert_gemm(a_ptrs, w_ptrs, k_start, k_end, stride_wk, n_mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """sum over k in [k_start, k_end) of a [BLOCK_M, BLOCK_K] tiles (row stride given, k contiguous; ``a_ptrs`` at
    k = 0) @ w [BLOCK_K, BLOCK_N] tiles (``w_ptrs`` at k = 0) -> [BLOCK_M, BLOCK_N] fp32. ``n_mask`` masks the
    columns when not EVEN_N; EVEN_K: the range is a whole number of BLOCK_K steps."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs += k_start
    w_ptrs += k_start * stride_wk
    for k0 in range(k_start, k_end, BLOCK_K):
        a, w = _gemm_tiles(a_ptrs, w_ptrs, k0 + offs_k, k_end, n_mask, EVEN_K, EVEN_N)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    return acc


@triton.jit(do_not_specialize=["num_pairs", "grid_m"])
def lora_shrink_kernel(
    in_ptr, stride_in, a_ptr, stride_al, stride_ae, stride_ar, s_ptr, topk_weights_ptr, token_lora_ptr,
    row_pair_ptr, block_expert_ptr, topk_ids_ptr, num_blocks_ptr, num_pairs, grid_m, K, R, top_k, k_per_split,
    counter_ptr, num_counters,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
    INPUT_BY_TOKEN: tl.constexpr, SCALE_BY_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ZERO_COUNTERS: tl.constexpr = False, USE_PDL: tl.constexpr = 0,
    ranks_ptr=None, rank_block=1, rank_stride=0, RANK_BLOCKS: tl.constexpr = 0, num_slots=2147483647,
    num_experts=2147483647,
):
    """s[split, row] = in[row or token, K slice] @ A[l, e, :, K slice]^T for rows with LoRA -> s [SPLIT_K, rows, R]
    fp32 (rows = grid_m*BLOCK_M); the consumer sums the SPLIT_K slices (deterministic, no memset, no atomics).
    Rows without LoRA are not written and never read. Grid (grid_m, SPLIT_K). A [L, E, R, K].

    ZERO_COUNTERS: also zero ``counter [num_counters]`` int32, the arrival counters of the later kernels of the
    layer (w13 split-K, w2 top-k sum): the shrink is the first kernel of the chain, so no memset launch.
    ``ranks_ptr``, ``rank_block``, ``rank_stride``, RANK_BLOCKS: each slot's rank (:func:`rank_mask`; RANK_BLOCKS
    n >= 1 for lora_linear's DENSE mode);
    A's rows past it are not read, their entries of s are 0. ``num_experts``: E (a pair of an expert outside
    ``[0, E)`` has no row with LoRA, :func:`_block_rows`)."""
    grid_dependency_sync(USE_PDL)
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ZERO_COUNTERS:
        offs_c = tl.arange(0, 128)
        first = (pid_k * tl.num_programs(0) + pid_m) * 128
        for c0 in range(first, num_counters, tl.num_programs(0) * tl.num_programs(1) * 128):
            tl.store(counter_ptr + c0 + offs_c, tl.zeros([128], dtype=tl.int32), mask=c0 + offs_c < num_counters)
    if MODE == _SORTED:
        if pid_m >= tl.load(num_blocks_ptr):
            return
    pair, expert, bad_expert = _block_rows(pid_m, row_pair_ptr, block_expert_ptr, topk_ids_ptr, num_pairs,
                                           num_experts, BLOCK_M, MODE)
    valid = pair >= 0
    token = tl.where(valid, pair // top_k, 0)
    lora = load_slots(token_lora_ptr, token, valid, num_slots)
    has_lora = valid & (lora >= 0)
    slot, last = _slot_range(lora, has_lora)
    if slot > last:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    rows = pid_m * BLOCK_M + offs_m
    if INPUT_BY_TOKEN:
        in_rows = token.to(tl.int64)
    else:
        in_rows = rows.to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    in_ptrs = in_ptr + in_rows[:, None] * stride_in + offs_k[None, :]
    a_offs = expert * stride_ae + offs_r[None, :] * stride_ar + offs_k[:, None]
    r_mask = offs_r[None, :] < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    while slot <= last:
        a_slot_ptr = a_ptr + slot.to(tl.int64) * stride_al + a_offs
        a_mask = rank_mask(ranks_ptr, slot, offs_r, R, rank_block, rank_stride, RANK_BLOCKS)[None, :]
        part = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                x = tl.load(in_ptrs + k0)
                a = tl.load(a_slot_ptr + k0, mask=a_mask, other=0.0)
            else:
                k_mask = (k0 + offs_k) < k_end
                x = tl.load(in_ptrs + k0, mask=k_mask[None, :], other=0.0)
                a = tl.load(a_slot_ptr + k0, mask=a_mask & k_mask[:, None], other=0.0)
            part += tl.dot(x, a, input_precision=DOT_PRECISION)
        acc += tl.where((has_lora & (lora == slot))[:, None], part, 0.0)
        slot = tl.min(tl.where(has_lora & (lora > slot), lora, _NO_SLOT), axis=0)
    launch_dependents(USE_PDL)
    if SCALE_BY_WEIGHT:
        weight = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    s_ptrs = s_ptr + pid_k.to(tl.int64) * grid_m * BLOCK_M * R + rows[:, None].to(tl.int64) * R + offs_r[None, :]
    tl.store(s_ptrs, acc, mask=has_lora[:, None] & r_mask)


@triton.jit(do_not_specialize=["num_pairs", "num_counters"])
def lora_shrink_pairs_kernel(
    in_ptr, stride_in, a_ptr, stride_al, stride_ae, stride_ar, s_ptr, split_stride, topk_weights_ptr,
    token_lora_ptr, pair_row_ptr, topk_ids_ptr, num_pairs, K, R, top_k, k_per_split, counter_ptr, num_counters,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
    INPUT_BY_TOKEN: tl.constexpr, SCALE_BY_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr,
    ZERO_COUNTERS: tl.constexpr = False, USE_PDL: tl.constexpr = 0, ranks_ptr=None, rank_block=1, rank_stride=0,
    num_slots=2147483647, num_experts=2147483647,
):
    """The per-pair shrink (decode-sized batches): what :func:`lora_shrink_kernel` computes, one (token, expert)
    pair and K slice per program, grid (num_pairs, SPLIT_K). The slot is a scalar (no walk over a block's slots),
    no ``tl.dot`` (``[BLOCK_R, BLOCK_K]`` products summed over K, as lora_linear's per-token shrink), pairs of
    ``-1`` tokens exit at once. The result goes to the pair's row of the consumers' layout ``s [SPLIT_K, rows, R]``
    (slice stride ``split_stride``): ``pair_row[pair]`` in SORTED mode (:mod:`.routing`), ``pair*BLOCK_M`` in
    PER_PAIR mode; the input row is the token (INPUT_BY_TOKEN) or that row (``act``). ZERO_COUNTERS, ranks: as
    there. A pair whose expert lies outside ``[0, num_experts)`` exits like a ``-1`` token (SORTED mode gave it no
    row: its ``pair_row`` entry is never written, so it is not read)."""
    grid_dependency_sync(USE_PDL)
    pair = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ZERO_COUNTERS:
        offs_c = tl.arange(0, 128)
        for c0 in range((pid_k * tl.num_programs(0) + pair) * 128, num_counters,
                        tl.num_programs(0) * tl.num_programs(1) * 128):
            tl.store(counter_ptr + c0 + offs_c, tl.zeros([128], dtype=tl.int32), mask=c0 + offs_c < num_counters)
    token = pair // top_k
    lora = load_slots(token_lora_ptr, token, None, num_slots).to(tl.int64)
    if lora < 0:
        return
    expert, bad_expert = load_expert(topk_ids_ptr, pair, num_experts)
    if bad_expert:
        return
    if MODE == _SORTED:
        row = tl.load(pair_row_ptr + pair).to(tl.int64)
    else:  # PER_PAIR
        row = pair.to(tl.int64) * BLOCK_M
    in_row = token.to(tl.int64) if INPUT_BY_TOKEN else row
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    a_mask = rank_mask(ranks_ptr, lora, offs_r, R, rank_block, rank_stride)[:, None]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    in_ptrs = in_ptr + in_row * stride_in + offs_k
    a_ptrs = a_ptr + lora * stride_al + expert * stride_ae + offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(in_ptrs + k0)
            a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_end
            x = tl.load(in_ptrs + k0, mask=k_mask, other=0.0)
            a = tl.load(a_ptrs + k0, mask=a_mask & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    launch_dependents(USE_PDL)
    s = tl.sum(acc, axis=1)
    if SCALE_BY_WEIGHT:
        s = s * tl.load(topk_weights_ptr + pair).to(tl.float32)
    tl.store(s_ptr + pid_k.to(tl.int64) * split_stride + row * R + offs_r, s, mask=r_mask)


@triton.jit
def _swizzle(pid, grid_m, num_pid_n, GROUP_SIZE_M: tl.constexpr):
    """Program id -> (pid_m, pid_n), walking GROUP_SIZE_M row blocks per column sweep (L2 reuse of weights)."""
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = tl.minimum(grid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit(do_not_specialize=["num_pairs", "grid_m"])
def moe_w13_kernel(
    x_ptr, stride_xt, w_ptr, stride_we, stride_wk, stride_wn, bias_ptr, stride_bias_e,
    b_ptr, stride_bl, stride_be, stride_bn, s_ptr, num_splits, split_stride, act_ptr, topk_weights_ptr, token_lora_ptr,
    row_pair_ptr, block_expert_ptr, topk_ids_ptr, num_blocks_ptr, num_pairs, grid_m, K, I, R, top_k, alpha, limit,
    a2_ptr, stride_a2l, stride_a2e, stride_a2r, s2_ptr, s2_split_stride, part_ptr, part_split_stride, counter_ptr,
    k_per_split,
    R2, BLOCK_R2: tl.constexpr, SPLIT_B13: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, MODE: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FUSE_SHRINK2: tl.constexpr, SPLIT_K: tl.constexpr = 1,
    WAIT_AFTER_MAIN_LOOP: tl.constexpr = True, USE_PDL: tl.constexpr = 0,
    w_scales_ptr=None, stride_se=0, stride_sn=0, W_FORMAT: tl.constexpr = 0,
    ranks_ptr=None, rank_block=1, ranks2_ptr=None, num_slots=2147483647, num_experts=2147483647,
):
    """act[row, j] = act(gate, up), gate/up = x W13[e]^T (* w if on input) + s13 B13[l,e]^T + bias, for j in a
    BLOCK_N tile of the I outputs. Gate/up columns: j and I+j (concat: two dots per K step) or 2j and 2j+1
    (interleaved: one contiguous 2*BLOCK_N tile, split in registers).
    W13 element (e, k, n) at e*stride_we + k*stride_wk + n*stride_wn (both layouts). B13 [L, E, 2I, R], or with
    SPLIT_B13 the split gate/up form [L, E, 2I, R/2] (see :func:`_b13_tile`). With FUSE_SHRINK2 it also writes the
    w2 shrink's partial rank vectors of its column tile to ``s2 [cdiv(I, BLOCK_N), rows, R2]`` (A2 [L, E, R2, I]);
    worth it for small batches (per-pair mode), where it saves a launch.

    SPLIT_K > 1 (grid (tiles, SPLIT_K), program ``p`` on K slice ``[p*k_per_split, (p+1)*k_per_split)``): for
    small batches, where the tiles alone are too few programs to keep every SM streaming weights. Each program
    writes its fp32 gate/up partial to ``part [SPLIT_K, rows, 2I]`` (valid rows, this tile's columns) and
    arrives on the tile's counter (``counter [grid_m * cdiv(I, BLOCK_N)]`` int32, zeroed by the shrink kernel);
    the last to arrive sums the SPLIT_K partials in split order (deterministic, no float atomics) and alone runs
    the epilogue: routing weight, LoRA expand, bias, activation, the act store and the fused shrink2.

    PDL (WAIT_AFTER_MAIN_LOOP): unlike the other kernels, this one waits for its predecessor (shrink13) only after
    the main loop, which reads nothing shrink13 writes (x, W13, routing data: all written before shrink13 passed
    its own wait, and so before this kernel could launch); the weights stream while shrink13 still runs.

    W_FORMAT MXFP4: ``w_ptr`` is W13's blocks uint8 ``[E, 2I, H/32, 16]`` (byte (e, n, k/2) at e*stride_we +
    n*stride_wn + k//2) and ``w_scales_ptr`` its scales ``[E, 2I, H/32]`` (e*stride_se + n*stride_sn + k//32),
    decoded in the main loop (:func:`.mxfp4_kernels.mxfp4_expert_gemm`); stride_wk is unused.

    Ranks (:func:`rank_mask`): ``ranks_ptr`` each slot's w13 rank (in blocks of ``rank_block``: R, or R/2 in the
    split form), ``ranks2_ptr`` its w2 rank (the fused shrink2's A2 rows).

    ``num_experts``: E. PER_PAIR mode: a pair whose expert lies outside ``[0, E)`` (:func:`_block_rows`) exits
    before its GEMM (after the PDL wait, so the chain's order holds) and writes nothing."""
    if not WAIT_AFTER_MAIN_LOOP:
        grid_dependency_sync(USE_PDL)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    pid_m, pid_n = _swizzle(tl.program_id(0), grid_m, num_pid_n, GROUP_SIZE_M)
    pid_k = tl.program_id(1)
    if MODE == _SORTED:
        if pid_m >= tl.load(num_blocks_ptr):
            return
    pair, expert, bad_expert = _block_rows(pid_m, row_pair_ptr, block_expert_ptr, topk_ids_ptr, num_pairs,
                                           num_experts, BLOCK_M, MODE)
    if MODE == _PER_PAIR:
        if bad_expert:  # an expert id outside [0, E): no GEMM, no act row (the w2 kernel writes zeros)
            if WAIT_AFTER_MAIN_LOOP:
                grid_dependency_sync(USE_PDL)
            return
    valid = pair >= 0
    token = tl.where(valid, pair // top_k, 0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j_mask = offs_j < I
    rows = pid_m * BLOCK_M + offs_m
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + token.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    w_base = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk
    gate_cols = offs_j
    up_cols = offs_j + I
    # Main loop: this program's K slice of the base GEMM.
    if INTERLEAVED:
        # One contiguous tile of 2*BLOCK_N columns (gate, up, gate, up, ...), split after the epilogue adds.
        cols = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        col_mask = cols < 2 * I
        if W_FORMAT == _MXFP4:
            h = mxfp4_expert_gemm(x_ptrs, w_ptr + expert * stride_we, w_scales_ptr + expert * stride_se, cols,
                                  stride_wn, stride_sn, k_start, k_end, col_mask, BLOCK_M, 2 * BLOCK_N, BLOCK_K,
                                  EVEN_K, EVEN_N, DOT_PRECISION)
        else:
            h = _expert_gemm(x_ptrs, w_base + cols[None, :] * stride_wn, k_start, k_end, stride_wk, col_mask,
                             BLOCK_M, 2 * BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_PRECISION)
    elif W_FORMAT == _MXFP4:  # gate and up rows apart (concat): one decoded GEMM each
        w_blocks = w_ptr + expert * stride_we
        w_scales = w_scales_ptr + expert * stride_se
        gate = mxfp4_expert_gemm(x_ptrs, w_blocks, w_scales, gate_cols, stride_wn, stride_sn, k_start, k_end, j_mask,
                                 BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_PRECISION)
        up = mxfp4_expert_gemm(x_ptrs, w_blocks, w_scales, up_cols, stride_wn, stride_sn, k_start, k_end, j_mask,
                               BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_PRECISION)
    else:
        wg_ptrs = w_base + gate_cols[None, :] * stride_wn + k_start * stride_wk
        wu_ptrs = w_base + up_cols[None, :] * stride_wn + k_start * stride_wk
        x_ptrs += k_start
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs)
                if EVEN_N:
                    wg = tl.load(wg_ptrs)
                    wu = tl.load(wu_ptrs)
                else:
                    wg = tl.load(wg_ptrs, mask=j_mask[None, :], other=0.0)
                    wu = tl.load(wu_ptrs, mask=j_mask[None, :], other=0.0)
            else:
                k_mask = (k0 + offs_k) < k_end
                x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
                wg = tl.load(wg_ptrs, mask=k_mask[:, None] & j_mask[None, :], other=0.0)
                wu = tl.load(wu_ptrs, mask=k_mask[:, None] & j_mask[None, :], other=0.0)
            gate += tl.dot(x, wg, input_precision=DOT_PRECISION)
            up += tl.dot(x, wu, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K * stride_wk
            wu_ptrs += BLOCK_K * stride_wk
    if WAIT_AFTER_MAIN_LOOP:
        grid_dependency_sync(USE_PDL)  # now shrink13's rank vectors and zeroed counters are visible
    launch_dependents(USE_PDL)
    if SPLIT_K > 1:
        # Split-K: publish this slice's partial, arrive; the last arriver continues with the sum of all slices.
        part_rows = part_ptr + rows.to(tl.int64)[:, None] * (2 * I)
        if INTERLEAVED:
            h_ptrs = part_rows + cols[None, :]
            h_mask = valid[:, None] & col_mask[None, :]
            tl.store(h_ptrs + pid_k * part_split_stride, h, mask=h_mask)
        else:
            g_ptrs = part_rows + gate_cols[None, :]
            u_ptrs = part_rows + up_cols[None, :]
            gu_mask = valid[:, None] & j_mask[None, :]
            tl.store(g_ptrs + pid_k * part_split_stride, gate, mask=gu_mask)
            tl.store(u_ptrs + pid_k * part_split_stride, up, mask=gu_mask)
        tl.debug_barrier()  # every thread's partial stores before the (release) arrival
        arrived = tl.atomic_add(counter_ptr + pid_m * num_pid_n + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived != SPLIT_K - 1:
            return
        # The tile's other SPLIT_K - 1 partials are written and visible: sum all of them in split order.
        if INTERLEAVED:
            h = tl.load(h_ptrs, mask=h_mask, other=0.0, cache_modifier=".cg")
            for sp in range(1, SPLIT_K):
                h += tl.load(h_ptrs + sp * part_split_stride, mask=h_mask, other=0.0, cache_modifier=".cg")
        else:
            gate = tl.load(g_ptrs, mask=gu_mask, other=0.0, cache_modifier=".cg")
            up = tl.load(u_ptrs, mask=gu_mask, other=0.0, cache_modifier=".cg")
            for sp in range(1, SPLIT_K):
                gate += tl.load(g_ptrs + sp * part_split_stride, mask=gu_mask, other=0.0, cache_modifier=".cg")
                up += tl.load(u_ptrs + sp * part_split_stride, mask=gu_mask, other=0.0, cache_modifier=".cg")

    # Epilogue: routing weight (on input), LoRA delta before the activation, bias, activation.
    lora = load_slots(token_lora_ptr, token, valid, num_slots)
    has_lora = valid & (lora >= 0)
    offs_r = tl.arange(0, BLOCK_R)
    s = _load_rank_vectors(s_ptr, rows, has_lora, R, num_splits, split_stride, BLOCK_R)
    b_expert = expert * stride_be
    if WEIGHT_ON_INPUT:  # s13 already carries the routing weight when it is on the input
        weight = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
    if INTERLEAVED:
        if WEIGHT_ON_INPUT:
            h = h * weight[:, None]
        b_offs, b_mask = _b13_tile(offs_r, cols, (cols % 2) == 1, col_mask, R, stride_bn, SPLIT_B13)
        h += _lora_expand(s, lora, has_lora, b_ptr, stride_bl, b_expert + b_offs, b_mask, ranks_ptr, R, rank_block, 0,
                          BLOCK_M, 2 * BLOCK_N, BLOCK_R, DOT_PRECISION)
        if HAS_BIAS:
            h += tl.load(bias_ptr + expert * stride_bias_e + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        gate, up = tl.split(tl.reshape(h, (BLOCK_M, BLOCK_N, 2)))
    else:
        if WEIGHT_ON_INPUT:
            gate = gate * weight[:, None]
            up = up * weight[:, None]
        b_offs, b_mask = _b13_tile(offs_r, gate_cols, gate_cols >= I, j_mask, R, stride_bn, SPLIT_B13)
        gate += _lora_expand(s, lora, has_lora, b_ptr, stride_bl, b_expert + b_offs, b_mask, ranks_ptr, R,
                             rank_block, 0, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)
        b_offs, b_mask = _b13_tile(offs_r, up_cols, up_cols >= I, j_mask, R, stride_bn, SPLIT_B13)
        up += _lora_expand(s, lora, has_lora, b_ptr, stride_bl, b_expert + b_offs, b_mask, ranks_ptr, R,
                           rank_block, 0, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)
        if HAS_BIAS:
            gate += tl.load(bias_ptr + expert * stride_bias_e + gate_cols, mask=j_mask,
                            other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias_ptr + expert * stride_bias_e + up_cols, mask=j_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == _SILU:
        act = gate * tl.sigmoid(gate) * up
    else:
        # propagate_nan: a NaN gate/up stays NaN, as torch.clamp keeps it (the default returns the other operand,
        # which made a NaN-poisoned adapter's rows finite and wrong)
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.minimum(tl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL), limit,
                        propagate_nan=tl.PropagateNan.ALL)
        act = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
    act = act.to(act_ptr.dtype.element_ty)
    act_ptrs = act_ptr + rows.to(tl.int64)[:, None] * I + offs_j[None, :]
    if EVEN_N:
        tl.store(act_ptrs, act)
    else:
        tl.store(act_ptrs, act, mask=j_mask[None, :])
    if FUSE_SHRINK2:
        # The w2 LoRA shrink for this tile's I columns: s2[pid_n] = act[:, j tile] A2[l, e, :, j tile]^T, one slice
        # per column tile (the w2 kernel sums them), instead of a separate shrink launch.
        offs_r2 = tl.arange(0, BLOCK_R2)
        r2_mask = offs_r2 < R2
        s2 = tl.zeros((BLOCK_M, BLOCK_R2), dtype=tl.float32)
        a2_offs = expert * stride_a2e + offs_r2[None, :] * stride_a2r + offs_j[:, None]
        a2_mask = j_mask[:, None] & r2_mask[None, :]
        slot, last = _slot_range(lora, has_lora)
        while slot <= last:
            a2_rank = rank_mask(ranks2_ptr, slot, offs_r2, R2, R2, 0)
            a2 = tl.load(a2_ptr + slot.to(tl.int64) * stride_a2l + a2_offs, mask=a2_mask & a2_rank[None, :],
                         other=0.0)
            part = tl.dot(act, a2, input_precision=DOT_PRECISION)
            s2 += tl.where((has_lora & (lora == slot))[:, None], part, 0.0)
            slot = tl.min(tl.where(has_lora & (lora > slot), lora, _NO_SLOT), axis=0)
        s2_ptrs = s2_ptr + pid_n.to(tl.int64) * s2_split_stride + rows.to(tl.int64)[:, None] * R2 + offs_r2[None, :]
        tl.store(s2_ptrs, s2, mask=has_lora[:, None] & r2_mask[None, :])


@triton.jit
def _w2_gemm(in_ptrs, w_ptr, stride_we, stride_wk, stride_wn, w_scales_ptr, stride_se, stride_sn, expert, offs_k,
             offs_n, n_mask, k_start, k_end, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, W_FORMAT: tl.constexpr):
    """The w2 kernel's base GEMM over K range ``[k_start, k_end)`` of ``expert`` -> [BLOCK_M, BLOCK_N] fp32."""
    if W_FORMAT == _MXFP4:
        acc = mxfp4_expert_gemm(in_ptrs, w_ptr + expert * stride_we, w_scales_ptr + expert * stride_se, offs_n,
                                stride_wn, stride_sn, k_start, k_end, n_mask, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                EVEN_N, DOT_PRECISION)
    else:
        w_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        acc = _expert_gemm(in_ptrs, w_ptrs, k_start, k_end, stride_wk, n_mask, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                           EVEN_N, DOT_PRECISION)
    return acc


@triton.jit
def _expert_gemm_summing(a_ptrs, w_ptrs, k_start, k_end, stride_wk, n_mask, s_ptrs, s_mask, num_splits, split_stride,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """:func:`_expert_gemm`'s product, and beside it the sum of the first slices of the shrink's rank vectors
    (``s_ptrs`` [BLOCK_M, BLOCK_R] at slice 0, ``split_stride`` apart, ``s_mask``), one slice a K step, loaded
    one step ahead so that no step waits for its slice -> (acc [BLOCK_M, BLOCK_N] fp32, s [BLOCK_M, BLOCK_R] fp32):
    s holds slices 0 .. (number of K steps), those of them that exist (num_splits >= 1)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    s_next = tl.load(s_ptrs, mask=s_mask, other=0.0)
    split = tl.full((BLOCK_M, BLOCK_R), 1, tl.int32)  # (a tile, not a scalar: the mask stays a tile)
    a_ptrs += k_start
    w_ptrs += k_start * stride_wk
    for k0 in range(k_start, k_end, BLOCK_K):
        a, w = _gemm_tiles(a_ptrs, w_ptrs, k0 + offs_k, k_end, n_mask, EVEN_K, EVEN_N)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        s += s_next
        s_next = tl.load(s_ptrs + split * split_stride, mask=s_mask & (split < num_splits), other=0.0)
        split += 1
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    return acc, s + s_next


@triton.jit(do_not_specialize=["num_pairs", "grid_m"])
def moe_w2_kernel(
    in_ptr, stride_in, w_ptr, stride_we, stride_wk, stride_wn, bias_ptr, stride_bias_e,
    b_ptr, stride_bl, stride_be, stride_bn, s_ptr, num_splits, split_stride, out_ptr, stride_out, topk_weights_ptr,
    token_lora_ptr,
    row_pair_ptr, block_expert_ptr, topk_ids_ptr, num_blocks_ptr, num_pairs, grid_m, K, N, R, top_k,
    counter_ptr, y_ptr, stride_y, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHT_ON_OUTPUT: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TOPK_SUM: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1, USE_PDL: tl.constexpr = 0,
    w_scales_ptr=None, stride_se=0, stride_sn=0, W_FORMAT: tl.constexpr = 0, ranks_ptr=None, num_slots=2147483647,
    num_experts=2147483647, SUM_IN_LOOP: tl.constexpr = False,
):
    """out[pair, n] = (in[row] W[e]^T + s B[l,e]^T + bias) (* routing weight): the w2 GEMM.

    ``in`` rows are block rows (act), or tokens in DENSE mode; W element (e, k, n) at e*stride_we + k*stride_wk +
    n*stride_wn; B element (l, e, n, r) at l*stride_bl + e*stride_be + n*stride_bn + r.

    TOPK_SUM (PER_PAIR mode): ``out`` is an fp32 scratch [pairs, N]; the program that finishes last among the
    k pairs of a token (per N tile; ``counter [T, cdiv(N, BLOCK_N)]`` int32, zeroed by the shrink kernel) sums the
    k fp32 rows in pair order and writes ``y [T, N]`` (x.dtype): the top-k sum without its own launch,
    deterministic (fixed order, no float atomics), with the per-pair grid's parallelism.

    SPLIT_K > 1 (TOPK_SUM only; grid (tiles, SPLIT_K)): program ``p`` does K slice ``[p*k_per_split, ...)`` and
    writes its partial (times the routing weight; LoRA and bias in slice 0 only) to scratch row
    ``p*num_pairs + pair``; the last of the token's top_k*SPLIT_K programs of the tile sums them all.

    W_FORMAT MXFP4: ``w_ptr`` is W2's blocks uint8 ``[E, H, I/32, 16]``, ``w_scales_ptr`` its scales (addressed
    like the w13 kernel's). ``ranks_ptr``: each slot's w2 rank (:func:`rank_mask`).

    ``num_experts``: E. PER_PAIR mode: a pair whose expert lies outside ``[0, E)`` (:func:`_block_rows`) skips its
    GEMM and writes its row (each K slice's) as zeros, and still arrives for the top-k sum: it adds nothing to y.
    (SORTED mode: :mod:`.routing` zeroes such a pair's row.)

    SUM_IN_LOOP (dense W, SPLIT_K 1; config ``w2_sum_in_loop``): the rank vectors' slices are summed in the main
    loop, one a K step (:func:`_expert_gemm_summing`), the rest (more slices than K steps) after it."""
    grid_dependency_sync(USE_PDL)
    pid_m, pid_n = _swizzle(tl.program_id(0), grid_m, tl.cdiv(N, BLOCK_N), GROUP_SIZE_M)
    pid_k = tl.program_id(1)
    if MODE == _SORTED:
        if pid_m >= tl.load(num_blocks_ptr):
            return
    pair, expert, bad_expert = _block_rows(pid_m, row_pair_ptr, block_expert_ptr, topk_ids_ptr, num_pairs,
                                           num_experts, BLOCK_M, MODE)
    valid = pair >= 0
    token = tl.where(valid, pair // top_k, 0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = pid_m * BLOCK_M + offs_m
    if MODE == _DENSE:
        in_rows = tl.where(valid, rows, 0).to(tl.int64)
    else:
        in_rows = rows.to(tl.int64)
    in_ptrs = in_ptr + in_rows[:, None] * stride_in + offs_k[None, :]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    if SUM_IN_LOOP:  # (SPLIT_K 1, dense W: the launcher's condition)
        if MODE == _PER_PAIR:  # an expert id outside [0, E): no GEMM (no K step), a zero row
            k_end = tl.where(bad_expert, k_start, k_end)
        lora = load_slots(token_lora_ptr, token, valid, num_slots)
        has_lora = valid & (lora >= 0)  # (False in every row of a pair with a bad expert: no valid row)
        s_ptrs = s_ptr + rows.to(tl.int64)[:, None] * R + offs_r[None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        acc, s = _expert_gemm_summing(in_ptrs, w_ptrs, k_start, k_end, stride_wk, n_mask, s_ptrs,
                                      has_lora[:, None] & r_mask[None, :], num_splits, split_stride,
                                      BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, EVEN_K, EVEN_N, DOT_PRECISION)
        for sp in range(tl.cdiv(k_end - k_start, BLOCK_K) + 1, num_splits):  # slices past the K steps
            s += tl.load(s_ptrs + sp * split_stride, mask=has_lora[:, None] & r_mask[None, :], other=0.0)
        launch_dependents(USE_PDL)
    else:
        if MODE == _PER_PAIR:
            if bad_expert:  # an expert id outside [0, E) (see _block_rows): no GEMM, a zero row
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            else:
                acc = _w2_gemm(in_ptrs, w_ptr, stride_we, stride_wk, stride_wn, w_scales_ptr, stride_se, stride_sn,
                               expert, offs_k, offs_n, n_mask, k_start, k_end, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                               EVEN_N, DOT_PRECISION, W_FORMAT)
        else:
            acc = _w2_gemm(in_ptrs, w_ptr, stride_we, stride_wk, stride_wn, w_scales_ptr, stride_se, stride_sn,
                           expert, offs_k, offs_n, n_mask, k_start, k_end, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N,
                           DOT_PRECISION, W_FORMAT)
        launch_dependents(USE_PDL)

        lora = load_slots(token_lora_ptr, token, valid, num_slots)
        if SPLIT_K > 1:  # the LoRA delta (and bias) once, in slice 0
            lora = tl.where(pid_k == 0, lora, _NO_ADAPTER)
        has_lora = valid & (lora >= 0)
        s = _load_rank_vectors(s_ptr, rows, has_lora, R, num_splits, split_stride, BLOCK_R)
    b_offs = expert * stride_be + offs_r[:, None] + offs_n[None, :] * stride_bn
    acc += _lora_expand(s, lora, has_lora, b_ptr, stride_bl, b_offs, r_mask[:, None] & n_mask[None, :], ranks_ptr,
                        R, R, 0, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc += bias[None, :]
    if WEIGHT_ON_OUTPUT:
        weight = tl.load(topk_weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    if MODE == _PER_PAIR:  # the block's pair owns its row even with an out-of-range expert: zeros there
        out_pair = tl.where(offs_m == 0, pid_m, _NO_PAIR)
        acc = tl.where(valid[:, None], acc, 0.0)
    else:
        out_pair = pair
    out_ptrs = out_ptr + (pid_k * num_pairs + out_pair).to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(out_pair >= 0)[:, None] & n_mask[None, :])
    if TOPK_SUM:
        # Arrive: all threads' partial stores happen before one thread's acq_rel atomic (release side).
        tl.debug_barrier()
        tok = pid_m // top_k
        arrived = tl.atomic_add(counter_ptr + tok * tl.cdiv(N, BLOCK_N) + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == top_k * SPLIT_K - 1:  # the token's other partials of this tile are written and visible
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sp in range(0, SPLIT_K):
                for j0 in range(0, top_k, BLOCK_M):
                    rows_j = j0 + offs_m
                    part_rows = (sp * num_pairs + tok * top_k + rows_j).to(tl.int64)
                    part = tl.load(out_ptr + part_rows[:, None] * stride_out + offs_n[None, :],
                                   mask=(rows_j < top_k)[:, None] & n_mask[None, :], other=0.0,
                                   cache_modifier=".cg")
                    y += tl.sum(part, axis=0)
            tl.store(y_ptr + tok.to(tl.int64) * stride_y + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_mask)
