"""MXFP4 expert weights in the layout GPT-OSS ships and transformers loads, in plain PyTorch.

Format (OCP MX, as in the ``openai/gpt-oss-*`` checkpoints). Per MoE layer and projection the checkpoint holds
``mlp.experts.{gate_up_proj,down_proj}_blocks`` and ``..._scales``:

- ``blocks`` uint8 ``[E, N, K/32, 16]``: row ``n`` (an output feature) of expert ``e``, its K inputs in groups of 32;
  each byte packs two 4-bit E2M1 codes, the **low nibble first** (input ``2b``), the high nibble second (``2b+1``).
- ``scales`` uint8 ``[E, N, K/32]``: one E8M0 exponent per group of 32, bias 127: the group's factor is
  ``2 ** (scale - 127)``.
- E2M1 code ``c``: sign ``c >> 3``, magnitude ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)[c & 7]`` (:data:`FP4_E2M1_VALUES`).
- gate_up: ``N = 2I`` rows **interleaved** (row ``2j`` gate ``j``, row ``2j+1`` up ``j``), ``K = H``; down: ``N = H``,
  ``K = I``. GPT-OSS-20B: E=32, H=I=2880 (90 groups), so ``gate_up_proj_blocks [32, 5760, 90, 16]``,
  ``down_proj_blocks [32, 2880, 90, 16]``; biases ``gate_up_proj_bias [E, 2I]``, ``down_proj_bias [E, H]`` are bf16.

Dequantized, a weight is ``[E, N, K]`` row-major, which transformers transposes to its ``GptOssExperts`` layout
``[E, K, N]`` (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``: our ``transposed_interleaved`` layout, see
:mod:`.contract`); :func:`dequantize_mxfp4` returns that, bit-exact against transformers'
``integrations.mxfp4.convert_moe_packed_tensors`` (same on transformers 5.17 and 5.24): values in ``dtype``, times
``2 ** (scale - 127)`` by ``torch.ldexp`` (in fp32, or fp64 for float64), rounded once to ``dtype``, overflow to
inf included. Scale bytes 1..252 give values exact in bf16 and fp32 (a code has at most 2 significant bits); fp16
holds only a narrow band of them. :func:`quantize_mxfp4` emits scale bytes 1..252 only, and trained weights of
magnitude ~1e-2 need bytes near 120, so a kernel may assume that range (fp32 scale from the byte's bits).

How transformers builds MXFP4 GPT-OSS (read in 5.17 and 5.24):

- ``GptOssForCausalLM(config)`` ignores ``config.quantization_config``; only ``from_pretrained`` applies the
  ``Mxfp4HfQuantizer``. Quantized, each ``mlp`` becomes ``Mxfp4GptOssMLP(router, Mxfp4GptOssExperts)`` (5.24; 5.17
  patches ``GptOssMLP.forward``): ``gate_up_proj`` uint8 ``[E, 2I, H/2]`` (5.24) or ``[E, 2I, H/32, 16]`` (5.17),
  ``down_proj`` uint8 ``[E, H, I/2]`` / ``[E, H, I/32, 16]``, fp32 biases; at load the blocks/scales are swizzled
  into ``triton_kernels`` tensors (scales in a ``PrecisionConfig``) and the forward is ``triton_kernels``'
  ``matmul_ogs`` with a fused swiglu. Both come from the hub (``kernels`` package,
  ``kernels-community/gpt-oss-triton-kernels``): nothing here or on the GPU machine can fetch them.
- Without the ``kernels`` package (or on CPU without ``use_kernels=True``) the quantizer sets ``dequantize=True`` and
  loads the blocks/scales dequantized into plain ``GptOssExperts`` parameters (bf16 on 5.17 whatever dtype is asked;
  the parameter's dtype on 5.24): a dense model. Quantizing a bf16 checkpoint on the fly needs the hub kernels.
  The dequantized values are exact in bf16, so :func:`quantize_mxfp4` of them gives the same values back (for scale
  bytes 4..252; codes and scales differ where a group's largest value is below 4x its scale): loading
  with transformers and then quantizing (``quantize_gpt_oss_experts_``) recovers the checkpoint's experts.

For a Triton kernel the checkpoint layout needs no re-layout: one expert's ``blocks`` viewed as ``[N, K/2]`` (K
contiguous) and ``scales [N, K/32]`` are what ``tl.dot_scaled(x_bf16, None, "bf16", tl.trans(blocks_tile),
scales_tile, "e2m1")`` reads (probed in ``tests/ops/test_mxfp4.py``, interpreter and GPU). The op over such
weights is ``torch.ops.moe_lora.fused_moe_lora_mxfp4`` (:mod:`.fused_moe_lora_mxfp4`); its kernels decode in
registers (:mod:`.triton.mxfp4_kernels`).

So a GPT-OSS model that keeps MXFP4 experts without the hub is built by us:
:func:`moe_lora_compile.models.mxfp4_gpt_oss.build_mxfp4_gpt_oss` (experts as ``GptOssMxfp4Experts``, the
checkpoint's own tensor names, forward = dequantize + the reference below).

:func:`quantize_mxfp4` makes such weights from float ones (round to nearest even, smallest power-of-two scale with
no clipping): for tests and benchmarks, not a calibrated quantizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .contract import GPTOSS_ALPHA, GPTOSS_LIMIT, MXFP4_GROUP_SIZE, check_fused_moe_lora_args
from .layout import TRANSPOSED_INTERLEAVED, is_transposed
from .reference import fused_moe_lora_reference

# E2M1 code -> value (code 8 is -0.0). One home for the table.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP4_MAX = 6.0
GROUP_SIZE = MXFP4_GROUP_SIZE  # values sharing one scale
BYTES_PER_GROUP = GROUP_SIZE // 2  # two codes per byte
SCALE_BIAS = 127  # E8M0: factor 2 ** (scale - 127)
_MAX_SCALE = 252  # largest scale byte quantize_mxfp4 emits: 6 * 2**125 is still finite in fp32
# Rounding boundaries between consecutive E2M1 magnitudes, and whether a tie there goes up (to the even code).
_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)


def check_mxfp4(name: str, blocks: Tensor, scales: Tensor) -> None:
    """ValueError/TypeError unless ``blocks`` is uint8 ``[E, N, G, 16]`` and ``scales`` uint8 ``[E, N, G]``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"{name}: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != BYTES_PER_GROUP:
        raise ValueError(f"{name}: blocks must be [E, N, K/32, 16], got {list(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{name}: scales must be [E, N, K/32] = {list(blocks.shape[:-1])} like the blocks, "
                         f"got {list(scales.shape)}")
    if min(blocks.shape) == 0:
        raise ValueError(f"{name}: empty MXFP4 weight {list(blocks.shape)}")
    if blocks.device != scales.device:
        raise ValueError(f"{name}: blocks on {blocks.device} but scales on {scales.device}")


@dataclass(frozen=True, eq=False)
class Mxfp4Weight:
    """One projection of all experts in MXFP4: ``blocks`` uint8 ``[E, N, K/32, 16]``, ``scales`` uint8
    ``[E, N, K/32]`` (N outputs, K inputs). Dequantized it is ``[E, K, N]`` (:attr:`shape`), transformers'
    ``GptOssExperts`` layout."""

    blocks: Tensor
    scales: Tensor

    def __post_init__(self):
        check_mxfp4("Mxfp4Weight", self.blocks, self.scales)

    @property
    def num_experts(self) -> int:
        return self.blocks.shape[0]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[1]

    @property
    def in_features(self) -> int:
        return self.blocks.shape[2] * GROUP_SIZE

    @property
    def shape(self) -> torch.Size:
        """Logical (dequantized) shape ``[E, K, N]``."""
        return torch.Size((self.num_experts, self.in_features, self.out_features))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def expert_nbytes(self) -> int:
        """HBM bytes of one expert's blocks + scales."""
        return mxfp4_nbytes(self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype)

    def to(self, device) -> "Mxfp4Weight":
        return Mxfp4Weight(self.blocks.to(device), self.scales.to(device))


def mxfp4_nbytes(out_features: int, in_features: int) -> int:
    """HBM bytes of one ``[out, in]`` MXFP4 matrix: half a byte per value plus one scale byte per 32 values."""
    if in_features % GROUP_SIZE:
        raise ValueError(f"in_features ({in_features}) must be a multiple of {GROUP_SIZE}")
    return out_features * in_features // 2 + out_features * in_features // GROUP_SIZE


def gpt_oss_mxfp4_expert_nbytes(hidden: int, intermediate: int, bias_itemsize: int = 2) -> int:
    """HBM bytes one GPT-OSS expert reads per forward when MXFP4 (for floors): gate_up ``[2I, H]`` and down
    ``[H, I]`` blocks + scales, plus the biases (``2I + H`` values of ``bias_itemsize`` bytes; bf16 in the
    checkpoint). GPT-OSS-20B (H = I = 2880): 13.24 MB, against 49.78 MB in bf16 (3.76x)."""
    return (mxfp4_nbytes(2 * intermediate, hidden) + mxfp4_nbytes(hidden, intermediate)
            + (2 * intermediate + hidden) * bias_itemsize)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """blocks uint8 ``[E, N, K/32, 16]``, scales uint8 ``[E, N, K/32]`` -> ``[E, K, N]`` in ``dtype``
    (contiguous), bit-exact against transformers' ``convert_moe_packed_tensors``."""
    check_mxfp4("dequantize_mxfp4", blocks, scales)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point) or dtype.itemsize < 2:
        raise TypeError(f"dequantize_mxfp4: dtype must be a floating dtype of >= 16 bits (bfloat16, float16, "
                        f"float32, float64), got {dtype}")
    E, N, G, _ = blocks.shape
    table = torch.tensor(FP4_E2M1_VALUES, dtype=dtype, device=blocks.device)
    low = table[(blocks & 0x0F).long()]
    high = table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).reshape(E, N, G, GROUP_SIZE)  # input 2b: low nibble, 2b+1: high
    exponent = scales.to(torch.int32).unsqueeze(-1) - SCALE_BIAS
    rows = torch.ldexp(values, exponent).to(dtype)  # the product in fp32 (or wider), one rounding to dtype
    return rows.reshape(E, N, G * GROUP_SIZE).transpose(1, 2).contiguous()


def _power_of_two(exponent: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.ldexp(torch.ones(exponent.shape, dtype=dtype, device=exponent.device), exponent)


def quantize_mxfp4(w: Tensor) -> Mxfp4Weight:
    """Float ``w [E, K, N]`` (transformers' GptOssExperts layout: ``gate_up_proj [E, H, 2I]``, ``down_proj
    [E, I, H]``) -> :class:`Mxfp4Weight` (blocks ``[E, N, K/32, 16]``). For tests and benchmarks.

    Per group of 32 inputs: the scale is the smallest power of two ``s`` with ``amax <= 6 s`` (no value clips; the
    rounding ``triton_kernels``' downcast uses), at least ``2**-126`` (scale byte 1; an all-zero group gets it), at
    most ``2**125`` (byte 252: larger codes would dequantize past fp32's range, ValueError); each value
    rounds to the nearest E2M1 multiple of ``s``, ties to the even code, sign kept (``-0`` for small negatives).
    Error bound: ``|w - dequant| <= s / 4`` below ``2 s``, ``<= s / 2`` below ``4 s``, ``<= s`` above.
    """
    if w.dim() != 3 or not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4: w must be a floating [E, K, N] tensor, got {w.dtype} {list(w.shape)}")
    E, K, N = w.shape
    if K % GROUP_SIZE or min(E, K, N) == 0:
        raise ValueError(f"quantize_mxfp4: K ({K}) must be a positive multiple of {GROUP_SIZE} (E={E}, N={N})")
    if not torch.isfinite(w).all():
        raise ValueError("quantize_mxfp4: w has non-finite values")
    acc = torch.promote_types(w.dtype, torch.float32)
    groups = w.to(acc).transpose(1, 2).reshape(E, N, K // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1)
    if (amax > FP4_MAX * 2.0 ** (_MAX_SCALE - SCALE_BIAS)).any():
        raise ValueError("quantize_mxfp4: |w| above 6 * 2**125 would dequantize past fp32's range")
    # ceil(log2(amax / 6)) from frexp, then corrected with exact comparisons (amax / 6 is rounded).
    _, exponent = torch.frexp(amax / FP4_MAX)
    exponent = exponent.to(torch.int32)
    exponent = torch.where(amax <= FP4_MAX * _power_of_two(exponent - 1, acc), exponent - 1, exponent)
    exponent = torch.where(amax > FP4_MAX * _power_of_two(exponent, acc), exponent + 1, exponent)
    # amax / 6 == 0: a zero group, or one of fp32's two smallest subnormals (amax / 6 underflows): the smallest scale
    exponent = torch.where(amax / FP4_MAX == 0, 1 - SCALE_BIAS, exponent).clamp(1 - SCALE_BIAS, _MAX_SCALE - SCALE_BIAS)
    scaled = groups / _power_of_two(exponent, acc).unsqueeze(-1)
    magnitude = scaled.abs()
    code = torch.zeros(magnitude.shape, dtype=torch.uint8, device=w.device)
    for boundary, tie_up in zip(_BOUNDARIES, _TIE_UP):
        code += (magnitude >= boundary if tie_up else magnitude > boundary).to(torch.uint8)
    code |= torch.signbit(scaled).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exponent + SCALE_BIAS).to(torch.uint8)
    return Mxfp4Weight(blocks.contiguous(), scales.contiguous())


def fused_moe_lora_mxfp4_reference(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13: Mxfp4Weight,
    w2: Mxfp4Weight,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    *,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    layout: str = TRANSPOSED_INTERLEAVED,
    activation: str = "gptoss_swiglu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
    lora_ranks: Optional[Tensor] = None,
) -> Tensor:
    """:func:`..reference.fused_moe_lora_reference` over MXFP4 experts: w13 (``[E, H, 2I]`` dequantized) and w2
    (``[E, I, H]``) dequantized to ``x.dtype`` (what a kernel feeding ``tl.dot`` with x's dtype computes), then the
    reference. ``layout``: a transposed one (the MXFP4 weights dequantize to ``[E, in, out]``). y [T, H] x.dtype."""
    if not is_transposed(layout):
        raise ValueError(f"layout must be a transposed layout for MXFP4 experts (they dequantize to [E, in, out]), "
                         f"got {layout!r}")
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, Mxfp4Weight):
            raise TypeError(f"{name} must be an Mxfp4Weight, got {type(w).__name__}")
    w13_dq, w2_dq = w13.dequantize(x.dtype), w2.dequantize(x.dtype)
    if not torch.compiler.is_compiling():  # traced (a model attached with use_ops=False), the checks' message
        # closures would break the graph at every MoE layer; the shapes are the traced graph's own
        check_fused_moe_lora_args(x, topk_ids, topk_weights, token_lora_ids, w13_dq, w2_dq, lora_a13, lora_b13,
                                  lora_a2, lora_b2, w13_bias, w2_bias, layout, activation)
    return fused_moe_lora_reference(
        x, topk_ids, topk_weights, token_lora_ids, w13_dq, w2_dq, lora_a13, lora_b13, lora_a2, lora_b2,
        w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha, limit=limit,
        routing_weight_on_input=routing_weight_on_input, lora_ranks=lora_ranks,
    )
