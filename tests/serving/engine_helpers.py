"""Shared by the engine tests: prompts and the reference (``mm.generate`` alone); random adapters are in
``support.factors``."""

from __future__ import annotations

import torch



def prompt(length: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(3, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone(mm, prompt_ids, adapter, max_new_tokens: int, eos=None) -> list[int]:
    """The new tokens ``mm.generate`` gives this prompt alone (greedy; ``eos``: token ids, None = the model's)."""
    kwargs = {} if eos is None else {"eos_token_id": list(eos)}
    ids = torch.tensor([prompt_ids], device=mm.token_lora_ids.device)
    out = mm.generate(ids, adapters=[adapter], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                      **kwargs)
    return out[0, len(prompt_ids):].tolist()
