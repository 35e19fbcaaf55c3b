"""@triton.jit kernels of ``lora_linear``: the per-token shrink for decode-sized batches, the GEMM with the LoRA
expand in its epilogue (split-K at decode), and the GEMV for a handful of tokens (same epilogue, no ``tl.dot``, no
16-row padding). The block shrink for larger batches is :mod:`.moe_kernels`' DENSE mode.

GEMV (:func:`lora_gemv_kernel`, T <= 8, the heuristic's choice up to 4; the tuned table may say otherwise). At
batch 1 the GEMM spent 15 of its 16 ``tl.dot`` rows on padding and ran at ~43 % of HBM bandwidth on the H200; the
GEMV streams W [BLOCK_N, BLOCK_K] tiles along K (W is [N, K], K contiguous) into an fp32 [T, BLOCK_N, BLOCK_K]
accumulator (x broadcast over the columns), split-K over about 4 programs per SM, and with PDL it streams the
weight while the shrink still runs (its main loop reads nothing the shrink writes). Its bandwidth is set by the
weight bytes in flight per SM: sm_90 SASS of the tuned N16 K128 (T=1, no prefetch) has two 16-byte W loads a
thread a K step (4 KB a program), 48 registers, 10 programs an SM: ~40 KB at best, each program waiting one full
HBM round trip per step (the H200 ran it at ~45 % of bandwidth); N4 K512 with the one-step prefetch keeps four in
flight (8 KB a program) at 45 registers, and without split-K the grid is N/4 programs, with no partials and no
arrival tail. Past ~4 tokens the GEMV's CUDA-core FMAs (T per weight) and its per-token x and accumulator registers
lose to ``tl.dot`` (T=8 N4 K256: 132 registers, 3 programs an SM).

GEMM epilogue (T = 2..64 on the GEMM path). The MoE kernels' expand walks a block's distinct slots one at a time,
a B round trip each (8 distinct adapters in a 16-row block: 8 serial L2/HBM round trips in the tail of slice 0,
~8 us a call on the H200 for < 1 us of bytes), and the kernel waited for the shrink before its main loop.
``EXPAND_SLOTS`` > 1 gathers the B tiles of up to that many slots in one load and multiplies them in one batched
``tl.dot`` (:func:`_lora_expand_grouped`), and the main loop and the first group's B load run before the PDL wait.

Shrink. At decode a block of 16 tokens can hold as many adapter slots as tokens, and the block shrink then walks every slot
of the block serially on a handful of programs (measured on the H200: ~37 us a launch for 8 tokens of 8 adapters at
rank 32, against a few us of bytes). Here every token gets its own programs instead: grid ``(T, SPLIT_K)``, one
token's rank vector over one K slice each, no ``tl.dot`` (``[BLOCK_R, BLOCK_K]`` products summed over K), so the
slot is a scalar per program, tokens without an adapter (``-1``) exit at once, and tokens of one adapter re-read its
A from L2 (HBM reads each used slot's A once).

Per-slot ranks (``ranks_ptr``, ``rank_block``, ``rank_stride``, RANK_BLOCKS; :func:`.moe_kernels.rank_mask`): every
kernel here masks a slot's A rows past its rank (never read) and its B columns past the rank rounded up to 8 entries
(:func:`.moe_kernels.rank_load_masks`: 16-byte loads kept; the extra entries are zeroed after the load).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_kernels import (_expert_gemm, _load_rank_vectors, _lora_expand, _swizzle, grid_dependency_sync,
                          launch_dependents, load_slots, rank_load_masks, rank_mask)

_COUNTER_TILE = tl.constexpr(128)


@triton.jit
def _slot_order(lora, rows, BLOCK_M: tl.constexpr):
    """Among the slots of the rows ``rows`` [BLOCK_M] bool: (whether each row is the first of its slot, how many
    distinct slots are smaller than its own) -> ([BLOCK_M] bool, [BLOCK_M] int32: the index of the row's slot in the
    ascending distinct slots; meaningless outside ``rows``). Registers only (a [BLOCK_M, BLOCK_M] compare)."""
    offs = tl.arange(0, BLOCK_M)
    earlier_same = (lora[None, :] == lora[:, None]) & rows[None, :] & (offs[None, :] < offs[:, None])
    first = rows & (tl.sum(earlier_same.to(tl.int32), axis=1) == 0)
    return first, tl.sum((first[None, :] & (lora[None, :] < lora[:, None])).to(tl.int32), axis=1)


@triton.jit
def _slot_group(lora, has_lora, after, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The SLOTS smallest distinct slots above ``after`` among the rows with LoRA -> [SLOTS] int32, ascending, -1
    past the last one. lora, has_lora [BLOCK_M]; registers only."""
    first, rank = _slot_order(lora, has_lora & (lora > after), BLOCK_M)
    pick = first[None, :] & (rank[None, :] == tl.arange(0, SLOTS)[:, None])  # [SLOTS, BLOCK_M]
    return tl.max(tl.where(pick, lora[None, :], -1), axis=1)


@triton.jit
def _load_slot_group(b_ptr, stride_bl, slots, b_offs, b_mask, ranks_ptr, R, rank_block, rank_stride,
                     BLOCK_R: tl.constexpr, RANK_BLOCKS: tl.constexpr):
    """B tiles of a slot group -> [SLOTS, BLOCK_R, BLOCK_N] (zero for a -1 slot, not fetched, and past each slot's
    rank: :func:`rank_load_masks`, per rank block): one gathered load, so the group's tiles are in flight together."""
    slot = tl.where(slots >= 0, slots, 0)
    load_r, keep_r = rank_load_masks(ranks_ptr, slot[:, None], tl.arange(0, BLOCK_R)[None, :], R, rank_block,
                                     rank_stride, RANK_BLOCKS)
    ptrs = b_ptr + slot.to(tl.int64)[:, None, None] * stride_bl + b_offs[None, :, :]
    mask = (slots >= 0)[:, None, None] & load_r[:, :, None] & b_mask[None, :, :]
    b = tl.load(ptrs, mask=mask, other=0.0)
    if ranks_ptr is not None:
        b = tl.where(keep_r[:, :, None], b, 0.0)
    return b


@triton.jit
def _lora_expand_grouped(s, lora, has_lora, slots, b, b_ptr, stride_bl, b_offs, b_mask, ranks_ptr, R, rank_block,
                         rank_stride, SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr, RANK_BLOCKS: tl.constexpr):
    """``_lora_expand``'s result (sum over the block's slots l of ``s[rows of l] @ B[l]^T`` -> [BLOCK_M, BLOCK_N]
    fp32), SLOTS slots a round: the round's B tiles (``b`` [SLOTS, BLOCK_R, BLOCK_N] of ``slots``, the first round
    loaded by the caller, before its PDL wait) come in one gathered load and one batched ``tl.dot``; a block of
    up to SLOTS distinct slots costs one B round trip instead of one per slot. Each product is kept only in its
    own slot's rows (``tl.where`` on the result: a non-finite B[l] reaches only the rows of l)."""
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    s_b = tl.broadcast_to(s[None, :, :], (SLOTS, BLOCK_M, s.shape[1])).to(b.dtype)
    while tl.max(slots, axis=0) >= 0:
        part = tl.dot(s_b, b, input_precision=DOT_PRECISION)  # [SLOTS, BLOCK_M, BLOCK_N]
        own = (lora[None, :] == slots[:, None]) & has_lora[None, :]
        delta += tl.sum(tl.where(own[:, :, None], part, 0.0), axis=0)
        slots = _slot_group(lora, has_lora, tl.max(slots, axis=0), SLOTS, BLOCK_M)
        b = _load_slot_group(b_ptr, stride_bl, slots, b_offs, b_mask, ranks_ptr, R, rank_block, rank_stride,
                             BLOCK_R, RANK_BLOCKS)
    return delta


@triton.jit(do_not_specialize=["T"])
def lora_shrink_rows_kernel(
    x_ptr, stride_x, a_ptr, stride_al, stride_ar, s_ptr, split_stride, token_lora_ptr, T, K, R, k_per_split,
    counter_ptr, num_counters,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ZERO_COUNTERS: tl.constexpr = False,
    USE_PDL: tl.constexpr = 0, ranks_ptr=None, rank_block=1, rank_stride=0, RANK_BLOCKS: tl.constexpr = 1,
    num_slots=2147483647,
):
    """s[split, t, :R] = x[t, K slice] @ A[l, :, K slice]^T in fp32, ``l = token_lora[t]``, for tokens with an
    adapter; rows of ``-1`` tokens are not written (the consumer never reads them). Grid (T, SPLIT_K).

    x [T, K] (row stride ``stride_x``, K contiguous); A [L, R, K] (K contiguous); s [SPLIT_K, >= T, R] fp32 with
    ``split_stride`` elements between slices: the layout :func:`lora_linear_kernel` reads.

    ZERO_COUNTERS: also zero ``counter [num_counters]`` int32, the arrival counters of the split-K GEMM that
    follows (the shrink is the first kernel of the pair, so no memset launch)."""
    grid_dependency_sync(USE_PDL)
    t = tl.program_id(0)
    pid_k = tl.program_id(1)
    if ZERO_COUNTERS:
        offs_c = tl.arange(0, _COUNTER_TILE)
        step = tl.num_programs(0) * tl.num_programs(1) * _COUNTER_TILE
        for c0 in range((pid_k * tl.num_programs(0) + t) * _COUNTER_TILE, num_counters, step):
            tl.store(counter_ptr + c0 + offs_c, tl.zeros([_COUNTER_TILE], dtype=tl.int32),
                     mask=c0 + offs_c < num_counters)
    lora = load_slots(token_lora_ptr, t, None, num_slots).to(tl.int64)
    if lora < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    a_mask = rank_mask(ranks_ptr, lora, offs_r, R, rank_block, rank_stride, RANK_BLOCKS)[:, None]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + t.to(tl.int64) * stride_x + offs_k
    a_ptrs = a_ptr + lora * stride_al + offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0)
            a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_end
            x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0)
            a = tl.load(a_ptrs + k0, mask=a_mask & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    launch_dependents(USE_PDL)
    s = tl.sum(acc, axis=1)
    tl.store(s_ptr + pid_k.to(tl.int64) * split_stride + t.to(tl.int64) * R + offs_r, s, mask=r_mask)


@triton.jit(do_not_specialize=["T", "grid_m"])
def lora_linear_kernel(
    x_ptr, stride_x, w_ptr, stride_wn, stride_wk, bias_ptr, b_ptr, stride_bl, stride_bn,
    s_ptr, num_splits, split_stride, token_lora_ptr, y_ptr, stride_y, part_ptr, counter_ptr,
    T, grid_m, K, N, R, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_K: tl.constexpr = 1, USE_PDL: tl.constexpr = 0,
    EXPAND_SLOTS: tl.constexpr = 1, ranks_ptr=None, rank_block=1, rank_stride=0, RANK_BLOCKS: tl.constexpr = 1,
    num_slots=2147483647, SPREAD_EXPAND: tl.constexpr = False,
):
    """y[t] = x[t] W^T + B[l] s[t] (+ bias), ``l = token_lora[t]`` (no delta for ``-1``). Grid (grid_m * N tiles,
    SPLIT_K). x [T, K] (K contiguous); W element (n, k) at n*stride_wn + k*stride_wk; B element (l, n, r) at
    l*stride_bl + n*stride_bn + r; s [num_splits, grid_m*BLOCK_M, R] fp32 (the shrink's slices); y [T, N].

    SPLIT_K > 1 (decode: a skinny GEMM has too few column tiles to stream the weight from every SM): program
    ``p`` does K slice ``[p*k_per_split, ...)``, slice 0 also adds the LoRA delta and the bias, and each writes its
    fp32 partial to ``part [SPLIT_K, grid_m*BLOCK_M, N]``; the last of the tile's SPLIT_K programs to arrive at
    ``counter [grid_m * N tiles]`` (int32, zeroed by the shrink) sums them in slice order and writes y:
    deterministic, no float atomics, no extra launch.

    EXPAND_SLOTS > 1: the expand loads the B tiles of up to that many distinct slots at once
    (:func:`_lora_expand_grouped`); 1: one slot at a time (:func:`.moe_kernels._lora_expand`, a B round trip per
    slot: ~8 us for 8 distinct slots at decode on the H200).

    SPREAD_EXPAND (SPLIT_K > 1): the block's i-th smallest distinct slot is expanded by slice ``i % SPLIT_K``
    instead of all of them by slice 0 (:func:`_slot_order`), so each program walks ~1/SPLIT_K of the slots' serial
    B round trips; each slice's partial then holds its slots' deltas, which the last arriver sums with the rest.

    PDL: the main loop reads only x (written before the shrink, the first kernel of the pair) and W, and the first
    slot group's B tiles depend on nothing the shrink writes, so all of that runs before the wait for the shrink
    (the weight streams while the shrink runs); the rank vectors, the counters and every store come after it."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _swizzle(tl.program_id(0), grid_m, tiles_n, GROUP_SIZE_M)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    rows = pid_m * BLOCK_M + offs_m
    valid = rows < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    x_ptrs = x_ptr + tl.where(valid, rows, 0).to(tl.int64)[:, None] * stride_x + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = w_ptr + tl.arange(0, BLOCK_K)[:, None] * stride_wk + offs_n[None, :] * stride_wn
    k_start = pid_k * k_per_split
    acc = _expert_gemm(x_ptrs, w_ptrs, k_start, tl.minimum(k_start + k_per_split, K), stride_wk, n_mask,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_PRECISION)

    lora = load_slots(token_lora_ptr, rows, valid, num_slots)
    if SPLIT_K > 1:  # each slot's delta once: in slice 0, or spread over the slices (the bias in slice 0)
        if SPREAD_EXPAND:
            _, order = _slot_order(lora, valid & (lora >= 0), BLOCK_M)
            lora = tl.where(order % SPLIT_K == pid_k, lora, -1)
        else:
            lora = tl.where(pid_k == 0, lora, -1)
    has_lora = valid & (lora >= 0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    b_offs = offs_r[:, None] + offs_n[None, :] * stride_bn
    b_mask = r_mask[:, None] & n_mask[None, :]
    if EXPAND_SLOTS > 1:  # the first slot group's B tiles in flight while waiting for the shrink
        slots = _slot_group(lora, has_lora, -1, EXPAND_SLOTS, BLOCK_M)
        b_first = _load_slot_group(b_ptr, stride_bl, slots, b_offs, b_mask, ranks_ptr, R, rank_block, rank_stride,
                                   BLOCK_R, RANK_BLOCKS)
    grid_dependency_sync(USE_PDL)  # now the shrink's rank vectors and zeroed counters are visible
    launch_dependents(USE_PDL)
    s = _load_rank_vectors(s_ptr, rows, has_lora, R, num_splits, split_stride, BLOCK_R)
    if EXPAND_SLOTS > 1:
        acc += _lora_expand_grouped(s, lora, has_lora, slots, b_first, b_ptr, stride_bl, b_offs, b_mask,
                                    ranks_ptr, R, rank_block, rank_stride, EXPAND_SLOTS, BLOCK_M, BLOCK_N, BLOCK_R,
                                    DOT_PRECISION, RANK_BLOCKS)
    else:
        acc += _lora_expand(s, lora, has_lora, b_ptr, stride_bl, b_offs, b_mask, ranks_ptr, R, rank_block,
                            rank_stride, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION, RANK_BLOCKS)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc += bias[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    y_mask = valid[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        part_rows = grid_m * BLOCK_M
        part_ptrs = part_ptr + (pid_k * part_rows + rows).to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs, acc, mask=y_mask)
        # Arrive: all threads' partial stores happen before one thread's acq_rel atomic (release side).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_m * tiles_n + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the tile's other partials are written and visible
            y = tl.load(part_ptrs - pid_k * part_rows * N, mask=y_mask, other=0.0, cache_modifier=".cg")
            for sp in range(1, SPLIT_K):
                y += tl.load(part_ptrs + (sp - pid_k) * part_rows * N, mask=y_mask, other=0.0,
                             cache_modifier=".cg")
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=y_mask)


@triton.jit
def _gemv_load(x_ptrs, w_ptrs, k_mask, n_mask, MASK_K: tl.constexpr, EVEN_N: tl.constexpr):
    """-> (x [BLOCK_T, BLOCK_N, BLOCK_K] (the same row at every n), w [1, BLOCK_N, BLOCK_K]) at one K step. The loads
    are 3-D so that W's coalesced layout (K-contiguous vectors) is the accumulator's: no layout conversion."""
    if MASK_K:
        x = tl.load(x_ptrs, mask=k_mask[None, None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[None, :, None] & k_mask[None, None, :], other=0.0)
    else:
        x = tl.load(x_ptrs)
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[None, :, None], other=0.0)
    return x, w


@triton.jit(do_not_specialize=["T", "split_k", "split_stride"])
def lora_gemv_kernel(
    x_ptr, stride_x, w_ptr, stride_wn, bias_ptr, b_ptr, stride_bl, stride_bn, s_ptr, num_splits, split_stride,
    token_lora_ptr, y_ptr, stride_y, part_ptr, counter_ptr, T, K, N, R, split_k, k_per_split,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_SPLIT_K: tl.constexpr = False,
    PREFETCH: tl.constexpr = True, USE_PDL: tl.constexpr = 0, ranks_ptr=None, rank_block=1, rank_stride=0,
    RANK_BLOCKS: tl.constexpr = 1, num_slots=2147483647,
):
    """``lora_linear_kernel``'s result for a handful of tokens (T <= BLOCK_T), as a GEMV: no ``tl.dot``, no 16-row
    padding. Grid (cdiv(N, BLOCK_N), split_k). Program (n, p) streams W [BLOCK_N, BLOCK_K] tiles of its columns
    over K slice ``[p*k_per_split, ...)`` (W [N, K] with K contiguous: coalesced along K; ``k_per_split`` a multiple
    of BLOCK_K, so only the last slice can end in a partial step, masked, when not EVEN_K = K % BLOCK_K == 0) and
    multiplies them by the T token rows by broadcast, fp32 products summed over K once after the loop. PREFETCH:
    the loop loads one step ahead (software pipelining in registers; Triton's own pipeliner leaves loads that feed
    no ``tl.dot`` alone).

    x [T, K] (K contiguous); W element (n, k) at n*stride_wn + k; B element (l, n, r) at l*stride_bl + n*stride_bn
    + r; s [num_splits, >= T, R] fp32 (the per-token shrink's slices); y [T, N].

    Epilogue (slice 0): per token t with ``l = token_lora[t] >= 0``, ``s[t] B[l]^T`` over the program's columns (a
    gather of B by each token's own slot: tokens of ``-1`` load nothing, a non-finite slot reaches only its own
    tokens) and the bias. USE_SPLIT_K (split_k > 1, a runtime count: one compile for any split): each program
    writes its fp32 partial to ``part [split_k, T, N]``; the last of a column tile's split_k programs to arrive at
    ``counter [cdiv(N, BLOCK_N)]`` (int32, zeroed by the shrink) sums them in slice order and writes y:
    deterministic, no float atomics, no extra launch.

    PDL: the main loop reads only x (written before the shrink, the first kernel of the pair) and W, so it runs
    before the wait for the shrink (the weight streams while the shrink runs).

    History (H200, GPT-OSS-20B whole-model decode at batch 1, 2026-12-04): a form that also issued slice 0's B
    gather before the main loop and loaded W with ``evict_first`` (besides the per-slot rank masks kept here) made
    the step's 48 dense calls 0.13-0.17 ms slower in total, with and without adapters, than the form before it;
    those two changes were taken back out (this form is not measured yet)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    k_full = k_start + (k_end - k_start) // BLOCK_K * BLOCK_K
    # x broadcast over the N axis in the pointers, not in registers: its loads then take W's layout (repeated
    # addresses, served by L1) instead of a layout conversion through shared memory at every K step
    x_ptrs = (x_ptr + tl.where(t_mask, offs_t, 0).to(tl.int64)[:, None, None] * stride_x
              + tl.zeros([1, BLOCK_N, 1], dtype=tl.int64) + offs_k[None, None, :])
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :, None] * stride_wn + offs_k[None, None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PREFETCH:  # the next step's tiles load while this step's multiply-adds wait for theirs: 2 tiles in flight
        if k_start < k_full:
            x, w = _gemv_load(x_ptrs + k_start, w_ptrs + k_start, None, n_mask, False, EVEN_N)
            for k0 in range(k_start + BLOCK_K, k_full, BLOCK_K):
                x_next, w_next = _gemv_load(x_ptrs + k0, w_ptrs + k0, None, n_mask, False, EVEN_N)
                acc += x.to(tl.float32) * w.to(tl.float32)
                x, w = x_next, w_next
            acc += x.to(tl.float32) * w.to(tl.float32)
    else:
        for k0 in range(k_start, k_full, BLOCK_K):
            x, w = _gemv_load(x_ptrs + k0, w_ptrs + k0, None, n_mask, False, EVEN_N)
            acc += x.to(tl.float32) * w.to(tl.float32)
    if not EVEN_K:
        if k_full < k_end:  # the partial step at the end of K
            x, w = _gemv_load(x_ptrs + k_full, w_ptrs + k_full, (k_full + offs_k) < k_end, n_mask, True, EVEN_N)
            acc += x.to(tl.float32) * w.to(tl.float32)
    out = tl.sum(acc, axis=2)  # [BLOCK_T, BLOCK_N]
    grid_dependency_sync(USE_PDL)  # now the shrink's rank vectors and zeroed counters are visible
    launch_dependents(USE_PDL)

    if pid_k == 0:  # the LoRA delta and the bias once, in slice 0
        lora = load_slots(token_lora_ptr, offs_t, t_mask, num_slots).to(tl.int64)
        has_lora = t_mask & (lora >= 0)
        if tl.max(has_lora.to(tl.int32), axis=0) > 0:
            offs_r = tl.arange(0, BLOCK_R)
            slot = tl.where(has_lora, lora, 0)
            # s past a slot's rank is 0 (the shrink's A rows there are masked); B there may hold anything
            s_mask = has_lora[:, None] & (offs_r < R)[None, :]
            s_ptrs = s_ptr + offs_t.to(tl.int64)[:, None] * R + offs_r[None, :]
            s = tl.load(s_ptrs, mask=s_mask, other=0.0)
            for split in range(1, num_splits):
                s += tl.load(s_ptrs + split * split_stride, mask=s_mask, other=0.0)
            load_r, keep_r = rank_load_masks(ranks_ptr, slot[:, None], offs_r[None, :], R, rank_block, rank_stride,
                                             RANK_BLOCKS)  # each token's slot, to its rank
            b_ptrs = (b_ptr + slot[:, None, None] * stride_bl + offs_n.to(tl.int64)[None, :, None] * stride_bn
                      + offs_r[None, None, :])
            b_mask = (has_lora[:, None] & load_r)[:, None, :] & n_mask[None, :, None]
            b = tl.load(b_ptrs, mask=b_mask, other=0.0)
            if ranks_ptr is not None:
                b = tl.where(keep_r[:, None, :], b, 0.0)
            out += tl.sum(b.to(tl.float32) * s[:, None, :], axis=2)  # 0 in rows without LoRA (b, s masked)
        if HAS_BIAS:
            out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * stride_y + offs_n[None, :]
    y_mask = t_mask[:, None] & n_mask[None, :]
    if not USE_SPLIT_K:
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        first = part_ptr + offs_t.to(tl.int64)[:, None] * N + offs_n[None, :]
        slice_stride = T.to(tl.int64) * N
        tl.store(first + pid_k * slice_stride, out, mask=y_mask)
        # Arrive: all threads' partial stores happen before one thread's acq_rel atomic (release side).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:  # the tile's other partials are written and visible
            y = tl.load(first, mask=y_mask, other=0.0, cache_modifier=".cg")
            for sp in range(1, split_k):
                y += tl.load(first + sp * slice_stride, mask=y_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=y_mask)
