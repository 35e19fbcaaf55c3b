"""The PEFT source forms on small graphs, without an Inductor compile (``torch.export`` or ``make_fx`` with Inductor's
decompositions): the other spellings of a merged expert weight, rank padding, one projection adapted, a delta the
graph cannot see into, Llama-4's plain experts, and PEFT's mixed-adapter rows (fused only when provably disjoint).
The real post-grad graphs of PEFT models are in ``test_peft_models.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._inductor.decomposition import select_decomp_table
from torch.fx.experimental.proxy_tensor import make_fx

from moe_lora_compile.passes import MoELoRAPass

E, H, I = 4, 32, 24


def _export(module, args):
    program = torch.export.export(module, args).run_decompositions(select_decomp_table())
    weights = [program.state_dict[spec.target] for spec in program.graph_signature.input_specs
               if spec.kind.name in ("PARAMETER", "BUFFER")]
    return program.graph_module, weights


def _rewrite(gm, options=None):
    p = MoELoRAPass(**(options or {}))
    p(gm.graph)
    gm.recompile()
    return p


def _qwen3_experts():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from moe_lora_compile.models.tiny import tiny_config

    config = tiny_config("qwen3_moe")
    config._experts_implementation = "batched_mm"
    experts = Qwen3MoeExperts(config)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    return experts.requires_grad_(False)


class MergedExperts(nn.Module):
    """Qwen3-MoE experts whose weights are merged per forward the way ``spelling`` says (PEFT's ParamWrapper
    parametrizes them as ``W + s * lhs @ rhs``; lhs/rhs in PEFT's orientation for ``[E, out, in]`` weights)."""

    def __init__(self, spelling, ranks=(4, 4), scale=2.0):
        super().__init__()
        self.experts, self.spelling, self.scale = _qwen3_experts(), spelling, scale
        g = torch.Generator().manual_seed(0)
        rand = lambda *s: nn.Parameter(torch.randn(*s, generator=g) * 0.3, requires_grad=False)
        r13, r2 = ranks
        self.lhs13, self.rhs13 = rand(E, 2 * I, r13), rand(E, r13, H)
        self.lhs2, self.rhs2 = rand(E, H, r2), rand(E, r2, I)
        self.second = nn.ParameterList([rand(E, 2 * I, 2), rand(E, 2, H), rand(E, H, 2), rand(E, 2, I)])

    def merged(self, w, lhs, rhs, delta):
        if self.spelling == "baddbmm":  # PEFT >= 0.21 on torch 2.13 (Inductor keeps baddbmm)
            return torch.baddbmm(w, lhs, rhs, alpha=self.scale)
        if self.spelling == "two_adapters":  # functional_expert_lora with two active adapters: nested updates
            lhs2, rhs2 = self.second[:2] if w.shape[1] == 2 * I else self.second[2:]
            return torch.baddbmm(torch.baddbmm(w, lhs, rhs, alpha=self.scale), lhs2, rhs2, alpha=0.5)
        if self.spelling == "add_bmm":  # baddbmm decomposed (older torch): W + s * bmm
            return w + torch.bmm(lhs, rhs) * self.scale
        if self.spelling == "outer":  # a rank-1 bmm as Inductor decomposes it: W + s * (lhs * rhs)
            return w + self.scale * (lhs * rhs)
        if self.spelling == "gate_up_only":
            return torch.baddbmm(w, lhs, rhs, alpha=self.scale) if w.shape[1] == 2 * I else w
        return w + delta  # "outside_delta": a delta this graph cannot see into (several active adapters)

    def forward(self, x, idx, weights, delta13, delta2):
        params = {"gate_up_proj": self.merged(self.experts.gate_up_proj, self.lhs13, self.rhs13, delta13),
                  "down_proj": self.merged(self.experts.down_proj, self.lhs2, self.rhs2, delta2)}
        return torch.func.functional_call(self.experts, params, (x, idx, weights))


# (spelling, ranks of gate/up and down, expected count key): each row names its edge case
MERGED_CASES = [
    ("baddbmm", (4, 4), "fused_moe_lora[peft_pairwise]"),  # PEFT's _LoraFactorsProxy
    ("add_bmm", (4, 4), "fused_moe_lora[peft_pairwise]"),  # the decomposed spelling
    ("baddbmm", (6, 3), "fused_moe_lora[peft_pairwise]"),  # ranks differ (PEFT-converted per-expert gate/up): pad
    ("gate_up_only", (4, 4), "fused_moe_lora[peft_pairwise]"),  # down not adapted: zero factors for it
    ("two_adapters", (4, 3), "fused_moe_lora[peft_pairwise]"),  # W + s1 l1 r1 + s2 l2 r2: ranks concatenated
    ("outer", (1, 1), "fused_moe_lora[peft_pairwise]"),  # rank 1, the bmm decomposed into an outer product
    ("outside_delta", (4, 4), "fused_moe_lora[pairwise]"),  # no factors to read: fused on the merged weight
]


@pytest.mark.parametrize("spelling, ranks, key", MERGED_CASES, ids=[f"{c[0]}-{c[1]}" for c in MERGED_CASES])
def test_merged_expert_weight_spellings(spelling, ranks, key):
    module = MergedExperts(spelling, ranks)
    g = torch.Generator().manual_seed(1)
    x, weights = torch.randn(6, H, generator=g), torch.rand(6, 2, generator=g)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0], [3, 2]])
    deltas = (torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1)
    args = (x, idx, weights, *deltas)
    gm, params = _export(module, args)
    p = _rewrite(gm)
    assert dict(p.counts) == {key: 1}
    torch.testing.assert_close(gm(*params, *args)[0], module(*args), atol=1e-5, rtol=1e-5)
    bmms = sum(n.target in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default) for n in gm.graph.nodes)
    assert bmms == 0  # neither the expert matmuls nor the merge are left (the graph does not return the merge)


def test_llama4_experts_without_lora():
    """transformers' Llama-4 experts (every row through its block's expert) -> one op, routing ids ``p // T``."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    from moe_lora_compile.models.tiny import tiny_config

    experts = Llama4TextExperts(tiny_config("llama4"))
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    experts.requires_grad_(False)
    x = torch.randn(E * 5, H)
    gm, params = _export(experts, (x,))
    p = _rewrite(gm)
    assert dict(p.counts) == {"fused_moe_lora[dense]": 1}
    assert not any(n.target == torch.ops.aten.bmm.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(*params, x)[0], experts(x), atol=1e-5, rtol=1e-5)
    assert dict(_rewrite(_export(experts, (x,))[0], dict(hf_experts=False)).counts) == {}


def _mixed_rows(rows_per_adapter, ranks=(4, 2), scales=(2.0, 0.5)):
    """PEFT's ``_mixed_batch_forward`` written out: ``out[rows] += B(A(x[rows])) * s`` per adapter, rows constant;
    returns ``(forward, weights)``, ``forward(x, w, bias, *factors)``."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(16, H, generator=g) * 0.2, torch.randn(16, generator=g)]
    for r in ranks[:len(rows_per_adapter)]:
        weights += [torch.randn(r, H, generator=g), torch.randn(16, r, generator=g)]

    def forward(x, w, bias, *factors):  # x [B, S, H]
        out = torch.nn.functional.linear(x, w, bias)
        for j, (rows, s) in enumerate(zip(rows_per_adapter, scales)):
            index = torch.tensor(rows)
            out[index] += (x[index] @ factors[2 * j].t() @ factors[2 * j + 1].t()) * s
        return out

    return forward, weights


# (rows per adapter, fused?): each row names its edge case
MIXED_CASES = [
    ([[0, 2], [1]], True),  # two adapters, row 3 without (id -1), ranks 4 and 2 (padded)
    ([[3]], True),  # one adapter on one row
    ([[0, 1], [1, 2]], False),  # overlapping rows: two deltas on row 1, which one slot per row cannot express
]


@pytest.mark.parametrize("rows, fused", MIXED_CASES, ids=["two-adapters", "one-row", "overlap"])
def test_mixed_adapter_rows(rows, fused):
    forward, weights = _mixed_rows(rows)
    args = (torch.randn(4, 3, H), *weights)
    functional = torch.func.functionalize(forward)  # post-grad graphs are functional: index_put, not index_put_
    gm = make_fx(functional, decomposition_table=select_decomp_table(), tracing_mode="fake")(*args)
    before = gm.graph.python_code("self").src
    p = _rewrite(gm)
    if not fused:
        assert not p.counts and gm.graph.python_code("self").src == before
        return
    assert dict(p.counts) == {"lora_linear[peft_mixed]": 1}
    assert not any(n.target == torch.ops.aten.index_put.default and len(n.meta["val"].shape) > 1
                   for n in gm.graph.nodes)  # no row update of the output is left, only the slot-id writes
    torch.testing.assert_close(gm(*args), forward(*args), atol=1e-5, rtol=1e-5)


def test_functional_expert_lora_with_two_active_adapters():
    """Two active expert adapters on a real PEFT model, run by :func:`functional_expert_lora`: PEFT's values, and
    the exported graph's nested merges become one op with the ranks concatenated (4 + 2)."""
    import copy

    from peft import get_peft_model

    from moe_lora_compile.models.tiny import randomize_lora_, tiny_lora_config
    from moe_lora_compile.peft_compat import functional_expert_lora

    experts = _qwen3_experts()
    holder = nn.Module()
    holder.experts = copy.deepcopy(experts)
    config = tiny_lora_config("qwen3_moe", target_modules=[], target_parameters=["experts.gate_up_proj",
                                                                                 "experts.down_proj"])
    peft_model = get_peft_model(holder, config, adapter_name="one")
    peft_model.add_adapter("two", tiny_lora_config("qwen3_moe", target_modules=[], r=2, lora_alpha=6,
                                                   target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    randomize_lora_(peft_model)
    peft_model.base_model.set_adapter(["one", "two"])
    wrapped = peft_model.base_model.model.experts
    x, idx, weights = torch.randn(6, H), torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0], [3, 2]]), torch.rand(6, 2)
    with torch.no_grad():
        want = wrapped(x, idx, weights)
        assert (want - experts(x, idx, weights)).abs().max() > 1e-2
        functional_expert_lora(peft_model)
        torch.testing.assert_close(wrapped(x, idx, weights), want, atol=1e-5, rtol=1e-5)
    gm, params = _export(wrapped, (x, idx, weights))
    p = _rewrite(gm)
    assert dict(p.counts) == {"fused_moe_lora[peft_pairwise]": 1}
    (fused,) = [n for n in gm.graph.nodes if n.target == torch.ops.moe_lora.fused_moe_lora.default]
    assert fused.args[6].meta["val"].shape == (1, E, 4 + 2, H)  # lora_a13: one slot, both adapters' ranks
    torch.testing.assert_close(gm(*params, x, idx, weights)[0], want, atol=1e-5, rtol=1e-5)


# --- look-alikes: graphs that resemble a fused form but compute something else are left alone -----------------
class _LinearPlusTerm(nn.Module):
    """``x W^T + term + (x A^T) B^T * 0.5`` with ``term`` a vector added per column (``[1, out]``: a bias) or per
    row (``[T, 1]``)."""

    def __init__(self, per_row: bool, n: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w, self.a, self.b = (nn.Parameter(torch.randn(*s, generator=g), requires_grad=False)
                                  for s in ((n, n), (4, n), (n, 4)))
        self.per_row = per_row

    def forward(self, x, v):
        term = v.unsqueeze(1) if self.per_row else v.unsqueeze(0)
        return x @ self.w.T + term + (x @ self.a.T) @ self.b.T * 0.5


@pytest.mark.parametrize("per_row, fused", [
    (False, True),   # a bias: fused with the add in the op
    (True, False),   # one value per row where T == out: the [T] vector is no [out] bias, whatever its size
])
def test_linear_with_a_per_row_term_is_not_read_as_its_bias(per_row, fused):
    module = _LinearPlusTerm(per_row)
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(16, 16, generator=g), torch.randn(16, generator=g) * 3)
    gm, params = _export(module, args)
    p = _rewrite(gm)
    assert dict(p.counts) == ({"lora_linear[peft]": 1} if fused else {})
    torch.testing.assert_close(gm(*params, *args)[0], module(*args), atol=1e-4, rtol=1e-4)


class _ClampedSilu(nn.Module):
    def forward(self, gate):
        return nn.functional.silu(gate.clamp(max=25.0))


@pytest.mark.parametrize("clamped", [
    False,  # transformers' silu-GLU experts: fused
    True,   # silu of a gate clamped at 25, which the fused op's silu-GLU does not clamp: left alone (the activation
])          # is identified by evaluation, on inputs large enough to reach the clamp)
def test_experts_activation_that_differs_on_large_inputs_is_not_fused(clamped):
    experts = _qwen3_experts()
    if clamped:
        experts.act_fn = _ClampedSilu()
    g = torch.Generator().manual_seed(1)
    x, weights = torch.randn(6, H, generator=g) * 40, torch.rand(6, 2, generator=g)  # gates past 25
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [1, 0], [3, 2]])
    gm, params = _export(experts, (x, idx, weights))
    p = _rewrite(gm)
    assert (dict(p.counts) == {}) == clamped
    torch.testing.assert_close(gm(*params, x, idx, weights)[0], experts(x, idx, weights), atol=1e-3, rtol=1e-4)
