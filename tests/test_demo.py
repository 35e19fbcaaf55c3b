"""``python -m moe_lora_compile demo`` end to end (in process, through ``main``): tiny Qwen3-MoE, three PEFT
adapters saved with PEFT's API, compiled with the pass, mixed batch checked against eager. Its report is the
whole-model check for Qwen3-MoE: one graph, no breaks, no recompiles (adapter mix, hot swap, batch size), one
fused MoE op per layer and one lora_linear per adapted projection."""

import re

import pytest

from moe_lora_compile.__main__ import main


@pytest.mark.slow
def test_demo_command(capsys):
    assert main(["demo", "--batch", "4", "--seq-len", "6"]) == 0
    out = capsys.readouterr().out
    assert "graphs 1, graph breaks 0, recompiles 0" in out
    fused = dict(re.findall(r"(\w+\[\w+\]) x(\d+)", out.split("fused ops:")[1].splitlines()[0]))
    # tiny Qwen3-MoE: 2 layers, each one MoE block and 4 attention projections (q, k, v, o) wrapped for LoRA
    assert fused == {"fused_moe_lora[pairwise]": "2", "lora_linear[multi]": "8"}
    assert "-> OK" in out
