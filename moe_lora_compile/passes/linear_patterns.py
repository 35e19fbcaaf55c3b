"""Find ``linear + LoRA delta`` in a post-grad graph and read off the arguments of ``moe_lora::lora_linear``.

Two source forms, anchored on the ``add`` / ``addmm`` that adds the delta (Inductor's own post-grad patterns have
already turned ``mm + add`` into ``addmm``, and 3-D activations into ``reshape -> mm -> reshape``):

- ``multi``: our :func:`~moe_lora_compile.ops.reference.lora_linear_reference`: ``x W^T (+ b)`` plus
  ``where(one_hot(ids), x A_flat^T (+ poison), 0) @ where(isfinite(B), B, 0)_flat`` over all L slots;
- ``peft``: PEFT's single adapter ``base(x) + lora_B(lora_A(x)) * s``: becomes one slot (``A[None]``,
  ``(s B)[None]``) with every token's id 0.

PEFT's mixed-adapter batches (``adapter_names=``) are a chain of row updates, read in :mod:`.peft_patterns`.

Hand-written for the same reasons as :mod:`.moe_patterns` (casts, views and symbolic shapes in many variants).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch.fx import Node

from . import rank_masks
from .fx_match import (NoMatch, aten, column_vector, find_in_chain, insert_call, is_call, require, same_shape, shape,
                       skip, val, where_or_zero)


@dataclasses.dataclass
class LinearMatch:
    form: str
    anchor: Node
    x: Node  # [T, in]
    weight: Node  # [out, in]
    bias: Optional[Node]
    lora_a: Node  # [L, R, in] (multi) or [R, in] (peft)
    lora_b: Node  # [L, out, R] (multi) or [out, R] (peft)
    token_lora_ids: Optional[Node]  # None for peft
    scale: Union[float, Node] = 1.0  # peft: a number, or a node of a scalar (symbolic or a 0-d tensor)
    lora_ranks: Optional[Node] = None  # multi with rank-masked factors: each slot's rank, [L] or [n, L] int

    def describe(self) -> str:
        return f"{self.form} at {self.anchor.name}: bias={self.bias is not None} scale={self.scale}"


def _terms(node: Node) -> list:
    """``a + b + ...`` as terms; an ``addmm(c, m1, m2)`` contributes ``c``'s terms and ``("mm", m1, m2)``."""
    inner = skip(node)
    if is_call(inner, aten.add.Tensor) and all(isinstance(a, Node) for a in inner.args[:2]) \
            and inner.kwargs.get("alpha", 1) == 1:
        return _terms(inner.args[0]) + _terms(inner.args[1])
    if is_call(inner, aten.addmm.default) and inner.kwargs.get("beta", 1) == 1 and inner.kwargs.get("alpha", 1) == 1:
        return _terms(inner.args[0]) + [("mm", inner.args[1], inner.args[2])]
    if is_call(inner, aten.mm.default):
        return [("mm", inner.args[0], inner.args[1])]
    return [node]


def _t_arg(node: Node) -> Optional[Node]:
    """The tensor under a 2-D transpose (``permute(., [1, 0])`` / ``t``), looking through casts; else None."""
    node = skip(node)
    if is_call(node, aten.permute.default) and list(node.args[1]) == [1, 0] or is_call(node, aten.t.default):
        return node.args[0]
    return None


def _transposed_2d(node: Node) -> Optional[Node]:
    """``W.t()`` of a 2-D W (through casts) -> W."""
    w = _t_arg(node)
    w = skip(w) if w is not None else None
    return w if w is not None and shape(w) is not None and len(shape(w)) == 2 else None


def _mm_of(node: Node) -> Optional[tuple[Node, Node]]:
    inner = skip(node)
    return (inner.args[0], inner.args[1]) if is_call(inner, aten.mm.default) else None


def _multi_delta(lhs: Node, rhs: Node):
    """``mm(where(one_hot, x @ A_flat^T (+ poison), 0), where(finite, B, 0)_flat)`` of the reference ->
    ``(x, A, B, ids)``, else None."""
    b_perm = skip(rhs)
    if not (is_call(b_perm, aten.permute.default) and list(b_perm.args[1]) == [0, 2, 1]):
        return None
    b_selected = where_or_zero(b_perm.args[0])
    b = skip(b_selected[1]) if b_selected is not None else skip(b_perm.args[0])
    selected = where_or_zero(lhs)
    if selected is None:
        return None
    mask, shrunk = selected
    eq = skip(mask)
    if not is_call(eq, aten.eq.Tensor):
        return None
    shrunk = skip(shrunk)
    if is_call(shrunk, aten.add.Tensor):  # the per-slot NaN poison for slots whose B is not finite
        shrunk = next((t for t in shrunk.args[:2] if _mm_of(t) is not None), shrunk)
    mm = _mm_of(shrunk)
    if mm is None:
        return None
    a_flat = _t_arg(mm[1])
    if a_flat is None:
        return None
    a = skip(a_flat)  # looks through the [L*R, in] reshape
    if shape(a) is None or len(shape(a)) != 3 or shape(b) is None or len(shape(b)) != 3:
        return None
    slots = [s for s in eq.args[:2] if _is_slot_range(s, shape(a)[0])]
    ids = [s for s in eq.args[:2] if isinstance(s, Node) and s not in slots
           and val(s).dtype in (torch.int32, torch.int64)]
    if len(slots) != 1 or len(ids) != 1:
        return None
    # the reference with per-slot ranks masks both factors, where(keep, factor, 0): the op takes the unmasked
    # factors and the ranks; any other mask stays computed and the op reads the masked factors
    ranks = None
    (a_src, a_keep), (b_src, b_keep) = rank_masks.unmask(a), rank_masks.unmask(b)
    if a_keep is not None and b_keep is not None and skip(a_keep) is skip(b_keep) \
            and len(shape(skip(a_src)) or ()) == 3 and len(shape(skip(b_src)) or ()) == 3:
        try:
            ranks = rank_masks.rank_source(skip(a_keep), shape(a)[0], shape(a)[1])
            a, b = skip(a_src), skip(b_src)
        except NoMatch:
            pass
    return mm[0], a, b, (ids[0], ranks)


def _is_slot_range(node, n_slots) -> bool:
    """``arange(L)`` (any view of it): the slot numbers the reference's one-hot compares token ids with."""
    src = skip(node)
    return is_call(src, torch.ops.prims.iota.default, aten.arange.default, aten.arange.start,
                   aten.arange.start_step) and same_shape(src, (n_slots,))


def _scalar_scale(value) -> bool:
    """Whether ``value`` (a ``mul``'s second argument) is one scalar: a number, or a node holding a symbolic number or
    a 0-d tensor (PEFT's scaling once Dynamo makes it an input: after ``set_scale`` / ``scale_layer`` on a compiled
    model, or made a tensor by ``prepare_model_for_compiled_hotswap``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    if not isinstance(value, Node):
        return False
    v = val(value)
    return isinstance(v, (torch.SymInt, torch.SymFloat)) or (isinstance(v, torch.Tensor) and v.dim() == 0
                                                              and not v.dtype.is_complex and v.dtype != torch.bool)


def _peft_delta(term) -> Optional[tuple[Node, Node, Node, Union[float, Node]]]:
    """``mm(mm(x, A^T), B^T) * s`` -> ``(x, A, B, s)`` (``s`` a number, or a node of a scalar), else None."""
    scale = 1.0
    if isinstance(term, Node):
        node = skip(term)
        if is_call(node, aten.mul.Tensor) and _scalar_scale(node.args[1]):
            scale = node.args[1] if isinstance(node.args[1], Node) else float(node.args[1])
            term = node.args[0]
        mm = _mm_of(term)
        if mm is None:
            return None
        lhs, rhs = mm
    else:
        _, lhs, rhs = term
    b = _transposed_2d(rhs)
    inner = _mm_of(lhs)
    if b is None or inner is None:
        return None
    a = _transposed_2d(inner[1])
    if a is None:
        return None
    return inner[0], a, b, scale


def match_linear(anchor: Node) -> LinearMatch:
    """Read ``x W^T (+ b) + delta`` at an ``add``/``addmm`` anchor."""
    base, deltas, bias = [], [], []
    for term in _terms(anchor):
        if isinstance(term, tuple):
            w = _transposed_2d(term[2])
            if w is not None and _mm_of(term[1]) is None:
                base.append((term[1], w))
                continue
            found = _multi_delta(term[1], term[2])
            if found is not None:
                deltas.append(("multi", found))
                continue
            found = _peft_delta(term)
            if found is not None:
                deltas.append(("peft", found))
                continue
            raise NoMatch(f"{anchor.name}: a matmul that is neither the base linear nor a LoRA delta")
        found = _peft_delta(term)
        if found is not None:
            deltas.append(("peft", found))
            continue
        bias.append(term)
    require(len(base) == 1 and len(deltas) == 1 and len(bias) <= 1,
            f"{anchor.name}: want one base linear and one LoRA delta, got {len(base)} and {len(deltas)}")
    (x_base, weight), (form, (x_delta, a, b, extra)) = base[0], deltas[0]
    require(skip(x_base) is skip(x_delta), f"{anchor.name}: base and LoRA read different inputs")
    T, n_in = shape(x_base)
    out = shape(weight)[0]
    if bias:  # the term as added must be one [out] vector on every row (a [T] one viewed [T, 1] is per row)
        bias = [column_vector(bias[0], out)]
        require(bias[0] is not None, f"{anchor.name}: the term besides the linear and the delta is no [out] bias")
    x = find_in_chain(x_base, (T, n_in))
    if form == "multi":
        L, R, _ = shape(a)
        ids, ranks = find_in_chain(extra[0], (T,)), extra[1]
        require(shape(b)[0] == L and shape(b)[2] == R and shape(b)[1] == out, f"{anchor.name}: LoRA stack shapes")
        return LinearMatch("multi", anchor, x, weight, bias[0] if bias else None, a, b, ids, lora_ranks=ranks)
    require(shape(a)[1] == n_in and shape(b)[0] == out and shape(a)[0] == shape(b)[1],
            f"{anchor.name}: PEFT A/B shapes {shape(a)}/{shape(b)} do not fit W {shape(weight)}")
    return LinearMatch("peft", anchor, x, weight, bias[0] if bias else None, a, b, None, extra)


def emit_lora_linear(graph, m: LinearMatch) -> Node:
    """Insert the ``lora_linear`` call for ``m`` and return its node."""
    a, b, ids = m.lora_a, m.lora_b, m.token_lora_ids
    if m.form == "peft":
        if isinstance(m.scale, Node) or m.scale != 1.0:
            b = insert_call(graph, aten.mul.Tensor, (b, m.scale))
        a = insert_call(graph, aten.unsqueeze.default, (a, 0))
        b = insert_call(graph, aten.unsqueeze.default, (b, 0))
        T = shape(m.x)[0]
        if not isinstance(T, int):
            T = insert_call(graph, aten.sym_size.int, (m.x, 0))
        ids = insert_call(graph, aten.full.default, ([T], 0), dict(dtype=torch.int32, device=val(m.x).device))
    ranks = m.lora_ranks
    if ranks is not None and val(ranks).dtype != torch.int32:
        ranks = insert_call(graph, torch.ops.prims.convert_element_type.default, (ranks, torch.int32))
    extra = {} if ranks is None else dict(lora_ranks=ranks)
    return insert_call(graph, torch.ops.moe_lora.lora_linear.default, (m.x, m.weight, a, b, ids, m.bias), extra)
