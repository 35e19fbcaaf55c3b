"""Random adapters as parsed factors (no PEFT folder), for tests that need adapters of a given model fast."""

from __future__ import annotations

import torch

from moe_lora_compile.adapters import ExpertsLoRA, LinearLoRA


def random_adapter(mm, seed: int, rank: int = 4, std: float = 0.3) -> dict:
    """Factors ``{module name: ExpertsLoRA | LinearLoRA}`` of rank ``rank`` for every LoRA module of ``mm`` (N(0,
    std) entries: large enough that adapters change the greedy tokens of a tiny model)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * std

    factors = {}
    for name, m in mm.slots.experts_modules.items():
        _, E, _, H = m.lora_a13.shape
        two_i, inter = m.lora_b13.shape[2], m.lora_a2.shape[3]
        factors[name] = ExpertsLoRA(rand(E, rank, H), rand(E, two_i, rank), rand(E, rank, inter), rand(E, H, rank))
    for name, m in mm.slots.linear_modules.items():
        factors[name] = LinearLoRA(rand(rank, m.in_features), rand(m.out_features, rank))
    return factors
