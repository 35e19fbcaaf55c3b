"""``python -m moe_lora_compile serve-bench`` runs benchmarks/bench_serving.py (its tiny mode on the CPU): every
configuration serves every request to its full length, paging loads adapters, and the JSON / markdown / PNG are
written. A smoke test of the script: its timings are not checked."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch

from moe_lora_compile.__main__ import main


def test_serve_bench_tiny_writes_json_markdown_and_png(tmp_path, capsys):
    out = {ext: str(tmp_path / f"serving.{ext}") for ext in ("json", "md", "png")}
    argv = ["serve-bench", "--requests", "3", "--new", "4", "--jitter", "0", "--rates", "1000", "--configs",
            "no_lora", "lora64", "grouped8", "--json", out["json"], "--md", out["md"], "--png", out["png"]]
    if torch.cuda.is_available():
        argv.insert(1, "--tiny")
    if importlib.util.find_spec("matplotlib") is None:  # --png without matplotlib: refused before any work
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and "--png" in capsys.readouterr().err and not os.path.exists(out["json"])
        argv = argv[: argv.index("--png")] + argv[argv.index("--png") + 2:]
    assert main(argv) == 0
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
    if "--png" in argv:
        assert open(out["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_serve_bench_bad_options_are_one_line(tmp_path, capsys):
    """Values the benchmark cannot use are refused at once, with one line: before, a negative count ended in a
    traceback, --requests=1 (with '=') was silently replaced by the tiny default, --model was ignored by --tiny."""
    not_json = tmp_path / "not.json"
    not_json.write_text("not json")
    for argv, needle in ((["--tiny", "--requests", "-2"], "must be >= 1"),
                         (["--tiny", "--jitter", "1.5"], "--jitter"),
                         (["--tiny", "--model", "qwen3-30b-a3b"], "--model qwen3-30b-a3b"),
                         (["--tiny", "--json", str(tmp_path / "no" / "x.json")], "not a writable folder"),
                         (["--tiny", "--md", str(tmp_path)], "a folder, not a file name"),  # failed after the run
                         # fewer slots than resident adapters: the rate calibration spun forever (--slots 1), or
                         # lora8 ended in a NoFreeSlot traceback
                         (["--tiny", "--slots", "2"], "--slots 2 < --resident 4"),
                         (["--tiny", "--buckets", "3"], "largest bucket must be --max-rows 4"),  # a RowGraphs traceback
                         (["--tiny", "--rates", "inf", "1", "2"], "finite number > 0"),
                         (["--tiny", "--budget-s", "nan"], "finite number > 0"),
                         (["--render", str(not_json)], "is not a bench_serving --json file")):  # JSONDecodeError
        with pytest.raises(SystemExit) as exited:
            main(["serve-bench", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and needle in err[0], err
    out = str(tmp_path / "one.json")
    assert main(["serve-bench", "--tiny", "--requests=1", "--new=2", "--jitter=0", "--rates", "1000", "--configs", "no_lora",
                       "--json", out]) == 0
    (run,) = [r for r in json.load(open(out)) if r["kind"] == "run"]
    assert run["requests"] == 1 and run["output_tokens"] == 2


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


def test_serve_bench_split_by_load_then_rendered(tmp_path):
    """A run split over two calls (--loads) keeps each rate's label, and --render merges the two JSON files into one
    table with all three loads (the later file's row wins for a config and load run twice)."""
    rates = ["--rates", "1000", "2000", "3000", "--requests", "1", "--new", "2", "--jitter", "0", "--configs", "no_lora"]
    first, second, md = (str(tmp_path / n) for n in ("over.json", "rest.json", "all.md"))
    assert main(["serve-bench", *rates, "--loads", "over", "--json", first]) == 0
    assert main(["serve-bench", *rates, "--loads", "near", "low", "--json", second]) == 0
    (over,) = [r for r in json.load(open(first)) if r["kind"] == "run"]
    assert (over["load"], over["rate"]) == ("over", 3000.0)
    assert sorted(r["load"] for r in json.load(open(second)) if r["kind"] == "run") == ["low", "near"]
    assert main(["serve-bench", "--render", first, second, first, "--md", md]) == 0
    table = [line for line in open(md) if "| no_lora |" in line]
    assert [line.split("|")[1].strip() for line in table] == ["low", "near", "over"]


def test_serve_bench_loads_need_three_rates(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve-bench", "--tiny", "--rates", "1", "2", "--loads", "over"])
    assert exited.value.code == 2 and "three rates" in capsys.readouterr().err


def test_serve_bench_calibration_with_a_small_prefill_chunk(tmp_path, capsys):
    """The rate calibration admits its rows over several steps when the prefill chunk is small: the rows' token
    budget covers that (before, --prefill-chunk 4 ended in "fewer adapter slots than distinct adapters", which
    was not the cause); where the workload's cache cannot cover it, a usage error names the prefill chunk that can,
    before the model is built (it was a traceback after it: --max-rows 64 too)."""
    out = str(tmp_path / "chunk.json")
    assert main(["serve-bench", "--tiny", "--prefill-chunk", "8", "--configs", "no_lora", "--json", out]) == 0
    (calibration,) = [r for r in json.load(open(out)) if r["kind"] == "calibration"]
    assert calibration["saturation_rps"] > 0
    capsys.readouterr()  # that run's log
    for argv, needle in ((["--prefill-chunk", "1"], r"prefill chunk of 1 tokens admits 4 rows .* --prefill-chunk of "
                                                    r"at least 8"),
                         (["--max-rows", "64", "--buckets", "64"], r"admits 64 rows .* --prefill-chunk of at least")):
        with pytest.raises(SystemExit) as exited:
            main(["serve-bench", "--tiny", *argv, "--configs", "no_lora"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and re.search(needle, err[0]), err


def _bench_serving():
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_serving.py")
    spec = importlib.util.spec_from_file_location("bench_serving_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_output_tokens_per_second_count_from_the_first_arrival(tmp_path, monkeypatch):
    """OTPS is output tokens over the time from the first arrival to the last token, as documented. It counted from
    the run's start, i.e. also the idle wait for the first arrival (at a low rate ~17 % of a published run: its
    OTPS read 18 % low)."""
    bench, delay = _bench_serving(), 5.0
    workload = bench.workload

    def late_workload(*args, **kwargs):  # the same requests, every arrival `delay` s later
        arrivals, requests = workload(*args, **kwargs)
        return [delay + a for a in arrivals], requests

    monkeypatch.setattr(bench, "workload", late_workload)
    out = str(tmp_path / "late.json")
    assert bench.main(["--tiny", "--requests", "2", "--new", "3", "--jitter", "0", "--rates", "1000", "--configs",
                       "no_lora", "--json", out]) == 0
    (run,) = [r for r in json.load(open(out)) if r["kind"] == "run"]
    assert run["seconds"] < delay  # two tiny requests take well under the delay; the delay itself is not counted
    assert run["otps"] == pytest.approx(run["output_tokens"] / run["seconds"])


def test_one_token_requests_write_valid_json(tmp_path):
    """--new 1: no request has a gap between tokens; ITL is null in the JSON and "-" in the table (it wrote a bare
    NaN, which is not JSON)."""
    out, md = str(tmp_path / "one.json"), str(tmp_path / "one.md")
    assert _bench_serving().main(["--tiny", "--requests", "2", "--new", "1", "--jitter", "0", "--rates", "1000",
                                  "--configs", "no_lora", "--json", out, "--md", md]) == 0
    text = open(out).read()
    assert "NaN" not in text
    (run,) = [r for r in json.loads(text) if r["kind"] == "run"]
    assert run["itl_p50_ms"] is None and run["itl_p99_ms"] is None and run["output_tokens"] == 2
    assert "| - | - |" in open(md).read()


def test_render_refuses_runs_of_other_workloads(tmp_path, capsys):
    """--render merges the runs of one workload and engine only: a file of another workload (requests, lengths,
    seed, ...) or a load label at another rate is refused with one line; a file with a run row lacking its figures
    is "not a bench_serving --json file" (a KeyError traceback before). It merged them silently, with ratios
    across different workloads."""
    bench = _bench_serving()
    common = ["--tiny", "--jitter", "0", "--configs", "no_lora", "--rates", "1000", "2000", "3000"]
    a, b, c, bad = (str(tmp_path / n) for n in ("a.json", "b.json", "c.json", "bad.json"))
    assert bench.main([*common, "--requests", "1", "--new", "2", "--loads", "over", "--json", a]) == 0
    assert bench.main([*common, "--requests", "2", "--new", "2", "--loads", "low", "--json", b]) == 0
    assert bench.main(["--tiny", "--jitter", "0", "--configs", "no_lora", "--rates", "1000", "2000", "4000",
                       "--requests", "1", "--new", "2", "--loads", "over", "--json", c]) == 0
    rows = json.load(open(a))
    json.dump([rows[0], {"kind": "run", "config": "no_lora"}], open(bad, "w"))
    capsys.readouterr()
    for files, needle in (([a, b], "ran another workload or engine than"),
                          ([a, c], "ran load 'over' at 4000.0 req/s, another file at 3000.0"),
                          ([bad], "is not a bench_serving --json file")):
        with pytest.raises(SystemExit) as exited:
            bench.main(["--render", *files, "--md", str(tmp_path / "m.md")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.parametrize("argv, needle", [
    (["--rates", "300", "200", "100"], "in increasing order"),  # labelled low / near / over by position
    (["--load-factors", "1.5", "0.9", "0.4"], "in increasing order"),
    (["--seed", str(10 ** 23)], "must be in [-2**63"),          # an overflow traceback after the model was built
])
def test_serve_bench_refuses_rates_out_of_order_and_huge_seeds(argv, needle, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve-bench", "--tiny", *argv, "--configs", "no_lora"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1 and needle in err[0], err
