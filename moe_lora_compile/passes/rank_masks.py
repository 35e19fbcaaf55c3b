"""Per-slot rank masks in a post-grad graph, read back as the ``lora_ranks`` tensor the fused ops take.

Modules that hold each slot's real rank (:class:`~moe_lora_compile.models.dense.LoRALinear`, the MoE experts after
``attach``) pass ``lora_ranks`` to the reference, which drops a slot's factor entries past its rank with
``where(keep, factor, 0)``, ``keep = rank_keep(lora_ranks, R, block)`` (``[L, R]`` bool; the MoE reference then
gathers ``keep[slot]`` per pair). The matchers look through that ``where``: the fused op gets the unmasked factors
and the rank tensor, and its kernels never read the dropped entries. The rank tensor is found among ``keep``'s
inputs and confirmed *numerically*: the graph's own ``keep`` nodes are evaluated on probe ranks and must equal
:func:`~moe_lora_compile.ops.reference.rank_keep` of the probe, so a mask of any other meaning is never dropped.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx import Node

from ..ops.reference import rank_keep
from .fx_match import NoMatch, aten, chain, is_call, require, shape, skip, val, where_or_zero

_MAX_REGION = 64  # nodes between the rank tensor and ``keep``; the reference's rank_keep is ~10


def unmask(node: Node) -> tuple[Node, Optional[Node]]:
    """``where(cond, value, 0)`` -> ``(value, cond)``; anything else -> ``(node, None)``."""
    found = where_or_zero(node)
    return (node, None) if found is None else (found[1], found[0])


def pair_keep(cond: Node, slot: Node) -> Node:
    """``keep[slot]`` (through views, and a leading ``[:, :n]`` slice of the rank axis) -> ``keep`` [L, R];
    raises NoMatch. ``slot`` is the per-pair slot index the factors are gathered with."""
    node = skip(cond)
    if is_call(node, aten.slice.Tensor) and node.args[1] == 1 and node.args[2] == 0:
        node = skip(node.args[0])
    require(is_call(node, aten.index.Tensor) and len(node.args[1]) == 1 and skip(node.args[1][0]) is skip(slot),
            f"{node.name}: a factor mask that is not a per-slot keep gathered by the pairs' slots")
    return node.args[0]


def _evaluate(keep: Node, leaf: Node, probe: torch.Tensor) -> torch.Tensor:
    """The graph's nodes from ``leaf`` to ``keep``, run on CPU with ``probe`` in place of ``leaf``."""
    env: dict[Node, object] = {leaf: probe}

    def run(node: Node):
        if node in env:
            return env[node]
        require(node.op == "call_function", f"rank mask reads {node.name} ({node.op}), not only the rank tensor")
        require(len(env) < _MAX_REGION, "rank mask subgraph too large")
        look = lambda a: run(a) if isinstance(a, Node) else a  # noqa: E731
        args = torch.fx.node.map_aggregate(node.args, look)
        kwargs = {k: torch.device("cpu") if k == "device" else torch.fx.node.map_aggregate(v, look)
                  for k, v in node.kwargs.items()}
        env[node] = node.target(*args, **kwargs)
        return env[node]

    return run(keep)


def _ancestors(node: Node) -> list[Node]:
    """Nodes ``node`` reads, breadth first (nearest first)."""
    seen, out, frontier = {node}, [], [node]
    while frontier and len(out) < _MAX_REGION:
        cur = frontier.pop(0)
        for arg in cur.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                out.append(arg)
                frontier.append(arg)
    return out


def rank_source(keep: Node, n_slots: int, R: int) -> Node:
    """The rank tensor (``[L]`` or ``[n, L]`` int, as the graph holds it) that ``keep`` [L, R] is
    ``rank_keep(ranks, R, R // n)`` of; raises NoMatch."""
    v = val(keep)
    require(isinstance(v, torch.Tensor) and v.dtype == torch.bool and tuple(v.shape) == (n_slots, R),
            f"{keep.name}: not an [L, R] bool rank mask")
    gen = torch.Generator().manual_seed(0)
    for cand in _ancestors(keep):
        cv = val(cand)
        if not (isinstance(cv, torch.Tensor) and not cv.dtype.is_floating_point and cv.dtype != torch.bool
                and cv.dim() in (1, 2) and all(isinstance(d, int) for d in cv.shape) and cv.shape[-1] == n_slots):
            continue
        n = cv.shape[0] if cv.dim() == 2 else 1
        if R % n:
            continue
        try:
            ok = all(torch.equal(_evaluate(keep, cand, probe).bool(), rank_keep(probe, R, R // n))
                     for probe in (torch.randint(0, R + 1, tuple(cv.shape), generator=gen) for _ in range(3)))
        except (NoMatch, RuntimeError, TypeError, IndexError):
            continue
        if ok:  # the same values behind views and casts: the tensor as the module holds it
            return next(n for n in reversed(chain(cand)) if val(n) is not None and val(n).numel() == cv.numel())
    raise NoMatch(f"{keep.name}: a factor mask that is not rank_keep of a per-slot rank tensor")


def as_rank_vector(graph, ranks: Node, insert_call) -> Node:
    """``ranks`` ([L] or [1, L], any int dtype) as an int32 [L] node."""
    if len(shape(ranks)) == 2:
        ranks = insert_call(graph, aten.reshape.default, (ranks, [shape(ranks)[1]]))
    if val(ranks).dtype != torch.int32:
        ranks = insert_call(graph, torch.ops.prims.convert_element_type.default, (ranks, torch.int32))
    return ranks
