"""Checks of token inputs shared by :class:`~moe_lora_compile.models.MultiLoRAModel` and
:mod:`moe_lora_compile.graphs`: one place for what a token-id tensor, a prompt and its attention mask must be."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def check_token_ids(name: str, ids) -> None:
    """``ids`` must be a ``[batch, seq_len]`` integer tensor, neither size 0 (shape and dtype only: no host sync)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be [batch, seq_len] integer token ids, got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() == 0:
        raise ValueError(f"{name} must have batch, seq_len >= 1, got {tuple(ids.shape)}")


def check_prompt_values(input_ids: Tensor, attention_mask: Optional[Tensor], vocab: int,
                        left_padding: bool = True) -> None:
    """Prompt ids in ``[0, vocab)``; ``attention_mask`` (if any) ``input_ids``'s shape, only 0s and 1s, each row
    with at least one token, and (``left_padding``) its padding on the left (transformers' generate also takes right
    padding, with a warning). One host sync (a device-side out-of-range id would be an assert)."""
    b, S = input_ids.shape
    if attention_mask is not None:
        if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != (b, S):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be [{b}, {S}] like input_ids, got {shape}")
        m = attention_mask.to(input_ids.device)
        checks = torch.stack([input_ids.min().long(), input_ids.max().long(), ((m != 0) & (m != 1)).any().long(),
                              (m[:, 1:] < m[:, :-1]).any().long(), (m.sum(-1) == 0).any().long()]).tolist()
    else:
        checks = torch.stack([input_ids.min().long(), input_ids.max().long()]).tolist() + [0, 0, 0]
    low, high, not_binary, right_padded, empty_row = checks
    if low < 0 or high >= vocab:
        raise ValueError(f"input_ids: ids outside the vocabulary [0, {vocab}) (min {low}, max {high})")
    if not_binary:
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    if right_padded and left_padding:
        raise ValueError("attention_mask: padding must be on the left (a row's 0s before its 1s), as for "
                         "transformers' generate")
    if empty_row:
        raise ValueError("attention_mask: a row has no token (all 0)")


def as_embedding_ids(ids: Tensor) -> Tensor:
    """Checked token ids (:func:`check_token_ids`) in a dtype an embedding takes: int64 / int32 as they are, other
    integer dtypes (int8, uint16 id tables, ...) as int64 (``F.embedding`` refused them, deep in the model)."""
    return ids if ids.dtype in (torch.int64, torch.int32) else ids.long()
