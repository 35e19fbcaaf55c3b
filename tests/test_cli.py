"""The command line's contract: arguments parsed before torch loads, one-line errors with exit code 2 (bad family,
no CUDA for ``--device cuda`` or the tuner), family names in both spellings from one table, triton only on the CUDA
path, progress lines on stderr only when asked for or on a terminal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, env=None, timeout=120):
    import os

    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=environment)


def _one_error_line(result, *needles):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and all(n in lines[0] for n in needles), lines[0]


def test_help_and_bad_family_answer_before_torch_loads():
    help_run = _run("-X", "importtime", "-m", "moe_lora_compile", "demo", "--help")
    assert help_run.returncode == 0 and "--seq-len" in help_run.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in help_run.stderr.splitlines() if "|" in line]
    assert "torch" not in imported and "transformers" not in imported
    for option in ("--dtype", "--batch", "--seq-len", "--family", "--verbose"):
        assert option in help_run.stdout
    assert "llama4 (or llama4_text)" in " ".join(help_run.stdout.split())
    _one_error_line(_run("-m", "moe_lora_compile", "demo", "--family", "nope"), "unknown family 'nope'", "--family")
    _one_error_line(_run("-m", "moe_lora_compile", "dump"), "folder")


def test_bad_values_are_one_line_before_any_work(tmp_path):
    """Values argparse would take but the run cannot use: answered with one line, exit 2, before a model is built
    (before, each ended in a traceback after the build: a negative batch, a dump folder under a file, --device
    meta)."""
    demo = ("-m", "moe_lora_compile", "demo")
    _one_error_line(_run(*demo, "--batch", "-3"), "--batch", "must be >= 3")
    _one_error_line(_run(*demo, "--seq-len", "0"), "--seq-len", "must be >= 1")
    _one_error_line(_run(*demo, "--batch", str(2 ** 70)), "--batch", "must be <= 4096")  # a torch overflow after
                                                                                         # the build
    _one_error_line(_run(*demo, "--batch", "2"), "--batch", "must be >= 3 (the recompile checks")
    _one_error_line(_run(*demo, "--device", "meta"), "--device meta", "cpu or cuda")
    _one_error_line(_run(*demo, "--device", ""), "--device is empty")  # (was read as "not given": the CPU)
    _one_error_line(_run(*demo, "--device", "cpu:5"), "one CPU device")  # (ran, reporting "on cpu:5")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _one_error_line(_run("-m", "moe_lora_compile", "dump", str(blocker / "dump")), "is a file, not a folder")
    _one_error_line(_run("-m", "moe_lora_compile", "dump", ""), "name is empty")  # (read as the current folder)
    # a folder the process cannot create (os.access says yes to root everywhere: the check creates it)
    _one_error_line(_run("-m", "moe_lora_compile", "dump", "/proc/moe_lora_dump"), "cannot write there")
    # an on/off switch set to another word (was a traceback from where it is first read)
    _one_error_line(_run(*demo, env={"MOE_LORA_PROGRESS": "maybe"}), "MOE_LORA_PROGRESS='maybe'")
    _one_error_line(_run(*demo, env={"MOE_LORA_PASS_LOG": "maybe"}), "MOE_LORA_PASS_LOG='maybe'")
    for command in ("tune", "serve-bench"):  # (their own parsers: a 40-line traceback before)
        _one_error_line(_run("-m", "moe_lora_compile", command, "--help", env={"MOE_LORA_PASS_LOG": "maybe"}),
                        f"moe-lora-compile {command}: error: MOE_LORA_PASS_LOG='maybe'")
    tune = ("-m", "moe_lora_compile", "tune", "--model", "qwen3-30b-a3b")
    _one_error_line(_run(*tune, "--tokens", "-1"), "--tokens", "must be >= 1")
    _one_error_line(_run(*tune, "--out", str(blocker / "t.json")), "--out", "not a writable folder")
    _one_error_line(_run(*tune, "--out", str(tmp_path)), "--out", "a folder; name the JSON file")  # (was: an
                                                                             # IsADirectoryError after tuning)


def test_dump_without_depyf_creates_no_folder(tmp_path):
    """depyf missing: the one-line error came after the folder check, which had already created the folder."""
    folder = tmp_path / "no" / "dump"
    code = ("import sys; sys.modules['depyf'] = None; from moe_lora_compile.__main__ import main; "
            f"sys.exit(main(['dump', {str(folder)!r}]))")
    _one_error_line(_run("-c", code), "depyf is not installed")
    assert not (tmp_path / "no").exists()


def test_dump_help_has_its_own_dtype_wording():
    """``dump --help`` said the dtype sets "the check's tolerance" (the demo's wording; dump runs no check)."""
    dump_help = " ".join(_run("-m", "moe_lora_compile", "dump", "--help").stdout.split())
    demo_help = " ".join(_run("-m", "moe_lora_compile", "demo", "--help").stdout.split())
    assert "tolerance" not in dump_help and "the dumped graphs compute in it" in dump_help
    assert "the check's tolerance follows it" in demo_help


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_no_cuda_is_one_line_and_exit_2():
    _one_error_line(_run("-m", "moe_lora_compile", "demo", "--device", "cuda"), "CUDA is not available")
    _one_error_line(_run("-m", "moe_lora_compile", "tune", "--model", "qwen3-30b-a3b", "--tokens", "1"),
                    "CUDA is not available")


def test_family_names_come_from_one_table():
    from moe_lora_compile.__main__ import _parser
    from moe_lora_compile.family_names import ALIASES, FAMILY_MODEL_TYPES, TINY_FAMILIES, canonical_family
    from moe_lora_compile.models import FAMILIES
    from moe_lora_compile.models.tiny import tiny_config

    assert {f.name: f.model_types for f in FAMILIES} == FAMILY_MODEL_TYPES
    assert ALIASES == {"llama4_text": "llama4"}
    for name in TINY_FAMILIES:  # every short name builds a config whose model_type maps back to it
        model_type = tiny_config(name).model_type
        assert canonical_family(model_type) == name
    assert tiny_config("llama4_text").model_type == "llama4_text"
    assert _parser().parse_args(["demo", "--family", "llama4_text"]).family == "llama4"
    with pytest.raises(ValueError, match="llama4 \\(or llama4_text\\)"):
        canonical_family("llama5")
    # the spellings of the model cards: case, '-' for '_', blanks (each refused before)
    for spelling, name in (("Mixtral", "mixtral"), ("Qwen3-MoE", "qwen3_moe"), ("GPT-OSS", "gpt_oss"),
                           ("Llama4_Text", "llama4"), (" olmoe ", "olmoe")):
        assert canonical_family(spelling) == name
    with pytest.raises(ValueError, match="'dense' is a group: name the model_type"):
        canonical_family("dense")
    with pytest.raises(ValueError, match="unknown family 'Qwen4-MoE'"):
        canonical_family("Qwen4-MoE")


def test_package_imports_and_runs_the_ops_without_triton():
    """A CPU install without triton (it is in the `test`/`gpu` extras only): the package imports, registers the ops
    and runs them; only the CUDA path imports triton."""
    code = '''
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")
sys.meta_path.insert(0, Block())
import torch, moe_lora_compile as mlc
x = torch.randn(3, 16)
w, ids = torch.randn(3, 4).softmax(-1).topk(2)
y = torch.ops.moe_lora.fused_moe_lora(x, ids, w, torch.tensor([0, -1, 1], dtype=torch.int32), torch.randn(4, 48, 16),
    torch.randn(4, 16, 24), torch.randn(2, 4, 4, 16), torch.randn(2, 4, 48, 4), torch.randn(2, 4, 4, 24),
    torch.randn(2, 4, 16, 4))
assert y.shape == (3, 16) and "triton" not in sys.modules
print("ok")
'''
    result = _run("-c", code, env={"TRITON_INTERPRET": "0"})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_progress_lines_go_to_stderr_only_when_on(capsys, monkeypatch):
    from moe_lora_compile import progress

    monkeypatch.setenv("MOE_LORA_PROGRESS", "1")
    with progress.step("compiling"):
        pass
    captured = capsys.readouterr()
    assert captured.out == "" and "moe_lora_compile: compiling ..." in captured.err
    monkeypatch.delenv("MOE_LORA_PROGRESS")  # pytest's capture is not a terminal: quiet
    progress.say("hidden")
    assert capsys.readouterr().err == ""


def test_every_environment_switch_is_declared_in_settings():
    """One home for the environment switches: every ``MOE_LORA_*`` name the package reads is declared (with its
    default and meaning) in ``moe_lora_compile.settings`` and listed in the README."""
    import re
    from pathlib import Path

    from moe_lora_compile import settings

    root = Path(__file__).resolve().parents[1]
    declared = {s.name for s in settings.SWITCHES}
    used = set()
    for path in (root / "moe_lora_compile").rglob("*.py"):
        used |= set(re.findall(r"MOE_LORA_[A-Z_]+", path.read_text()))
    assert used <= declared, f"read but not declared in settings.py: {sorted(used - declared)}"
    readme = (root / "README.md").read_text()
    assert all(name in readme for name in declared), [n for n in declared if n not in readme]


@pytest.mark.parametrize("counts, code", [
    (dict(graphs=1, graph_breaks=0, recompiles=0), 0),
    (dict(graphs=2, graph_breaks=0, recompiles=0), 1),  # two graphs without a break (README: exits 1 unless one)
    (dict(graphs=1, graph_breaks=1, recompiles=0), 1),
    (dict(graphs=1, graph_breaks=0, recompiles=1), 1),
])
def test_demo_exit_code_needs_one_graph_no_break_no_recompile(monkeypatch, counts, code):
    import moe_lora_compile.__main__ as cli

    monkeypatch.setattr(cli, "run_demo", lambda *a, **k: dict(ok=True, peft={"ok": True}, **counts))
    assert cli.main(["demo"]) == code


def test_pass_log_lines_print_once_under_an_apps_logging_setup():
    """MOE_LORA_PASS_LOG=1 adds the pass logger's own handler: with the app's logging configured too, each line
    printed twice (the record propagated to the root handler)."""
    code = ("import logging; logging.basicConfig(level=logging.INFO); import moe_lora_compile.passes.fx_match as m; "
            "m.log.info('one line')")
    result = _run("-c", code, env={"MOE_LORA_PASS_LOG": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("one line") == 1, result.stderr
