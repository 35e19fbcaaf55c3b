"""PEFT's own LoRA as it appears in a post-grad graph, and the ``moe_lora`` op arguments built from it.

Two PEFT forms (PEFT >= 0.21; the source is ``peft/tuners/lora/layer.py``):

- **Expert LoRA** (``LoraConfig(target_parameters=[".experts.gate_up_proj", ".experts.down_proj"])``):
  ``ParamWrapper`` parametrizes the 3-D expert weight for the duration of the forward as the *merged* weight
  ``W + s * lhs @ rhs`` (``baddbmm(W, lhs, rhs, alpha=s)``; older torch decomposes it into ``W + s * bmm``), which
  transformers' experts then read. :func:`low_rank_update` reads ``(W, lhs, rhs, s)`` back off such a weight and
  :func:`lora_stacks` turns the factors into the op's ``[1, E, R, in]`` / ``[1, E, out, R]`` slot-0 stacks (views,
  the scale folded into B, zero rank padding where the two projections' ranks differ), so the fused op reads ``W``
  and never the merged weight. Per-expert adapters (PEFT converts transformers-4 ``experts.{e}.w1/w3/w2`` folders
  into the same wrapper on load) take the same path. Where the graph also *returns* the merged weight, it stays
  computed: PEFT reads it inside ``torch.nn.utils.parametrize.cached()``, and Dynamo replays that cache write as a
  graph output (the pass counts these as ``merged_weight_outputs``).
- **Mixed-adapter dense LoRA** (``model(..., adapter_names=[...])``, PEFT's ``_mixed_batch_forward``): the base
  linear, then per adapter ``out[rows] = out[rows] + B(A(x[rows])) * s`` with ``rows`` a constant index list,
  i.e. a chain of ``index_put`` ops. :func:`match_mixed_linear` reads the chain; :func:`emit_mixed_lora_linear`
  stacks the adapters into ``L`` slots (per-call copies of the small A/B factors: PEFT keeps each adapter in its
  own parameters) and writes each row's slot id from the same index lists (``-1`` for ``"__base__"`` rows).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.fx import Node

from .fx_match import (TRANSPARENT, NoMatch, aten, column_vector, insert_call, is_call, require, same, same_shape, shape,
                       sizes_for, skip, val)
from .linear_patterns import _peft_delta, _terms, _transposed_2d


@dataclasses.dataclass(frozen=True)
class LowRankUpdate:
    """A merged expert weight ``W + sum_i scale_i * lhs_i @ rhs_i`` (one term per active PEFT adapter):
    W ``[E, P, Q]``, lhs_i ``[E, P, r_i]``, rhs_i ``[E, r_i, Q]``; ``merged``: the merged nodes, outermost first."""

    merged: tuple[Node, ...]
    base: Node
    terms: tuple[tuple[Node, Node, float], ...]

    @property
    def rank(self) -> int:
        return sum(shape(lhs)[2] for lhs, _, _ in self.terms)


def _number(a) -> Optional[float]:
    return float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else None


def _scaled_bmm(node: Node) -> Optional[tuple[Node, Node, float]]:
    """``s * bmm(lhs, rhs)`` (either operand order of the mul, ``s`` a Python number; no mul: ``s = 1``; a rank-1
    ``bmm`` may be the outer product ``lhs * rhs``)."""
    node, scale = skip(node), 1.0
    if is_call(node, aten.mul.Tensor):
        for t, s in (node.args[:2], node.args[1::-1]):
            if _number(s) is not None and isinstance(t, Node):
                node, scale = skip(t), _number(s)
                break
    if is_call(node, aten.bmm.default):
        return node.args[0], node.args[1], scale
    # a rank-1 bmm as Inductor decomposes it: the outer product [E, P, 1] * [E, 1, Q]
    if is_call(node, aten.mul.Tensor) and all(isinstance(a, Node) for a in node.args[:2]):
        lhs, rhs = node.args[:2]
        if len(shape(lhs) or ()) == 3 and len(shape(rhs) or ()) == 3 and shape(lhs)[2] == 1 and shape(rhs)[1] == 1:
            return lhs, rhs, scale
    return None


def _one_update(node: Node) -> Optional[tuple[Node, Node, Node, float]]:
    """``baddbmm(W, lhs, rhs, alpha=s)`` or ``W + s * bmm(lhs, rhs)`` of chaining 3-D shapes -> ``(W, lhs, rhs, s)``."""
    if is_call(node, aten.baddbmm.default):
        if node.kwargs.get("beta", 1) != 1 or _number(node.kwargs.get("alpha", 1)) is None:
            return None
        base, lhs, rhs, scale = node.args[0], node.args[1], node.args[2], _number(node.kwargs.get("alpha", 1))
    elif is_call(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1 \
            and all(isinstance(a, Node) for a in node.args[:2]):
        found = None
        for base, other in (node.args[:2], node.args[1::-1]):
            found = _scaled_bmm(other)
            if found is not None:
                break
        if found is None:
            return None
        lhs, rhs, scale = found
    else:
        return None
    shapes = [shape(n) for n in (base, lhs, rhs)]
    if any(s is None or len(s) != 3 for s in shapes):
        return None
    (E, P, Q), (e1, p, r), (e2, r2, q) = shapes
    if not (isinstance(r, int) and r == r2 and all(same(a, b) for a, b in ((E, e1), (E, e2), (P, p), (Q, q)))):
        return None
    return base, lhs, rhs, scale


def low_rank_update(weight: Node) -> Optional[LowRankUpdate]:
    """The low-rank updates merged into ``weight`` (``beta`` 1, as PEFT's ``_LoraFactorsProxy``; nested for several
    active adapters) down to the weight they are added to, else None."""
    merged, terms, node = [], [], skip(weight)
    while (found := _one_update(node)) is not None:
        merged.append(node)
        base, lhs, rhs, scale = found
        terms.append((lhs, rhs, scale))
        node = skip(base)
    if not terms:
        return None
    return LowRankUpdate(tuple(merged), base, tuple(reversed(terms)))


def returned_by_graph(update: LowRankUpdate) -> bool:
    """Whether the graph returns one of the merged weights (so it stays computed whatever the pass does)."""
    return any(u.op == "output" for node in update.merged for u in node.users)


# ---------------------------------------------------------------------------------------------------------------
# expert LoRA -> slot-0 stacks


def _factors(graph, u: LowRankUpdate, transposed: bool) -> tuple[Node, Node]:
    """``(A [E, r, in], B [E, out, r])`` of the update in the op's orientation, the scales folded into B and the
    terms' ranks concatenated (``sum_i B_i A_i = [B_1 .. B_n] [A_1; ..; A_n]``).

    ``[E, out, in]`` weights (``x @ W^T``): ``W + s lhs rhs`` is ``B = lhs``, ``A = rhs``. ``[E, in, out]`` weights
    (``x @ W``, transposed): ``x (W + s lhs rhs) = x W + s (x lhs) rhs``, so ``A = lhs^T`` and ``B = rhs^T``.
    """
    a_parts, b_parts = [], []
    for lhs, rhs, scale in u.terms:
        if transposed:
            a = insert_call(graph, aten.permute.default, (lhs, [0, 2, 1]))
            b = insert_call(graph, aten.permute.default, (rhs, [0, 2, 1]))
        else:
            a, b = rhs, lhs
        if scale != 1.0:
            b = insert_call(graph, aten.mul.Tensor, (b, scale))
        a_parts.append(a)
        b_parts.append(b)
    if len(u.terms) == 1:
        return a_parts[0], b_parts[0]
    return insert_call(graph, aten.cat.default, (a_parts, 1)), insert_call(graph, aten.cat.default, (b_parts, 2))


def _pad_rank(graph, a: Node, b: Node, rank: int) -> tuple[Node, Node]:
    """Zero-pad A's rows and B's columns up to ``rank`` (the product, hence the delta, is unchanged)."""
    extra = rank - shape(a)[1]
    if extra:
        a = insert_call(graph, aten.constant_pad_nd.default, (a, [0, 0, 0, extra], 0.0))
        b = insert_call(graph, aten.constant_pad_nd.default, (b, [0, extra], 0.0))
    return a, b


def lora_stacks(graph, updates: tuple[Optional[LowRankUpdate], Optional[LowRankUpdate]], transposed: bool,
                dims: tuple, x: Node) -> tuple[tuple[Node, Node, Node, Node], Node]:
    """Slot-0 stacks ``(a13, b13, a2, b2)`` from the gate/up and down updates (a missing one gets zero factors) and
    ``token_lora_ids`` of zeros (every token uses PEFT's one active adapter). ``dims``: ``(E, H, I)`` ints."""
    E, H, I = dims
    rank = max(u.rank for u in updates if u is not None)
    ref = val(next(u.terms[0][0] for u in updates if u is not None))
    opts = dict(dtype=ref.dtype, device=ref.device)
    stacks = []
    for u, (n_in, n_out) in zip(updates, ((H, 2 * I), (I, H))):
        if u is None:
            a = insert_call(graph, aten.full.default, ([E, rank, n_in], 0.0), opts)
            b = insert_call(graph, aten.full.default, ([E, n_out, rank], 0.0), opts)
        else:
            a, b = _pad_rank(graph, *_factors(graph, u, transposed), rank)
        stacks += [insert_call(graph, aten.unsqueeze.default, (t, 0)) for t in (a, b)]
    T = shape(x)[0]
    if not isinstance(T, int):
        T = insert_call(graph, aten.sym_size.int, (x, 0))
    ids = insert_call(graph, aten.full.default, ([T], 0), dict(dtype=torch.int32, device=ref.device))
    return tuple(stacks), ids


# ---------------------------------------------------------------------------------------------------------------
# mixed-adapter dense LoRA


@dataclasses.dataclass
class MixedAdapter:
    rows: Node  # int64 index of the batch rows (sequences) using this adapter
    lora_a: Node  # [r, in]
    lora_b: Node  # [out, r]
    scale: float


@dataclasses.dataclass
class MixedLinearMatch:
    anchor: Node  # the last index_put, [B, ..., out]
    x: Node  # [T, in]: the base linear's input
    batched_x: Node  # [B, ..., in]: what the adapters' rows are taken from
    weight: Node  # [out, in]
    bias: Optional[Node]
    adapters: list[MixedAdapter]
    form: str = "peft_mixed"

    def describe(self) -> str:
        ranks = [shape(a.lora_a)[0] for a in self.adapters]
        return f"{self.form} at {self.anchor.name}: {len(self.adapters)} adapters, ranks {ranks}"


def _index_values(node: Node) -> Optional[list[int]]:
    """The values of a constant 1-D index (``full([n], v)`` or a lifted tensor constant), else None."""
    node = skip(node)
    if is_call(node, aten.full.default) and isinstance(node.args[0], (list, tuple)) and len(node.args[0]) == 1 \
            and all(isinstance(a, int) for a in (node.args[0][0], node.args[1])):
        return [node.args[1]] * node.args[0][0]
    if is_call(node, aten.lift_fresh_copy.default):
        node = node.args[0]
    if isinstance(node, Node) and node.op == "get_attr" and node.graph.owning_module is not None:
        tensor = getattr(node.graph.owning_module, node.target, None)
        if isinstance(tensor, torch.Tensor) and tensor.dim() == 1 and not tensor.dtype.is_floating_point:
            return tensor.tolist()
    return None


def _same_rows(a: Node, b: Node) -> bool:
    if skip(a) is skip(b):
        return True
    va, vb = _index_values(a), _index_values(b)
    return va is not None and va == vb


def _single_index(node: Node, source: Node) -> Optional[Node]:
    """``source[rows]`` (an ``index`` with one index tensor on dim 0) -> ``rows``, else None."""
    node = skip(node)
    if is_call(node, aten.index.Tensor) and skip(node.args[0]) is skip(source) and len(node.args[1]) == 1 \
            and node.args[1][0] is not None:
        return node.args[1][0]
    return None


def _adapter_term(put: Node, batched_x: Optional[Node]) -> tuple[MixedAdapter, Node]:
    """One ``index_put(prev, [rows], prev[rows] + B(A(x[rows])) * s)`` -> (adapter, x it reads)."""
    require(len(put.args[1]) == 1 and put.args[1][0] is not None, f"{put.name}: index_put with other than one index")
    prev, (rows,), value = put.args[0], put.args[1], put.args[2]
    require(not (len(put.args) > 3 and put.args[3]) and not put.kwargs.get("accumulate", False),
            f"{put.name}: accumulating index_put")
    added = skip(value)
    require(is_call(added, aten.add.Tensor) and added.kwargs.get("alpha", 1) == 1, f"{put.name}: value is no add")
    for old, delta in (added.args[:2], added.args[1::-1]):
        old_rows = _single_index(old, prev) if isinstance(old, Node) else None
        found = _peft_delta(delta) if old_rows is not None and isinstance(delta, Node) else None
        if found is not None:
            break
    else:
        raise NoMatch(f"{put.name}: value is not out[rows] + B(A(x[rows])) * s")
    x_sub, a, b, scale = found
    require(_same_rows(old_rows, rows), f"{put.name}: reads other rows than it writes")
    x_rows = skip(x_sub)
    require(is_call(x_rows, aten.index.Tensor) and len(x_rows.args[1]) == 1, f"{put.name}: LoRA input is no x[rows]")
    source = x_rows.args[0]
    require(batched_x is None or skip(source) is skip(batched_x), f"{put.name}: adapters read different inputs")
    require(_same_rows(x_rows.args[1][0], rows), f"{put.name}: LoRA reads other rows than it writes")
    return MixedAdapter(rows, a, b, scale), source


def feeds_another_row_update(put: Node) -> bool:
    """Whether an ``index_put`` reads ``put`` (through views) as the tensor it writes into: then ``put`` is not the
    last adapter of a chain."""
    frontier = list(put.users)
    while frontier:
        user = frontier.pop()
        if is_call(user, aten.index_put.default) and skip(user.args[0]) is put:
            return True
        if is_call(user, *TRANSPARENT):
            frontier += list(user.users)
    return False


def _previous_row_update(node: Node) -> Optional[Node]:
    """The ``index_put`` behind ``node`` through views that end in its own shape (functionalization's round trips)."""
    inner = skip(node)
    return inner if is_call(inner, aten.index_put.default) and same_shape(node, shape(inner)) else None


def match_mixed_linear(anchor: Node) -> MixedLinearMatch:
    """Read PEFT's mixed-adapter forward ending at the ``index_put`` ``anchor``: a chain of per-adapter row updates
    on top of ``x W^T (+ b)``."""
    require(is_call(anchor, aten.index_put.default), f"{anchor.name}: not an index_put")
    require(not feeds_another_row_update(anchor), f"{anchor.name}: not the last adapter of the chain")
    adapters, put, batched_x = [], anchor, None
    while True:
        adapter, batched_x = _adapter_term(put, batched_x)
        adapters.append(adapter)
        node = put.args[0]
        put = _previous_row_update(node)
        if put is None:
            break
    adapters.reverse()
    terms = _terms(node)
    mms = [t for t in terms if isinstance(t, tuple)]
    require(len(mms) == 1 and len(terms) <= 2, f"{node.name}: the rows' base is no single linear")
    _, x, w_t = mms[0]
    weight = _transposed_2d(w_t)
    require(weight is not None, f"{node.name}: base matmul is no x @ W^T")
    out = shape(weight)[0]
    bias = [column_vector(t, out) for t in terms if not isinstance(t, tuple)]
    require(all(b is not None for b in bias), f"{node.name}: the term besides the base linear is no [out] bias")
    require(skip(x) is skip(batched_x), f"{anchor.name}: adapters read another input than the base linear")
    B = shape(batched_x)[0]
    require(len(shape(batched_x)) >= 2 and same(shape(anchor)[0], B), f"{anchor.name}: rows are not batch rows")
    n_in = shape(weight)[1]
    for a in adapters:
        require(shape(a.lora_a)[1] == n_in and shape(a.lora_b)[0] == out and shape(a.lora_a)[0] == shape(a.lora_b)[1],
                f"{anchor.name}: adapter shapes {shape(a.lora_a)}/{shape(a.lora_b)} do not fit W {shape(weight)}")
    # PEFT's lists are disjoint (one adapter per row); overlapping ones would add two deltas to a row, which one
    # slot per row cannot express: only constant, provably disjoint lists are fused
    values = [_index_values(a.rows) for a in adapters]
    require(all(v is not None for v in values), f"{anchor.name}: adapter rows are not constants")
    flat = [r for v in values for r in v]
    require(len(flat) == len(set(flat)), f"{anchor.name}: adapter row lists overlap")
    x_flat = x if len(shape(x)) == 2 else None
    require(x_flat is not None, f"{anchor.name}: base input is not [T, in]")
    return MixedLinearMatch(anchor, x_flat, batched_x, weight, bias[0] if bias else None, adapters)


def _stack(graph, nodes: list[Node]) -> Node:
    """``torch.stack(nodes)`` as post-grad graphs spell it (``stack`` is decomposed before the pass runs)."""
    parts = [insert_call(graph, aten.unsqueeze.default, (n, 0)) for n in nodes]
    return parts[0] if len(parts) == 1 else insert_call(graph, aten.cat.default, (parts, 0))


def emit_mixed_lora_linear(graph, m: MixedLinearMatch) -> Node:
    """``lora_linear`` over ``L`` stacked adapter slots (rank-padded, scale folded into B) and per-row slot ids."""
    rank = max(shape(a.lora_a)[0] for a in m.adapters)
    stacked_a, stacked_b = [], []
    for adapter in m.adapters:
        a, b = adapter.lora_a, adapter.lora_b
        if adapter.scale != 1.0:
            b = insert_call(graph, aten.mul.Tensor, (b, adapter.scale))
        extra = rank - shape(a)[0]
        if extra:
            a = insert_call(graph, aten.constant_pad_nd.default, (a, [0, 0, 0, extra], 0.0))
            b = insert_call(graph, aten.constant_pad_nd.default, (b, [0, extra], 0.0))
        stacked_a.append(a)
        stacked_b.append(b)
    lora_a, lora_b = _stack(graph, stacked_a), _stack(graph, stacked_b)
    batch = list(shape(m.batched_x)[:-1])
    device = val(m.x).device
    sizes = sizes_for(graph, batch[:1], [m.batched_x])
    require(sizes is not None, f"{m.anchor.name}: batch size has no source")
    ids = insert_call(graph, aten.full.default, (sizes, -1), dict(dtype=torch.int32, device=device))
    for slot, adapter in enumerate(m.adapters):
        value = insert_call(graph, aten.full.default, ([], slot), dict(dtype=torch.int32, device=device))
        ids = insert_call(graph, aten.index_put.default, (ids, [adapter.rows], value))
    if len(batch) > 1:  # every token of a sequence gets its sequence's slot
        sizes = sizes_for(graph, batch, [m.batched_x])
        flat = sizes_for(graph, shape(m.x)[:1], [m.x, m.batched_x])
        require(sizes is not None and flat is not None, f"{m.anchor.name}: token count has no source")
        ids = insert_call(graph, aten.reshape.default, (ids, [-1] + [1] * (len(batch) - 1)))
        ids = insert_call(graph, aten.expand.default, (ids, sizes))
        ids = insert_call(graph, aten.reshape.default, (ids, flat))
    return insert_call(graph, torch.ops.moe_lora.lora_linear.default, (m.x, m.weight, lora_a, lora_b, ids, m.bias))
