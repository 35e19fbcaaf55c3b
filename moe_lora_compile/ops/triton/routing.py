"""Device-side routing: group the P = T*k (token, slot) pairs per (expert, adapter) into BLOCK_M-padded segments.

No host sync: every buffer has its worst-case size, known from shapes alone, and the number of used blocks stays on
the device (``num_blocks [1]``). Pairs of one expert are padded together (one expert per block); inside an expert
they are ordered by adapter slot so a block sees few distinct adapters. Order inside one (expert, adapter) segment
is arbitrary (atomics); each row's result does not depend on its neighbours.

A pair whose expert id lies outside ``[0, E)`` (the op's checks refuse it, but they are off inside CUDA graphs and
with ``MOE_LORA_CHECK_IDS=0``) is left out: counted nowhere, in no block, no ``pair_row`` entry; the count kernel
zeroes its output row instead (``zero_rows``), so it adds nothing to the top-k sum and nothing indexes past the
counters or the weights.

Four launches: one memset, count, offsets (one program), scatter. The scatter also writes the inverse map
``pair_row`` (row of each pair), for the per-pair shrink (:func:`.moe_kernels.lora_shrink_pairs_kernel`). With a :class:`.pdl.LaunchChain` the three
Triton kernels are the start of the layer's PDL chain (count is its first kernel: it follows the memset).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .moe_kernels import _NO_PAIR, PDL_OFF, grid_dependency_sync, load_slots
from .pdl import LaunchChain

CHUNK = 256  # pairs per program in the count/scatter kernels


@dataclass(frozen=True)
class Routing:
    """Sorted-pair metadata. row_pair [grid_m*BLOCK_M] int32 (NO_PAIR = padding); block_expert [grid_m] int32;
    num_blocks [1] int32 (blocks in use, on device); grid_m: worst-case block count (host int, from shapes);
    pair_row [T*k] int32: the row of each pair (``row_pair[pair_row[p]] == p``)."""

    row_pair: torch.Tensor
    block_expert: torch.Tensor
    num_blocks: torch.Tensor
    grid_m: int
    pair_row: torch.Tensor


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case number of non-empty BLOCK_M blocks: every block holds at least one pair, and
    sum_e ceil(c_e / BM) <= P // BM + E."""
    return max(1, min(num_pairs, num_pairs // block_m + num_experts))


@triton.jit
def _load_experts(topk_ids_ptr, offs, in_range, num_experts):
    """-> (experts [CHUNK] int32, 0 where left out; pairs kept: in range with an expert in ``[0, num_experts)``;
    pairs dropped: in range with an expert outside it). Compared as loaded: an int64 id is not truncated first."""
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=0)
    dropped = in_range & ((expert < 0) | (expert >= num_experts))
    keep = in_range & ~dropped
    return tl.where(keep, expert, 0).to(tl.int32), keep, dropped


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _count_kernel(topk_ids_ptr, token_lora_ptr, counts_ptr, row_pair_ptr, num_pairs, num_rows, top_k, num_experts,
                  zero_ptr, stride_zero, N, NUM_SLOTS_P1: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK_N: tl.constexpr = 32, USE_PDL: tl.constexpr = 0):
    """counts[e*(L+1) + l+1] += 1 per pair (segment l+1 = 0: NO_ADAPTER = -1); also fills row_pair with NO_PAIR
    (padding). A pair of an expert outside ``[0, num_experts)`` is not counted; with ``zero_ptr`` its row
    ``zero_ptr[pair, :N]`` (row stride ``stride_zero``) is zeroed (a loop that only a chunk holding one runs)."""
    grid_dependency_sync(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(row_pair_ptr + offs, tl.full([CHUNK], _NO_PAIR, tl.int32), mask=offs < num_rows)
    in_range = offs < num_pairs
    expert, keep, dropped = _load_experts(topk_ids_ptr, offs, in_range, num_experts)
    lora = load_slots(token_lora_ptr, offs // top_k, in_range, NUM_SLOTS_P1 - 1)
    tl.atomic_add(counts_ptr + expert * NUM_SLOTS_P1 + lora + 1, 1, mask=keep)
    if zero_ptr is not None:
        if tl.max(dropped.to(tl.int32), axis=0) > 0:
            row_ptrs = zero_ptr + offs.to(tl.int64)[:, None] * stride_zero
            zeros = tl.zeros((CHUNK, BLOCK_N), dtype=zero_ptr.dtype.element_ty)
            for n0 in range(0, N, BLOCK_N):
                offs_n = n0 + tl.arange(0, BLOCK_N)
                tl.store(row_ptrs + offs_n[None, :], zeros, mask=dropped[:, None] & (offs_n < N)[None, :])


@triton.jit(do_not_specialize=["grid_m"])
def _offsets_kernel(counts_ptr, cursor_ptr, block_expert_ptr, num_blocks_ptr, grid_m, num_experts,
                    BLOCK_M: tl.constexpr, NUM_SLOTS_P1: tl.constexpr, E_BLOCK: tl.constexpr,
                    S_BLOCK: tl.constexpr, B_CHUNK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """One program: segment start rows (into cursor), expert of each block, number of blocks used."""
    grid_dependency_sync(USE_PDL)
    offs_e = tl.arange(0, E_BLOCK)
    offs_s = tl.arange(0, S_BLOCK)
    mask = (offs_e[:, None] < num_experts) & (offs_s[None, :] < NUM_SLOTS_P1)
    seg = offs_e[:, None] * NUM_SLOTS_P1 + offs_s[None, :]
    counts = tl.load(counts_ptr + seg, mask=mask, other=0)
    per_expert = tl.sum(counts, axis=1)
    padded = (per_expert + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    expert_end = tl.cumsum(padded, axis=0)
    expert_start = expert_end - padded
    seg_start = expert_start[:, None] + tl.cumsum(counts, axis=1) - counts
    tl.store(cursor_ptr + seg, seg_start, mask=mask)
    tl.store(num_blocks_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    expert_end = tl.where(offs_e < num_experts, expert_end, 2147483647)
    for b0 in range(0, grid_m, B_CHUNK):
        offs_b = b0 + tl.arange(0, B_CHUNK)
        # The block's expert = number of experts whose padded range ends at or before the block's first row.
        expert = tl.sum((expert_end[None, :] <= offs_b[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + offs_b, tl.minimum(expert, num_experts - 1), mask=offs_b < grid_m)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(topk_ids_ptr, token_lora_ptr, cursor_ptr, row_pair_ptr, pair_row_ptr, num_pairs, top_k,
                    num_experts, NUM_SLOTS_P1: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """row_pair[cursor[segment]++] = pair, and pair_row[pair] = that row (pairs the count kernel counted)."""
    grid_dependency_sync(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < num_pairs
    expert, keep, _ = _load_experts(topk_ids_ptr, offs, in_range, num_experts)
    lora = load_slots(token_lora_ptr, offs // top_k, in_range, NUM_SLOTS_P1 - 1)
    row = tl.atomic_add(cursor_ptr + expert * NUM_SLOTS_P1 + lora + 1, 1, mask=keep)
    tl.store(row_pair_ptr + row, offs, mask=keep)
    tl.store(pair_row_ptr + offs, row, mask=keep)


def sort_pairs(topk_ids: torch.Tensor, token_lora_ids: torch.Tensor, num_experts: int, num_slots: int,
               block_m: int, chain: Optional[LaunchChain] = None,
               zero_rows: Optional[torch.Tensor] = None) -> Routing:
    """topk_ids [T, k] int, token_lora_ids [T] int (NO_ADAPTER = none) -> :class:`Routing` for ``num_slots`` adapters.

    ``chain``: the PDL launch chain these kernels start (default: none, plain launches). ``zero_rows`` ([T*k, N],
    unit column stride): the per-pair output rows; a pair whose expert lies outside ``[0, num_experts)`` (left out
    of the routing) gets its row zeroed."""
    chain = chain if chain is not None else LaunchChain(PDL_OFF)
    T, top_k = topk_ids.shape
    num_pairs = T * top_k
    grid_m = max_blocks(num_pairs, num_experts, block_m)
    num_rows = grid_m * block_m
    segments = num_experts * (num_slots + 1)
    device = topk_ids.device
    scratch = torch.zeros(2 * segments + 1, dtype=torch.int32, device=device)
    counts, cursor, num_blocks = scratch[:segments], scratch[segments:2 * segments], scratch[2 * segments:]
    row_pair = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(grid_m, dtype=torch.int32, device=device)
    pair_row = torch.empty(num_pairs, dtype=torch.int32, device=device)
    topk_flat = topk_ids.reshape(-1).contiguous()  # reshape keeps a [T, 1] column slice strided
    lora_ids = token_lora_ids.contiguous()
    _count_kernel[(triton.cdiv(max(num_pairs, num_rows), CHUNK),)](
        topk_flat, lora_ids, counts, row_pair, num_pairs, num_rows, top_k, num_experts, zero_rows,
        0 if zero_rows is None else zero_rows.stride(0), 0 if zero_rows is None else zero_rows.shape[1],
        NUM_SLOTS_P1=num_slots + 1, CHUNK=CHUNK, **chain.next())
    _offsets_kernel[(1,)](
        counts, cursor, block_expert, num_blocks, grid_m, num_experts, BLOCK_M=block_m, NUM_SLOTS_P1=num_slots + 1,
        E_BLOCK=triton.next_power_of_2(num_experts), S_BLOCK=triton.next_power_of_2(num_slots + 1), B_CHUNK=64,
        **chain.next())
    _scatter_kernel[(triton.cdiv(num_pairs, CHUNK),)](
        topk_flat, lora_ids, cursor, row_pair, pair_row, num_pairs, top_k, num_experts, NUM_SLOTS_P1=num_slots + 1,
        CHUNK=CHUNK, **chain.next())
    return Routing(row_pair, block_expert, num_blocks, grid_m, pair_row)
