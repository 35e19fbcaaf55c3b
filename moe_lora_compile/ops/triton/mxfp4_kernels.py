"""@triton.jit helpers that read MXFP4 expert weights in the checkpoint's layout and decode them in registers.

Format (:mod:`..mxfp4`): one expert's weight ``[N, K]`` (N outputs, K inputs) is ``blocks`` uint8 ``[N, K/2]``
(K contiguous, two E2M1 codes per byte, low nibble = even input) and ``scales`` uint8 ``[N, K/32]`` (E8M0, factor
``2 ** (s - 127)``). The GEMM kernels of :mod:`.moe_kernels` call :func:`mxfp4_expert_gemm` in place of their bf16
``_expert_gemm`` when their constexpr ``W_FORMAT`` is ``MXFP4``: each K step loads the ``[BLOCK_N, BLOCK_K/2]``
bytes and ``[BLOCK_N, BLOCK_K/32]`` scale bytes of the tile, decodes them to the activations' dtype
(:func:`decode_mxfp4`) and feeds ``tl.dot`` with fp32 accumulation, so HBM sees 4.25 bits per weight.

Decoding (:func:`decode_mxfp4`): the two nibbles of a byte decode apart (no byte shuffles) and join as adjacent
inputs after the cast; each value is its E2M1 bits placed in an fp32 (value times ``2**-126``) times two exact
powers of two, so the result is ``ldexp`` (IEEE overflow to inf and subnormals included) rounded once to the
activations' dtype: the same bits as transformers' dequantization for every byte and scale byte. The scale bytes
(too narrow a row for the async-copy pipeline) are loaded one K step ahead; the byte tiles' K mask is constant
over each 16-byte group so their loads stay vectorized async copies (2026-12: SASS of the w13 K step at T=1 went
from 4626 instructions to 1117, w2's from 2282 to 614 with its byte loads pipelined; see the branch report).

bfloat16 activations (the GPU path) decode in packed bf16x2 PTX instead (:func:`_decode_mxfp4_bf16`: byte lookups
with ``prmt``, one ``fma.rn.bf16x2`` per two values for the scale, same bits): sm_90 SASS of the K step with the
GPT-OSS T=1 tiles (w13 2x128 rows x 64 inputs, w2 64 x 128, 4 warps) went from 1071 to 648 instructions (w13,
~5 per value, no spills, 200 registers) and 595 to 362 (w2), the decoded tile feeding the MMA without a layout
conversion. Byte loads are 8-byte async copies: with a 16-byte hint Triton loads the bytes in a layout it then
converts, after the decode, through shared memory (745 instructions).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..contract import MXFP4_GROUP_SIZE

BF16, MXFP4 = 0, 1  # W_FORMAT of the GEMM kernels: dense weights in x's dtype, or MXFP4 blocks + scales
GROUP = MXFP4_GROUP_SIZE  # inputs sharing one scale byte; BLOCK_K of the MXFP4 path is a multiple of it
_GROUP = tl.constexpr(GROUP)


@triton.jit
def _scale_factor(scale):
    """E8M0 bytes (any int tensor) -> fp32 ``2 ** (s - 128)``, exact: normal for s >= 2, subnormal for s = 0, 1."""
    s = scale.to(tl.int32)
    return tl.where(s >= 2, (s - 1) << 23, 0x200000 << s).to(tl.float32, bitcast=True)


# bf16 decode (:func:`_decode_mxfp4_bf16`), per 32-bit register of 4 bytes (8 nibbles, nibble j = bits 4j..4j+3):
# two byte lookups (``prmt``) give the high and low byte of bf16(2 * |value|) per nibble (pools below: byte i of a pool
# = that byte of bf16(2 * E2M1 magnitude i), i.e. of 0, 1, 2, 3, 4, 6, 8, 12); a third lookup on the nibbles' sign
# bits (selector ``r >> 3``: the sign lands on the index parity, pool bytes 0x00/0x80 alternate, so even the
# sign-replicate mode of a selector nibble with bit 3 set keeps the sign in the byte's msb) ORs the sign into the
# high bytes; two byte permutes interleave low/high bytes into one bf16x2 per input byte (low nibble in the low
# half: the pair of adjacent inputs the MMA operand register holds); one ``fma.rn.bf16x2`` by the group's
# ``2**(s - 128)`` (with -0.0 added: the product unchanged) rounds ``value * 2**(s - 127)`` once, subnormals and
# overflow to inf included. 20 instructions for 8 values.
_DECODE_BF16_ASM = tl.constexpr("""{
.reg .b32 m, mh, g, gh, h0, h1, l0, l1, z;
mov.b32 z, 0x80008000;
and.b32 m, $4, 0x77777777;
shr.u32 mh, m, 16;
prmt.b32 h0, 0x40403F00, 0x41414040, m;
prmt.b32 h1, 0x40403F00, 0x41414040, mh;
prmt.b32 l0, 0x40008000, 0x4000C080, m;
prmt.b32 l1, 0x40008000, 0x4000C080, mh;
shr.u32 g, $4, 3;
shr.u32 gh, $4, 19;
prmt.b32 g, z, z, g;
prmt.b32 gh, z, z, gh;
lop3.b32 h0, h0, g, 0x80808080, 0xF8;
lop3.b32 h1, h1, gh, 0x80808080, 0xF8;
prmt.b32 $0, l0, h0, 0x5140;
prmt.b32 $1, l0, h0, 0x7362;
prmt.b32 $2, l1, h1, 0x5140;
prmt.b32 $3, l1, h1, 0x7362;
fma.rn.bf16x2 $0, $0, $5, z;
fma.rn.bf16x2 $1, $1, $5, z;
fma.rn.bf16x2 $2, $2, $5, z;
fma.rn.bf16x2 $3, $3, $5, z;
}""")


@triton.jit
def _decode_mxfp4_bf16(packed, scale, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """:func:`decode_mxfp4` to bfloat16 in packed bf16x2 arithmetic (PTX, see ``_DECODE_BF16_ASM``): each byte
    becomes one 32-bit (low nibble, high nibble) pair, the register the MMA's K-pair operand wants."""
    s = scale.to(tl.int32)
    factor = tl.where(s >= 2, (s - 1) << 7, 0x20 << s).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 2**(s - 128)
    factor = tl.reshape(tl.broadcast_to(factor[:, :, None], (BLOCK_N, BLOCK_K // _GROUP, _GROUP // 2)),
                        (BLOCK_N, BLOCK_K // 2))
    pairs = tl.inline_asm_elementwise(_DECODE_BF16_ASM, "=r,=r,=r,=r,r,r,r", [packed, factor], dtype=tl.int32,
                                      is_pure=True, pack=4)  # [BN, BK/2]: bf16(low nibble) | bf16(high nibble) << 16
    lo = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.trans(tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)))


@triton.jit
def decode_mxfp4(packed, scale, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """packed uint8 ``[BLOCK_N, BLOCK_K/2]`` + scale uint8 ``[BLOCK_N, BLOCK_K/32]`` -> W tile ``[BLOCK_K, BLOCK_N]``
    in ``dtype`` (input ``2b`` of a row from byte ``b``'s low nibble, ``2b+1`` from its high nibble).

    Per value: the nibble's 3 magnitude bits go to fp32 bits 22-24 and its sign to bit 31, which is the E2M1 value
    times ``2**-126`` (a subnormal for codes 0, 1); two exact multiplies (``2**127``, then the group's
    ``2**(s - 128)``, see :func:`_scale_factor`) give ``value * 2**(s - 127)`` with IEEE overflow/underflow, i.e.
    ``ldexp``; the cast to ``dtype`` rounds to nearest. The two nibbles of a byte decode apart (no byte shuffles)
    and are joined as adjacent inputs only after the cast. bfloat16: :func:`_decode_mxfp4_bf16` (same bits, PTX;
    not in Triton's interpreter)."""
    if dtype == tl.bfloat16:
        return _decode_mxfp4_bf16(packed, scale, BLOCK_N, BLOCK_K)
    p = tl.reshape(packed.to(tl.int32), (BLOCK_N, BLOCK_K // _GROUP, _GROUP // 2))  # [BN, groups, 16 bytes]
    factor = _scale_factor(scale)[:, :, None]
    lo = (((p & 7) << 22) | ((p & 8) << 28)).to(tl.float32, bitcast=True) * 1.7014118346046923e38  # 2**127
    hi = (((p & 0x70) << 18) | ((p & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.7014118346046923e38
    lo = tl.reshape((lo * factor).to(dtype), (BLOCK_N, BLOCK_K // 2))
    hi = tl.reshape((hi * factor).to(dtype), (BLOCK_N, BLOCK_K // 2))
    return tl.trans(tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K)))


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
    byte_group_k = (offs_byte // (_GROUP // 2)) * _GROUP  # first input of each byte's group: a K mask constant
    rows = cols.to(tl.int64)                             # over 16 bytes, so the byte loads stay vector loads
    b_ptrs = blocks_ptr + rows[:, None] * stride_bn + (k_start // 2 + offs_byte)[None, :]
    s_ptrs = scales_ptr + rows[:, None] * stride_sn + (k_start // _GROUP + offs_group)[None, :]
    a_ptrs += k_start
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The scales (BLOCK_K/32 bytes a row, too narrow for the async-copy pipeline) are loaded one K step ahead.
    if EVEN_K and EVEN_N:
        scale = tl.load(s_ptrs)
    else:
        scale = tl.load(s_ptrs, mask=n_mask[:, None] & ((k_start + offs_group * _GROUP) < k_end)[None, :], other=0)
    for k0 in range(k_start, k_end, BLOCK_K):
        s_ptrs += BLOCK_K // _GROUP
        k_next = k0 + BLOCK_K
        if EVEN_K:
            a = tl.load(a_ptrs)
            if EVEN_N:
                packed = tl.load(b_ptrs)
            else:
                packed = tl.load(b_ptrs, mask=n_mask[:, None], other=0)
        else:  # code 0 (a zero whatever the scale) past k_end
            a = tl.load(a_ptrs, mask=((k0 + offs_k) < k_end)[None, :], other=0.0)
            packed = tl.load(b_ptrs, mask=n_mask[:, None] & ((k0 + byte_group_k) < k_end)[None, :], other=0)
        next_mask = n_mask[:, None] & ((k_next + offs_group * _GROUP) < k_end)[None, :]
        next_scale = tl.load(s_ptrs, mask=next_mask, other=0)
        w = decode_mxfp4(packed, scale, a.dtype, BLOCK_N, BLOCK_K)
        acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        scale = next_scale
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K // 2
    return acc
