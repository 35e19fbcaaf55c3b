"""``dump_graphs``: the depyf dump of a compiled module names the fused ops in its post-grad graph."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from moe_lora_compile.compile import compile as compile_model
from moe_lora_compile.dump import dump_graphs
from moe_lora_compile.ops.reference import lora_linear_reference

from test_reference_patterns import H, L, R, MoELayer

ROOT = Path(__file__).resolve().parents[2]


class OneLayer(nn.Module):
    """A LoRA linear feeding one MoE layer, both through the references."""

    def __init__(self):
        super().__init__()
        self.moe = MoELayer(torch.float32, "concat", "silu")
        self.w, self.a, self.b = (nn.Parameter(torch.randn(*s) / 4, requires_grad=False)
                                  for s in ((H, H), (L, R, H), (L, H, R)))

    def forward(self, x, ids):
        return self.moe(lora_linear_reference(x, self.w, self.a, self.b, ids), ids)


def test_dump_names_the_fused_ops(tmp_path):
    pytest.importorskip("depyf")
    torch.manual_seed(0)
    model = OneLayer()
    compiled = compile_model(model, fullgraph=True)
    x, ids = torch.randn(6, H), torch.tensor([0, -1, 2, 1, -1, 0], dtype=torch.int32)
    report = dump_graphs(compiled, (x, ids), str(tmp_path))
    assert report.op_counts() == {"fused_moe_lora": 1, "lora_linear": 1}
    assert len(report.post_grad_files) == 1
    text = open(report.post_grad_files[0]).read()
    assert "torch.ops.moe_lora.fused_moe_lora.default(" in text and "torch.ops.moe_lora.lora_linear.default(" in text
    assert "fused_moe_lora x1" in report.summary() and "lora_linear x1" in report.summary()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, ids), model(x, ids), atol=1e-4, rtol=1e-4)


def test_dump_after_a_first_call_recompiles_and_ignores_stale_files(tmp_path):
    """The README's order: call the compiled model, then dump it. Dynamo's cache would answer (nothing traced, an
    empty dump): dump_graphs resets it and compiles again under depyf. Files already in the folder do not count."""
    pytest.importorskip("depyf")
    torch.manual_seed(0)
    stale = tmp_path / "__compiled_fn_99.AFTER_POST_GRAD.0.py"
    stale.write_text("x = torch.ops.moe_lora.lora_linear.default(a, b)\n")  # an earlier run's file
    compiled = compile_model(OneLayer(), fullgraph=True)
    x, ids = torch.randn(6, H), torch.tensor([0, -1, 2, 1, -1, 0], dtype=torch.int32)
    compiled(x, ids)  # first call: compiled outside the dump
    report = dump_graphs(compiled, (x, ids), str(tmp_path))
    assert report.recompiled
    assert report.op_counts() == {"fused_moe_lora": 1, "lora_linear": 1}
    assert str(stale) not in report.files and len(report.post_grad_files) == 1
    assert "compiled again under depyf" in report.summary()


def test_dump_of_a_callable_without_an_inductor_graph_says_so(tmp_path):
    """An eager-backend compile writes Dynamo's files but no post-grad graph: no reset (another compiled function
    keeps its graph), no claim that it "compiled again"; an uncompiled callable writes nothing and is told so."""
    pytest.importorskip("depyf")
    torch._dynamo.reset()
    other = torch.compile(lambda t: t * 2, backend="eager")
    other(torch.randn(3))
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    eager_backend = torch.compile(OneLayer(), backend="eager")
    x, ids = torch.randn(6, H), torch.tensor([0, -1, 2, 1, -1, 0], dtype=torch.int32)
    report = dump_graphs(eager_backend, (x, ids), str(tmp_path / "eager"))
    assert report.files and not report.post_grad_files and not report.recompiled
    assert "no post-grad graph" in report.summary() and "compiled again" not in report.summary()
    with torch._dynamo.config.patch(error_on_recompile=True):
        other(torch.randn(3))  # its graph survived the dump
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames + 1  # the eager-backend model only

    plain = dump_graphs(OneLayer(), (x, ids), str(tmp_path / "plain"))
    assert not plain.files and not plain.recompiled
    assert "nothing was traced" in plain.summary() and "compiled again" not in plain.summary()
    torch._dynamo.reset()


_DUMP_ONE_LAYER = """
import sys, torch
from test_depyf_dump import H, OneLayer
from moe_lora_compile.compile import compile as compile_model
from moe_lora_compile.dump import dump_graphs
torch.manual_seed(0)
compiled = compile_model(OneLayer(), fullgraph=True)
report = dump_graphs(compiled, (torch.randn(6, H), torch.tensor([0, -1, 2, 1, -1, 0], dtype=torch.int32)), sys.argv[1])
print(report.summary())
sys.exit(0 if report.sites else 1)
"""


def test_a_second_dump_into_the_same_folder_counts_its_graph(tmp_path):
    """A dump re-run into the same folder (a fresh process): depyf leaves a file whose text is unchanged as it is,
    and dump_graphs took it for an earlier run's (mtime, size unchanged): "0 post-grad graph(s)", no fused ops."""
    pytest.importorskip("depyf")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent)]))
    runs = [subprocess.run([sys.executable, "-c", _DUMP_ONE_LAYER, str(tmp_path)], capture_output=True, text=True,
                           timeout=300, cwd=ROOT, env=env) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr[-2000:]
        assert "1 post-grad graph(s)" in run.stdout and "fused_moe_lora x1, lora_linear x1" in run.stdout
    assert runs[0].stdout.splitlines()[1:] == runs[1].stdout.splitlines()[1:]  # the same sites
