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
    assert out.rstrip().endswith("OK") and out.count("tokens: identical") == 3  # float32: exactly, no tie allowance


@pytest.mark.slow
def test_cuda_graph_decode_bfloat16(capsys):
    """--dtype bfloat16 (documented): the decode paths agree up to bf16 near-ties in the reference's own logits (the
    hot-swapped run parts at a tie of two logits one bf16 step apart); a real difference still fails."""
    example = _example("cuda_graph_decode")
    assert example.main(["--dtype", "bfloat16"]) == 0, capsys.readouterr().out
    assert "DIFFERENT" not in capsys.readouterr().out


def test_agree_refuses_a_real_difference():
    """``agree`` allows a bf16 divergence only where the reference's two best logits nearly tie: a token the model
    does not rank second is a difference in any dtype."""
    import torch

    agree = _example("cuda_graph_decode").agree

    class Fixed:  # logits favour token 3 clearly, token 5 a near-tie second
        def __call__(self, ids, adapters):
            logits = torch.full((1, ids.shape[1], 8), -5.0)
            logits[..., 3], logits[..., 5] = 4.0, 3.99
            return type("Out", (), {"logits": logits})()

    theirs = torch.tensor([[1, 2, 3, 3]])
    assert agree(Fixed(), theirs.clone(), theirs, [None], torch.bfloat16) == "identical"
    assert agree(Fixed(), torch.tensor([[1, 2, 5, 0]]), theirs, [None], torch.bfloat16).startswith("same up to")
    assert agree(Fixed(), torch.tensor([[1, 2, 6, 0]]), theirs, [None], torch.bfloat16) == "DIFFERENT"
    assert agree(Fixed(), torch.tensor([[1, 2, 5, 0]]), theirs, [None], torch.float32) == "DIFFERENT"


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


# a value the run cannot use is argparse's usage error (exit 2) before any model is built
@pytest.mark.parametrize("window", ["0", "-5"])
def test_cuda_graph_decode_refuses_a_window_below_one(window, monkeypatch, capsys):
    """``--sliding-window 0`` was silently replaced by the default window, a negative one failed in a traceback
    after the build."""
    example = _example("cuda_graph_decode")
    monkeypatch.setattr(example, "build", lambda *a, **k: pytest.fail(f"--sliding-window {window} was accepted"))
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--family", "gpt_oss", "--sliding-window", window])
    assert exit_info.value.code == 2 and "--sliding-window: must be >= 1" in capsys.readouterr().err


def test_cuda_graph_decode_passes_the_window_on(monkeypatch):
    """A window given is the tiny config's; without one, prompt + 3 x new tokens."""
    example, seen = _example("cuda_graph_decode"), []

    class Built(Exception):
        pass

    def build(*args, config_overrides, **kwargs):
        seen.append(config_overrides["sliding_window"])
        raise Built

    monkeypatch.setattr(example, "build", build)
    for argv in (["--sliding-window", "16"], ["--max-new-tokens", "4"]):
        with pytest.raises(Built):
            example.main(["--family", "gpt_oss", *argv])
    assert seen == [16, 8 + 3 * 4]
