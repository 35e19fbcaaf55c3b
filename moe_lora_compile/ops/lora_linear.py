"""``torch.ops.moe_lora.lora_linear``: a linear layer plus each token's LoRA delta from its own adapter slot.

Gradients flow to ``x`` and the LoRA stacks (``weight`` and ``bias`` are frozen) through
``moe_lora::lora_linear_backward``, which recomputes the reference under autograd.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import cuda_impl
from .contract import NO_ADAPTER, check_index_values, check_lora_linear_args, check_lora_ranks, check_rank_values
from .reference import lora_linear_reference
from .autograd import recompute_grads_by_slot, save_for_backward

CORE_ARGS = ("x", "weight", "lora_a", "lora_b", "token_lora_ids", "bias", "lora_ranks")
_GRAD_POSITIONS = (0, 2, 3)
_FROZEN_POSITIONS = (1, 5)


def _check(x, weight, lora_a, lora_b, token_lora_ids, bias, values: bool, lora_ranks=None) -> None:
    check_lora_linear_args(x, weight, lora_a, lora_b, token_lora_ids, bias)
    L, R = lora_a.shape[0], lora_a.shape[1]
    check_lora_ranks(lora_ranks, -1, L, R, x, what="[L] or [n, L] (n equal rank blocks; each slot's rank per block)")
    if values:
        check_index_values("token_lora_ids", token_lora_ids, NO_ADAPTER, L)
        if lora_ranks is not None:
            check_rank_values(lora_ranks, (R // (lora_ranks.shape[0] if lora_ranks.dim() == 2 else 1),))


@torch.library.custom_op("moe_lora::lora_linear", mutates_args=())
def _lora_linear_op(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, token_lora_ids: Tensor, bias: Optional[Tensor] = None,
    lora_ranks: Optional[Tensor] = None,
) -> Tensor:
    _check(x, weight, lora_a, lora_b, token_lora_ids, bias, values=True, lora_ranks=lora_ranks)
    return lora_linear_reference(x, weight, lora_a, lora_b, token_lora_ids, bias=bias, lora_ranks=lora_ranks)


@_lora_linear_op.register_kernel("cuda")
def _lora_linear_cuda(x, weight, lora_a, lora_b, token_lora_ids, bias=None, lora_ranks=None):
    _check(x, weight, lora_a, lora_b, token_lora_ids, bias, values=cuda_impl.check_values_on_device(),
           lora_ranks=lora_ranks)
    return cuda_impl.lora_linear_cuda(x, weight, lora_a, lora_b, token_lora_ids, bias=bias, lora_ranks=lora_ranks)


@_lora_linear_op.register_fake
def _lora_linear_fake(x, weight, lora_a, lora_b, token_lora_ids, bias=None, lora_ranks=None):
    _check(x, weight, lora_a, lora_b, token_lora_ids, bias, values=False, lora_ranks=lora_ranks)
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("moe_lora::lora_linear_backward", mutates_args=())
def _lora_linear_backward_op(
    grad_y: Tensor, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, token_lora_ids: Tensor,
    bias: Optional[Tensor] = None, lora_ranks: Optional[Tensor] = None,
) -> list[Tensor]:
    """Grads of ``lora_linear`` w.r.t. (x, lora_a, lora_b)."""
    args = (x, weight, lora_a, lora_b, token_lora_ids)
    return recompute_grads_by_slot(lora_linear_reference, grad_y, args, dict(bias=bias, lora_ranks=lora_ranks),
                                   _GRAD_POSITIONS, row_positions=(0, 4), stack_positions=(2, 3), ids_position=4)


@_lora_linear_backward_op.register_fake
def _lora_linear_backward_fake(grad_y, *args, **kwargs):
    return [torch.empty_like(args[i], memory_format=torch.contiguous_format) for i in _GRAD_POSITIONS]


def _setup_context(ctx, inputs, output):
    save_for_backward(ctx, "lora_linear", inputs, CORE_ARGS, _FROZEN_POSITIONS)


def _backward(ctx, grad_y):
    grads = torch.ops.moe_lora.lora_linear_backward(grad_y, *ctx.saved_tensors)
    out = [None] * len(CORE_ARGS)
    for pos, g in zip(_GRAD_POSITIONS, grads):
        out[pos] = g if ctx.needs_input_grad[pos] else None
    return tuple(out)


_lora_linear_op.register_autograd(_backward, setup_context=_setup_context)


def lora_linear(
    x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, token_lora_ids: Tensor, *,
    bias: Optional[Tensor] = None, lora_ranks: Optional[Tensor] = None,
) -> Tensor:
    """``y = x @ weight^T (+ bias) + B[l] A[l] x`` per token: ``torch.ops.moe_lora.lora_linear``.

    x [T, in]; weight [out, in]; lora_a [L, R, in]; lora_b [L, out, R] (scaling in B); token_lora_ids [T] int
    (-1 = no adapter); bias [out] or None; lora_ranks [L] (or [n, L]: n equal rank blocks) int or None: each
    slot's rank, entries past it never read (see :mod:`.contract`). Returns ``y [T, out]`` in ``x.dtype``.
    """
    return torch.ops.moe_lora.lora_linear(x, weight, lora_a, lora_b, token_lora_ids, bias=bias, lora_ranks=lora_ranks)
