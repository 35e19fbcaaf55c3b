"""Eager attention with the grouped query heads folded into the matmuls: no ``repeat_kv`` copies of the cache.

Transformers' eager attention (the only one GPT-OSS offers besides flash / flex: its sinks rule out SDPA) expands
every key/value head to its ``n_rep`` query heads with ``repeat_kv`` before the two matmuls. Under ``torch.compile``
that expansion is a real copy of the whole static cache, twice per layer and step: on the H200 it was a quarter of
GPT-OSS-20B's attention time at batch 1 and 40 % at batch 8 (2026-12-03 profile). Here the ``n_rep`` query heads
that share a key/value head become extra query rows of one ``[B, Hkv, n_rep*S, D] @ [B, Hkv, D, L]`` matmul; the
mask, the sinks and the softmax are those of transformers' eager function, in the same order and dtypes.

:func:`use_folded_gqa_attention` switches a model whose attention implementation is ``"eager"`` to it for good
(registered as :data:`FOLDED_GQA` with eager's additive mask). Transformers' SDPA attention copies the cache the same
way whenever it is given a mask on CUDA (``use_gqa_in_sdpa`` allows ``enable_gqa`` only without a mask, and 5.24's
``pack_gqa`` is skipped under ``torch.compile``), and a static-cache decode step always has one: Inductor turns
``repeat_kv`` into copy kernels of the whole cache in front of the fused SDPA kernel. :func:`folded_gqa_decode`
switches an ``"sdpa"`` model to :data:`FOLDED_GQA` only while inside (a ``DecodeGraphs`` decode step), so prefill and
``generate`` keep SDPA's fused kernels. :func:`fold_gqa_mode` reads ``DecodeGraphs``' ``fold_gqa`` argument.

:func:`decode_attention_forward` (registered as :data:`DECODE_ATTENTION`, eager's additive mask) runs the
flash-decoding Triton kernel ``moe_lora.decode_attention`` (:mod:`moe_lora_compile.ops.decode_attention`): one launch
per layer that reads only the cache blocks the mask leaves visible. :func:`decode_attention_steps` switches an
eager, folded or SDPA model to it only while inside (``DecodeGraphs`` / ``RowGraphs`` ``attention="triton"``: their
decode steps), so prefill and ``generate`` keep their own attention.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

FOLDED_GQA = "moe_lora_folded_gqa"
FOLD_GQA_MODES = ("off", "eager", "all")  # off: nothing; eager: eager models for good; all: + SDPA models' decode
DECODE_ATTENTION = "moe_lora_decode_attention"
ATTENTION_MODES = ("default", "triton")  # decode steps: the model's (folded) attention, or the Triton kernel


def folded_gqa_attention_forward(module, query: Tensor, key: Tensor, value: Tensor,
                                 attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                                 dropout: float = 0.0, **kwargs) -> tuple[Tensor, Tensor]:
    """query [B, H, S, D], key [B, Hkv, L, D], value [B, Hkv, L, Dv], additive mask [B, 1, S, L] (or None)
    -> (out [B, S, H, Dv], probabilities [B, H, S, L]), as transformers' eager attention (with GPT-OSS's
    per-head ``module.sinks`` when the module has them)."""
    B, H, S, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    n_rep = H // Hkv
    if scaling is None:
        scaling = D ** -0.5
    # query head h = g * n_rep + j reads key/value head g (repeat_kv's order)
    q = query.reshape(B, Hkv, n_rep * S, D)
    scores = torch.matmul(q, key.transpose(2, 3)).view(B, H, S, L) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., :L]
    sinks = getattr(module, "sinks", None)
    if sinks is not None:
        logits = torch.cat([scores, sinks.reshape(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    out = torch.matmul(probs.reshape(B, Hkv, n_rep * S, L), value).view(B, H, S, value.shape[-1])
    return out.transpose(1, 2).contiguous(), probs


def decode_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                             scaling: Optional[float] = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """query [B, H, S, D], key / value [B, Hkv, L, D] (the static cache), additive [B, 1, S, L] or boolean (True =
    seen) mask or None -> (out [B, S, H, D], None): ``torch.ops.moe_lora.decode_attention`` with GPT-OSS's
    ``module.sinks`` when the module has them. Where the op does not apply (training with dropout, or gradients
    needed: it has no backward) the folded eager attention runs instead."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if needs_grad or (dropout and module.training) or value.shape[-1] != query.shape[-1]:
        out, _ = folded_gqa_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        return out, None
    from ..ops.decode_attention import decode_attention

    mask = attention_mask
    if mask is not None and mask.dtype == torch.bool:  # SDPA's masks (RowGraphs builds them for SDPA models)
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)
    return decode_attention(query, key, value, mask, scaling=scaling, sinks=getattr(module, "sinks", None)), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FOLDED_GQA, folded_gqa_attention_forward)
    AttentionMaskInterface.register(FOLDED_GQA, eager_mask)
    AttentionInterface.register(DECODE_ATTENTION, decode_attention_forward)
    AttentionMaskInterface.register(DECODE_ATTENTION, eager_mask)


def use_folded_gqa_attention(model) -> bool:
    """Switch ``model`` (a transformers model) from ``"eager"`` attention to :func:`folded_gqa_attention_forward`;
    -> whether it did (False: another implementation, left alone)."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "eager":
        return False
    _register()
    model.set_attn_implementation(FOLDED_GQA)
    return config._attn_implementation == FOLDED_GQA


def fold_gqa_mode(fold_gqa: Union[bool, str]) -> str:
    """``DecodeGraphs``' ``fold_gqa`` -> one of :data:`FOLD_GQA_MODES` (``True`` = ``"eager"``, ``False`` =
    ``"off"``); anything else is a ValueError."""
    if fold_gqa is True or fold_gqa is False:
        return "eager" if fold_gqa else "off"
    if isinstance(fold_gqa, str) and fold_gqa in FOLD_GQA_MODES:
        return fold_gqa
    raise ValueError(f"fold_gqa must be True, False or one of {FOLD_GQA_MODES}, got {fold_gqa!r}")


@contextlib.contextmanager
def folded_gqa_decode(model, enabled: bool = True) -> Iterator[bool]:
    """While inside: ``model`` on ``"sdpa"`` attention runs :func:`folded_gqa_attention_forward` with eager's
    additive mask instead (same results up to rounding); restored to ``"sdpa"`` on exit. Yields whether it
    switched (False: disabled, or another implementation). The switch is the model config's attribute, which a
    compiled function guards on: a step traced inside runs folded, one traced outside keeps SDPA. Not for a model
    that another thread runs at the same time (that thread's forward would run folded too)."""
    config = model.config
    if not enabled or getattr(config, "_attn_implementation", None) != "sdpa":
        yield False
        return
    _register()
    config._attn_implementation = FOLDED_GQA
    try:
        yield True
    finally:
        config._attn_implementation = "sdpa"


def attention_mode(attention: str) -> str:
    """``DecodeGraphs`` / ``RowGraphs``' ``attention`` argument, checked: one of :data:`ATTENTION_MODES`."""
    if isinstance(attention, str) and attention in ATTENTION_MODES:
        return attention
    raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")


@contextlib.contextmanager
def decode_attention_steps(model, enabled: bool = True) -> Iterator[bool]:
    """While inside: ``model`` on ``"eager"``, :data:`FOLDED_GQA` or ``"sdpa"`` attention runs
    :func:`decode_attention_forward` (the Triton decode kernel) with eager's additive mask; its own implementation is
    restored on exit. Yields whether it switched (False: disabled, or another implementation). As
    :func:`folded_gqa_decode`: a step compiled inside runs the kernel, one compiled outside keeps the model's own;
    not for a model that another thread runs at the same time."""
    config = model.config
    current = getattr(config, "_attn_implementation", None)
    if not enabled or current not in ("eager", FOLDED_GQA, "sdpa"):
        yield False
        return
    _register()
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield True
    finally:
        config._attn_implementation = current
