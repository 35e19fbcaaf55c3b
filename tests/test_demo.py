"""``python -m moe_lora_compile demo`` end to end (in process, through ``main``), both ways in.

1. Our attached model: tiny Qwen3-MoE, three PEFT adapters saved with PEFT's API, compiled with the pass, mixed batch
   checked against eager. Its report is the whole-model check for Qwen3-MoE: one graph, no breaks, no recompiles
   (adapter mix, hot swap, batch size), one fused MoE op per layer and one lora_linear per adapted projection.
2. A plain PEFT model (one layer, experts adapter via ``target_parameters`` + q/v/o) compiled with ``torch.compile``
   and the pass after ``functional_expert_lora``: one graph, no breaks, no recompiles (new tokens, smaller batch),
   the experts as one ``fused_moe_lora[peft_grouped]``, each adapted linear as ``lora_linear[peft]``, logits equal
   PEFT eager."""

import re

import pytest

from moe_lora_compile.__main__ import main


def _fused(line: str) -> dict:
    return dict(re.findall(r"(\w+\[\w+\]) x(\d+)", line))


@pytest.mark.slow
def test_demo_command(capsys):
    assert main(["demo", "--batch", "4", "--seq-len", "6"]) == 0
    out = capsys.readouterr().out
    attached, peft = out.split("the PEFT way")
    assert "graphs 1, graph breaks 0, recompiles 0" in attached
    fused = _fused(attached.split("fused ops:")[1].splitlines()[0])
    # tiny Qwen3-MoE: 2 layers, each one MoE block and 4 attention projections (q, k, v, o) wrapped for LoRA
    assert fused == {"fused_moe_lora[pairwise]": "2", "lora_linear[multi]": "8"}
    assert "-> OK" in attached

    assert "graphs 1, graph breaks 0, recompiles 0 (after: new tokens, smaller batch)" in peft
    # one layer: its MoE block (PEFT's merged expert weights read back as W + factors) and q, v, o
    assert _fused(peft.split("fused ops:")[1].splitlines()[0]) == {"fused_moe_lora[peft_grouped]": "1",
                                                                   "lora_linear[peft]": "3"}
    assert "compiled vs PEFT eager" in peft and "-> OK" in peft


@pytest.mark.slow
def test_peft_section_in_bf16_measures_both_sides_against_float32():
    """bf16 (what the CUDA demo runs): compiled and PEFT eager are each measured against the float32 PEFT model;
    tokens at a router near-tie (a bf16 rounding can swap their k-th expert) are counted and left out, and they
    must stay a small minority, so the exclusion cannot hide a wrong result."""
    import torch

    from moe_lora_compile.peft_demo import run_peft_demo

    r = run_peft_demo("qwen3_moe", dtype=torch.bfloat16, device=torch.device("cpu"), batch=4, seq_len=8)
    assert r["ok"], r
    assert r["near_tie_tokens"] <= r["tokens"] // 8, r
    assert 0 < r["max_abs_err"] <= r["tol"] and 0 < r["peft_eager_err"]


@pytest.mark.slow
def test_demo_and_dump_fail_when_no_moe_layer_is_fused(monkeypatch, capsys, tmp_path):
    """The pass fusing only the dense layers (its MoE matcher stopped, as a change of the reference's graph once made
    it) is a failure of both commands: they exited 0 on their lora_linear sites and accuracy alone."""
    from moe_lora_compile.passes import moe_patterns
    from moe_lora_compile.passes.fx_match import NoMatch

    def no_moe(anchor):
        raise NoMatch(f"{anchor.name}: the test's stand-in for a matcher that stopped")

    monkeypatch.setattr(moe_patterns, "match_moe", no_moe)
    assert main(["demo", "--skip-peft", "--batch", "3", "--seq-len", "4"]) == 1
    assert "MISSING fused_moe_lora" in capsys.readouterr().out
    pytest.importorskip("depyf")
    assert main(["dump", str(tmp_path / "dump")]) == 1
    out = capsys.readouterr().out
    assert "lora_linear x" in out and "MISSING: fused_moe_lora" in out
