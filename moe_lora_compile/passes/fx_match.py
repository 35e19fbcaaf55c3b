"""Small helpers to read and edit Inductor's post-grad FX graphs: walk past views and casts, compare symbolic
shapes, insert nodes with fake-tensor metadata, and log matches and near misses (``MOE_LORA_PASS_LOG=1``)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import settings

aten = torch.ops.aten
prims = torch.ops.prims

LOG_ENV = settings.PASS_LOG.name
log = logging.getLogger("moe_lora_compile.passes")
if settings.PASS_LOG.enabled() and not log.handlers:
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[moe_lora pass] %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.INFO)
    log.propagate = False  # an app's own logging setup would print every line a second time


class NoMatch(Exception):
    """Raised by a matcher step; the message says why (logged as a near miss)."""


def require(cond: Any, why: str) -> None:
    if not cond:
        raise NoMatch(why)


# Ops that change neither values nor (beyond a cast) meaning: the matchers look through them. Reordering views
# (permute/transpose) are deliberately absent.
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.expand.default, aten.clone.default,
          aten.alias.default)
CASTS = (prims.convert_element_type.default, aten._to_copy.default)
TRANSPARENT = frozenset(_VIEWS + CASTS)


def is_call(node: Any, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def chain(node: Node) -> list[Node]:
    """``node`` and the nodes behind it through views and casts, nearest first (``[node]`` for a non-node)."""
    out = [node]
    while is_call(out[-1], *TRANSPARENT):
        out.append(out[-1].args[0])
    return out


def skip(node: Node) -> Node:
    """The first node behind ``node`` that is not a view or a cast (a non-node comes back as is)."""
    return chain(node)[-1]


def is_zero(node: Any) -> bool:
    """A literal 0 or a ``full``/``scalar_tensor`` of 0 (how ``torch.where(c, x, 0.0)`` appears post-grad)."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return node == 0
    node = skip(node)
    if is_call(node, aten.full.default) and len(node.args) > 1:
        return isinstance(node.args[1], (int, float)) and node.args[1] == 0
    if is_call(node, aten.scalar_tensor.default):
        return isinstance(node.args[0], (int, float)) and node.args[0] == 0
    return False


def where_or_zero(node: Any) -> Optional[tuple[Node, Node]]:
    """``torch.where(cond, value, 0)`` (through views and casts) -> ``(cond, value)``, else None."""
    node = skip(node)
    if is_call(node, aten.where.self) and is_zero(node.args[2]) and isinstance(node.args[1], Node):
        return node.args[0], node.args[1]
    if is_call(node, aten.where.ScalarOther) and is_zero(node.args[2]) and isinstance(node.args[1], Node):
        return node.args[0], node.args[1]
    return None


def name(node: Any) -> str:
    return node.name if isinstance(node, Node) else repr(node)


def val(node: Any):
    """The fake tensor (or SymInt) of a node, or None."""
    return node.meta.get("val") if isinstance(node, Node) else None


def shape(node: Node) -> Optional[tuple]:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def same(a, b) -> bool:
    """Equal sizes, symbolic or not, without adding guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(statically_known_true(a == b))


def same_shape(node: Node, sizes: Iterable) -> bool:
    s = shape(node)
    sizes = tuple(sizes)
    return s is not None and len(s) == len(sizes) and all(same(x, y) for x, y in zip(s, sizes))


def column_vector(node: Any, out) -> Optional[Node]:
    """The ``[out]`` vector that ``node`` adds to every row (a bias), through views and casts, else None.

    Walking out from the vector, every node must be ``[1, ..., 1, out]`` until an ``expand`` broadcasts the leading
    dims; from there on every node keeps ``out`` as its last dim (a view of whole rows). A ``[T]`` vector viewed
    as ``[T, 1]`` and expanded adds one value per row, not per column: refused even where ``T == out``."""
    nodes = chain(node)
    source = nodes[-1]
    if not isinstance(source, Node) or not same_shape(source, (out,)):
        return None
    broadcast = False
    for n in reversed(nodes[:-1]):
        s = shape(n)
        if s is None or not s or not same(s[-1], out):
            return None
        broadcast = broadcast or is_call(n, aten.expand.default)
        if not broadcast and not all(same(d, 1) for d in s[:-1]):
            return None
    return source


def find_in_chain(node: Node, sizes: Iterable) -> Node:
    """The furthest-back node along ``chain(node)`` with exactly ``sizes`` (the source tensor, before casts).

    Views and casts between two equal-shaped nodes of the chain do not change values (reorderings are not
    transparent), so any of them is the same tensor up to a cast.
    """
    sizes = tuple(sizes)
    hits = [n for n in chain(node) if same_shape(n, sizes)]
    require(hits, f"{name(node)}: nothing of shape {sizes} behind it")
    return hits[-1]


def fake_mode_of(graph: Graph):
    for node in graph.nodes:
        v = val(node)
        if isinstance(v, torch._subclasses.FakeTensor):
            return v.fake_mode
    return None


def _to_meta(a):
    return val(a) if isinstance(a, Node) else a


def insert_call(graph: Graph, target: Callable, args: tuple, kwargs: Optional[dict] = None) -> Node:
    """Insert ``target(*args, **kwargs)`` at the current insert point and fill ``meta['val']`` by fake tracing."""
    kwargs = kwargs or {}
    mode = fake_mode_of(graph)
    meta = None
    if mode is not None:  # before creating the node: a failing shape check leaves the graph untouched
        margs = torch.fx.node.map_aggregate(args, _to_meta)
        mkwargs = torch.fx.node.map_aggregate(kwargs, _to_meta)
        with mode:
            meta = target(*margs, **mkwargs)
    node = graph.call_function(target, args, kwargs)
    if meta is not None:
        node.meta["val"] = meta
    return node


def cast_to(graph: Graph, node: Node, dtype: torch.dtype) -> Node:
    if val(node).dtype == dtype:
        return node
    return insert_call(graph, prims.convert_element_type.default, (node, dtype))


def extend_through_casts(node: Node, dtype: torch.dtype) -> Node:
    """``node`` or its sole cast-user chain up to the first node of ``dtype`` (the natural replacement point)."""
    cur = node
    while val(cur).dtype != dtype and len(cur.users) == 1:
        (user,) = cur.users
        if not is_call(user, *CASTS):
            break
        cur = user
    return cur if val(cur).dtype == dtype else node


def sizes_for(graph: Graph, sizes: Iterable, sources: Iterable[Node]) -> Optional[list]:
    """``sizes`` as reshape arguments: ints, a placeholder holding the symbol, or ``sym_size`` of a source node.

    Returns None when a symbolic size has no source; nodes are inserted only when every size has one.
    """
    placeholders = [n for n in graph.nodes if n.op == "placeholder" and isinstance(val(n), torch.SymInt)]
    plan = []
    for s in sizes:
        if isinstance(s, int):
            plan.append(s)
            continue
        hit = next((p for p in placeholders if same(val(p), s)), None)
        if hit is None:
            hit = next(((n, j) for n in sources if shape(n) is not None
                        for j, d in enumerate(shape(n)) if same(d, s)), None)
        if hit is None:
            return None
        plan.append(hit)
    return [insert_call(graph, aten.sym_size.int, p) if isinstance(p, tuple) else p for p in plan]


def replace(graph: Graph, anchor: Node, new: Node, sources: Iterable[Node] = ()) -> None:
    """Route ``anchor``'s users to ``new``, cast to the anchor's dtype and reshaped (sizes from ``sources``)."""
    with graph.inserting_before(anchor):
        out = cast_to(graph, new, val(anchor).dtype)
        if not same_shape(out, shape(anchor)):
            sizes = sizes_for(graph, shape(anchor), list(sources))
            require(sizes is not None, f"{anchor.name}: no node to take the output shape from")
            out = insert_call(graph, aten.reshape.default, (out, sizes))
    anchor.replace_all_uses_with(out)
