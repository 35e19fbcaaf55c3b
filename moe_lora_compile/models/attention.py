"""Eager attention with the grouped query heads folded into the matmuls: no ``repeat_kv`` copies of the cache.

Transformers' eager attention (the only one GPT-OSS offers besides flash / flex: its sinks rule out SDPA) expands
every key/value head to its ``n_rep`` query heads with ``repeat_kv`` before the two matmuls. Under ``torch.compile``
that expansion is a real copy of the whole static cache, twice per layer and step: on the H200 it was a quarter of
GPT-OSS-20B's attention time at batch 1 and 40 % at batch 8 (2026-12-03 profile). Here the ``n_rep`` query heads
that share a key/value head become extra query rows of one ``[B, Hkv, n_rep*S, D] @ [B, Hkv, D, L]`` matmul; the
mask, the sinks and the softmax are those of transformers' eager function, in the same order and dtypes.

:func:`use_folded_gqa_attention` switches a model whose attention implementation is ``"eager"`` to it (registered
as :data:`FOLDED_GQA` with eager's additive mask); other implementations (SDPA, flash, flex) are left alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

FOLDED_GQA = "moe_lora_folded_gqa"


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


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(FOLDED_GQA, folded_gqa_attention_forward)
    AttentionMaskInterface.register(FOLDED_GQA, eager_mask)


def use_folded_gqa_attention(model) -> bool:
    """Switch ``model`` (a transformers model) from ``"eager"`` attention to :func:`folded_gqa_attention_forward`;
    -> whether it did (False: another implementation, left alone)."""
    config = model.config
    if getattr(config, "_attn_implementation", None) != "eager":
        return False
    _register()
    model.set_attn_implementation(FOLDED_GQA)
    return config._attn_implementation == FOLDED_GQA
