"""``torch.ops.moe_lora.route``: an MoE router (logits, top-k expert ids and routing weights) in one op.

Returns exactly what transformers' routers return: ``logits [T, E]`` in the input dtype (``F.linear``), ``scores
[T, k]`` (``scores_dtype``, default the logits dtype) and ``ids [T, k]`` int64 (``torch.topk``), sorted by
descending score. ``scoring`` (:data:`~.contract.SCORINGS`):

- ``"topk_softmax"`` (GPT-OSS): top-k of the logits, softmax over the k values in the logits dtype;
- ``"softmax_topk"`` (Qwen3-MoE, Qwen2-MoE, OLMoE: ``renormalize=norm_topk_prob``; Mixtral: ``renormalize=True``,
  ``scores_dtype=torch.float32``): softmax over all E in fp32, top-k of the probabilities, optionally divided by
  their sum;
- ``"topk_sigmoid"`` (Llama-4): top-k of the logits, ``sigmoid`` of the k values in fp32 (transformers' dense
  ``[T, E]`` router scores are these at the ids and 0 elsewhere).

DeepSeek-V3's router (sigmoid, ``e_score_correction_bias``, group-limited top-k) is not covered: it stays on
transformers' code.

CPU (and float64, large T, E > 256, k > 16 on CUDA): :func:`route_reference`, transformers' own sequence of aten
ops. CUDA with ``T <= MAX_KERNEL_TOKENS`` (decode): one Triton launch (:mod:`.triton.router_kernels`), with fp32
accumulation in another order than cuBLAS (logits equal up to one rounding of the input dtype) and ties broken
towards the lower expert index. ``torch.topk``'s order among equal values is unspecified on both devices (on
the H200 and on the CPU it is not index order), so where two experts tie at the k-th place the kernel and
transformers' eager path may pick different ones (both are top-k); the GPU test checks the kernel's rule.

Gradients flow to ``hidden`` (from logits and scores) through ``moe_lora::route_backward``, which recomputes the
reference under autograd; the router ``weight`` and ``bias`` are frozen.
"""

from __future__ import annotations

import numbers

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .autograd import _autograd_enabled, frozen_input_error
from .contract import check_route_args

MAX_KERNEL_TOKENS = 64  # CUDA: the Triton kernel up to this many tokens (decode), the aten ops above


def route_reference(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, top_k: int, scoring: str,
                    renormalize: bool = False, scores_dtype: Optional[torch.dtype] = None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' routers in plain PyTorch: hidden [T, H], weight [E, H], bias [E] or None -> (logits [T, E] in
    hidden's dtype, scores [T, top_k] in ``scores_dtype`` (None: the logits dtype), ids [T, top_k] int64)."""
    logits = F.linear(hidden, weight, bias)
    out_dtype = logits.dtype if scores_dtype is None else scores_dtype
    if scoring == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        scores, ids = torch.topk(probs, top_k, dim=-1)
        if renormalize:
            scores = scores / scores.sum(dim=-1, keepdim=True)
    else:
        values, ids = torch.topk(logits, top_k, dim=-1)
        if scoring == "topk_softmax":
            scores = torch.softmax(values, dim=-1, dtype=values.dtype)
        else:
            scores = torch.sigmoid(values.float())
    return logits, scores.to(out_dtype), ids


def _kernel_takes(hidden, weight, bias, top_k) -> bool:
    if hidden.shape[0] > MAX_KERNEL_TOKENS:
        return False
    from .triton.router_launch import kernel_covers

    return kernel_covers(hidden, weight, bias, top_k)


@torch.library.custom_op("moe_lora::route", mutates_args=())
def _route_op(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], top_k: int, scoring: str,
              renormalize: bool = False, scores_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    check_route_args(hidden, weight, bias, top_k, scoring, renormalize, scores_dtype)
    return route_reference(hidden, weight, bias, top_k=top_k, scoring=scoring, renormalize=renormalize,
                           scores_dtype=scores_dtype)


@_route_op.register_kernel("cuda")
def _route_cuda(hidden, weight, bias, top_k, scoring, renormalize=False, scores_dtype=None):
    check_route_args(hidden, weight, bias, top_k, scoring, renormalize, scores_dtype)
    if not _kernel_takes(hidden, weight, bias, top_k):  # prefill, float64, wide routers: the aten ops
        return route_reference(hidden, weight, bias, top_k=top_k, scoring=scoring, renormalize=renormalize,
                               scores_dtype=scores_dtype)
    from .triton.router_launch import route_triton

    return route_triton(hidden, weight, bias, top_k=top_k, scoring=scoring, renormalize=renormalize,
                        scores_dtype=hidden.dtype if scores_dtype is None else scores_dtype)


@_route_op.register_fake
def _route_fake(hidden, weight, bias, top_k, scoring, renormalize=False, scores_dtype=None):
    check_route_args(hidden, weight, bias, top_k, scoring, renormalize, scores_dtype)
    T = hidden.shape[0]
    return (hidden.new_empty((T, weight.shape[0])),
            hidden.new_empty((T, top_k), dtype=hidden.dtype if scores_dtype is None else scores_dtype),
            hidden.new_empty((T, top_k), dtype=torch.int64))


@torch.library.custom_op("moe_lora::route_backward", mutates_args=())
def _route_backward_op(grad_logits: Tensor, grad_scores: Tensor, hidden: Tensor, weight: Tensor,
                       bias: Optional[Tensor], top_k: int, scoring: str, renormalize: bool = False,
                       scores_dtype: Optional[torch.dtype] = None) -> Tensor:
    """d(logits, scores)/d(hidden) applied to (grad_logits [T, E], grad_scores [T, k]) -> grad_hidden [T, H]."""
    with _autograd_enabled():
        leaf = hidden.detach().requires_grad_(True)
        logits, scores, _ = route_reference(leaf, weight, bias, top_k=top_k, scoring=scoring,
                                            renormalize=renormalize, scores_dtype=scores_dtype)
        (grad,) = torch.autograd.grad((logits, scores), (leaf,), (grad_logits, grad_scores), allow_unused=True)
    return torch.zeros_like(hidden) if grad is None else grad.contiguous()


@_route_backward_op.register_fake
def _route_backward_fake(grad_logits, grad_scores, hidden, *args, **kwargs):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, top_k, scoring, renormalize, scores_dtype = inputs
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.requires_grad:
            raise frozen_input_error("route", name)
    ctx.save_for_backward(hidden, weight, bias)
    ctx.options = (top_k, scoring, renormalize, scores_dtype)
    ctx.shapes = (output[0].shape, output[1].shape, output[1].dtype)


def _backward(ctx, grad_logits, grad_scores, grad_ids):
    hidden, weight, bias = ctx.saved_tensors
    logits_shape, scores_shape, scores_dtype = ctx.shapes
    if grad_logits is None:
        grad_logits = hidden.new_zeros(logits_shape)
    if grad_scores is None:
        grad_scores = hidden.new_zeros(scores_shape, dtype=scores_dtype)
    grad_hidden = None
    if ctx.needs_input_grad[0]:
        grad_hidden = torch.ops.moe_lora.route_backward(grad_logits, grad_scores, hidden, weight, bias, *ctx.options)
    return grad_hidden, None, None, None, None, None, None


_route_op.register_autograd(_backward, setup_context=_setup_context)


def route(hidden: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *, top_k: int, scoring: str,
          renormalize: bool = False, scores_dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.moe_lora.route``: hidden [T, H], weight [E, H], bias [E] or None (hidden's dtype) ->
    (logits [T, E] in hidden's dtype, scores [T, top_k] in ``scores_dtype`` (default: logits dtype), ids [T, top_k]
    int64). ``scoring``: ``"topk_softmax"``, ``"softmax_topk"`` (with ``renormalize``) or ``"topk_sigmoid"``."""
    # the op's int schema would read True as 1, and refuse a float with a raw RuntimeError
    if isinstance(top_k, bool) or not isinstance(top_k, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    top_k = top_k if isinstance(top_k, torch.SymInt) else int(top_k)  # (a numpy int too)
    return torch.ops.moe_lora.route(hidden, weight, bias, top_k, scoring, renormalize, scores_dtype)
