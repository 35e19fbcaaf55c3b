"""transformers' own experts implementations (``grouped_mm``, ``batched_mm``; bf16, no LoRA) become one
``fused_moe_lora`` each, with no adapters (one rank-1 zero slot, all token ids -1): base models benefit too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pass_helpers import RecordingPass, pass_always_runs

T_SIZES = (5, 9)  # second size within the dynamic range: reuses the graph

# (family, experts implementation, dtype): each row names its edge case
CASES = [
    ("qwen3_moe", "grouped_mm", torch.bfloat16),  # sort + _grouped_mm with offsets + inverse perm; [E,2I,H]
    ("qwen3_moe", "batched_mm", torch.bfloat16),  # per-pair bmm of gathered weights (decode path on GPU)
    ("gpt_oss", "grouped_mm", torch.bfloat16),  # transposed interleaved weights, biases, swiglu, own _apply_gate
    ("gpt_oss", "batched_mm", torch.bfloat16),  # the same through per-pair bmm, bias added in place
    ("qwen3_moe", "grouped_mm", torch.float32),  # outside bf16: transformers' opaque grouped_mm_fallback op
]


def _experts(family: str, implementation: str, dtype=torch.bfloat16) -> nn.Module:
    from moe_lora_compile.models.tiny import tiny_config

    cfg = tiny_config(family)
    cfg._experts_implementation = implementation
    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as Experts
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts
    experts = Experts(cfg)
    for p in experts.parameters():
        nn.init.normal_(p, std=0.2)
    return experts.to(dtype).requires_grad_(False)


class ExpertsZoo(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(_experts(*case) for case in CASES)
        self.dtypes = [dtype for _, _, dtype in CASES]
        self.router = nn.Linear(32, 4, bias=False, dtype=torch.bfloat16).requires_grad_(False)

    def forward(self, x):
        weights, idx = torch.topk(self.router(x).float().softmax(-1), 2)
        return [e(x.to(dtype), idx, weights.to(dtype)) for e, dtype in zip(self.experts, self.dtypes)]


@pytest.fixture(scope="module")
def compiled_experts():
    torch.manual_seed(0)
    model = ExpertsZoo()
    recorder = RecordingPass()
    compiled = torch.compile(model, fullgraph=True)
    results = []
    with pass_always_runs(recorder):
        for T in T_SIZES:
            x = torch.randn(T, 32, dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            results.append((compiled(x), model(x)))
    return recorder, results


def test_each_experts_subgraph_becomes_one_fused_op(compiled_experts):
    recorder, _ = compiled_experts
    assert len(recorder.graphs) == 1
    graph = recorder.graphs[0]
    assert graph["fused_moe_lora"] == len(CASES)
    assert recorder.counts["fused_moe_lora[grouped]"] == 3 and recorder.counts["fused_moe_lora[pairwise]"] == 2
    assert graph["aten._grouped_mm.default"] == 0 and graph["aten.bmm.default"] == 0
    assert graph["transformers.grouped_mm_fallback.default"] == 0
    assert recorder.leftover_expert_matmuls() == 0


def test_fused_experts_equal_eager(compiled_experts):
    _, results = compiled_experts
    for got_all, want_all in results:
        for (family, impl, _), got, want in zip(CASES, got_all, want_all):
            # the op accumulates in fp32 where transformers rounds each bf16 step: bf16 tolerance
            torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2, msg=lambda m: f"{family}/{impl}: {m}")


def test_hf_experts_option_off_leaves_them():
    """``MoELoRAPass(hf_experts=False)`` leaves an experts subgraph without LoRA alone; the default rewrites it
    (checked on an exported, decomposed graph: no Inductor compile needed)."""
    from torch._inductor.decomposition import select_decomp_table

    from moe_lora_compile.passes import MoELoRAPass

    model = _experts("gpt_oss", "batched_mm")
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3]])
    w = torch.rand(4, 2, dtype=torch.bfloat16)
    program = torch.export.export(model, (x, idx, w)).run_decompositions(select_decomp_table())
    gm = program.graph_module
    before = gm.graph.python_code("self").src
    MoELoRAPass(hf_experts=False)(gm.graph)
    assert gm.graph.python_code("self").src == before
    MoELoRAPass()(gm.graph)
    gm.recompile()
    assert sum(n.target == torch.ops.moe_lora.fused_moe_lora.default for n in gm.graph.nodes) == 1
    weights = [program.state_dict[spec.target] for spec in program.graph_signature.input_specs
               if spec.kind.name == "PARAMETER"]
    torch.testing.assert_close(gm(*weights, x, idx, w)[0], model(x, idx, w), atol=5e-2, rtol=5e-2)
