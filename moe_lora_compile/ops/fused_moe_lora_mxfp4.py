"""``torch.ops.moe_lora.fused_moe_lora_mxfp4``: :mod:`.fused_moe_lora` over MXFP4 experts (GPT-OSS's checkpoint).

Same layer, same LoRA and routing arguments, but the base experts come as the checkpoint's blocks and scales
(format: :mod:`.mxfp4`): ``w13_blocks`` uint8 ``[E, 2I, H/32, 16]`` + ``w13_scales`` uint8 ``[E, 2I, H/32]``
(gate_up rows in the layout's gate/up order: interleaved for GPT-OSS), ``w2_blocks [E, H, I/32, 16]`` +
``w2_scales [E, H, I/32]``; ``layout`` must be a transposed one (the weights dequantize to ``[E, in, out]``).

CPU: dequantize to ``x.dtype``, then the reference (:func:`.mxfp4.fused_moe_lora_mxfp4_reference`). CUDA: the
Triton kernels decode the 4-bit values and E8M0 scales in their GEMMs' load path (fp32 accumulation, no dense copy
of the experts; :mod:`.triton.mxfp4_kernels`), or the reference where the kernels do not cover the dtypes (as
:mod:`.cuda_impl` decides for the dense op). Gradients flow to ``x``, ``topk_weights`` and the LoRA stacks through
``moe_lora::fused_moe_lora_mxfp4_backward`` (the reference recomputed under autograd). Contract:
:func:`.contract.check_fused_moe_lora_mxfp4_args`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import cuda_impl
from .autograd import recompute_grads_by_slot, save_for_backward
from .contract import (GPTOSS_ALPHA, GPTOSS_LIMIT, NO_ADAPTER, check_fused_moe_lora_mxfp4_args,
                       check_index_values, check_lora_ranks, check_rank_values)
from .layout import TRANSPOSED_INTERLEAVED
from .mxfp4 import Mxfp4Weight, fused_moe_lora_mxfp4_reference

CORE_ARGS = ("x", "topk_ids", "topk_weights", "token_lora_ids", "w13_blocks", "w13_scales", "w2_blocks",
             "w2_scales", "lora_a13", "lora_b13", "lora_a2", "lora_b2", "w13_bias", "w2_bias", "lora_ranks")
_GRAD_POSITIONS = (0, 2, 8, 9, 10, 11)  # x, topk_weights, the LoRA stacks
_FROZEN_POSITIONS = (12, 13)  # the biases (blocks and scales are uint8: never differentiable)


def _check(x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, lora_a13,
           lora_b13, lora_a2, lora_b2, w13_bias, w2_bias, lora_ranks, layout, activation, values: bool) -> None:
    check_fused_moe_lora_mxfp4_args(x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks,
                                    w2_scales, lora_a13, lora_b13, lora_a2, lora_b2, w13_bias, w2_bias, layout,
                                    activation)
    check_lora_ranks(lora_ranks, 2, lora_a13.shape[0], lora_a13.shape[2], x, what="[2, L] (w13 and w2 rank per slot)")
    if values:
        check_index_values("topk_ids", topk_ids, 0, w13_blocks.shape[0])
        check_index_values("token_lora_ids", token_lora_ids, NO_ADAPTER, lora_a13.shape[0])
        check_rank_values(lora_ranks, (lora_a13.shape[2], lora_a2.shape[2]))


def _reference(x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, lora_a13,
               lora_b13, lora_a2, lora_b2, w13_bias=None, w2_bias=None, **kwargs) -> Tensor:
    """The op's reference on its flat arguments (dequantize to x.dtype, then the dense reference)."""
    return fused_moe_lora_mxfp4_reference(
        x, topk_ids, topk_weights, token_lora_ids, Mxfp4Weight(w13_blocks, w13_scales),
        Mxfp4Weight(w2_blocks, w2_scales), lora_a13, lora_b13, lora_a2, lora_b2, w13_bias=w13_bias,
        w2_bias=w2_bias, **kwargs)


@torch.library.custom_op("moe_lora::fused_moe_lora_mxfp4", mutates_args=())
def _fused_moe_lora_mxfp4_op(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13_blocks: Tensor,
    w13_scales: Tensor,
    w2_blocks: Tensor,
    w2_scales: Tensor,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    lora_ranks: Optional[Tensor] = None,
    *,
    layout: str = TRANSPOSED_INTERLEAVED,
    activation: str = "gptoss_swiglu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
) -> Tensor:
    args = (x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, lora_a13,
            lora_b13, lora_a2, lora_b2, w13_bias, w2_bias)
    _check(*args, lora_ranks, layout, activation, values=True)
    return _reference(*args, layout=layout, activation=activation, alpha=alpha, limit=limit,
                      routing_weight_on_input=routing_weight_on_input, lora_ranks=lora_ranks)


@_fused_moe_lora_mxfp4_op.register_kernel("cuda")
def _fused_moe_lora_mxfp4_cuda(x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks,
                               w2_scales, lora_a13, lora_b13, lora_a2, lora_b2, w13_bias=None, w2_bias=None,
                               lora_ranks=None, *, layout=TRANSPOSED_INTERLEAVED, activation="gptoss_swiglu",
                               alpha=GPTOSS_ALPHA, limit=GPTOSS_LIMIT, routing_weight_on_input=False):
    args = (x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, lora_a13,
            lora_b13, lora_a2, lora_b2)
    _check(*args, w13_bias, w2_bias, lora_ranks, layout, activation, values=cuda_impl.check_values_on_device())
    kwargs = dict(w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha,
                  limit=limit, routing_weight_on_input=routing_weight_on_input, lora_ranks=lora_ranks)
    if cuda_impl._kernel_covers("fused_moe_lora_mxfp4", x, lora_a13=lora_a13, lora_b13=lora_b13, lora_a2=lora_a2,
                                lora_b2=lora_b2, w13_bias=w13_bias, w2_bias=w2_bias):
        from .triton.launch import fused_moe_lora_mxfp4_triton

        return fused_moe_lora_mxfp4_triton(*args, **kwargs)
    return _reference(*args, **kwargs)


@_fused_moe_lora_mxfp4_op.register_fake
def _fused_moe_lora_mxfp4_fake(x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks,
                               w2_scales, lora_a13, lora_b13, lora_a2, lora_b2, w13_bias=None, w2_bias=None,
                               lora_ranks=None, *, layout=TRANSPOSED_INTERLEAVED, activation="gptoss_swiglu",
                               alpha=GPTOSS_ALPHA, limit=GPTOSS_LIMIT, routing_weight_on_input=False):
    _check(x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, lora_a13,
           lora_b13, lora_a2, lora_b2, w13_bias, w2_bias, lora_ranks, layout, activation, values=False)
    return x.new_empty(x.shape)


@torch.library.custom_op("moe_lora::fused_moe_lora_mxfp4_backward", mutates_args=())
def _fused_moe_lora_mxfp4_backward_op(
    grad_y: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13_blocks: Tensor,
    w13_scales: Tensor,
    w2_blocks: Tensor,
    w2_scales: Tensor,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    lora_ranks: Optional[Tensor] = None,
    *,
    layout: str = TRANSPOSED_INTERLEAVED,
    activation: str = "gptoss_swiglu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
) -> list[Tensor]:
    """Grads of ``fused_moe_lora_mxfp4`` w.r.t. (x, topk_weights, lora_a13, lora_b13, lora_a2, lora_b2)."""
    args = (x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, lora_a13,
            lora_b13, lora_a2, lora_b2)
    kwargs = dict(w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha,
                  limit=limit, routing_weight_on_input=routing_weight_on_input, lora_ranks=lora_ranks)
    return recompute_grads_by_slot(_reference, grad_y, args, kwargs, _GRAD_POSITIONS, row_positions=(0, 1, 2, 3),
                                   stack_positions=(8, 9, 10, 11), ids_position=3)


@_fused_moe_lora_mxfp4_backward_op.register_fake
def _fused_moe_lora_mxfp4_backward_fake(grad_y, *args, **kwargs):
    return [torch.empty_like(args[i], memory_format=torch.contiguous_format) for i in _GRAD_POSITIONS]


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    save_for_backward(ctx, "fused_moe_lora_mxfp4", inputs, CORE_ARGS, _FROZEN_POSITIONS)
    ctx.kw = keyword_only_inputs


def _backward(ctx, grad_y):
    grads = torch.ops.moe_lora.fused_moe_lora_mxfp4_backward(grad_y, *ctx.saved_tensors, **ctx.kw)
    out = [None] * len(CORE_ARGS)
    for pos, g in zip(_GRAD_POSITIONS, grads):
        out[pos] = g if ctx.needs_input_grad[pos] else None
    return tuple(out)


_fused_moe_lora_mxfp4_op.register_autograd(_backward, setup_context=_setup_context)


def fused_moe_lora_mxfp4(
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
    lora_ranks: Optional[Tensor] = None,
    layout: str = TRANSPOSED_INTERLEAVED,
    activation: str = "gptoss_swiglu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
) -> Tensor:
    """One MoE layer over MXFP4 experts with per-token multi-LoRA: ``torch.ops.moe_lora.fused_moe_lora_mxfp4``.

    Like :func:`.fused_moe_lora.fused_moe_lora` with ``w13`` (dequantizes to ``[E, H, 2I]``) and ``w2``
    (``[E, I, H]``) as :class:`.mxfp4.Mxfp4Weight`; GPT-OSS defaults (transposed interleaved layout, clamped
    swiglu); ``lora_ranks`` ``[2, L]`` int: each slot's w13 / w2 rank, as for the dense op. Returns ``y [T, H]`` in
    ``x.dtype``."""
    for name, weight in (("w13", w13), ("w2", w2)):
        if not isinstance(weight, Mxfp4Weight):
            raise TypeError(f"{name}: an Mxfp4Weight(blocks, scales), got {type(weight).__name__}")
    return torch.ops.moe_lora.fused_moe_lora_mxfp4(
        x, topk_ids, topk_weights, token_lora_ids, w13.blocks, w13.scales, w2.blocks, w2.scales, lora_a13,
        lora_b13, lora_a2, lora_b2, w13_bias=w13_bias, w2_bias=w2_bias, lora_ranks=lora_ranks, layout=layout,
        activation=activation, alpha=alpha, limit=limit, routing_weight_on_input=routing_weight_on_input)
