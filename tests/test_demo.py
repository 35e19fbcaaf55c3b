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
