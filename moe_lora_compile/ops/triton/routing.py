"""Device-side routing: group the P = T*k (token, slot) pairs per (expert, adapter) into BLOCK_M-padded segments.

No host sync: every buffer has its worst-case size, known from shapes alone, and the number of used blocks stays on
the device (``num_blocks [1]``). Pairs of one expert are padded together (one expert per block); inside an expert
they are ordered by adapter slot so a block sees few distinct adapters. Order inside one (expert, adapter) segment
is arbitrary (atomics); each row's result does not depend on its neighbours.

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


@triton.jit(do_not_specialize=["num_pairs", "num_rows"])
def _count_kernel(topk_ids_ptr, token_lora_ptr, counts_ptr, row_pair_ptr, num_pairs, num_rows, top_k,
                  NUM_SLOTS_P1: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """counts[e*(L+1) + l+1] += 1 per pair (segment l+1 = 0: NO_ADAPTER = -1); also fills row_pair with NO_PAIR
    (padding)."""
    grid_dependency_sync(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    tl.store(row_pair_ptr + offs, tl.full([CHUNK], _NO_PAIR, tl.int32), mask=offs < num_rows)
    in_range = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
    lora = load_slots(token_lora_ptr, offs // top_k, in_range, NUM_SLOTS_P1 - 1)
    tl.atomic_add(counts_ptr + expert * NUM_SLOTS_P1 + lora + 1, 1, mask=in_range)


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
                    NUM_SLOTS_P1: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    """row_pair[cursor[segment]++] = pair, and pair_row[pair] = that row."""
    grid_dependency_sync(USE_PDL)
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=0).to(tl.int32)
    lora = load_slots(token_lora_ptr, offs // top_k, in_range, NUM_SLOTS_P1 - 1)
    row = tl.atomic_add(cursor_ptr + expert * NUM_SLOTS_P1 + lora + 1, 1, mask=in_range)
    tl.store(row_pair_ptr + row, offs, mask=in_range)
    tl.store(pair_row_ptr + offs, row, mask=in_range)


def sort_pairs(topk_ids: torch.Tensor, token_lora_ids: torch.Tensor, num_experts: int, num_slots: int,
               block_m: int, chain: Optional[LaunchChain] = None) -> Routing:
    """topk_ids [T, k] int, token_lora_ids [T] int (NO_ADAPTER = none) -> :class:`Routing` for ``num_slots`` adapters.

    ``chain``: the PDL launch chain these kernels start (default: none, plain launches)."""
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
        topk_flat, lora_ids, counts, row_pair, num_pairs, num_rows, top_k, NUM_SLOTS_P1=num_slots + 1, CHUNK=CHUNK,
        **chain.next())
    _offsets_kernel[(1,)](
        counts, cursor, block_expert, num_blocks, grid_m, num_experts, BLOCK_M=block_m, NUM_SLOTS_P1=num_slots + 1,
        E_BLOCK=triton.next_power_of_2(num_experts), S_BLOCK=triton.next_power_of_2(num_slots + 1), B_CHUNK=64,
        **chain.next())
    _scatter_kernel[(triton.cdiv(num_pairs, CHUNK),)](
        topk_flat, lora_ids, cursor, row_pair, pair_row, num_pairs, top_k, NUM_SLOTS_P1=num_slots + 1, CHUNK=CHUNK,
        **chain.next())
    return Routing(row_pair, block_expert, num_blocks, grid_m, pair_row)
