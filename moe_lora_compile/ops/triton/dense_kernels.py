"""@triton.jit kernels of ``lora_linear`` for decode-sized batches (the block kernels are in :mod:`.moe_kernels`).

At decode a block of 16 tokens can hold as many adapter slots as tokens, and the block shrink then walks every slot
of the block serially on a handful of programs (measured on the H200: ~37 us a launch for 8 tokens of 8 adapters at
rank 32, against a few us of bytes). Here every token gets its own programs instead: grid ``(T, SPLIT_K)``, one
token's rank vector over one K slice each, no ``tl.dot`` (``[BLOCK_R, BLOCK_K]`` products summed over K), so the
slot is a scalar per program, tokens without an adapter (``-1``) exit at once, and tokens of one adapter re-read its
A from L2 (HBM reads each used slot's A once).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .moe_kernels import grid_dependency_sync, launch_dependents


@triton.jit(do_not_specialize=["T"])
def lora_shrink_rows_kernel(
    x_ptr, stride_x, a_ptr, stride_al, stride_ar, s_ptr, split_stride, token_lora_ptr, T, K, R, k_per_split,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr = 0,
):
    """s[split, t, :R] = x[t, K slice] @ A[l, :, K slice]^T in fp32, ``l = token_lora[t]``, for tokens with an
    adapter; rows of ``-1`` tokens are not written (the consumer never reads them). Grid (T, SPLIT_K).

    x [T, K] (row stride ``stride_x``, K contiguous); A [L, R, K] (K contiguous); s [SPLIT_K, >= T, R] fp32 with
    ``split_stride`` elements between slices: the layout :func:`.moe_kernels.moe_w2_kernel` reads in DENSE mode."""
    grid_dependency_sync(USE_PDL)
    t = tl.program_id(0)
    pid_k = tl.program_id(1)
    lora = tl.load(token_lora_ptr + t).to(tl.int64)
    if lora < 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < R
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + t.to(tl.int64) * stride_x + offs_k
    a_ptrs = a_ptr + lora * stride_al + offs_r[:, None] * stride_ar + offs_k[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0)
            a = tl.load(a_ptrs + k0, mask=r_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < k_end
            x = tl.load(x_ptrs + k0, mask=k_mask, other=0.0)
            a = tl.load(a_ptrs + k0, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc += a.to(tl.float32) * x.to(tl.float32)[None, :]
    launch_dependents(USE_PDL)
    s = tl.sum(acc, axis=1)
    tl.store(s_ptr + pid_k.to(tl.int64) * split_stride + t.to(tl.int64) * R + offs_r, s, mask=r_mask)
