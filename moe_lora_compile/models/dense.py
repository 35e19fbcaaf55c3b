"""Dense linear with per-token multi-LoRA: a drop-in for a target ``nn.Linear``.

Keeps the original ``weight`` / ``bias`` parameters (same objects, same state-dict names) and adds slot buffers
``lora_a [L,R,in]``, ``lora_b [L,out,R]`` plus the shared ``token_lora_ids`` buffer. Forward flattens ``x [..., in]``
to ``[T, in]`` and reads ``token_lora_ids[:T]``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from ..ops.reference import lora_linear_reference


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, *, max_loras: int, max_rank: int, token_lora_ids: Tensor, use_ops: bool):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, self.in_features, **like), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, **like), persistent=False)
        self.register_buffer("token_lora_ids", token_lora_ids, persistent=False)
        self.use_ops = use_ops

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        token_lora_ids = self.token_lora_ids[: x2.shape[0]]
        fn = torch.ops.moe_lora.lora_linear if self.use_ops else lora_linear_reference
        y = fn(x2, self.weight, self.lora_a, self.lora_b, token_lora_ids, bias=self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}")
