"""Plain PEFT models compiled with ``torch.compile(..., options={"post_grad_custom_post_pass": MoELoRAPass()})``:
what Inductor's post-grad graphs hold after PEFT's own LoRA ran under Dynamo, against PEFT eager (float32).

- Expert LoRA (``target_parameters``, PEFT's ``ParamWrapper``): one MoE block per family, compiled as it is (PEFT's
  parametrization breaks the graph around the experts, so Dynamo makes several graphs; the experts land in one).
  Exactly one graph holds the fused op; the only expert matmuls left are PEFT's merged weights, which the graph
  returns (PEFT's ``parametrize.cached()`` write, replayed by Dynamo) and so stay computed. The same blocks
  recompile on every call; with :func:`~moe_lora_compile.peft_compat.functional_expert_lora` they make one graph,
  no recompiles, and the merged weights disappear.
- A per-expert (transformers-4 ``w1/w3/w2``) Mixtral adapter, which PEFT converts into the same wrapper on load:
  gate/up rank 2r, down rank r (the pass pads the smaller rank with zeros).
- Mixed-adapter dense LoRA (``adapter_names=``) on a MoE model: one graph, one ``lora_linear`` per adapted linear
  with the batch's adapters as slots, transformers' experts fused without LoRA.

One block compile costs 10-15 s on 2 CPU cores; each family is compiled once.
"""

from __future__ import annotations

import collections
import copy
import json
import os

import pytest
import torch
from peft import PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from moe_lora_compile.models.families import FAMILIES
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config
from moe_lora_compile.peft_compat import functional_expert_lora

from pass_helpers import RecordingPass, fresh_dynamo, pass_always_runs  # noqa: F401 (fresh_dynamo: fixture)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("fresh_dynamo")]
TOL = dict(atol=1e-5, rtol=1e-5)

# (family, transformers experts implementation, LoRA settings): each row names what it covers
EXPERT_CASES = [
    ("qwen3_moe", "grouped_mm", {}),  # concat [E,2I,H], sort + grouped_mm; baddbmm-merged weights
    ("gpt_oss", "batched_mm", dict(use_rslora=True)),  # transposed interleaved + biases, per-pair bmm; s = a/sqrt(r)
    ("mixtral", "batched_mm", {}),  # concat, softmax -> top-k -> renormalise
    ("deepseek_v3", "grouped_mm", dict(r=2, lora_alpha=3)),  # sigmoid group routing + shared experts; s = 1.5
    ("olmoe", "grouped_mm", {}),  # concat, softmax top-k
    ("qwen2_moe", "batched_mm", {}),  # shared expert and sigmoid shared gate beside the experts
    ("llama4", None, {}),  # every row through its block's expert (dense bmm), PEFT's A on the output side
]


def _family(name):
    return next(f for f in FAMILIES if f.name == name)


def _block_input(family):
    return torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(1))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _compile_block(block, x, recorder):
    torch._dynamo.utils.counters.clear()
    with pass_always_runs(recorder):
        got = _first(torch.compile(block, options={"post_grad_custom_post_pass": recorder})(x))
    counters = torch._dynamo.utils.counters
    return got, counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def _peft_block(family, implementation, lora=None):
    """A tiny PEFT model with an experts adapter (random LoRA); returns it, its last MoE block and a plain copy."""
    torch.manual_seed(0)
    config = tiny_config(family)
    if implementation is not None:
        config._experts_implementation = implementation
    base = AutoModelForCausalLM.from_config(config).eval()
    attr = _family(family).block_attr
    plain_block = copy.deepcopy(getattr(base.model.layers[-1], attr))
    peft_model = get_peft_model(base, tiny_lora_config(family, target_modules=[], **(lora or {}))).eval()
    randomize_lora_(peft_model)
    return peft_model, getattr(peft_model.base_model.model.model.layers[-1], attr), plain_block


FORMS = {"grouped_mm": "peft_grouped", "batched_mm": "peft_pairwise", None: "peft_dense"}


@pytest.mark.parametrize("family, implementation, lora", EXPERT_CASES, ids=[c[0] for c in EXPERT_CASES])
def test_peft_expert_lora_becomes_one_fused_op(family, implementation, lora):
    _, block, plain_block = _peft_block(family, implementation, lora)
    x = _block_input(family)
    with torch.no_grad():
        want, without_lora = _first(block(x)), _first(plain_block(x))
    assert (want - without_lora).abs().max() > 1e-2  # the adapter changes the output: dropping it would fail

    recorder = RecordingPass()
    got, graphs, breaks = _compile_block(block, x, recorder)
    torch.testing.assert_close(got, want, **TOL)
    # both expert weights are merged by PEFT and, through its parametrize cache, returned by the experts graph
    assert dict(recorder.counts) == {f"fused_moe_lora[{FORMS[implementation]}]": 1, "merged_weight_outputs": 2}
    assert len(recorder.graphs) == graphs and breaks > 0  # PEFT's parametrization breaks the graph
    (fused,) = [g for g in recorder.graphs if g["fused_moe_lora"]]
    assert fused["fused_moe_lora"] == 1
    # what is left of expert matmuls: the two merged weights the graph returns, nothing that reads them
    assert fused["aten.baddbmm.default"] == fused["leftover_matmuls"] == 2
    assert fused["aten.bmm.default"] + fused["aten._grouped_mm.default"] + \
        fused["transformers.grouped_mm_fallback.default"] == 0


def test_peft_expert_lora_recompiles_every_call():
    """Why :func:`functional_expert_lora` exists: PEFT registers a parametrization per forward, which makes a new
    ``Parametrized<Experts>`` class each time, and Dynamo guards on the type: every call compiles the experts frame
    again (``eager`` backend here: the count is Dynamo's, whatever the backend)."""
    _, block, _ = _peft_block("qwen3_moe", "grouped_mm")
    compiled = torch.compile(block, backend="eager")
    graphs = []
    with torch.no_grad():
        for seed in range(3):
            compiled(torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(seed)))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[2] - graphs[1] == graphs[1] - graphs[0] > 0  # same shapes, new graphs on every call


# (family, experts implementation): each row names what it covers
FUNCTIONAL_CASES = [
    ("gpt_oss", "batched_mm"),  # transposed interleaved weights and biases, per-pair bmm
    ("llama4", None),  # every row through its block's expert (dense bmm), PEFT's A on the output side
]


@pytest.mark.parametrize("family, implementation", FUNCTIONAL_CASES, ids=[c[0] for c in FUNCTIONAL_CASES])
def test_functional_expert_lora_one_graph_no_recompiles(family, implementation):
    """With :func:`functional_expert_lora`: one graph (fullgraph), no recompile on new inputs, the merged weights
    gone (the op reads W and the LoRA factors), PEFT's values; ``enable=False`` gives PEFT's forward back."""
    peft_model, block, _ = _peft_block(family, implementation)
    inputs = [torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    with torch.no_grad():
        want = [_first(block(x)) for x in inputs]
        functional_expert_lora(peft_model)
        torch.testing.assert_close(_first(block(inputs[0])), want[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="mixed"):  # PEFT's own error for adapter_names on expert adapters
        block.experts(torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2),
                      adapter_names=["default"] * 3)

    recorder = RecordingPass()
    compiled = torch.compile(block, fullgraph=True, options={"post_grad_custom_post_pass": recorder})
    with pass_always_runs(recorder), torch._dynamo.config.patch(error_on_recompile=True):
        got = [_first(compiled(x)) for x in inputs]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    assert dict(recorder.counts) == {f"fused_moe_lora[{FORMS[implementation]}]": 1}
    (graph,) = recorder.graphs
    expert_matmuls = ("aten.baddbmm.default", "aten.bmm.default", "aten._grouped_mm.default")
    assert sum(graph[op] for op in expert_matmuls) == 0  # the merged weights are gone with the expert matmuls
    functional_expert_lora(peft_model, enable=False)
    assert "forward" not in block.experts.__dict__


def _per_expert_mixtral_adapter(path, rank=3, alpha=6):
    """A transformers-4 Mixtral adapter: per-expert ``w1/w3/w2`` LoRA, distinct A for gate (w1) and up (w3)."""
    E, H, I = 4, 32, 24
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        prefix = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts"
        for e in range(E):
            for leaf, (n_in, n_out) in (("w1", (H, I)), ("w3", (H, I)), ("w2", (I, H))):
                tensors[f"{prefix}.{e}.{leaf}.lora_A.weight"] = torch.randn(rank, n_in, generator=generator) * 0.3
                tensors[f"{prefix}.{e}.{leaf}.lora_B.weight"] = torch.randn(n_out, rank, generator=generator) * 0.3
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": alpha, "peft_type": "LORA", "task_type": "CAUSAL_LM",
              "target_modules": ["w1", "w3", "w2"]}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys:RuntimeWarning")  # PEFT's conversion
def test_peft_converted_per_expert_adapter(tmp_path):
    """PEFT loads per-expert Mixtral keys into its 3-D wrapper: gate/up rank 2r (block-diagonal B), down rank r."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("mixtral")).eval()
    plain_block = copy.deepcopy(base.model.layers[0].mlp)
    _per_expert_mixtral_adapter(tmp_path / "per_expert")
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "per_expert")).eval()
    experts = peft_model.base_model.model.model.layers[0].mlp.experts
    assert experts.base_layer.lora_A["default"].weight.shape == (4 * 6, 32)  # gate/up: E * 2r rows
    assert experts.lora_A["default"].weight.shape == (4 * 3, 24)  # down: E * r rows
    block = peft_model.base_model.model.model.layers[0].mlp
    x = _block_input("mixtral")
    with torch.no_grad():
        want = _first(block(x))
    assert (want - _first(plain_block(x))).abs().max() > 1e-2
    recorder = RecordingPass()
    got, _, _ = _compile_block(block, x, recorder)
    torch.testing.assert_close(got, want, **TOL)
    assert dict(recorder.counts) == {"fused_moe_lora[peft_grouped]": 1, "merged_weight_outputs": 2}


def test_peft_mixed_adapter_batch():
    """``adapter_names=`` on a Qwen2-MoE model (q/k/v biases) with two dense adapters of different ranks and targets:
    q_proj has both (2 slots), v_proj only ``sql``, o_proj only ``chat``; ``__base__`` rows keep the base model."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe", num_hidden_layers=1)).eval()
    config_a = tiny_lora_config("qwen2_moe", target_parameters=None, target_modules=["q_proj", "v_proj"])
    config_b = tiny_lora_config("qwen2_moe", target_parameters=None, target_modules=["q_proj", "o_proj"], r=2,
                                lora_alpha=8, use_rslora=True)
    peft_model = get_peft_model(base, config_a, adapter_name="sql")
    peft_model.add_adapter("chat", config_b)
    randomize_lora_(peft_model)
    peft_model.eval()
    names = ["sql", "chat", "__base__", "sql", "chat"]
    input_ids = torch.randint(3, 128, (len(names), 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = peft_model(input_ids, adapter_names=names).logits
        with peft_model.disable_adapter():
            without_lora = peft_model(input_ids).logits
    assert torch.equal(want[2], without_lora[2])  # the __base__ row
    assert all((want[i] - without_lora[i]).abs().max() > 1e-3 for i in (0, 1, 3, 4))

    recorder = CountingBefore()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(peft_model, options={"post_grad_custom_post_pass": recorder})
    with pass_always_runs(recorder):
        got = compiled(input_ids, adapter_names=names).logits
    torch.testing.assert_close(got, want, **TOL)
    counters = torch._dynamo.utils.counters
    assert (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())) == (1, 0)
    assert dict(recorder.counts) == {"lora_linear[peft_mixed]": 3, "fused_moe_lora[grouped]": 1}
    (graph,) = recorder.graphs
    assert graph["leftover_matmuls"] == 0
    # gone: the A and B matmuls of the four (linear, adapter) pairs and the three adapted base linears
    matmuls = ("aten.mm.default", "aten.addmm.default")
    assert sum(recorder.before[op] - graph[op] for op in matmuls) == 4 * 2 + 3


class CountingBefore(RecordingPass):
    """Also counts the ops of the graph the pass received."""

    def __call__(self, graph):
        self.before = collections.Counter(str(n.target) for n in graph.nodes if n.op == "call_function")
        super().__call__(graph)
