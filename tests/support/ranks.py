"""Slot stacks with each slot's entries past its rank poisoned: what the per-slot rank tests feed the kernels."""

from __future__ import annotations

import torch

NAN = float("nan")


def poison_moe(args, ranks13, ranks2, split_half=None):
    """``(clean, dirty)`` MoE argument tuples: slot ``l``'s rank entries past ``ranks13[l]`` (w13; in each half of
    ``split_half`` entries for the split form) / ``ranks2[l]`` (w2) zeroed in ``clean``, NaN in ``dirty``."""
    clean, dirty = list(args), list(args)
    for pos, ranks, rank_dim in ((6, ranks13, 2), (7, ranks13, 3), (8, ranks2, 2), (9, ranks2, 3)):
        c, d = args[pos].clone(), args[pos].clone()
        size = c.shape[rank_dim]
        r = torch.arange(size)
        block = split_half if (split_half and pos == 6) else size
        for slot, rank in enumerate(ranks):
            pad = (r % block) >= rank
            c[slot].index_fill_(rank_dim - 1, pad.nonzero().squeeze(1).to(c.device), 0.0)
            d[slot].index_fill_(rank_dim - 1, pad.nonzero().squeeze(1).to(d.device), NAN)
        clean[pos], dirty[pos] = c, d
    return tuple(clean), tuple(dirty)
