"""Host launcher of :func:`.attention_kernels.decode_attention_kernel`: tile sizes, the cache split and the arrival
counters.

The grid is ``(B * Hkv) x splits``, the splits chosen so that there are about two programs per SM
(:func:`plan`): GPT-OSS-20B at batch 1 (8 KV heads, 640 slots) gets 8 x 20 programs of 32 slots, at batch 64 one
split of 640 slots per ``(b, g)``. Blocks of 64 slots where that still gives enough programs, else 32. One launch,
no memset: the counters live in one int32 buffer per device, zeroed once and reset by the kernel itself (launches on
one stream are ordered; two of these kernels running at the same time on two streams of one device would share the
counters, which this module does not support).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
from torch import Tensor

from .counters import ArrivalCounters
from .attention_kernels import decode_attention_kernel

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_QUERY_ROWS = 128  # n_rep * S rows of one program (decode / verify steps); more: the reference (prefill)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64

_counters = ArrivalCounters(minimum=1024)


def kernel_covers(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], sinks: Optional[Tensor]) -> bool:
    """Whether :func:`decode_attention_triton` takes these inputs; the op runs the reference otherwise."""
    B, H, S, D = query.shape
    return (query.dtype in SUPPORTED_DTYPES and key.dtype == value.dtype == query.dtype
            and value.shape[-1] == D and D <= MAX_HEAD_DIM and (H // key.shape[1]) * S <= MAX_QUERY_ROWS
            and (mask is None or mask.dtype in SUPPORTED_DTYPES))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so tests cover the combine
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(num_bg: int, L: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_splits, chunk_len) for ``num_bg = B * Hkv`` programs' worth of rows over ``L`` slots: about
    two programs per SM, at most :data:`MAX_SPLITS` splits, each a whole number of blocks."""
    target = 2 * _num_sms(device)
    block_n = 64 if num_bg * triton.cdiv(L, 64) >= target else 32
    n_blocks = triton.cdiv(L, block_n)
    splits = max(1, min(MAX_SPLITS, n_blocks, triton.cdiv(target, num_bg)))
    chunk = triton.cdiv(n_blocks, splits) * block_n
    return block_n, triton.cdiv(L, chunk), chunk


def num_warps(block_d: int, block_n: int) -> int:
    """8 warps from 64 x 64 K/V tiles on (at 4 their per-element pointers spill registers on sm_90 at D = 128)."""
    return 8 if block_d * block_n >= 64 * 64 else 4


def counters_clear(device: torch.device) -> bool:
    """Whether every arrival counter of ``device`` is back at zero (tests)."""
    return _counters.all_clear(device)


def decode_attention_triton(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], scaling: float,
                            sinks: Optional[Tensor], *, block_n: Optional[int] = None,
                            num_splits: Optional[int] = None) -> Tensor:
    """query [B, H, S, D], key / value [B, Hkv, L, D] (one dtype), additive mask [B or 1, 1, S, >= L] (its first L
    columns; entries <= half the dtype's most negative value count as masked) or None, sinks [H] or None ->
    out [B, S, H, D] in query's dtype (fresh, contiguous). ``block_n`` / ``num_splits``: override :func:`plan`
    (tests)."""
    B, H, S, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    n_rep = H // Hkv
    device = query.device
    out = torch.empty((B, S, H, D), dtype=query.dtype, device=device)
    if out.numel() == 0:
        return out
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    if mask is not None:
        mask = mask[..., :L].expand(B, 1, S, L)
        masked_below = torch.finfo(mask.dtype).min / 2
    else:
        masked_below = 0.0
    mask_strides = (mask.stride(0), mask.stride(2), mask.stride(3)) if mask is not None else (0, 0, 0)
    sinks = None if sinks is None else sinks.contiguous()
    block_m = max(16, triton.next_power_of_2(n_rep * S))
    block_d = max(16, triton.next_power_of_2(D))
    if block_n is None and num_splits is None:
        block_n, splits, chunk = plan(B * Hkv, L, device)
    else:
        block_n = block_n or 32
        n_blocks = triton.cdiv(L, block_n)
        chunk = triton.cdiv(n_blocks, min(num_splits or 1, n_blocks)) * block_n
        splits = triton.cdiv(L, chunk)
    part_acc = torch.empty((B * Hkv, splits, block_m, block_d), dtype=torch.float32, device=device)
    part_ml = torch.empty((B * Hkv, splits, 2, block_m), dtype=torch.float32, device=device)
    decode_attention_kernel[(B * Hkv, splits)](
        query, key, value, mask, sinks, out, part_acc, part_ml, _counters.get(device, B * Hkv),
        query.stride(0), query.stride(1), query.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        *mask_strides,
        out.stride(0), out.stride(1), out.stride(2),
        Hkv, L, splits, chunk, scaling * 1.4426950408889634, masked_below,
        D=D, S=S, N_REP=n_rep, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)), HAS_MASK=mask is not None, HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", num_warps=num_warps(block_d, block_n),
        num_stages=2,
    )
    return out
