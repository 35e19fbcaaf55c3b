"""Dense linear with per-token multi-LoRA: a drop-in for a target ``nn.Linear``.

Keeps the original ``weight`` / ``bias`` parameters (same objects, same state-dict names) and adds slot buffers
``lora_a [L,R,in]``, ``lora_b [L,out,R]`` plus the two shared id buffers of the :class:`MultiLoRAModel`:
``token_lora_ids`` (one slot per token of the forward, row-major over ``[B, S]``) and ``sequence_lora_ids`` (one
slot per sequence of the batch).

Which input row belongs to which sequence is read from the input's shape, never from adapter state:

- ``x [T, in]`` (2-D: flattened tokens, e.g. shared experts after ``view(-1, H)``): row ``t`` uses
  ``token_lora_ids[t]``;
- ``x [B, ..., in]`` (3-D or more): the leading dim is the batch, so every row of ``x[b]`` uses
  ``sequence_lora_ids[b]``, whatever the middle dims hold. That covers inputs whose row count is not the forward's
  token count, such as DeepSeek-V3's ``kv_b_proj``, applied after the cache update to the whole cached latent
  ``[B, 1, ctx, r]``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from ..ops.reference import lora_linear_reference


def rows_lora_ids(x: Tensor, token_lora_ids: Tensor, sequence_lora_ids: Tensor) -> Tensor:
    """The slot of every row of ``x.reshape(-1, x.shape[-1])``: see the module docstring."""
    if x.dim() <= 2:
        return token_lora_ids[: x.reshape(-1, x.shape[-1]).shape[0]]
    batch = x.shape[0]
    per_sequence = sequence_lora_ids[:batch].view(batch, *([1] * (x.dim() - 2)))
    return per_sequence.expand(x.shape[:-1]).reshape(-1)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, *, max_loras: int, max_rank: int, token_lora_ids: Tensor,
                 sequence_lora_ids: Tensor, use_ops: bool):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, self.in_features, **like), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, **like), persistent=False)
        self.register_buffer("token_lora_ids", token_lora_ids, persistent=False)
        self.register_buffer("sequence_lora_ids", sequence_lora_ids, persistent=False)
        self.use_ops = use_ops

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        token_lora_ids = rows_lora_ids(x, self.token_lora_ids, self.sequence_lora_ids)
        fn = torch.ops.moe_lora.lora_linear if self.use_ops else lora_linear_reference
        y = fn(x2, self.weight, self.lora_a, self.lora_b, token_lora_ids, bias=self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}")
