"""Every example passes with its defaults for every family (in process: each example's ``main(argv)`` with only
``--family``), and the examples' ``--family`` takes a model_type too (``llama4_text``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moe_lora_compile.family_names import TINY_FAMILIES

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cuda_graph_decode_defaults(family, capsys):
    assert _example("cuda_graph_decode").main(["--family", family]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert out.rstrip().endswith("OK") and "tokens identical: False" not in out


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_multi_adapter_generate_defaults(family, capsys):
    assert _example("multi_adapter_generate").main(["--family", family]) == 0, capsys.readouterr().out
    assert f"{family}: all rows match PEFT" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["cuda_graph_decode", "multi_adapter_generate"])
def test_examples_take_both_family_spellings(name, capsys):
    parser_main = _example(name).main
    with pytest.raises(SystemExit) as exit_info:
        parser_main(["--family", "nope"])
    assert exit_info.value.code == 2 and "llama4 (or llama4_text)" in capsys.readouterr().err
