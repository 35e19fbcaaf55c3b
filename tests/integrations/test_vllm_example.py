"""``examples/vllm_multi_lora.py``: with vLLM, it serves two adapters and a base row in one batch through the plugin,
each row equal to PEFT's greedy tokens, with vLLM's default engine processes (the opt-in environment variable must
reach them through the entry point); without vLLM it says what is missing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm_multi_lora.py"
HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_example_says_what_is_missing(capsys):
    spec = importlib.util.spec_from_file_location("example_vllm_multi_lora", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 1
    assert "vLLM is not installed" in capsys.readouterr().out


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed in this venv; see tests/integrations/conftest.py")
def test_example_serves_two_adapters_through_the_plugin(tmp_path):
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), VLLM_CACHE_ROOT=str(tmp_path / "cache" / "vllm"),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("MOE_LORA_VLLM", None)  # the example turns the plugin on itself
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    child = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, env=env, timeout=600,
                           cwd=ROOT)
    log = child.stdout + child.stderr
    assert child.returncode == 0, log[-4000:]
    assert "vllm: all rows match PEFT" in child.stdout
    assert "MoE LoRA layers run torch.ops.moe_lora.fused_moe_lora" in log
    assert "uses vLLM's own TritonExperts path" not in log
