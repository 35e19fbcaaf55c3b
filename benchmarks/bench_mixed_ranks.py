"""Mixed-rank rows of the layer benchmark (``bench_fused_moe_lora.py --mixed-ranks``): one MoE layer, slots padded to
``max_rank`` R = 64, adapters of rank 8 / 16 / 64 across the L = 8 slots (8, 16, 64, 8, 16, 64, 8, 16; every token
with an adapter, slots drawn at random), timed like the grid (:mod:`moe_layer`: CUDA-graph replays, L2 flushed,
weights alternating between two sets):

- ``ranked_us``: ``fused_moe_lora`` with ``lora_ranks`` (each slot read up to its own rank);
- ``padded_us``: the same stacks (zero past each rank) with ``lora_ranks=None``: every slot read at R = 64, today's
  behaviour before per-slot ranks (and vLLM's);
- ``uniform_us``: every slot a rank-64 adapter (``lora_ranks=None``): the most a batch of these slots can cost;
- ``base_us``: every token at -1;
- ``floor_us`` / ``padded_floor_us``: the HBM floor with the LoRA factors at each slot's real rank / at R;
  ``pct_floor`` = floor / ranked.

    python benchmarks/bench_fused_moe_lora.py --mixed-ranks [--tokens 1 8 32] --json ranks.json --md ranks.md
"""

from __future__ import annotations

import time

import torch

from moe_layer import bytes_moved, fmt, lora_stacks, make_batch, make_layer, no_adapter, time_graph
from moe_lora_compile.shapes import MODELS

MAX_RANK = 64
SLOT_RANKS = (8, 16, 64, 8, 16, 64, 8, 16)
RANK_COLUMNS = ["model", "T", "ranked_us", "padded_us", "uniform_us", "base_us", "floor_us", "padded_floor_us",
                "pct_floor", "ranked_vs_padded"]


def _ranked_stacks(layer, L: int, R: int, ranks) -> tuple:
    """``lora_stacks(layer, L, R)`` with slot ``l``'s rank entries past ``ranks[l]`` zeroed (a copy)."""
    stacks = tuple(t.clone() for t in lora_stacks(layer, L, R))
    for slot, rank in enumerate(ranks):
        for t, rank_dim in zip(stacks, (1, 2, 1, 2)):
            t[slot].narrow(rank_dim, rank, R - rank).zero_()
    return stacks


def _call(layer, lora, batch, lora_ranks):
    g = layer.geometry
    x, ids, w, lora_ids = batch
    return lambda: torch.ops.moe_lora.fused_moe_lora(
        x, ids, w, lora_ids, layer.w13, layer.w2, *lora, w13_bias=layer.w13_bias, w2_bias=layer.w2_bias,
        lora_ranks=lora_ranks, layout=g.layout, activation=g.activation)


def _ranked_bytes(g, batch, ranks) -> float:
    """:func:`moe_layer.bytes_moved` with each (slot, expert) pair's factors at its slot's rank."""
    _, ids, _, lora_ids = batch
    base = bytes_moved(g, 0, batch)  # experts, x and y
    slots = lora_ids.long()[:, None].expand_as(ids)
    pairs = torch.unique((slots * g.E + ids.long())[slots >= 0])
    rank_of = torch.tensor(ranks, device=pairs.device)[pairs // g.E]
    return base + int(rank_of.sum()) * (g.H + 2 * g.I + g.I + g.H) * 2


def mixed_ranks_grid(models, tokens, sets: int, hbm_tbs: float, warmup_ms: int, rep_ms: int, on_row=None):
    results = []
    L, R = len(SLOT_RANKS), MAX_RANK
    for model in models:
        g = MODELS[model]
        torch.cuda.empty_cache()
        layers = [make_layer(g, seed) for seed in (1, 2)]
        uniform = [lora_stacks(lay, L, R) for lay in layers]
        ranked = [_ranked_stacks(lay, L, R, SLOT_RANKS) for lay in layers]
        lora_ranks = torch.tensor([SLOT_RANKS, SLOT_RANKS], dtype=torch.int32, device="cuda")
        for T in tokens:
            t0 = time.time()
            batches = [make_batch(g, T, L, 0.0, seed=100 + s) for s in range(sets)]

            def timed(stacks, ranks, batch_of=lambda b: b):
                return time_graph([_call(layers[s % 2], stacks[s % 2], batch_of(batches[s]), ranks)
                                   for s in range(sets)], warmup_ms, rep_ms)

            row = dict(model=model, T=T, ranked_us=timed(ranked, lora_ranks), padded_us=timed(ranked, None),
                       uniform_us=timed(uniform, None), base_us=timed(uniform, None, no_adapter))
            row["floor_us"] = sum(_ranked_bytes(g, b, SLOT_RANKS) for b in batches) / sets / (hbm_tbs * 1e6)
            row["padded_floor_us"] = sum(bytes_moved(g, R, b) for b in batches) / sets / (hbm_tbs * 1e6)
            row["pct_floor"] = 100 * row["floor_us"] / row["ranked_us"]
            row["ranked_vs_padded"] = row["ranked_us"] / row["padded_us"]
            results.append(row)
            if on_row is not None:
                on_row(results)
            print(" ".join(f"{c}={fmt(row[c])}" for c in RANK_COLUMNS) + f"  ({time.time() - t0:.1f}s)", flush=True)
        layers = uniform = ranked = None  # free this model's weights before the next one
    return results


def mixed_ranks_markdown(results) -> str:
    lines = [f"Slots of rank {'/'.join(map(str, SLOT_RANKS))} padded to {MAX_RANK}, every token with an adapter; "
             "us per layer (CUDA-graph replay, L2 flushed).", "",
             "| " + " | ".join(RANK_COLUMNS) + " |", "|" + "---|" * len(RANK_COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in RANK_COLUMNS) + " |" for r in results]
    return "\n".join(lines)
