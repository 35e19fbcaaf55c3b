"""``torch.ops.moe_lora.fused_moe_lora``: one MoE layer with per-token multi-LoRA, as a ``torch.library`` custom op.

CPU runs the reference (:mod:`.reference`); CUDA runs :mod:`.cuda_impl` (Triton); the fake impl gives
``torch.compile`` the output's shape and strides. The op is opaque to Dynamo, so argument checks inside it never
graph-break. Gradients flow to ``x``, ``topk_weights`` and the four LoRA stacks (base weights are frozen) through
``moe_lora::fused_moe_lora_backward``, which recomputes the reference under autograd. Contract: :mod:`.contract`.

The biases and ``lora_ranks`` (each slot's rank, :mod:`.contract`) are keyword arguments of :func:`fused_moe_lora`;
in the op's schema they follow the core tensors as optional positional-or-keyword tensors, because
``torch.library`` cannot give kwarg-only tensors an autograd formula.

``torch.ops.moe_lora.fused_moe_lora_out(out, x, ...)`` (``fused_moe_lora(..., out=out)``) is the ``out=`` form for
serving: ``out [T, H]`` (x's dtype and device; first, as in vLLM's own ops, since ``torch.library`` takes no
kwarg-only tensors) receives ``y``, then the same arguments; returns nothing, no autograd.
On CUDA the Triton kernels write ``y`` straight into ``out`` (no [T, H] copy); the reference impls copy into it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import cuda_impl
from .contract import (GPTOSS_ALPHA, GPTOSS_LIMIT, NO_ADAPTER, check_fused_moe_lora_args, check_index_values,
                       check_lora_ranks, check_out_arg, check_out_writable, check_rank_values)
from .layout import CONCAT
from .reference import fused_moe_lora_reference
from .autograd import recompute_grads_by_slot, save_for_backward

CORE_ARGS = ("x", "topk_ids", "topk_weights", "token_lora_ids", "w13", "w2",
             "lora_a13", "lora_b13", "lora_a2", "lora_b2", "w13_bias", "w2_bias", "lora_ranks")
# Inputs that receive gradients (positions in CORE_ARGS); the rest are indices or frozen base weights.
_GRAD_POSITIONS = (0, 2, 6, 7, 8, 9)
_FROZEN_POSITIONS = (4, 5, 10, 11)


def _check(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
           w13_bias, w2_bias, layout, activation, values: bool, lora_b13_split: bool = False,
           lora_ranks: Optional[Tensor] = None) -> None:
    check_fused_moe_lora_args(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2,
                              lora_b2, w13_bias, w2_bias, layout, activation, lora_b13_split)
    check_lora_ranks(lora_ranks, 2, lora_a13.shape[0], lora_a13.shape[2], x, what="[2, L] (w13 and w2 rank per slot)")
    if values:
        check_index_values("topk_ids", topk_ids, 0, w13.shape[0])
        check_index_values("token_lora_ids", token_lora_ids, NO_ADAPTER, lora_a13.shape[0])
        R = lora_a13.shape[2]
        check_rank_values(lora_ranks, (R // 2 if lora_b13_split else R, lora_a2.shape[2]))


@torch.library.custom_op("moe_lora::fused_moe_lora", mutates_args=())
def _fused_moe_lora_op(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    lora_ranks: Optional[Tensor] = None,
    *,
    layout: str = CONCAT,
    activation: str = "silu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
    lora_b13_split: bool = False,
) -> Tensor:
    _check(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
           w13_bias, w2_bias, layout, activation, values=True, lora_b13_split=lora_b13_split, lora_ranks=lora_ranks)
    return fused_moe_lora_reference(
        x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
        w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha, limit=limit,
        routing_weight_on_input=routing_weight_on_input, lora_b13_split=lora_b13_split, lora_ranks=lora_ranks,
    )


@_fused_moe_lora_op.register_kernel("cuda")
def _fused_moe_lora_cuda(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
                         w13_bias=None, w2_bias=None, lora_ranks=None, *, layout=CONCAT, activation="silu",
                         alpha=GPTOSS_ALPHA,
                         limit=GPTOSS_LIMIT, routing_weight_on_input=False, lora_b13_split=False):
    _check(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
           w13_bias, w2_bias, layout, activation, values=cuda_impl.check_values_on_device(),
           lora_b13_split=lora_b13_split, lora_ranks=lora_ranks)
    return cuda_impl.fused_moe_lora_cuda(
        x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
        w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha, limit=limit,
        routing_weight_on_input=routing_weight_on_input, lora_b13_split=lora_b13_split, lora_ranks=lora_ranks,
    )


@_fused_moe_lora_op.register_fake
def _fused_moe_lora_fake(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
                         w13_bias=None, w2_bias=None, lora_ranks=None, *, layout=CONCAT, activation="silu",
                         alpha=GPTOSS_ALPHA,
                         limit=GPTOSS_LIMIT, routing_weight_on_input=False, lora_b13_split=False):
    _check(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
           w13_bias, w2_bias, layout, activation, values=False, lora_b13_split=lora_b13_split,
           lora_ranks=lora_ranks)
    return x.new_empty(x.shape)


@torch.library.custom_op("moe_lora::fused_moe_lora_backward", mutates_args=())
def _fused_moe_lora_backward_op(
    grad_y: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    lora_ranks: Optional[Tensor] = None,
    *,
    layout: str = CONCAT,
    activation: str = "silu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
    lora_b13_split: bool = False,
) -> list[Tensor]:
    """Grads of ``fused_moe_lora`` w.r.t. (x, topk_weights, lora_a13, lora_b13, lora_a2, lora_b2)."""
    args = (x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2)
    kwargs = dict(w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha,
                  limit=limit, routing_weight_on_input=routing_weight_on_input, lora_b13_split=lora_b13_split,
                  lora_ranks=lora_ranks)
    return recompute_grads_by_slot(fused_moe_lora_reference, grad_y, args, kwargs, _GRAD_POSITIONS,
                                   row_positions=(0, 1, 2, 3), stack_positions=(6, 7, 8, 9), ids_position=3)


@_fused_moe_lora_backward_op.register_fake
def _fused_moe_lora_backward_fake(grad_y, *args, **kwargs):
    return [torch.empty_like(args[i], memory_format=torch.contiguous_format) for i in _GRAD_POSITIONS]


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    save_for_backward(ctx, "fused_moe_lora", inputs, CORE_ARGS, _FROZEN_POSITIONS)
    ctx.kw = keyword_only_inputs


def _backward(ctx, grad_y):
    grads = torch.ops.moe_lora.fused_moe_lora_backward(grad_y, *ctx.saved_tensors, **ctx.kw)
    out = [None] * len(CORE_ARGS)
    for pos, g in zip(_GRAD_POSITIONS, grads):
        out[pos] = g if ctx.needs_input_grad[pos] else None
    return tuple(out)


_fused_moe_lora_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("moe_lora::fused_moe_lora_out", mutates_args=("out",))
def _fused_moe_lora_out_op(
    out: Tensor,
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    lora_ranks: Optional[Tensor] = None,
    *,
    layout: str = CONCAT,
    activation: str = "silu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
    lora_b13_split: bool = False,
) -> None:
    _check(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
           w13_bias, w2_bias, layout, activation, values=True, lora_b13_split=lora_b13_split,
           lora_ranks=lora_ranks)
    check_out_arg(out, x)
    check_out_writable(out)
    out.copy_(fused_moe_lora_reference(
        x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
        w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha, limit=limit,
        routing_weight_on_input=routing_weight_on_input, lora_b13_split=lora_b13_split, lora_ranks=lora_ranks,
    ))


@_fused_moe_lora_out_op.register_kernel("cuda")
def _fused_moe_lora_out_cuda(out, x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2,
                             lora_b2, w13_bias=None, w2_bias=None, lora_ranks=None, *, layout=CONCAT, activation="silu",
                             alpha=GPTOSS_ALPHA, limit=GPTOSS_LIMIT, routing_weight_on_input=False,
                             lora_b13_split=False):
    _check(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
           w13_bias, w2_bias, layout, activation, values=cuda_impl.check_values_on_device(),
           lora_b13_split=lora_b13_split, lora_ranks=lora_ranks)
    check_out_arg(out, x)
    check_out_writable(out)
    cuda_impl.fused_moe_lora_cuda(
        x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
        w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha, limit=limit,
        routing_weight_on_input=routing_weight_on_input, lora_b13_split=lora_b13_split, lora_ranks=lora_ranks,
        out=out,
    )


@_fused_moe_lora_out_op.register_fake
def _fused_moe_lora_out_fake(out, x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2,
                             lora_b2, w13_bias=None, w2_bias=None, lora_ranks=None, *, layout=CONCAT, activation="silu",
                             alpha=GPTOSS_ALPHA, limit=GPTOSS_LIMIT, routing_weight_on_input=False,
                             lora_b13_split=False):
    _check(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
           w13_bias, w2_bias, layout, activation, values=False, lora_b13_split=lora_b13_split,
           lora_ranks=lora_ranks)
    check_out_arg(out, x)


def fused_moe_lora(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    *,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    layout: str = CONCAT,
    activation: str = "silu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
    lora_b13_split: bool = False,
    lora_ranks: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """One MoE layer, each token's LoRA delta from its own adapter slot: ``torch.ops.moe_lora.fused_moe_lora``.

    x [T,H]; topk_ids [T,k] int; topk_weights [T,k]; token_lora_ids [T] int (-1 = base only); w13/w2 in
    ``layout`` (see :mod:`.layout`); lora_a13 [L,E,R,H], lora_b13 [L,E,2I,R] (``lora_b13_split``: [L,E,2I,R/2],
    gate rows on ranks [0,R/2), up rows on [R/2,R)), lora_a2 [L,E,R2,I], lora_b2 [L,E,H,R2] (scaling folded into
    B); lora_ranks [2, L] int or None: each slot's w13 and w2 rank (entries past it are never read; None = all R).
    w13_bias [E, 2I] / w2_bias [E, H] or None (GPT-OSS); ``activation`` "silu" (silu(gate) * up) or
    "gptoss_swiglu" (GPT-OSS: gate clamped to ``limit``, up to [-limit, limit], (up + 1) * gate * sigmoid(``alpha``
    * gate)); ``routing_weight_on_input`` (Llama-4): each pair's input is scaled by its routing weight before w13
    instead of its output after w2. Returns ``y [T, H]`` in ``x.dtype``; with ``out`` (a [T, H] tensor of x's dtype
    and device) ``y`` is written there and ``out`` returned (``torch.ops.moe_lora.fused_moe_lora_out``, inference only: no autograd).
    """
    kwargs = dict(w13_bias=w13_bias, w2_bias=w2_bias, lora_ranks=lora_ranks, layout=layout, activation=activation,
                  alpha=alpha, limit=limit, routing_weight_on_input=routing_weight_on_input,
                  lora_b13_split=lora_b13_split)
    args = (x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2)
    if out is None:
        return torch.ops.moe_lora.fused_moe_lora(*args, **kwargs)
    if torch.is_grad_enabled() and any(args[i].requires_grad for i in _GRAD_POSITIONS):
        raise ValueError("fused_moe_lora(..., out=) is inference only (no autograd through out): call it without "
                         "out= when gradients are needed, or under torch.no_grad()")
    torch.ops.moe_lora.fused_moe_lora_out(out, *args, **kwargs)
    return out
