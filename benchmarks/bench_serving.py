"""Serving benchmark (a script, not a test): continuous batching with per-request adapters under Poisson arrivals.

One :class:`~moe_lora_compile.serving.ServingEngine` (compiled, CUDA graphs on a GPU) serves the same request
stream (prompt and output lengths drawn around ``--prompt`` / ``--new``, +-``--jitter``) at three arrival rates (low,
near saturation, overload) in four configurations, in one run:

- ``no_lora``: every request on the base model (``adapter=None``): the ceiling;
- ``lora8``: adapters drawn uniformly from 8, all resident (8 slots, loaded before the run);
- ``lora64``: adapters drawn uniformly from 64 names over the same 8 slots (paged through the
  :class:`~moe_lora_compile.serving.AdapterStore`; 64 names over the 8 adapters' factors, each name a full copy
  into its slot when loaded, so host memory holds 8 copies);
- ``grouped8``: ``lora8``'s requests served one adapter at a time (``schedule="grouped"``: what a one-adapter server,
  e.g. plain PEFT, does).

Rates: ``--rates`` in requests/s, or ``--load-factors`` times the saturation rate estimated at the start (one
prefill of a mean prompt and a few decode steps of a full batch: ``1 / (t_prefill + new * t_step / max_rows)``).
Per run: output tokens/s (all new tokens / time from the first arrival to the last token), TTFT p50/p99 (first token
- arrival), inter-token latency p50/p99 (gaps between a request's tokens), end-to-end latency p50, mean decode
batch, adapter loads and evictions. Adapters: rank ``--rank`` PEFT adapters on q/k/v/o and the experts
(``bench_decode.make_adapters``), the model from ``moe_lora_compile.shapes.DECODE_MODELS`` with random bf16 weights
(``bench_decode.build_model``). Writes ``--json``, ``--md`` (table + ratios against the targets), ``--png`` (OTPS and
TTFT against the arrival rate).

    python benchmarks/bench_serving.py --model gpt-oss-20b --requests 32 --json s.json --md s.md --png s.png
    python benchmarks/bench_serving.py --buckets 8 16 32 --configs no_lora lora8 ...   # fewer compiles / runs
    python benchmarks/bench_serving.py --tiny   # CPU smoke test (tiny GPT-OSS, under a minute; no timing claims)

A run that does not fit one device call can be split by load: ``--rates R_LOW R_NEAR R_OVER --loads over`` runs one
of the three rates (labels kept), and ``--render a.json b.json --md m.md --png p.png`` merges the runs of several
JSON files (the later file's run wins where two ran the same config and load) into one table and plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from collections import deque

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import build_model, log, make_adapters, sync  # noqa: E402

import moe_lora_compile as mlc  # noqa: E402
from moe_lora_compile.__main__ import OneLineParser, int_at_least  # noqa: E402
from moe_lora_compile.serving import AdapterStore, Request, ServingEngine  # noqa: E402
from moe_lora_compile.shapes import DECODE_MODELS  # noqa: E402

CONFIGS = ("no_lora", "lora8", "lora64", "grouped8")
TARGETS = {"lora8": 0.85, "lora64": 0.75}  # OTPS vs no_lora at every rate (issue 15)


def workload(count: int, prompt: int, new: int, jitter: float, vocab: int, adapters: list, rate: float,
             seed: int) -> tuple[list[float], list[Request]]:
    """``count`` Poisson arrival times (rate ``rate`` per second) and requests: lengths uniform in
    ``x * (1 +- jitter)``, random token ids, adapters drawn uniformly from ``adapters`` (greedy, no eos)."""
    g = torch.Generator().manual_seed(seed)

    def length(mean):
        lo, hi = max(1, round(mean * (1 - jitter))), max(1, round(mean * (1 + jitter)))
        return int(torch.randint(lo, hi + 1, (), generator=g))

    gaps = torch.empty(count, dtype=torch.float64).exponential_(rate, generator=g) if rate > 0 else torch.zeros(count)
    arrivals = torch.cumsum(gaps, 0).tolist()
    requests = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (length(prompt),), generator=g).tolist()
        adapter = adapters[int(torch.randint(len(adapters), (), generator=g))]
        requests.append(Request(ids, adapter=adapter, max_new_tokens=length(new), eos_token_ids=()))
    return arrivals, requests


def serve(engine: ServingEngine, arrivals: list[float], requests: list[Request]) -> dict:
    """Submit each request at its arrival time (from now) while stepping the engine; the metrics of the run."""
    store = engine.store
    before = store.counters if store is not None else None
    steps0, tokens0 = engine.steps, engine.tokens_generated
    drafts0, kept0 = engine.draft_tokens, engine.accepted_draft_tokens
    pending = deque(zip(arrivals, requests))
    handles = []
    t0 = time.perf_counter()
    while pending or not engine.idle:
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            arrival, request = pending.popleft()
            handles.append((t0 + arrival, engine.submit(request)))
        if engine.idle and pending:
            time.sleep(max(0.0, min(pending[0][0] - (time.perf_counter() - t0), 0.05)))
            continue
        engine.step()
    sync(engine.device)
    end = max(h.token_times[-1] for _, h in handles)
    first = t0 + arrivals[0]  # the run's time starts at its first arrival (the engine idles before: not served time)
    ttft = torch.tensor([h.first_token_at - a for a, h in handles])
    e2e = torch.tensor([h.token_times[-1] - a for a, h in handles])
    gaps = [b - a for _, h in handles for a, b in zip(h.token_times, h.token_times[1:])]
    itl = torch.tensor(gaps) if gaps else None  # none when every request asked for one token
    tokens = sum(len(h.tokens) for _, h in handles)
    steps = engine.steps - steps0
    row = dict(requests=len(handles), output_tokens=tokens, seconds=end - first, otps=tokens / (end - first),
               ttft_p50_ms=1e3 * _q(ttft, 0.5), ttft_p99_ms=1e3 * _q(ttft, 0.99),
               itl_p50_ms=None if itl is None else 1e3 * _q(itl, 0.5),
               itl_p99_ms=None if itl is None else 1e3 * _q(itl, 0.99), e2e_p50_s=_q(e2e, 0.5),
               mean_batch=(engine.tokens_generated - tokens0 - len(handles)) / max(steps, 1), steps=steps)
    if engine.num_speculative_tokens:  # mean_batch is then decode tokens per step (rows x tokens kept per row)
        row.update(draft_tokens=engine.draft_tokens - drafts0, accepted_draft_tokens=engine.accepted_draft_tokens - kept0)
    if store is not None:
        after = store.counters
        row.update(adapter_loads=after.loads - before.loads, evictions=after.evictions - before.evictions,
                   load_ms=1e3 * (after.load_seconds - before.load_seconds))
    return row


def _q(values: torch.Tensor, q: float) -> float:
    return float(torch.quantile(values.double(), q))


def _ms(value) -> str:
    """An ITL figure for a table: one decimal, "-" where no request had a second token."""
    return "-" if value is None else f"{value:.1f}"


CALIBRATION_PROMPT, CALIBRATION_STEPS = 8, 16  # the rate calibration's rows: prompt tokens, timed full steps


def _calibration_plan(rows: int, prefill_chunk: int, max_cache_len: int) -> tuple[int, str | None]:
    """The calibration's new tokens a row, and why it cannot run (None: it can). Every row's prefill must land
    before the first row ends: with a prefill chunk under the rows' prompt tokens, rows are admitted over several
    steps (the last after up to ``rows * CALIBRATION_PROMPT`` of them, at chunk 1)."""
    admit_steps = -(-rows * CALIBRATION_PROMPT // prefill_chunk)
    new_tokens = CALIBRATION_STEPS + max(4, admit_steps + 1)
    if CALIBRATION_PROMPT + new_tokens - 1 <= max_cache_len:
        return new_tokens, None
    room = max_cache_len - CALIBRATION_PROMPT - CALIBRATION_STEPS  # the most admission steps the cache leaves
    least = f"a --prefill-chunk of at least {-(-rows * CALIBRATION_PROMPT // room)}" if room > 0 else "a longer --new"
    return new_tokens, (f"rate calibration: a prefill chunk of {prefill_chunk} tokens admits {rows} rows of "
                        f"{CALIBRATION_PROMPT}-token prompts over {admit_steps} steps, and the first rows' cache "
                        f"({max_cache_len} slots) ends before the last row is in: pass --rates, or {least}")


def saturation_rate(engine: ServingEngine, prompt: int, new: int, vocab: int, adapters: list) -> tuple[float, dict]:
    """Requests/s the engine sustains at a full batch: one prefill of a ``prompt``-token request, then decode steps
    with every row busy (adapters round-robin): ``1 / (t_prefill + new * t_step / max_rows)``."""
    rows = engine.graphs.max_rows
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    engine.generate_many([Request(ids(prompt), adapter=adapters[0], max_new_tokens=1, eos_token_ids=())])  # warm
    sync(engine.device)
    t0 = time.perf_counter()
    engine.generate_many([Request(ids(prompt), adapter=adapters[0], max_new_tokens=1, eos_token_ids=())])
    sync(engine.device)
    t_prefill = time.perf_counter() - t0
    new_tokens, problem = _calibration_plan(rows, engine.graphs.prefill_chunk, engine.graphs.max_cache_len)
    if problem:
        raise RuntimeError(problem)
    handles = [engine.submit(ids(CALIBRATION_PROMPT), adapter=adapters[i % len(adapters)], max_new_tokens=new_tokens,
                             eos_token_ids=()) for i in range(rows)]
    while engine.num_running < rows:  # every row admitted, prefilled and decoding
        if not engine.step():
            raise RuntimeError(f"rate calibration: {engine.num_running} of {rows} rows ever decoded at once "
                               f"(fewer adapter slots than distinct adapters among the rows?)")
    sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(CALIBRATION_STEPS):
        engine.step()
    sync(engine.device)
    t_step = (time.perf_counter() - t0) / CALIBRATION_STEPS
    for h in handles:
        h.cancel()
    while engine.step():  # the cancelled rows leave
        pass
    rate = 1.0 / (t_prefill + new * t_step / rows)
    return rate, dict(t_prefill_ms=1e3 * t_prefill, t_step_ms=1e3 * t_step, saturation_rps=rate)


def build(args, device, dtype):
    """The attached model, its store (64 names over the 8 adapters' factors) and the engine."""
    name = "gpt_oss" if args.tiny else args.model
    t0 = time.perf_counter()
    model = build_model(name, device, dtype, args.tiny)
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    size = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params:,}"
    log(f"{name}: built ({size} params) in {time.perf_counter() - t0:.1f} s")
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            paths, peft_model = make_adapters(model, folder, args.distinct, args.rank, name if args.tiny else None)
        model = peft_model.unload()
        del peft_model
        log(f"{len(paths)} PEFT adapters of rank {args.rank} made in {time.perf_counter() - t0:.1f} s")
        mm = mlc.attach(model, max_loras=args.slots, max_rank=args.rank, use_ops=device.type == "cuda",
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        t0 = time.perf_counter()
        parsed = [mm.parse_adapter(p) for p in paths]
    if device.type == "cuda":
        parsed = [w.pinned() for w in parsed]
    store = AdapterStore(mm)
    names = [f"a{i}" for i in range(max(args.paged, args.resident))]
    for i, n in enumerate(names):
        store.register(n, parsed[i % len(parsed)])  # names beyond the distinct ones share their host copy
    log(f"{len(names)} adapter names registered over {len(parsed)} parsed adapters in {time.perf_counter() - t0:.1f} s")
    max_cache = max_cache_len(args)
    buckets = args.buckets or None
    t0 = time.perf_counter()
    engine = ServingEngine(mm, store, max_rows=args.max_rows, max_cache_len=max_cache, batch_sizes=buckets,
                           prefill_chunk=args.prefill_chunk, compile=not args.no_compile,
                           compile_prefill=not args.eager_prefill, log=log,
                           num_speculative_tokens=args.num_speculative_tokens)
    log(f"engine ready ({'compiled, ' if not args.no_compile else ''}buckets {list(engine.graphs.batch_sizes)}, "
        f"{args.max_rows} rows x {max_cache} slots) in {time.perf_counter() - t0:.1f} s")
    return mm, store, engine, vocab, names


def run(args, on_row=None) -> list[dict]:
    """Every run's row (after the setup and calibration rows); ``on_row(rows)`` is called after each run."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    mm, store, engine, vocab, names = build(args, device, dtype)
    resident, paged = names[: args.resident], names[: args.paged]
    rows = [dict(kind="setup", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 **{k: v for k, v in vars(args).items() if k != "model"},
                 model="gpt_oss (tiny)" if args.tiny else args.model)]
    if args.rates:
        rates = list(args.rates)
    else:
        rate, info = saturation_rate(engine, args.prompt, args.new, vocab, resident)
        rows.append(dict(kind="calibration", **info))
        log(f"saturation estimate: {rate:.3f} requests/s (prefill {info['t_prefill_ms']:.1f} ms, step at "
            f"{args.max_rows} rows {info['t_step_ms']:.2f} ms)")
        rates = [f * rate for f in args.load_factors]
    log(f"rates {', '.join(f'{r:.3f}' for r in rates)} requests/s: arrivals alone take "
        f"{len(args.configs) * sum(args.requests / r for r in rates):.0f} s over the {len(rates) * len(args.configs)} "
        f"runs (each run then drains its last requests)")
    started = time.perf_counter()
    # near saturation first (the targets' main rate, the one-adapter-at-a-time baseline's only rate with
    # --grouped-near-only), then low, then overload: a run cut short keeps what the targets read first
    order = [1, 0, 2] if len(rates) == 3 else list(range(len(rates)))
    if len(rates) == 3:
        order = [i for i in order if LOADS[i] in args.loads]
    for r_i in order:
        rate = rates[r_i]
        for config in sorted(args.configs, key=lambda c: CONFIGS.index(c) if c != "grouped8" else 1.5):
            if config == "grouped8" and args.grouped_near_only and len(rates) == 3 and r_i != 1:
                continue
            if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
                log(f"--budget-s {args.budget_s:.0f} spent: {config} @ {rate:.3f} req/s and later runs skipped")
                rows.append(dict(kind="skipped", config=config, rate=rate, reason="budget"))
                continue
            adapters = {"no_lora": [None], "lora8": resident, "lora64": paged, "grouped8": resident}[config]
            arrivals, requests = workload(args.requests, args.prompt, args.new, args.jitter, vocab, adapters, rate,
                                          seed=args.seed + r_i)
            engine.schedule = "grouped" if config == "grouped8" else "mixed"
            if config in ("lora8", "grouped8"):
                with store.use(resident):  # all 8 resident before the run: its loads are the run's own
                    pass
            result = serve(engine, arrivals, requests)
            rows.append(dict(kind="run", config=config, rate=rate, load=LOADS[r_i] if len(rates) == 3 else str(r_i), **result))
            log(f"{config} @ {rate:.3f} req/s: {result['otps']:.1f} tok/s, TTFT p50 {result['ttft_p50_ms']:.0f} ms "
                f"p99 {result['ttft_p99_ms']:.0f} ms, ITL p50 {_ms(result['itl_p50_ms'])} ms p99 "
                f"{_ms(result['itl_p99_ms'])} ms, batch {result['mean_batch']:.1f}, loads "
                f"{result.get('adapter_loads')}")
            if on_row is not None:  # results so far written after every run (a run cut short keeps them)
                on_row(rows)
    return rows


LOADS = ("low", "near", "over")
# what --render needs of a file, and what must agree between the files it merges (rates: per load label)
SETUP_KEYS = {"kind", "model", "device", "requests", "prompt", "new", "jitter", "rank", "max_rows", "slots", "tiny",
              "configs"}
RUN_KEYS = {"config", "load", "rate", "otps", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_s",
            "mean_batch"}
WORKLOAD_KEYS = ("model", "device", "tiny", "requests", "prompt", "new", "jitter", "seed", "rank", "max_rows",
                 "slots", "resident", "paged", "distinct", "buckets", "prefill_chunk", "eager_prefill", "no_compile",
                 "num_speculative_tokens")


def merge(files: list[str]) -> list[dict]:
    """The rows of several ``--json`` files as one run: the first file's setup row, every file's run rows (a later
    file's row replaces an earlier one of the same config and load)."""
    setup, runs, rates = None, {}, {}
    for path in files:
        try:
            with open(path) as f:
                rows = json.load(f)
        except (ValueError, UnicodeDecodeError) as error:
            raise SystemExit(f"--render: {path} is not a bench_serving --json file ({error})") from None
        if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows) \
                or rows[0].get("kind") != "setup" or not SETUP_KEYS <= rows[0].keys() \
                or not all(RUN_KEYS <= r.keys() for r in rows if r.get("kind") == "run"):
            raise SystemExit(f"--render: {path} is not a bench_serving --json file")
        if setup is not None:  # one workload and engine: otherwise the ratios compare different runs
            differ = [k for k in WORKLOAD_KEYS if setup.get(k) != rows[0].get(k)]
            if differ:
                raise SystemExit(f"--render: {path} ran another workload or engine than {files[0]} "
                                 f"({', '.join(f'{k}: {setup.get(k)!r} vs {rows[0].get(k)!r}' for k in differ)})")
        setup = setup or rows[0]
        for r in rows:
            if r.get("kind") != "run":
                continue
            rate = rates.setdefault(r["load"], r["rate"])
            if not math.isclose(rate, r["rate"], rel_tol=1e-9):
                raise SystemExit(f"--render: {path} ran load {r['load']!r} at {r['rate']} req/s, another file at "
                                 f"{rate}")
            runs[(r["config"], r["load"])] = r
    return [setup, *runs.values()]


def to_markdown(rows: list[dict]) -> str:
    runs = sorted((r for r in rows if r["kind"] == "run"), key=lambda r: r["rate"])  # stable: run order per rate
    setup = rows[0]
    out = [f"Serving, {setup['model']} on {setup['device']}: {setup['requests']} requests per run, prompt "
           f"~{setup['prompt']} / output ~{setup['new']} tokens (+-{100 * setup['jitter']:.0f} %), rank "
           f"{setup['rank']}, {setup['max_rows']} rows, {setup['slots']} slots"
           + (" (tiny model on the CPU: a smoke run, no timing claims)" if setup["tiny"] else ""), "",
           "| load | req/s | config | out tok/s | vs no_lora | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | "
           "e2e p50 s | mean batch | adapter loads |", "|" + "---|" * 12]
    base = {r["rate"]: r for r in runs if r["config"] == "no_lora"}
    for r in runs:
        ratio = r["otps"] / base[r["rate"]]["otps"] if r["rate"] in base else float("nan")
        out.append(f"| {r['load']} | {r['rate']:.3f} | {r['config']} | {r['otps']:.1f} | {ratio:.2f} | "
                   f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {_ms(r['itl_p50_ms'])} | {_ms(r['itl_p99_ms'])} | "
                   f"{r['e2e_p50_s']:.2f} | {r['mean_batch']:.1f} | {r.get('adapter_loads', '-')} |")
    out += ["", "Targets (issue 15" + ("; a tiny smoke run is not judged)" if setup["tiny"] else "):")]

    def verdict(ok: bool) -> str:
        return "-" if setup["tiny"] else "met" if ok else "NOT met"

    for config, target in TARGETS.items():
        ratios = [r["otps"] / base[r["rate"]]["otps"] for r in runs if r["config"] == config and r["rate"] in base]
        if ratios:
            out.append(f"- {config} OTPS / no_lora >= {target} at every rate: min {min(ratios):.2f} "
                       f"({verdict(min(ratios) >= target)})")
    near = {r["config"]: r for r in runs if r["load"] == "near"}
    if "lora8" in near and "grouped8" in near:
        x = near["lora8"]["otps"] / near["grouped8"]["otps"]
        out.append(f"- lora8 OTPS / grouped8 >= 3 near saturation: {x:.2f} ({verdict(x >= 3)})")
    ttft = [r["ttft_p50_ms"] / base[r["rate"]]["ttft_p50_ms"] for r in runs if r["config"] == "lora8"
            and r["rate"] in base]
    if ttft:
        out.append(f"- lora8 TTFT p50 / no_lora <= 1.2: max {max(ttft):.2f} ({verdict(max(ttft) <= 1.2)})")
    skipped = [f"{r['config']} @ {r['rate']:.3f}" for r in rows if r["kind"] == "skipped"]
    if skipped:
        out.append(f"- not run (--budget-s spent): {', '.join(skipped)}")
    ran = {(r["config"], r["load"]) for r in runs}
    missing = [f"{c} @ {load}" for load in LOADS if any(r["load"] == load for r in runs) for c in setup["configs"]
               if (c, load) not in ran and not (c == "grouped8" and setup.get("grouped_near_only") and load != "near")]
    if missing:  # e.g. a run killed at its time limit: the verdicts above read only the runs that finished
        out.append(f"- no result (the run ended first): {', '.join(missing)}")
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r["kind"] == "run"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in CONFIGS:
        pts = sorted((r["rate"], r["otps"], r["ttft_p50_ms"]) for r in runs if r["config"] == config)
        if pts:
            rates, otps, ttft = zip(*pts)
            axes[0].plot(rates, otps, marker="o", label=config)
            axes[1].plot(rates, ttft, marker="o", label=config)
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("TTFT p50 (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("arrival rate (requests/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"serving {rows[0]['model']} on {rows[0]['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


POSITIVE, NON_NEGATIVE = int_at_least(1), int_at_least(0)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not -2 ** 63 <= value < 2 ** 63 - len(LOADS):  # torch.Generator.manual_seed's range, with the per-rate offsets
        raise argparse.ArgumentTypeError(f"must be in [-2**63, 2**63 - {len(LOADS)}), got {text}")
    return value


def parser(prog=None) -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, choices=list(DECODE_MODELS), help="default gpt-oss-20b")
    p.add_argument("--tiny", action="store_true",
                   help="tiny GPT-OSS on the CPU, small workload (a smoke test); its defaults: "
                        + " ".join(f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in TINY.items()))
    p.add_argument("--requests", type=POSITIVE, default=32,
                   help="requests per run; a run lasts ~requests / rate + the last requests' decode (scale to fit)")
    p.add_argument("--prompt", type=POSITIVE, default=1600, help="mean prompt tokens")
    p.add_argument("--new", type=POSITIVE, default=600, help="mean output tokens")
    p.add_argument("--jitter", type=float, default=0.25, help="lengths uniform in mean * (1 +- jitter)")
    p.add_argument("--rates", type=_positive_float, nargs="+", help="arrival rates in requests/s (default: calibrated)")
    p.add_argument("--load-factors", type=_positive_float, nargs="+", default=[0.4, 0.9, 1.5],
                   help="rates as multiples of the estimated saturation rate (low, near, overload)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--rank", type=POSITIVE, default=32)
    p.add_argument("--resident", type=POSITIVE, default=8, help="adapters of lora8 / grouped8")
    p.add_argument("--paged", type=POSITIVE, default=64, help="adapters of lora64")
    p.add_argument("--distinct", type=POSITIVE, default=8, help="distinct adapters made (names share their factors)")
    p.add_argument("--slots", type=POSITIVE, default=8, help="GPU adapter slots (max_loras)")
    p.add_argument("--max-rows", type=POSITIVE, default=32, help="requests decoding at once")
    p.add_argument("--buckets", type=POSITIVE, nargs="+", help="decode buckets (default: powers of two up to max-rows)")
    p.add_argument("--prefill-chunk", type=POSITIVE, default=2048, help="prompt tokens prefilled per engine step")
    p.add_argument("--no-compile", action="store_true", help="run the decode steps eagerly (captured on CUDA)")
    p.add_argument("--eager-prefill", action="store_true",
                   help="compile_prefill=False: no prefill compile (~2 min less for a 20B model; TTFT then is the "
                        "eager prefill's)")
    p.add_argument("--num-speculative-tokens", type=NON_NEGATIVE, default=0,
                   help="draft tokens per request and step (prompt lookup; random prompts rarely match: this measures "
                        "the cost of verifying drafts more than their gain)")
    p.add_argument("--loads", nargs="+", choices=LOADS, default=list(LOADS),
                   help="which of the three rates to run (labels kept; with --rates, give all three rates)")
    p.add_argument("--render", nargs="+", metavar="JSON",
                   help="no run: merge these --json files' runs into --md / --png (a run split over device calls)")
    p.add_argument("--grouped-near-only", action="store_true",
                   help="run grouped8 only at the near-saturation rate (its runs are the longest)")
    p.add_argument("--budget-s", type=_positive_float, default=None,
                   help="skip the runs that would start after this many seconds of runs (results so far kept)")
    p.add_argument("--seed", type=_seed, default=0, help="the workload's seed (run i of a rate uses seed + i)")
    p.add_argument("--json")
    p.add_argument("--md")
    p.add_argument("--png")
    return p


def _outputs_error(args) -> str | None:
    """Why --json / --md / --png cannot be written (one line), or None."""
    for flag, path in (("--json", args.json), ("--md", args.md), ("--png", args.png)):
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            return f"{flag} {path}: {folder} is not a writable folder"
        if os.path.isdir(path):  # (it was written after the whole run, and failed then)
            return f"{flag} {path}: a folder, not a file name"
    if args.png is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            return f"--png {args.png} needs matplotlib (pip install matplotlib)"
    return None


def max_cache_len(args) -> int:
    """Cache slots a request row gets: the longest prompt + output the jitter draws, and 2 more."""
    return round((args.prompt + args.new) * (1 + args.jitter)) + 2


TINY = dict(requests=3, prompt=16, new=5, max_rows=4, slots=4, prefill_chunk=32, no_compile=True, rank=4,
            paged=16, distinct=4, resident=4)


def main(argv=None, prog=None) -> int:
    warnings.filterwarnings("ignore", message=".*Online softmax is disabled.*")
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser(prog)
    if p.parse_known_args(argv)[0].tiny:  # small defaults, unless given on the command line (any spelling)
        p.set_defaults(**TINY)
    args = p.parse_args(argv)
    if args.tiny and args.model not in (None, "gpt-oss-20b"):
        p.error(f"--model {args.model}: --tiny serves a tiny GPT-OSS on the CPU (serve-bench adds --tiny where there "
                f"is no CUDA device); the full-size models need a GPU")
    args.model = args.model or "gpt-oss-20b"
    if not 0 <= args.jitter < 1:
        p.error(f"--jitter must be in [0, 1), got {args.jitter}")
    problem = _outputs_error(args)  # before minutes of model building and runs
    if problem:
        p.error(problem)
    resident_configs = [c for c in args.configs if c in ("lora8", "grouped8")]
    if args.slots < args.resident and (resident_configs or not args.rates):  # the calibration uses them too
        p.error(f"--slots {args.slots} < --resident {args.resident}: the resident adapters"
                f"{' of ' + '/'.join(resident_configs) if resident_configs else ' (rate calibration)'} must all fit "
                f"the slots")
    if args.buckets and (max(args.buckets) != args.max_rows or min(args.buckets) < 1):
        p.error(f"--buckets {' '.join(map(str, args.buckets))}: the largest bucket must be --max-rows "
                f"{args.max_rows}, none larger")
    if not args.rates:  # the calibration's plan depends on the arguments only (the engine may cut the chunk more)
        problem = _calibration_plan(args.max_rows, args.prefill_chunk, max_cache_len(args))[1]
        if problem:
            p.error(problem)
    for flag, values in (("--rates", args.rates), ("--load-factors", None if args.rates else args.load_factors)):
        if values and len(values) == 3 and not values[0] < values[1] < values[2]:
            p.error(f"{flag} {' '.join(map(str, values))}: three rates are low, near and over saturation, in "
                    f"increasing order")
    if args.loads != list(LOADS) and args.rates and len(args.rates) != 3:
        p.error(f"--loads picks among three rates; --rates gave {len(args.rates)}")
    if args.loads != list(LOADS) and not args.rates and len(args.load_factors) != 3:
        p.error(f"--loads picks among three rates; --load-factors gave {len(args.load_factors)}")

    def write(rows):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        if args.md:
            with open(args.md, "w") as f:
                f.write(to_markdown(rows))

    if args.render:
        missing = [f for f in args.render if not os.path.isfile(f)]
        if missing:
            p.error(f"--render: no such file: {missing[0]}")
        try:
            rows = merge(args.render)
        except SystemExit as error:  # a file that is not one of ours: a usage error, one line
            p.error(str(error))
        args.json = None  # nothing ran: the inputs stay as they are
    else:
        rows = run(args, on_row=write)
    write(rows)
    print(to_markdown(rows))
    if args.png:
        plot(rows, args.png)  # matplotlib checked above
    return 0


if __name__ == "__main__":
    sys.exit(main())
