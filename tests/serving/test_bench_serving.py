"""``python -m moe_lora_compile serve-bench`` runs benchmarks/bench_serving.py (its tiny mode on the CPU): every
configuration serves every request to its full length, paging loads adapters, and the JSON / markdown / PNG are
written. A smoke test of the script: its timings are not checked."""

from __future__ import annotations

import importlib.util
import json

import torch

from moe_lora_compile.__main__ import main


def test_serve_bench_tiny_writes_json_markdown_and_png(tmp_path, capsys):
    out = {ext: str(tmp_path / f"serving.{ext}") for ext in ("json", "md", "png")}
    argv = ["serve-bench", "--requests", "3", "--new", "4", "--jitter", "0", "--rates", "1000", "--configs",
            "no_lora", "lora64", "grouped8", "--json", out["json"], "--md", out["md"], "--png", out["png"]]
    if torch.cuda.is_available():
        argv.insert(1, "--tiny")
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert main(argv) == (0 if has_matplotlib else 2)  # --png without matplotlib: the rest written, exit 2
    rows = json.load(open(out["json"]))
    runs = [r for r in rows if r["kind"] == "run"]
    assert [r["config"] for r in runs] == ["no_lora", "grouped8", "lora64"]  # the baselines first at each rate
    for r in runs:
        assert r["requests"] == 3 and r["output_tokens"] == 3 * 4  # no eos: every request runs to max_new_tokens
        assert r["otps"] > 0 and r["ttft_p50_ms"] > 0 and r["itl_p50_ms"] > 0
    assert runs[0]["adapter_loads"] == 0 and runs[2]["adapter_loads"] >= 1
    table = open(out["md"]).read()
    printed = capsys.readouterr()
    assert table.count("| lora64 |") == 1 and "OTPS / no_lora" in table and table in printed.out
    if has_matplotlib:
        assert open(out["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert "--png needs matplotlib" in printed.err


def test_serve_bench_with_draft_tokens(tmp_path):
    """--num-speculative-tokens: the engine verifies prompt-lookup drafts; the runs record the draft counters and
    still produce every request's max_new_tokens."""
    out = str(tmp_path / "spec.json")
    argv = ["serve-bench", "--requests", "3", "--new", "6", "--jitter", "0", "--rates", "1000", "--configs", "lora8",
            "--num-speculative-tokens", "2", "--json", out]
    if torch.cuda.is_available():
        argv.insert(1, "--tiny")
    assert main(argv) == 0
    (run,) = [r for r in json.load(open(out)) if r["kind"] == "run"]
    assert run["output_tokens"] == 3 * 6 and run["draft_tokens"] > 0
    assert 0 <= run["accepted_draft_tokens"] <= run["draft_tokens"]
