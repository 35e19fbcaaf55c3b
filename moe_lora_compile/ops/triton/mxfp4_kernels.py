"""@triton.jit helpers that read MXFP4 expert weights in the checkpoint's layout and decode them in registers.

Format (:mod:`..mxfp4`): one expert's weight ``[N, K]`` (N outputs, K inputs) is ``blocks`` uint8 ``[N, K/2]``
(K contiguous, two E2M1 codes per byte, low nibble = even input) and ``scales`` uint8 ``[N, K/32]`` (E8M0, factor
``2 ** (s - 127)``). The GEMM kernels of :mod:`.moe_kernels` call :func:`mxfp4_expert_gemm` in place of their bf16
``_expert_gemm`` when their constexpr ``W_FORMAT`` is ``MXFP4``: each K step loads the ``[BLOCK_N, BLOCK_K/2]``
bytes and ``[BLOCK_N, BLOCK_K/32]`` scale bytes of the tile, decodes them to the activations' dtype
(:func:`decode_mxfp4`) and feeds ``tl.dot`` with fp32 accumulation, so HBM sees 4.25 bits per weight.

Decoding is integer arithmetic on the float's bits, no table: code ``c`` (sign ``c >> 3``, magnitude index
``m = c & 7``) times ``2 ** (s - 127)`` is, for ``m >= 1``, exponent field ``(m >> 1) + s - 1`` and top mantissa
bit ``m & 1`` when ``m >= 2`` (``m = 1`` is 0.5: mantissa 0); ``m = 0`` is a signed zero; an exponent past 254 is
inf. The fp32 pattern is exact (every E2M1 value times a power of two has at most 2 significant bits) and so is its
cast to bf16; fp16 rounds like :func:`..mxfp4.dequantize_mxfp4` does. Same bits as transformers' dequantization for
every byte and scale byte (overflow to inf included), except results below ``2**-126`` (fp32 subnormals, only
under scale bytes 0 and 1; trained weights sit near byte 120), which flush to a zero of the same sign.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..contract import MXFP4_GROUP_SIZE

BF16, MXFP4 = 0, 1  # W_FORMAT of the GEMM kernels: dense weights in x's dtype, or MXFP4 blocks + scales
GROUP = MXFP4_GROUP_SIZE  # inputs sharing one scale byte; BLOCK_K of the MXFP4 path is a multiple of it
_GROUP = tl.constexpr(GROUP)


@triton.jit
def decode_mxfp4(packed, scale, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """packed uint8 ``[BLOCK_N, BLOCK_K/2]`` + scale uint8 ``[BLOCK_N, BLOCK_K/32]`` -> W tile ``[BLOCK_K, BLOCK_N]``
    in ``dtype`` (input ``2b`` of a row from byte ``b``'s low nibble, ``2b+1`` from its high nibble)."""
    codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.int32)  # [BN, BK]
    codes = tl.reshape(codes, (BLOCK_N, BLOCK_K // _GROUP, _GROUP))
    mag = codes & 7
    exponent = (mag >> 1) + scale.to(tl.int32)[:, :, None] - 1
    mantissa = tl.where(mag >= 2, mag & 1, 0)
    bits = tl.where(exponent >= 255, 255 << 23, (exponent << 23) | (mantissa << 22))
    bits = tl.where((mag == 0) | (exponent <= 0), 0, bits) | ((codes & 8) << 28)
    w = tl.reshape(bits.to(tl.float32, bitcast=True), (BLOCK_N, BLOCK_K))
    return tl.trans(w.to(dtype))


@triton.jit
def mxfp4_expert_gemm(a_ptrs, blocks_ptr, scales_ptr, cols, stride_bn, stride_sn, k_start, k_end, n_mask,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                      EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``_expert_gemm`` of :mod:`.moe_kernels` over one expert's MXFP4 weight: sum over k in ``[k_start, k_end)``
    of a ``[BLOCK_M, BLOCK_K]`` tiles (``a_ptrs`` at k = 0, k contiguous) @ W ``[BLOCK_K, BLOCK_N]`` of the weight
    rows ``cols [BLOCK_N]`` -> ``[BLOCK_M, BLOCK_N]`` fp32. ``blocks_ptr`` / ``scales_ptr``: the expert's
    ``[N, K/2]`` bytes / ``[N, K/32]`` scales, row strides ``stride_bn`` / ``stride_sn``. ``k_start``, ``k_end``
    and BLOCK_K are multiples of 32; ``n_mask`` masks the rows when not EVEN_N."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_byte = tl.arange(0, BLOCK_K // 2)
    offs_group = tl.arange(0, BLOCK_K // _GROUP)
    rows = cols.to(tl.int64)
    b_ptrs = blocks_ptr + rows[:, None] * stride_bn + (k_start // 2 + offs_byte)[None, :]
    s_ptrs = scales_ptr + rows[:, None] * stride_sn + (k_start // _GROUP + offs_group)[None, :]
    a_ptrs += k_start
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_N:
                packed = tl.load(b_ptrs)
                scale = tl.load(s_ptrs)
            else:
                packed = tl.load(b_ptrs, mask=n_mask[:, None], other=0)
                scale = tl.load(s_ptrs, mask=n_mask[:, None], other=0)
        else:  # code 0 (a zero whatever the scale) past k_end
            a = tl.load(a_ptrs, mask=((k0 + offs_k) < k_end)[None, :], other=0.0)
            packed = tl.load(b_ptrs, mask=n_mask[:, None] & ((k0 + 2 * offs_byte) < k_end)[None, :], other=0)
            scale = tl.load(s_ptrs, mask=n_mask[:, None] & ((k0 + offs_group * _GROUP) < k_end)[None, :], other=0)
        w = decode_mxfp4(packed, scale, a.dtype, BLOCK_N, BLOCK_K)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // _GROUP
    return acc
