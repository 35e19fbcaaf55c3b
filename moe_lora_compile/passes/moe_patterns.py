"""Find MoE expert subgraphs in a post-grad graph and read off the arguments of ``moe_lora::fused_moe_lora``.

Two source forms, both anchored on the final ``pairs.view(T, k, H).sum(dim=1)``:

- ``pairwise``: per (token, k) pair ``bmm`` with gathered expert weights ``w[experts]``: our reference
  (:func:`~moe_lora_compile.ops.reference.fused_moe_lora_reference`, LoRA terms selected by ``token_lora_ids >= 0``)
  and transformers' ``batched_mm`` experts;
- ``grouped``: transformers' ``grouped_mm`` experts (sort by expert, ``_grouped_mm`` with offsets, inverse permute).

In both, an expert weight may be PEFT's merged ``W + s * lhs @ rhs`` (a ``target_parameters`` adapter,
:mod:`.peft_patterns`): the match then reads ``W`` and the factors, and its form is tagged ``peft_pairwise`` /
``peft_grouped``. Llama-4's experts (every token through every expert) are matched in :mod:`.dense_experts`.

Why a hand-written matcher rather than traced ``register_replacement`` patterns: the op has 3 layouts x 2
activations x 4 bias combinations x 2 routing placements, each again with and without the casts a bf16 model adds,
and Inductor's decompositions (``silu`` -> ``neg/exp/add/div``, ``chunk`` -> ``split``) differ across torch
versions. So this matcher follows data flow through views and casts (:func:`.fx_match.skip`), checks shapes
symbolically, and identifies the activation (and the gate/up order) *numerically*: it evaluates the graph's own
activation nodes on a random probe and compares with the contract's activations. ``torch._inductor.pattern_matcher``
still finds the anchors and drives the rewrite (:mod:`.graph_pass`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import operator
from typing import Optional

import torch
from torch.fx import Node

from ..ops.contract import GPTOSS_ALPHA, GPTOSS_LIMIT, NO_ADAPTER
from ..ops.layout import CONCAT, TRANSPOSED_INTERLEAVED, expert_geometry, is_transposed, layout_of, split_gate_up
from ..ops.reference import glu_activation
from . import peft_patterns, rank_masks
from .fx_match import (CASTS, NoMatch, aten, chain, find_in_chain, insert_call, is_call, is_zero, name, require,
                       same, same_shape, shape, skip, val, where_or_zero)


def _grouped_mm_targets() -> tuple:
    """``aten._grouped_mm`` (torch >= 2.8) and transformers' opaque ``grouped_mm_fallback`` op (what compile
    gets outside bf16), when present."""
    ops = (getattr(aten, "_grouped_mm", None),
           getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None))
    return tuple(op.default for op in ops if op is not None)


@dataclasses.dataclass
class Projection:
    """One expert projection ``out = W[e] x (+ B[l,e] A[l,e] x) (+ bias[e])`` found in the graph."""

    root: Node  # the node holding the projection's result
    weight: Node  # base weight [E, out, in] or, transposed, [E, in, out]
    transposed: bool
    inp: Node  # the per-pair input as the matmul reads it
    experts: Node  # per-pair expert ids as the gather reads them (grouped form: the group offsets)
    lora_a: Optional[Node] = None
    lora_b: Optional[Node] = None
    lora_ids: Optional[Node] = None  # per-pair slot ids (before clamp)
    lora_ranks: Optional[Node] = None  # each slot's rank ([L] / [1, L] int) when the factors are rank-masked
    bias: Optional[Node] = None
    bias_experts: Optional[Node] = None  # the ids the bias is gathered with
    update: Optional[peft_patterns.LowRankUpdate] = None  # PEFT's merged weight W + s lhs rhs (then weight is W)


@dataclasses.dataclass
class MoEMatch:
    """Everything needed to emit one ``fused_moe_lora`` call in place of ``anchor``."""

    form: str
    anchor: Node
    x: Node
    topk_ids: Node
    topk_weights: Node
    token_lora_ids: Optional[Node]  # None: no LoRA in the source subgraph
    w13: Node
    w2: Node
    lora: Optional[tuple[Node, Node, Node, Node]]
    w13_bias: Optional[Node]
    w2_bias: Optional[Node]
    layout: str
    activation: str
    alpha: float
    limit: float
    routing_weight_on_input: bool
    updates: Optional[tuple] = None  # PEFT's (gate/up, down) LowRankUpdate, either may be None
    lora_ranks: Optional[tuple[Node, Node]] = None  # (w13, w2) per-slot rank tensors of rank-masked factors

    def describe(self) -> str:
        lora = "peft" if self.updates else "yes" if self.lora else "no"
        return (f"{self.form} at {self.anchor.name}: layout={self.layout} activation={self.activation} "
                f"alpha={self.alpha} limit={self.limit} lora={lora} "
                f"bias={self.w13_bias is not None}/{self.w2_bias is not None} "
                f"routing_on_input={self.routing_weight_on_input}")


# ---------------------------------------------------------------------------------------------------------------
# projections


def _sum_terms(node: Node) -> list[Node]:
    """Flatten ``a + b + ...`` (looking through views and casts) into its terms."""
    inner = skip(node)
    if is_call(inner, aten.add.Tensor) and all(isinstance(a, Node) for a in inner.args[:2]) \
            and inner.kwargs.get("alpha", 1) == 1:
        return _sum_terms(inner.args[0]) + _sum_terms(inner.args[1])
    return [node]


def _gather(node: Node, rank: int, n_index: int) -> Optional[tuple[Node, list]]:
    """``src[idx...]`` of a ``rank``-D source with ``n_index`` index tensors -> ``(src, indices)``, else None."""
    node = skip(node)
    if not is_call(node, aten.index.Tensor):
        return None
    src, indices = node.args[0], node.args[1]
    if len(indices) != n_index or any(i is None for i in indices) or shape(src) is None:
        return None
    # the source behind views and casts (a weight behind its cast); else the furthest-back node of the gathered
    # tensor's own shape (x.view(-1, H) of a [B, S, H] input gathers rows of the view, not of the input)
    candidates = [skip(src)] + [n for n in reversed(chain(src)) if same_shape(n, shape(src))]
    src = next((n for n in candidates if len(shape(n) or ()) == rank), None)
    return None if src is None else (src, list(indices))


def _bmm_operands(node: Node) -> Optional[tuple]:
    """``(a, b)`` of ``bmm(a, b)``, also in the form Inductor decomposes a skinny bmm into under
    ``coordinate_descent_tuning`` on GPU: ``(a.unsqueeze(-1) * b.unsqueeze(1)).sum(dim=2)``; else None."""
    node = skip(node)
    if is_call(node, aten.bmm.default):
        return node.args[0], node.args[1]
    if not (is_call(node, aten.sum.dim_IntList) and list(node.args[1]) == [2] and len(shape(node) or ()) == 3):
        return None
    prod = skip(node.args[0])
    if not (is_call(prod, aten.mul.Tensor) and all(isinstance(a, Node) for a in prod.args[:2])):
        return None
    a_u, b_u = (_cast_free(a) for a in prod.args[:2])
    if is_call(a_u, aten.unsqueeze.default) and a_u.args[1] in (-1, 3) \
            and is_call(b_u, aten.unsqueeze.default) and b_u.args[1] == 1:
        return a_u.args[0], b_u.args[0]
    return None


def _without_sentinel_mask(node: Node) -> Node:
    """``x.masked_fill(ids >= E, 0)`` -> ``x`` (through views and casts); anything else comes back as is.

    transformers 5.17-5.2x zero the rows of expert-parallel sentinel ids (``>= num_experts``) this way. Without
    expert parallelism no id reaches E (they come from a top-k over E experts), and the fused op asserts ids in
    ``[0, E)``, so dropping the mask never hides a sentinel silently."""
    inner = skip(node)
    if is_call(inner, aten.masked_fill.Scalar) and inner.args[2] == 0:  # as traced
        mask, kept = inner.args[1], inner.args[0]
    elif is_call(inner, aten.where.self) and is_zero(inner.args[1]):  # as Inductor decomposes it
        mask, kept = inner.args[0], inner.args[2]
    else:
        return node
    return kept if is_call(skip(mask), aten.ge.Scalar) else node


def _without_id_clamp(node: Node) -> Node:
    """``ids.clamp(0, E - 1)`` (or ``clamp_max``) of integer expert ids -> ``ids``: transformers' in-bounds clamp of
    expert-parallel sentinels, a no-op for ids from a top-k (see :func:`_without_sentinel_mask`)."""
    inner = skip(node)
    clamps = (aten.clamp.default, aten.clamp_max.default, aten.clamp_min.default)
    while is_call(inner, *clamps) and isinstance(val(inner), torch.Tensor) and not val(inner).dtype.is_floating_point:
        node, inner = inner.args[0], skip(inner.args[0])
    return node


def _cast_free(node: Node) -> Node:
    while is_call(node, *CASTS):
        node = node.args[0]
    return node


def _lora_term(term: Node):
    """``where(ids >= 0, bmm(B[slot,e], bmm(A[slot,e], x)), 0)`` -> ``(A, B, ids, e, x, ranks)``, else None.

    Each gathered factor may be rank-masked (``where(keep[slot], factor, 0)``, the reference with per-slot ranks):
    ``ranks`` is then the slot-rank tensor behind ``keep`` (:mod:`.rank_masks`), else None."""
    selected = where_or_zero(term)
    if selected is None:
        return None
    mask, prod = selected
    outer, ge = _bmm_operands(prod), skip(mask)
    if outer is None or not (is_call(ge, aten.ge.Scalar) and ge.args[1] == 0):
        return None
    b_gathered, b_keep = rank_masks.unmask(outer[0])
    b = _gather(b_gathered, 4, 2)
    inner = _bmm_operands(outer[1])
    if b is None or inner is None:
        return None
    a_gathered, a_keep = rank_masks.unmask(inner[0])
    a = _gather(a_gathered, 4, 2)
    if a is None:
        return None
    (a_src, (a_slot, a_e)), (b_src, (b_slot, b_e)) = a, b
    ids = skip(ge.args[0])
    slots = [skip(s) for s in (a_slot, b_slot)]
    if not all(is_call(s, aten.clamp_min.default) and skip(s.args[0]) is ids for s in slots):
        return None
    if skip(a_e) is not skip(b_e):
        return None
    ranks = None
    if a_keep is not None or b_keep is not None:
        require(a_keep is not None and b_keep is not None, f"{term.name}: only one LoRA factor is rank-masked")
        keep = rank_masks.pair_keep(a_keep, a_slot)
        require(rank_masks.pair_keep(b_keep, b_slot) is keep, f"{term.name}: A and B masked by different ranks")
        L, R = shape(a_src)[0], shape(a_src)[2]
        ranks = rank_masks.rank_source(keep, L, R)
        require(val(ranks).numel() == L, f"{term.name}: MoE factors masked by {shape(ranks)} ranks, not [L]")
    return a_src, b_src, ge.args[0], a_e, inner[1], ranks


def _base_bmm_term(term: Node):
    """``bmm(W[e], x)`` or, transposed, ``bmm(x, W[e])`` -> ``(W, e, x, transposed)``, else None."""
    operands = _bmm_operands(term)
    if operands is None:
        return None
    lhs, rhs = operands
    g = _gather(lhs, 3, 1)
    if g is not None:
        return g[0], g[1][0], rhs, False
    g = _gather(rhs, 3, 1)
    if g is not None:
        return g[0], g[1][0], lhs, True
    return None


def _grouped_term(term: Node):
    """``grouped_mm(x, W^T or W, offs)`` -> ``(W, offs, x, transposed)``, else None."""
    node = skip(term)
    if not is_call(node, *_grouped_mm_targets()):
        return None
    x, w = node.args[0], node.args[1]
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    w = skip(w)
    if is_call(w, aten.permute.default) and list(w.args[1]) == [0, 2, 1]:
        return skip(w.args[0]), offs, x, False
    if shape(w) is not None and len(shape(w)) == 3:
        return w, offs, x, True
    return None


def parse_projection(root: Node, grouped: bool) -> Projection:
    """Read one expert projection (base term, optional LoRA term, optional bias term) ending at ``root``."""
    require(isinstance(root, Node), f"{name(root)} is a constant, not a projection")
    terms = _sum_terms(_without_sentinel_mask(root))
    base, lora, bias = [], [], []
    for term in terms:
        if grouped:
            found = _grouped_term(term)
            if found is not None:
                base.append(found)
                continue
        else:
            found = _base_bmm_term(term)
            if found is not None:
                base.append(found)
                continue
            found = _lora_term(term)
            if found is not None:
                lora.append(found)
                continue
        found = _gather(term, 2, 1)
        require(found is not None, f"{root.name}: term {name(skip(term))} is no expert matmul, LoRA or bias")
        bias.append(found)
    require(len(base) == 1 and len(lora) <= 1 and len(bias) <= 1,
            f"{root.name}: expected one expert matmul (got {len(base)}), <=1 LoRA, <=1 bias")
    w, experts, inp, transposed = base[0]
    update = peft_patterns.low_rank_update(w)
    require(not (lora and update), f"{root.name}: both a LoRA term and a merged PEFT weight")
    proj = Projection(root, update.base if update else w, transposed, inp, experts, update=update)
    if lora:
        proj.lora_a, proj.lora_b, proj.lora_ids, lora_experts, lora_inp, proj.lora_ranks = lora[0]
        require(skip(lora_experts) is skip(experts), f"{root.name}: LoRA gathers other expert ids than the base")
        require(skip(lora_inp) is skip(inp), f"{root.name}: LoRA reads another input than the base matmul")
    if bias:
        proj.bias, (proj.bias_experts,) = bias[0]
        if not grouped:
            require(skip(proj.bias_experts) is skip(experts), f"{root.name}: bias gathered with other expert ids")
    return proj


# ---------------------------------------------------------------------------------------------------------------
# activation


def _activation_region(act: Node, h_is: callable, limit: int = 64) -> tuple[list[Node], list[Node]]:
    """Walk back from ``act`` to the gate/up projection (nodes with ``h_is``, views of one tensor); return
    ``(those nodes, the nodes in between)``."""
    seen, frontier, region, found = {act}, [act], [act], []
    while frontier:
        node = frontier.pop(0)
        for arg in node.all_input_nodes:
            if arg in seen:
                continue
            seen.add(arg)
            if h_is(arg):
                found.append(arg)
                continue
            require(arg.op == "call_function", f"{act.name}: activation reads {arg.name} ({arg.op})")
            require(len(region) < limit, f"{act.name}: activation subgraph too large")
            region.append(arg)
            frontier.append(arg)
    require(found, f"{act.name}: no gate/up projection feeds the activation")
    require(len({skip(h) for h in found}) == 1 and all(same_shape(h, shape(found[0])) for h in found),
            f"{act.name}: activation reads two projections")
    return found, region


def _evaluate(hs: list[Node], region: list[Node], act: Node, probe: torch.Tensor) -> torch.Tensor:
    """Run the graph's own activation nodes on ``probe`` in place of the projection nodes ``hs``."""
    order = {n: i for i, n in enumerate(act.graph.nodes)}
    env = {h: probe for h in hs}

    def look(a):
        if isinstance(a, Node):
            require(a in env, f"activation node reads {a.name}, not computed from the probe")
            return env[a]
        return a

    for node in sorted(region, key=order.__getitem__):
        args = torch.fx.node.map_aggregate(node.args, look)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, look)
        env[node] = node.target(*args, **kwargs)
    return env[act]


def _scalars(region: list[Node], targets) -> list[float]:
    out = []
    for node in region:
        if is_call(node, *targets):
            out += [float(a) for a in list(node.args[1:]) + list(node.kwargs.values())
                    if isinstance(a, (int, float)) and not isinstance(a, bool)]
    return out


_PROBE_SCALES = (5.0, 40.0, 300.0, 3000.0)  # standard deviations of the probe's rows (identify_activation)
_PROBE_SCALES_FP16 = (5.0, 40.0, 150.0)


def identify_activation(hs: list[Node], region: list[Node], act: Node, two_i: int) -> tuple[bool, str, float, float]:
    """Which contract activation the nodes compute, by evaluation: ``(interleaved, activation, alpha, limit)``."""
    lead = shape(hs[0])[:-1]
    require(len(lead) in (1, 2) and same(shape(hs[0])[-1], two_i), f"{hs[0].name}: gate/up output is not [..., 2I]")
    lead = (16,) if len(lead) == 1 else tuple(d if isinstance(d, int) else 4 for d in lead)
    dtype = val(hs[0]).dtype
    gen = torch.Generator().manual_seed(0)
    # rows at several magnitudes: an activation that only differs from a candidate on large inputs (a clamp the
    # candidate lacks, say at 25) must not pass; fp16's products stay finite
    scales = torch.tensor(_PROBE_SCALES_FP16 if dtype == torch.float16 else _PROBE_SCALES)
    rows = torch.arange(math.prod(lead)).remainder(len(scales))
    probe = (torch.randn(*lead, two_i, generator=gen) * scales[rows].reshape(*lead, 1)).to(dtype)
    got = _evaluate(hs, region, act, probe).float()
    require(got.shape == (*lead, two_i // 2), f"{act.name}: activation output shape {tuple(got.shape)}")
    got, probe = got.reshape(-1, two_i // 2), probe.reshape(-1, two_i)
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 4e-2
    # the graph's own constants first, the contract's defaults last
    clamps = (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default)
    limits = sorted({abs(v) for v in _scalars(region, clamps) if v}) + [GPTOSS_LIMIT]
    alphas = sorted(set(_scalars(region, (aten.mul.Tensor,))) - {1.0}) + [GPTOSS_ALPHA]
    candidates = [("silu", GPTOSS_ALPHA, GPTOSS_LIMIT)]
    candidates += [("gptoss_swiglu", a, lim) for a, lim in itertools.product(alphas, limits)]
    for interleaved in (False, True):
        gate, up = split_gate_up(probe.float(), TRANSPOSED_INTERLEAVED if interleaved else CONCAT)
        for activation, alpha, lim in candidates:
            want = glu_activation(gate, up, activation, alpha, lim)
            if torch.allclose(got, want, atol=tol, rtol=tol):
                return interleaved, activation, alpha, lim
    raise NoMatch(f"{act.name}: activation is neither silu-GLU nor GPT-OSS swiglu (checked numerically)")


# ---------------------------------------------------------------------------------------------------------------
# whole layer


def _check_weights(up: Projection, down: Projection, H, I2) -> None:
    require(up.transposed == down.transposed, "gate/up and down projections disagree on transposition")
    w13, w2 = shape(up.weight), shape(down.weight)
    E = w13[0]
    if up.transposed:
        require(same(w13[1], H) and same(w2[2], H) and same(w2[1] * 2, I2) and same(w2[0], E),
                f"transposed weights {w13}/{w2} do not fit H={H}")
    else:
        require(same(w13[2], H) and same(w2[1], H) and same(w2[2] * 2, I2) and same(w2[0], E),
                f"weights {w13}/{w2} do not fit H={H}")


def _activation_between(up_is, down: Projection, I2):
    I = I2 // 2 if isinstance(I2, int) else None
    act = skip(down.inp)
    require(I is not None and shape(act) is not None and same(shape(act)[-1], I),
            f"{down.root.name}: down projection input is not [P, I]")
    hs, region = _activation_region(act, up_is)
    return skip(hs[0]), identify_activation(hs, region, act, I2)


def _anchor_dims(anchor: Node):
    require(is_call(anchor, aten.sum.dim_IntList) and list(anchor.args[1]) == [1]
            and not (len(anchor.args) > 2 and anchor.args[2]) and not anchor.kwargs.get("keepdim", False),
            f"{anchor.name}: not a sum over the top-k axis")
    pairs = anchor.args[0]
    require(shape(pairs) is not None and len(shape(pairs)) == 3, f"{anchor.name}: sums a non-[T,k,H] tensor")
    return pairs, shape(pairs)


def match_pairwise(anchor: Node) -> MoEMatch:
    """The reference / ``batched_mm`` form: per-pair ``bmm`` with gathered expert weights."""
    pairs, (T, k, H) = _anchor_dims(anchor)
    y = skip(pairs)
    routing_on_input, weights = True, None
    try:
        down = parse_projection(y, grouped=False)
    except NoMatch:
        require(is_call(y, aten.mul.Tensor), f"{y.name}: neither expert down projection nor routing-weight mul")
        down = None
        for out, w in (y.args, y.args[::-1]):
            try:
                down = parse_projection(out, grouped=False)
                weights, routing_on_input = w, False
                break
            except NoMatch:
                continue
        require(down is not None, f"{y.name}: no expert down projection under the routing-weight mul")

    I2 = shape(down.weight)[1 if down.transposed else 2] * 2
    e_src = skip(down.experts)

    def is_up(n: Node) -> bool:
        try:
            p = parse_projection(n, grouped=False)
        except NoMatch:
            return False
        return skip(p.experts) is e_src and len(shape(p.weight)) == 3

    h, (interleaved, activation, alpha, limit) = _activation_between(is_up, down, I2)
    up = parse_projection(h, grouped=False)
    _check_weights(up, down, H, I2)

    x_pairs = skip(up.inp)
    if routing_on_input:
        require(is_call(x_pairs, aten.mul.Tensor), f"{h.name}: no routing weights on output nor on input")
        a, b = x_pairs.args[:2]
        x_side, weights = (a, b) if _has_shape(b, (T, k)) else (b, a)
    else:
        x_side = up.inp
    # pairs must be token-major (pair p = t*k + j), as topk_ids.reshape(-1) is: x and the ids pass through
    # [T, k, ...] on their way to [T*k, ...]
    require(_has_shape(x_side, (T, k, H)), f"{h.name}: x is not repeated token-major to the (token, k) pairs")
    x = find_in_chain(x_side, (T, H))
    topk_weights = find_in_chain(weights, (T, k))
    topk_ids = find_in_chain(_without_id_clamp(down.experts), (T, k))

    lora, ids = None, None
    require((up.lora_a is None) == (down.lora_a is None), "LoRA on only one of the two projections")
    if up.lora_a is not None:
        require(skip(up.lora_ids) is skip(down.lora_ids), "projections read different token_lora_ids")
        lora = (up.lora_a, up.lora_b, down.lora_a, down.lora_b)
        require(_has_shape(up.lora_ids, (T, k)), "token_lora_ids are not repeated token-major to the pairs")
        ids = find_in_chain(up.lora_ids, (T,))
        require((up.lora_ranks is None) == (down.lora_ranks is None), "per-slot ranks on only one projection")
        ranks = None if up.lora_ranks is None else (up.lora_ranks, down.lora_ranks)
    layout = _layout(up.transposed, interleaved)
    form, updates = _peft_form("pairwise", up, down)
    return MoEMatch(form, anchor, x, topk_ids, topk_weights, ids, up.weight, down.weight, lora, up.bias,
                    down.bias, layout, activation, alpha, limit, routing_on_input, updates,
                    None if up.lora_a is None else ranks)


def _peft_form(form: str, up: Projection, down: Projection) -> tuple[str, Optional[tuple]]:
    """``(form, None)``, or ``("peft_" + form, (gate/up update, down update))`` where PEFT merged a weight."""
    if up.update is None and down.update is None:
        return form, None
    return f"peft_{form}", (up.update, down.update)


def _has_shape(node: Node, sizes) -> bool:
    return any(same_shape(n, sizes) for n in chain(node))


def _layout(transposed: bool, interleaved: bool) -> str:
    require(transposed or not interleaved, "interleaved gate/up on [E, 2I, H] weights (the op's `interleaved` "
            "layout, vLLM's): no transformers family has it, so the pass does not rewrite it (untested)")
    return layout_of(transposed=transposed, interleaved=interleaved)


def match_grouped(anchor: Node) -> MoEMatch:
    """transformers' ``grouped_mm`` experts: sorted pairs, ``_grouped_mm`` with offsets, inverse permutation."""
    pairs, (T, k, H) = _anchor_dims(anchor)
    unperm = skip(pairs)
    require(is_call(unperm, aten.index.Tensor) and len(unperm.args[1]) == 1, f"{unperm.name}: no inverse permute")
    inv = skip(unperm.args[1][0])
    require(is_call(inv, aten.index_put.default) and len(inv.args[1]) == 1, f"{inv.name}: not an inverse perm")
    perm = inv.args[1][0]
    sort = perm.args[0] if is_call(perm, operator.getitem) else None
    require(is_call(sort, aten.sort.default, aten.sort.stable) and perm.args[1] == 1, "permutation is not a sort")
    weighted = skip(unperm.args[0])
    require(is_call(weighted, aten.mul.Tensor), f"{weighted.name}: no routing-weight mul")
    down, weights = None, None
    for out, w in (weighted.args, weighted.args[::-1]):
        g = skip(w) if isinstance(w, Node) else None
        if is_call(g, aten.index.Tensor) and len(g.args[1]) == 1 and g.args[1][0] is perm:
            down, weights = parse_projection(out, grouped=True), g.args[0]
    require(down is not None, f"{weighted.name}: no grouped down projection times permuted weights")
    I2 = shape(down.weight)[1 if down.transposed else 2] * 2

    def is_up(n: Node) -> bool:
        try:
            p = parse_projection(n, grouped=True)
        except NoMatch:
            return False
        return p.experts is down.experts  # the same offsets

    h, (interleaved, activation, alpha, limit) = _activation_between(is_up, down, I2)
    up = parse_projection(h, grouped=True)
    _check_weights(up, down, H, I2)
    _require_offsets_count(down.experts, sort)
    for proj in (up, down):
        require(proj.bias is None or _is_sorted_ids(proj.bias_experts, sort),
                f"{proj.root.name}: bias not gathered with the sorted expert ids")
    gathered = _gather(_without_sentinel_mask(up.inp), 2, 1)
    require(gathered is not None, f"{h.name}: grouped input is not x[perm // k]")
    x_flat, (row,) = gathered
    row = skip(row)
    require(is_call(row, aten.div.Tensor_mode, aten.floor_divide.default) and row.args[0] is perm
            and row.args[1] == k, f"{row.name}: grouped input rows are not perm // k")
    x = find_in_chain(x_flat, (T, H))
    topk_ids = find_in_chain(sort.args[0], (T, k))
    topk_weights = find_in_chain(weights, (T, k))
    form, updates = _peft_form("grouped", up, down)
    return MoEMatch(form, anchor, x, topk_ids, topk_weights, None, up.weight, down.weight, None, up.bias,
                    down.bias, _layout(up.transposed, interleaved), activation, alpha, limit, False, updates)


def _require_offsets_count(offs: Node, sort: Node) -> None:
    """``offs`` must be the running count of the sorted expert ids: ``cumsum(histc|bincount(sorted ids))``."""
    cumsum = skip(offs)
    require(is_call(cumsum, aten.cumsum.default), f"{name(offs)}: grouped_mm offsets are not a cumsum")
    count = skip(cumsum.args[0])
    require(is_call(count, aten.histc.default, aten.bincount.default), f"{count.name}: offsets count no experts")
    require(_is_sorted_ids(count.args[0], sort), f"{count.name}: offsets count something else than sorted ids")


def _is_sorted_ids(node: Node, sort: Node) -> bool:
    ids = skip(_without_id_clamp(node))
    return is_call(ids, operator.getitem) and ids.args[0] is sort and ids.args[1] == 0


def match_moe(anchor: Node) -> MoEMatch:
    """Try each source form at a ``sum(dim=1)`` anchor; raise NoMatch with the most specific reason."""
    reasons = []
    for matcher in (match_pairwise, match_grouped):
        try:
            return matcher(anchor)
        except NoMatch as e:
            reasons.append(f"{matcher.__name__}: {e}")
    raise NoMatch("; ".join(reasons))


# ---------------------------------------------------------------------------------------------------------------
# rewrite


def _expert_dims(m: MoEMatch) -> tuple[int, int, int]:
    """``(E, H, I)`` of the matched expert weights (ints: the stacks built from them need static sizes)."""
    dims = expert_geometry(m.layout, shape(m.w13), shape(m.w2))
    require(all(isinstance(d, int) for d in dims), "symbolic expert weight shapes")
    return dims


def _no_adapter_stacks(graph, m: MoEMatch):
    """Rank-1, one-slot zero LoRA stacks and all ``-1`` token ids: the op computes just the base MoE (the kernels
    skip every LoRA term of a ``-1`` token; the contract asks for R >= 1)."""
    E, H, I = _expert_dims(m)
    w13 = val(m.w13)
    opts = dict(dtype=w13.dtype, device=w13.device)
    shapes = ([1, E, 1, H], [1, E, 2 * I, 1], [1, E, 1, I], [1, E, H, 1])
    stacks = tuple(insert_call(graph, aten.full.default, (s, 0.0), opts) for s in shapes)
    T = insert_call(graph, aten.sym_size.int, (m.x, 0)) if not isinstance(shape(m.x)[0], int) else shape(m.x)[0]
    ids = insert_call(graph, aten.full.default, ([T], NO_ADAPTER), dict(dtype=torch.int32, device=w13.device))
    return stacks, ids


def emit_fused_moe(graph, m: MoEMatch) -> Node:
    """Insert the ``fused_moe_lora`` call for ``m`` (at the graph's insert point) and return its node."""
    if m.updates:
        lora, ids = peft_patterns.lora_stacks(graph, m.updates, is_transposed(m.layout), _expert_dims(m), m.x)
    elif m.lora is None:
        lora, ids = _no_adapter_stacks(graph, m)
    else:
        lora, ids = m.lora, m.token_lora_ids
    extra = {}
    if m.lora_ranks is not None and not m.updates:
        extra["lora_ranks"] = _stacked_ranks(graph, *m.lora_ranks)
    return insert_call(
        graph, torch.ops.moe_lora.fused_moe_lora.default,
        (m.x, m.topk_ids, m.topk_weights, ids, m.w13, m.w2, *lora, m.w13_bias, m.w2_bias),
        dict(layout=m.layout, activation=m.activation, alpha=m.alpha, limit=m.limit,
             routing_weight_on_input=m.routing_weight_on_input, **extra),
    )


def _stacked_ranks(graph, r13: Node, r2: Node) -> Node:
    """The op's ``lora_ranks`` [2, L] int32 from the two projections' rank tensors: the module's [2, L] buffer
    itself when they are its rows 0 and 1, else a stack."""
    sel = [skip(r) for r in (r13, r2)]
    if all(is_call(s, aten.select.int) and s.args[1] == 0 for s in sel) and sel[0].args[0] is sel[1].args[0] \
            and (sel[0].args[2], sel[1].args[2]) == (0, 1) and val(sel[0].args[0]).dtype == torch.int32:
        return sel[0].args[0]
    rows = [rank_masks.as_rank_vector(graph, r, insert_call) for r in (r13, r2)]
    return insert_call(graph, aten.stack.default, (rows,))
