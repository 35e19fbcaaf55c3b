"""The pass object itself: leaves unrelated graphs alone, cache identity (``uuid``), near-miss logging, the entry
points (``moe_lora_compile.compile`` options, vLLM adapter). No Inductor compile here: graphs come from
``torch.export`` + Inductor's decompositions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch._inductor.decomposition import select_decomp_table

from moe_lora_compile.compile import inductor_options
from moe_lora_compile.passes import MoELoRAPass
from moe_lora_compile.passes.graph_pass import SOURCE_FILES


def _program(module: nn.Module, *args):
    return torch.export.export(module, args).run_decompositions(select_decomp_table())


def _graph(module: nn.Module, *args) -> torch.fx.GraphModule:
    return _program(module, *args).graph_module


def _run(program, *args):
    """Call an exported program's (edited) graph module with its weights and ``args``."""
    weights = [program.state_dict[spec.target] for spec in program.graph_signature.input_specs
               if spec.kind.name in ("PARAMETER", "BUFFER")]
    program.graph_module.recompile()
    return program.graph_module(*weights, *args)[0]


class NoMoENoLoRA(nn.Module):
    """Everything the pass anchors on, none of it MoE or LoRA: linear + bias, residual adds, two matmuls added,
    a sum over dim 1 of a [T, k, H] tensor."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        h = self.up(x) + x  # residual
        h = h + self.other(x)  # two matmuls of the same input added (no low-rank chain)
        pairs = h.reshape(-1, 2, 8) * 2.0
        return pairs.sum(dim=1)


def test_graph_without_moe_or_lora_is_unchanged():
    gm = _graph(NoMoENoLoRA(), torch.randn(6, 8))
    before = gm.graph.python_code("self").src
    p = MoELoRAPass()
    p(gm.graph)
    assert gm.graph.python_code("self").src == before
    assert not p.counts  # no rewrite and no matcher error


class TwoIndexPut(nn.Module):
    """``out[rows, cols] += v``: an index_put with two index tensors (backward graphs of gathered LoRA hold such),
    which is no PEFT adapter term."""

    def forward(self, out, rows, cols, v):
        out = out.clone()
        out[rows, cols] = out[rows, cols] + v
        return out


def test_index_put_with_two_indices_is_no_match_not_a_matcher_error():
    args = (torch.randn(6, 8), torch.tensor([0, 2]), torch.tensor([1, 3]), torch.randn(2))
    gm = _graph(TwoIndexPut(), *args)
    assert any(n.target is torch.ops.aten.index_put.default and len(n.args[1]) == 2 for n in gm.graph.nodes)
    before = gm.graph.python_code("self").src
    p = MoELoRAPass()
    p(gm.graph)
    assert gm.graph.python_code("self").src == before
    assert not p.counts  # was matcher_errors 1 (a ValueError unpacking the indices, logged with its traceback)


def test_uuid_changes_with_options():
    uuids = {MoELoRAPass().uuid(), MoELoRAPass(moe=False).uuid(), MoELoRAPass(hf_experts=False).uuid(),
             MoELoRAPass(linear=False).uuid()}
    assert len(uuids) == 4
    assert MoELoRAPass().uuid() == MoELoRAPass().uuid()


def test_uuid_covers_every_matcher_source_file():
    passes_dir = os.path.dirname(SOURCE_FILES[0])
    matcher_files = {os.path.join(passes_dir, f) for f in os.listdir(passes_dir)
                     if f.endswith(".py") and f not in ("__init__.py", "vllm.py")}
    assert matcher_files <= set(SOURCE_FILES)
    assert any(f.endswith("ops/reference.py") for f in SOURCE_FILES)  # the matchers follow its op sequence


_CHILD = textwrap.dedent("""
    import torch
    from torch import nn
    from torch._inductor.decomposition import select_decomp_table
    from moe_lora_compile.passes import MoELoRAPass

    print(MoELoRAPass().uuid())
    print(MoELoRAPass(linear=False).uuid())

    class GeluMoE(nn.Module):  # reference structure with an activation outside the contract: a near miss
        def forward(self, x, ids, w, w13, w2):
            e = ids.reshape(-1)
            xp = x.unsqueeze(1).expand(-1, 2, 8).reshape(-1, 8)
            h = torch.bmm(w13[e], xp.unsqueeze(-1)).squeeze(-1)
            g, u = h.chunk(2, dim=-1)
            out = torch.bmm(w2[e], (torch.nn.functional.gelu(g) * u).unsqueeze(-1)).squeeze(-1)
            return (out * w.reshape(-1, 1)).reshape(-1, 2, 8).sum(dim=1)

    args = (torch.randn(3, 8), torch.tensor([[0, 1], [1, 0], [0, 0]]), torch.rand(3, 2),
            torch.randn(2, 12, 8), torch.randn(2, 8, 6))
    gm = torch.export.export(GeluMoE(), args).run_decompositions(select_decomp_table()).graph_module
    MoELoRAPass()(gm.graph)
""")


def test_uuid_is_stable_across_processes_and_log_names_near_misses():
    env = dict(os.environ, MOE_LORA_PASS_LOG="1")
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    default_uuid, no_linear_uuid = child.stdout.split()[:2]
    assert default_uuid == MoELoRAPass().uuid()
    assert no_linear_uuid == MoELoRAPass(linear=False).uuid()
    assert "near miss" in child.stderr and "neither silu-GLU nor GPT-OSS swiglu" in child.stderr


def test_compile_options_install_the_pass():
    opts = inductor_options({"max_autotune": False})
    assert isinstance(opts["post_grad_custom_post_pass"], MoELoRAPass) and opts["max_autotune"] is False
    mine = MoELoRAPass(linear=False)
    assert inductor_options({"post_grad_custom_post_pass": mine})["post_grad_custom_post_pass"] is mine
    # torch.compile takes mode or options, not both: compile() folds the mode's options in
    assert inductor_options(None, mode="max-autotune-no-cudagraphs")["max_autotune"] is True


def test_compile_refuses_a_foreign_post_grad_pass():
    with pytest.raises(ValueError, match="post_grad_custom_post_pass"):
        inductor_options({"post_grad_custom_post_pass": lambda graph: None})


def test_without_duck_sizing_keeps_one_graph_when_the_first_call_has_equal_sizes():
    """Duck sizing gives sizes equal at the first trace one symbol: a first batch 2 x length 2 guarded
    batch == length and the next shape recompiled. compile() (and the graphs' compiled prefill) call through
    without_duck_sizing; the caller's own compiles keep duck sizing."""
    from torch._dynamo.testing import CompileCounter

    from moe_lora_compile.compile import without_duck_sizing

    counts = []
    for wrap in (False, True):
        torch._dynamo.reset()
        counter = CompileCounter()
        fn = torch.compile(lambda x: (x * x.shape[0]).sum(1), backend=counter, dynamic=True)
        fn = without_duck_sizing(fn) if wrap else fn
        for shape in [(2, 2), (3, 5), (4, 4), (6, 3)]:
            torch.testing.assert_close(fn(torch.ones(shape)), torch.full((shape[0],), float(shape[0] * shape[1])))
        counts.append(counter.frame_count)
    assert counts == [2, 1]
    from torch.fx.experimental import _config as fx_config

    assert fx_config.use_duck_shape  # restored after each call


def test_compile_refuses_other_backends():
    from moe_lora_compile.compile import compile as compile_model

    with pytest.raises(ValueError, match="backend must be 'inductor'"):
        compile_model(nn.Linear(2, 2), backend="eager")


def test_compile_refuses_pass_options_beside_a_given_pass():
    """pass_options with a MoELoRAPass already in options: that pass would run as it is, the options unused."""
    from moe_lora_compile.compile import compile as compile_model
    from moe_lora_compile.passes import MoELoRAPass

    with pytest.raises(ValueError, match="pass_options: options.*already holds a MoELoRAPass"):
        compile_model(nn.Linear(2, 2), pass_options={"linear": False},
                      options={"post_grad_custom_post_pass": MoELoRAPass()})
    compile_model(nn.Linear(2, 2), options={"post_grad_custom_post_pass": MoELoRAPass(linear=False)})  # fine


def test_vllm_adapter(monkeypatch):
    """Without vLLM: a clear ImportError. With vLLM's InductorPass importable (stubbed here): an instance of it
    with our uuid scheme."""
    import types

    from torch._inductor.custom_graph_pass import CustomGraphPass

    from moe_lora_compile.passes import vllm as vllm_adapter

    vllm_adapter._vllm_pass_class.cache_clear()
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match="needs vLLM"):
        vllm_adapter.vllm_pass()

    class InductorPass(CustomGraphPass):
        def uuid(self):
            return "source hash"

    stub = types.ModuleType("vllm.compilation.inductor_pass")
    stub.InductorPass = InductorPass
    for name in ("vllm", "vllm.compilation"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.compilation.inductor_pass", stub)
    vllm_adapter._vllm_pass_class.cache_clear()
    try:
        p = vllm_adapter.vllm_pass(linear=False)
        assert isinstance(p, InductorPass) and isinstance(p, MoELoRAPass)
        assert p.uuid() == vllm_adapter.vllm_pass(linear=False).uuid() != "source hash"
        assert p.uuid() != vllm_adapter.vllm_pass().uuid()
    finally:
        vllm_adapter._vllm_pass_class.cache_clear()


def test_gpu_decomposed_bmm_form_is_matched(monkeypatch):
    """On GPU under ``coordinate_descent_tuning`` Inductor decomposes a skinny bmm into
    ``(a.unsqueeze(-1) * b.unsqueeze(1)).sum(2)``: the matcher reads that form too."""
    from test_reference_patterns import H, MoELayer

    torch.manual_seed(0)
    layer = MoELayer(torch.float32, "transposed_interleaved", "gptoss_swiglu", w13_bias=True, w2_bias=True)
    x, ids = torch.randn(5, H), torch.tensor([0, -1, 2, 1, 0], dtype=torch.int32)
    want = layer(x, ids)
    monkeypatch.setattr(torch, "bmm", lambda a, b: (a.unsqueeze(-1) * b.unsqueeze(1)).sum(dim=2))
    program = _program(layer, x, ids)
    monkeypatch.undo()
    assert not any(n.target == torch.ops.aten.bmm.default for n in program.graph_module.graph.nodes)
    p = MoELoRAPass()
    p(program.graph_module.graph)
    assert p.counts == {"fused_moe_lora[pairwise]": 1}
    torch.testing.assert_close(_run(program, x, ids), want, atol=1e-5, rtol=1e-5)
