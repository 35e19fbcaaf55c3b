"""Shared helpers of the pass tests: a pass that records what each post-grad graph holds after it ran, and the
Inductor config under which the pass really runs (no FX-graph / AOT cache hit that would skip it)."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch

from moe_lora_compile.compile import pass_runs
from moe_lora_compile.passes import MoELoRAPass, fused_op_counts
from moe_lora_compile.passes.fx_match import is_call, shape, skip

aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default) + tuple(
    op.default for op in (getattr(aten, "_grouped_mm", None),) if op is not None)


def _operand_source(node):
    src = skip(node)
    if is_call(src, aten.permute.default):
        src = skip(src.args[0])
    return src


def leftover_expert_or_lora_matmuls(graph) -> int:
    """Matmuls still reading gathered expert weights or a stacked (>= 3-D) weight input: unfused MoE/LoRA work.

    Routers, attention and the LM head read activations or 2-D weights and are not counted.
    """
    count = 0
    for node in graph.nodes:
        if not is_call(node, *_MATMULS):
            continue
        for arg in node.args:
            src = _operand_source(arg) if isinstance(arg, torch.fx.Node) else None
            if src is not None and (is_call(src, aten.index.Tensor)
                                    or src.op == "placeholder" and len(shape(src) or ()) >= 3):
                count += 1
                break
    return count


class RecordingPass(MoELoRAPass):
    """``MoELoRAPass`` that also records, per graph, the op counts of the graph it leaves behind."""

    def __init__(self, **options):
        super().__init__(**options)
        self.graphs: list[collections.Counter] = []

    def __call__(self, graph):
        super().__call__(graph)
        assert not self.counts["matcher_errors"], "a matcher raised (see the logged warning)"
        ops = fused_op_counts(graph)
        for node in graph.nodes:
            if node.op == "call_function":
                ops[str(node.target)] += 1
        ops["leftover_matmuls"] = leftover_expert_or_lora_matmuls(graph)
        self.graphs.append(ops)

    def total(self, name: str) -> int:
        return sum(g[name] for g in self.graphs)

    def leftover_expert_matmuls(self) -> int:
        return self.total("leftover_matmuls")


@contextlib.contextmanager
def pass_always_runs(custom_pass):
    """Run ``custom_pass`` as Inductor's post-grad pass with the FX-graph and AOT caches off (a hit skips it)."""
    with pass_runs(), torch._inductor.config.patch(post_grad_custom_post_pass=custom_pass), torch.no_grad():
        yield


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
