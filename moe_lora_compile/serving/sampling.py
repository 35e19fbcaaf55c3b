"""Per-request sampling that a seed makes reproducible whatever else runs in the batch.

``sample`` draws one token per row from ``softmax(logits / temperature)`` restricted to the top-k tokens (and those
tied with the k-th) and then to the nucleus of those (the fewest most likely of them whose probability, renormalised
over the top k, reaches ``top_p``: transformers' and vLLM's order), by the exponential race (Gumbel-max):
``argmax_i log p_i - log E_i`` with ``E_i ~ Exp(1)`` is distributed as ``p``. The noise ``E`` is not drawn from a
generator but computed from ``(seed, counter, token id)`` by an integer hash, so a row's draw depends only on its own
logits, its seed and its counter (the request's token index): the same request gives the same tokens alone or beside
any other requests, in any row, on any device (given the same logits), and the whole batch is sampled at once.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """An avalanching 32-bit integer hash of ``x`` (int64 holding values in ``[0, 2**32)``); the products stay
    below ``2**63`` (multipliers below ``2**31``)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def unit_interval(bits: Tensor) -> Tensor:
    """32-bit hashes (int64 in ``[0, 2**32)``) -> float32 uniforms in ``[2**-24, 1 - 2**-24]``: the top 23 bits plus
    a half, exact in float32 (with 24 bits the largest, ``2**24 - 0.5``, rounds to ``2**24``: U = 1, E = 0, and
    that token won every draw it came up in, whatever its probability)."""
    return ((bits >> 9).float() + 0.5) / float(1 << 23)


def uniform_noise(seeds: Tensor, counters: Tensor, vocab: int) -> Tensor:
    """``[n, vocab]`` float32 uniforms in ``(0, 1)`` from ``seeds [n]`` and ``counters [n]`` (int64): a pure
    function of ``(seed, counter, token id)``."""
    seeds, counters = seeds.long(), counters.long()
    key = _mix32(_mix32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (counters & _MASK32))
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    bits = _mix32(_mix32(key[:, None] ^ ids[None, :]) ^ (key[:, None] >> 7))
    return unit_interval(bits)


def filtered_scores(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor,
                    filtered: Optional[bool] = None) -> Tensor:
    """``(logits [n, V] - its row max) / temperature [n]`` in float32 with the tokens outside the top-k (``top_k [n]``, 0 = off)
    and outside the nucleus of the top-k distribution (``top_p [n]``, 1 = off) set to ``-inf``; the most likely token is always kept.
    ``filtered``: whether any row filters (None: found out from the tensors, a host sync on a GPU)."""
    logits = logits.float()
    # shifted so that the largest score is 0: a tiny temperature sends the others to -inf, never inf - inf = NaN
    scores = (logits - logits.amax(-1, keepdim=True)) / temperature.float()[:, None]
    if filtered is None:
        filtered = bool(((top_p < 1) | (top_k > 0)).any())
    if filtered:
        # ranked by the logits, not the scores: the order is the same for every temperature > 0, but a huge one
        # rounds the scores to ties (all 0), and top-k / top-p then kept arbitrary tokens
        order = logits.argsort(dim=-1, descending=True)
        ordered = scores.gather(1, order)
        ordered_logits = logits.gather(1, order)
        # top-k keeps every token whose logit reaches the k-th largest, ties included (transformers' TopK warper
        # and vLLM keep them too: with logits [2, 1.5, 1.5] and top_k=2 all three stay)
        kth = ordered_logits.gather(1, (top_k.long().clamp(1, logits.shape[-1]) - 1)[:, None])
        drop = (top_k[:, None] > 0) & (ordered_logits < kth)
        # the nucleus of the top-k tokens' renormalised distribution (transformers' TopK then TopP warpers, vLLM):
        # with p = [0.5, 0.3, 0.2], top_k=2, top_p=0.6 only the first token stays (0.5 / 0.8 >= 0.6)
        probs = ordered.masked_fill(drop, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        # top_p = 1 is off: its rows drop nothing (the float32 cumsum reaches 1.0 before the tail, which a row
        # batched with a filtering row then lost)
        drop |= (top_p < 1)[:, None] & (before >= top_p.float()[:, None])
        drop[:, 0] = False
        scores = scores.scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return scores


def sample(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seeds: Tensor, counters: Tensor, *,
           filtered: Optional[bool] = None) -> Tensor:
    """One token per row of ``logits [n, V]`` (int64 ``[n]``): greedy where ``temperature == 0``, else drawn as the
    module docstring says. All parameters are ``[n]`` tensors on the logits' device; ``filtered`` as in
    :func:`filtered_scores` (pass it to keep the call free of host syncs)."""
    hot = temperature > 0
    # a temperature outside float32's range (accepted: > 0 and finite) divides by float32's smallest normal instead
    # of 0, or by its largest number instead of inf (-inf / inf is NaN)
    f32 = torch.finfo(torch.float32)
    safe = torch.where(hot, temperature, torch.ones_like(temperature)).clamp(f32.tiny, f32.max).float()
    scores = filtered_scores(logits, safe, top_p, top_k, filtered)
    noise = uniform_noise(seeds, counters, logits.shape[-1])
    drawn = (scores - torch.log(-torch.log(noise))).argmax(-1)  # log p - log E, E = -log U ~ Exp(1)
    return torch.where(hot, drawn, logits.argmax(-1))
