"""The README's ```python blocks, executed in the order written, in one namespace, on the CPU with a tiny model.

What the test supplies, and the one substitution it makes (nothing else in a block is changed):

- the working directory is a temp folder holding PEFT adapter folders ``adapters/sql``, ``adapters/chat`` and
  ``adapters/sql-v2`` (made with PEFT's API for the tiny model, ranks 4, 8, 4);
- substitution: ``from_pretrained("<hub name>", ...)`` with a name that is not a local folder (the README says
  ``Qwen/Qwen3-30B-A3B``) loads a tiny random Qwen3-MoE saved in the temp folder instead (same family, same call).

A block that needs CUDA is skipped when there is none, with the reason: it calls ``.cuda()``, says
``device="cuda"``, or captures CUDA graphs (``.capture()``). Every other block runs; a block added to or removed
from the README is picked up as it is.
"""

from __future__ import annotations

import contextlib
import copy
import io
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_HUB_NAME = re.compile(r"""from_pretrained\((["'])([^"']+)\1""")
_NEEDS_CUDA = [(re.compile(r"\.cuda\(\)"), "calls .cuda()"),
               (re.compile(r"""device\s*=\s*["']cuda(:\d+)?["'](?!\s+if\b)"""), 'says device="cuda"'),
               (re.compile(r"\.capture\(\)"), "captures CUDA graphs")]


def readme_blocks() -> list[tuple[int, str, str]]:
    """``(line, heading, code)`` of every python block of the README, in order."""
    text = README.read_text()
    blocks = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        headings = re.findall(r"^#+ (.*)$", text[: match.start()], re.M)
        blocks.append((line, headings[-1] if headings else "", match.group(1)))
    return blocks


def _cuda_reason(code: str):
    if torch.cuda.is_available():
        return None
    return next((reason for pattern, reason in _NEEDS_CUDA if pattern.search(code)), None)


@pytest.fixture
def readme_world(tmp_path, monkeypatch):
    """The temp folder with the tiny model and the adapters; returns the namespace the blocks run in."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    tiny_folder = tmp_path / "tiny-qwen3-moe"
    base.save_pretrained(tiny_folder)
    for seed, (name, rank) in enumerate((("sql", 4), ("chat", 8), ("sql-v2", 4))):
        peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config("qwen3_moe", r=rank, lora_alpha=2 * rank))
        randomize_lora_(peft_model, seed=seed)
        peft_model.save_pretrained(tmp_path / "adapters" / name)
    monkeypatch.chdir(tmp_path)
    return dict(__name__="readme"), str(tiny_folder)


def _substitute_hub_names(code: str, tiny_folder: str) -> str:
    def local(match):
        quote, name = match.group(1), match.group(2)
        return match.group(0) if Path(name).exists() else f"from_pretrained({quote}{tiny_folder}{quote}"
    return _HUB_NAME.sub(local, code)


def test_readme_has_the_blocks_this_test_relies_on():
    headings = [heading for _, heading, _ in readme_blocks()]
    assert "Serving adapters, in ten lines" in headings and "Compiling: the pass" in headings


@pytest.mark.slow
def test_readme_python_blocks_run_in_order(readme_world):
    namespace, tiny_folder = readme_world
    ran, skipped = [], []
    for line, heading, code in readme_blocks():
        reason = _cuda_reason(code)
        if reason:
            skipped.append(f"README.md:{line} ({heading}): {reason}")
            continue
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            try:
                exec(compile(_substitute_hub_names(code, tiny_folder), f"README.md:{line}", "exec"), namespace)
            except Exception as error:
                raise AssertionError(f"README.md:{line} ({heading}) failed: {error!r}") from error
        ran.append((heading, stdout.getvalue()))
    if skipped:
        print("skipped (no CUDA):", *skipped, sep="\n  ")
    outputs = dict(ran)
    assert "Serving adapters, in ten lines" in outputs and "Compiling: the pass" in outputs
    # the compile block: call the compiled model, then dump it (the README's order) -> the dump finds the ops
    dump = outputs["Compiling: the pass"]
    assert "fused ops: none" not in dump and "fused_moe_lora x2" in dump and "lora_linear x" in dump, dump
    out = namespace["out"]
    assert out.shape == (3, namespace["input_ids"].shape[1] + 32)
