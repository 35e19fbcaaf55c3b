"""transformers' Llama-4 experts (``Llama4TextExperts``) in a post-grad graph -> one ``fused_moe_lora``.

That module runs every routed row through its block's expert: ``x [E*T, H]`` (already scaled by the router, which
runs outside this subgraph) is viewed ``[E, T, H]``, then ``bmm(x, W13)`` -> GLU -> ``bmm(., W2)``, weights
``[E, H, 2I]`` / ``[E, I, H]`` (``transposed_concat``), either possibly PEFT's merged ``W + s lhs rhs``
(:mod:`.peft_patterns`). The same thing as the op: row ``p`` is a token with one expert, ``p // T``, routing weight
1 (``routing_weight_on_input=False``: the scaling already happened on the input). Anchored on the down ``bmm``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from . import moe_patterns, peft_patterns
from .fx_match import NoMatch, aten, chain, insert_call, is_call, require, same, same_shape, shape, skip, val


def _expert_weight(node) -> tuple[Node, object]:
    """A ``[E, ., .]`` graph input, or PEFT's merged weight over one -> ``(W, update or None)``."""
    require(isinstance(node, Node), "constant expert weight")
    update = peft_patterns.low_rank_update(node)
    w = update.base if update is not None else skip(node)
    require(w.op in ("placeholder", "get_attr") and len(shape(w) or ()) == 3 and isinstance(shape(w)[0], int),
            f"{node.name}: not a 3-D expert weight input")
    return w, update


def looks_like_dense_experts(anchor: Node) -> bool:
    """A ``bmm`` of a computed 3-D tensor and a 3-D weight input (or a merged PEFT weight): the down projection's
    shape, worth a near-miss line (the up projection reads a view of a 2-D input)."""
    if len(shape(skip(anchor.args[0])) or ()) != 3:
        return False
    try:
        _expert_weight(anchor.args[1])
    except NoMatch:
        return False
    return True


def match_dense(anchor: Node) -> moe_patterns.MoEMatch:
    """``bmm(act(bmm(x.view(E, -1, H), W13)), W2)`` at the down ``bmm`` ``anchor``."""
    require(is_call(anchor, aten.bmm.default), f"{anchor.name}: not a bmm")
    act, w2_node = anchor.args
    w2, down_update = _expert_weight(w2_node)
    E, I, H = shape(w2)
    require(same_shape(act, (E, shape(act)[1], I)), f"{anchor.name}: input {shape(act)} is not [E, T, I]")

    def up_of(n: Node):
        n = skip(n)
        if not is_call(n, aten.bmm.default):
            return None
        try:
            w13, update = _expert_weight(n.args[1])
        except NoMatch:
            return None
        return (n, w13, update) if same_shape(w13, (E, H, 2 * I)) else None

    hs, region = moe_patterns._activation_region(skip(act), lambda n: up_of(n) is not None)
    interleaved, activation, alpha, limit = moe_patterns.identify_activation(hs, region, skip(act), 2 * I)
    h, w13, up_update = up_of(hs[0])
    rows = h.args[0]
    require(same_shape(rows, (E, shape(act)[1], H)), f"{h.name}: input is not [E, T, H]")
    flat = [n for n in chain(rows) if len(shape(n) or ()) == 2 and same(shape(n)[1], H)]
    require(flat, f"{h.name}: input is no [E*T, H] tensor viewed [E, T, H]")
    updates = (up_update, down_update) if up_update or down_update else None
    return moe_patterns.MoEMatch(
        "peft_dense" if updates else "dense", anchor, flat[-1], None, None, None, w13, w2, None, None, None,
        moe_patterns._layout(True, interleaved), activation, alpha, limit, False, updates)


def emit_dense(graph, m: moe_patterns.MoEMatch) -> Node:
    """Insert one-expert-per-row routing (ids ``p // T``, weights 1) and the ``fused_moe_lora`` call."""
    E, rows_per_expert = shape(m.anchor)[0], shape(m.anchor)[1]
    device = val(m.x).device
    if not isinstance(rows_per_expert, int):
        rows_per_expert = insert_call(graph, aten.sym_size.int, (skip(m.anchor.args[0]), 1))
    n_rows = shape(m.x)[0]
    if not isinstance(n_rows, int):
        n_rows = insert_call(graph, aten.sym_size.int, (m.x, 0))
    experts = insert_call(graph, torch.ops.prims.iota.default, (E,),
                          dict(start=0, step=1, dtype=torch.int64, device=device, requires_grad=False))
    experts = insert_call(graph, aten.unsqueeze.default, (experts, 1))
    experts = insert_call(graph, aten.expand.default, (experts, [E, rows_per_expert]))
    topk_ids = insert_call(graph, aten.reshape.default, (experts, [n_rows, 1]))
    topk_weights = insert_call(graph, aten.full.default, ([n_rows, 1], 1.0), dict(dtype=val(m.x).dtype, device=device))
    return moe_patterns.emit_fused_moe(graph, dataclasses.replace(m, topk_ids=topk_ids, topk_weights=topk_weights))
