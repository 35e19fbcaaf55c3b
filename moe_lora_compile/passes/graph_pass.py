"""``MoELoRAPass``: the Inductor post-grad pass that puts ``torch.ops.moe_lora.*`` calls into compiled graphs.

Use it as ``torch.compile(m, options={"post_grad_custom_post_pass": MoELoRAPass()})`` (or through
:func:`moe_lora_compile.compile`). ``torch._inductor.pattern_matcher`` finds the anchor nodes (``sum(dim=1)`` of
per-pair expert outputs; the down ``bmm`` of Llama-4's experts; ``add``/``addmm`` of a linear and its LoRA delta;
the last ``index_put`` of PEFT's mixed-adapter rows); :mod:`.moe_patterns`, :mod:`.dense_experts`,
:mod:`.linear_patterns` and :mod:`.peft_patterns` check the dataflow behind each anchor and emit the fused op.
``MOE_LORA_PASS_LOG=1`` logs every rewrite and every near miss with its reason.
"""

from __future__ import annotations

import collections
import hashlib
import os

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import Arg, CallFunction, Match, PatternMatcherPass, register_graph_pattern
from torch.fx import Graph, Node

from . import dense_experts, linear_patterns, moe_patterns, peft_patterns
from .fx_match import (NoMatch, aten, chain, extend_through_casts, is_call, log, replace, same, same_shape, shape, skip,
                       val)

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Every source file whose content changes what the pass does (the matchers follow the reference's op sequence).
# Every module of this package but the vLLM adapter counts, found by listing: a new matcher module cannot be missed.
SOURCE_FILES = tuple(
    sorted(os.path.join(_PACKAGE, "passes", f) for f in os.listdir(os.path.join(_PACKAGE, "passes"))
           if f.endswith(".py") and f not in ("__init__.py", "vllm.py"))
    + [os.path.join(_PACKAGE, p) for p in ("ops/reference.py", "ops/contract.py", "ops/layout.py")]
)


def _source_hash() -> str:
    digest = hashlib.sha256()
    for path in SOURCE_FILES:
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


class MoELoRAPass(CustomGraphPass):
    """Rewrite MoE expert subgraphs to ``moe_lora::fused_moe_lora`` and linear + LoRA to ``moe_lora::lora_linear``.

    Options: ``moe`` (our reference MoE+LoRA subgraph), ``hf_experts`` (transformers' ``batched_mm`` /
    ``grouped_mm`` / Llama-4 experts: without LoRA emitted with one rank-1 zero slot and all token ids ``-1``; with
    PEFT's ``target_parameters`` LoRA merged into their weights, with that adapter as slot 0 for every token),
    ``linear`` (``lora_linear_reference``, PEFT's ``base(x) + lora_B(lora_A(x)) * s`` and PEFT's mixed-adapter
    ``adapter_names=`` rows). ``counts`` accumulates what was rewritten, by kind and source form, over every graph
    this pass ran on; also ``matcher_errors`` (anchors left unfused because a matcher raised; logged as warnings)
    and ``merged_weight_outputs`` (PEFT merged expert weights a graph also returns, so they stay computed).
    """

    def __init__(self, *, moe: bool = True, hf_experts: bool = True, linear: bool = True) -> None:
        self.options = dict(moe=moe, hf_experts=hf_experts, linear=linear)
        self.counts: collections.Counter = collections.Counter()
        self._patterns = self._build_patterns()

    def __repr__(self) -> str:
        return f"MoELoRAPass({', '.join(f'{k}={v}' for k, v in self.options.items())})"

    def uuid(self) -> str:
        """Stable across processes; changes with the pass's source files, the reference, and the options."""
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return hashlib.sha256(f"{type(self).__qualname__}|{opts}|{_source_hash()}".encode()).hexdigest()

    def __call__(self, graph: Graph) -> None:
        self._patterns.apply(graph)
        graph.eliminate_dead_code()
        graph.lint()

    # -- patterns ---------------------------------------------------------------------------------------------

    def _build_patterns(self) -> PatternMatcherPass:
        patterns = PatternMatcherPass(pass_name="moe_lora")
        plans: dict[Node, object] = {}  # anchor -> what its extra_check matched, consumed by the rewrite

        def checked(matcher, interesting):
            def extra_check(match: Match) -> bool:
                anchor = match.output_node()
                if not anchor.users:
                    return False
                try:
                    plans[anchor] = matcher(anchor)
                    return True
                except NoMatch as e:
                    if interesting(anchor):
                        log.info("near miss at %s: %s", anchor.name, e)
                    else:
                        log.debug("no match at %s: %s", anchor.name, e)
                    return False
                except Exception:  # a matcher bug must not fail the user's compile: leave the graph as it is
                    log.warning("moe_lora pass: matcher error at %s, left unfused", anchor.name, exc_info=True)
                    self.counts["matcher_errors"] += 1
                    return False
            return extra_check

        def rewrite_with(rewrite):
            def handler(match: Match, *args) -> None:
                anchor = match.output_node()
                rewrite(anchor.graph, plans.pop(anchor))
            return handler

        def register(pattern, matcher, interesting, rewrite):
            register_graph_pattern(pattern, extra_check=checked(matcher, interesting), pass_dict=patterns)(
                rewrite_with(rewrite))

        if self.options["moe"] or self.options["hf_experts"]:
            for n_args in (2, 3):  # sum(x, dims) and sum(x, dims, keepdim)
                register(CallFunction(aten.sum.dim_IntList, *[Arg() for _ in range(n_args)]), self._match_moe,
                         _looks_like_moe, self._rewrite_moe)
        if self.options["hf_experts"]:
            register(CallFunction(aten.bmm.default, Arg(), Arg()), dense_experts.match_dense,
                     dense_experts.looks_like_dense_experts, self._rewrite_moe)
        if self.options["linear"]:
            for pattern in (CallFunction(aten.add.Tensor, Arg(), Arg()),
                            CallFunction(aten.addmm.default, Arg(), Arg(), Arg())):
                register(pattern, self._match_linear, _looks_like_lora_linear, self._rewrite_linear)
            for n_args in (3, 4):  # index_put(x, indices, values) and (..., accumulate)
                register(CallFunction(aten.index_put.default, *[Arg() for _ in range(n_args)]),
                         peft_patterns.match_mixed_linear, _looks_like_mixed_rows, self._rewrite_mixed_linear)
        return patterns

    def _match_moe(self, anchor: Node):
        m = moe_patterns.match_moe(anchor)
        if m.lora is None and not self.options["hf_experts"]:
            raise NoMatch(f"{anchor.name}: transformers' experts (without LoRA or with PEFT's) and hf_experts=False")
        if m.lora is not None and not self.options["moe"]:
            raise NoMatch(f"{anchor.name}: MoE+LoRA subgraph and moe=False")
        return m

    def _match_linear(self, anchor: Node):
        m = linear_patterns.match_linear(anchor)
        T, out = shape(m.x)[0], shape(m.weight)[0]
        if not (same_shape(anchor, (T, out)) or _can_rebuild(anchor, m.x)):
            raise NoMatch(f"{anchor.name}: output shape {shape(anchor)} cannot be rebuilt from [T, out]")
        return m

    def _rewrite_moe(self, graph: Graph, m) -> None:
        dense = m.form.endswith("dense")
        with graph.inserting_before(m.anchor):
            fused = dense_experts.emit_dense(graph, m) if dense else moe_patterns.emit_fused_moe(graph, m)
        target = extend_through_casts(m.anchor, val(m.x).dtype)
        replace(graph, target, fused, sources=chain(m.anchor.args[0]) + chain(m.x) if dense else ())
        self.counts[f"fused_moe_lora[{m.form}]"] += 1
        merged = [u for u in m.updates or () if u is not None and peft_patterns.returned_by_graph(u)]
        if merged:
            self.counts["merged_weight_outputs"] += len(merged)
        log.info("fused_moe_lora <- %s%s", m.describe(), f"; {len(merged)} merged weight(s) stay computed: the "
                 "graph returns them (PEFT's parametrize cache)" if merged else "")
        for w in (m.w13, m.w2):
            if m.lora is None and not m.updates and is_call(skip(w), aten.add.Tensor):
                log.info("near miss at %s: expert weight %s is a sum whose low-rank factors this graph does not "
                         "compute (PEFT with several active expert adapters, without functional_expert_lora): "
                         "fused on the merged weight, which stays computed", m.anchor.name, skip(w).name)

    def _rewrite_linear(self, graph: Graph, m) -> None:
        target = extend_through_casts(m.anchor, val(m.x).dtype)
        with graph.inserting_before(m.anchor):
            fused = linear_patterns.emit_lora_linear(graph, m)
        replace(graph, target, fused, sources=chain(m.x))
        self.counts[f"lora_linear[{m.form}]"] += 1
        log.info("lora_linear <- %s", m.describe())

    def _rewrite_mixed_linear(self, graph: Graph, m) -> None:
        with graph.inserting_before(m.anchor):
            fused = peft_patterns.emit_mixed_lora_linear(graph, m)
        target = extend_through_casts(m.anchor, val(m.x).dtype)
        replace(graph, target, fused, sources=chain(m.batched_x) + chain(m.x))
        self.counts[f"lora_linear[{m.form}]"] += 1
        log.info("lora_linear <- %s", m.describe())


def _can_rebuild(anchor: Node, x: Node) -> bool:
    """Whether every symbolic size of ``anchor`` is a graph input or a size of ``x`` or a tensor behind it."""
    dims = [d for n in chain(x) if shape(n) is not None for d in shape(n)]
    dims += [val(n) for n in anchor.graph.nodes if n.op == "placeholder" and isinstance(val(n), torch.SymInt)]
    return all(isinstance(s, int) or any(same(s, d) for d in dims) for s in shape(anchor))


def _looks_like_moe(anchor: Node) -> bool:
    pairs = anchor.args[0]
    return shape(pairs) is not None and len(shape(pairs)) == 3 and list(anchor.args[1]) == [1]


def _looks_like_lora_linear(anchor: Node) -> bool:
    """Two or more matmul terms and nothing else but a bias: worth a near-miss log line."""
    terms = linear_patterns._terms(anchor)
    others = [t for t in terms if not isinstance(t, tuple)]
    return len(terms) - len(others) >= 2 and all(len(shape(skip(t)) or ()) == 1 for t in others)


def _looks_like_mixed_rows(anchor: Node) -> bool:
    """An ``index_put`` of ``rows + something`` on a tensor of 2+ dims: PEFT's mixed-adapter step, worth a log."""
    value = skip(anchor.args[2])
    return len(shape(anchor) or ()) >= 2 and is_call(value, aten.add.Tensor) \
        and not peft_patterns.feeds_another_row_update(anchor)


def fused_op_counts(graph: Graph) -> collections.Counter:
    """How many ``moe_lora`` ops (by name) a graph calls."""
    counts = collections.Counter()
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "moe_lora":
            counts[node.target._opname] += 1
    return counts
