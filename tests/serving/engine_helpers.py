"""Shared by the engine tests: random adapters as parsed factors, prompts, and the reference (``mm.generate`` alone)."""

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


def prompt(length: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(mm, prompt_ids, adapter, max_new_tokens: int, eos=None) -> list[int]:
    """The new tokens ``mm.generate`` gives this prompt alone (greedy; ``eos``: token ids, None = the model's)."""
    kwargs = {} if eos is None else {"eos_token_id": list(eos)}
    ids = torch.tensor([prompt_ids], device=mm.token_lora_ids.device)
    out = mm.generate(ids, adapters=[adapter], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                      **kwargs)
    return out[0, len(prompt_ids):].tolist()
