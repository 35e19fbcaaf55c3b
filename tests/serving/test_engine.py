"""ServingEngine: continuous batching with per-request adapters equals each request generated alone.

CPU tests run the engine's static-buffer steps eagerly (``capture=False``) on tiny float32 models with three PEFT
adapters (``moe_lora_compile.__main__.build``): GPT-OSS (eager attention with sinks, sliding window 16 beside full
layers: a dict of masks) and Qwen3-MoE (SDPA, one mask). The reference for every request is ``mm.generate`` of its
prompt alone (greedy, HF's dynamic cache and masks). ``@pytest.mark.gpu`` tests capture the steps as CUDA graphs with
the Triton kernels (``use_ops=True``): ``pytest -m gpu tests/serving``.
"""

from __future__ import annotations

import copy
import os
import shutil
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters

from moe_lora_compile.__main__ import build
from moe_lora_compile.models import attach
from moe_lora_compile.serving import AdapterStore, NoFreeSlot, PromptLookupDraft, Request, ServingEngine
from moe_lora_compile.serving.engine import RequestsFailed

from engine_helpers import alone, prompt
from support.factors import random_adapter

# (prompt length, adapter, max_new_tokens): lengths 1..26 (longer than the sliding window 16 and than one prefill
# chunk of 8, so prompts are prefilled over several engine steps while others decode), every adapter and none
WORK = [(5, "alpha", 9), (19, "beta", 12), (1, None, 6), (11, "gamma", 10), (26, "alpha", 8), (2, "beta", 5),
        (8, None, 11)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> its tiny model with three adapters, the prompts of WORK and each one's tokens alone (built once)."""
    built = {}

    def get(family):
        if family not in built:
            workdir = str(tmp_path_factory.mktemp("adapters"))
            s = build(family, dtype=torch.float32, device=torch.device("cpu"), batch=1, seq_len=4, workdir=workdir)
            s.workdir = workdir
            s.prompts = [prompt(n, seed=i) for i, (n, _, _) in enumerate(WORK)]
            s.want = [alone(s.model, p, a, m) for p, (_, a, m) in zip(s.prompts, WORK)]
            built[family] = s
        return built[family]

    return get


# the core checks on both families; the rest on GPT-OSS (the benchmark's model: sliding window, sinks, mask dict)
both = pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])


@pytest.fixture
def family():
    return "gpt_oss"  # tests parametrized over "family" override this


@pytest.fixture
def setup(models, family):
    return models(family)


def _engine(mm, **kwargs):
    kwargs = {"max_rows": 4, "max_cache_len": 48, "prefill_chunk": 8, "log": None, **kwargs}
    return ServingEngine(mm, **kwargs)


@both
def test_requests_joining_mid_stream_equal_each_alone(setup, family):
    """Seven requests over four rows, in three waves: rows are shared by requests of different lengths and
    adapters, requests join while others decode (after two and after five steps) and take the rows of finished ones;
    each gets exactly the tokens mm.generate gives it alone (eos included: the model's eos ends some early)."""
    engine = _engine(setup.model)
    live_per_step = []

    def submit(indices):
        return [engine.submit(setup.prompts[i], adapter=WORK[i][1], max_new_tokens=WORK[i][2]) for i in indices]

    def steps(n):
        for _ in range(n):
            more = engine.step()
            live_per_step.append(len(engine._running))
        return more

    handles = submit([0, 1, 2])
    steps(2)
    handles += submit([3, 4])
    steps(3)
    handles += submit([5, 6])
    while steps(1):
        pass
    assert [h.tokens for h in handles] == setup.want
    assert all(h.finish_reason == ("eos" if h.tokens[-1] == 2 else "length") for h in handles)
    assert max(live_per_step) == 4 and engine.steps < sum(len(w) for w in setup.want)  # rows shared the steps
    assert engine.idle and sorted(engine._free_rows) == [0, 1, 2, 3]


@both
def test_stop_conditions(setup, family):
    """eos ids of the request (first occurrence ends it, kept), a stop sequence (ends after its first occurrence,
    even one spanning the prefill's token and the first decode step's), max_new_tokens, cancel."""
    mm, p = setup.model, setup.prompts[1]
    ref = alone(mm, p, "beta", 12, eos=[])  # no eos: the full 12
    engine = _engine(mm)
    eos = ref[4]
    stop_mid, stop_first = ref[6:8], ref[0:2]
    cut_eos = ref.index(eos) + 1
    cut_mid = next(i + 2 for i in range(len(ref) - 1) if ref[i:i + 2] == stop_mid)
    absent = next(t for t in range(128) if t not in ref)  # a stop sequence that never matches
    requests = [Request(p, adapter="beta", max_new_tokens=12, eos_token_ids=[eos]),
                Request(p, adapter="beta", max_new_tokens=12, eos_token_ids=(), stop=[[absent], stop_mid]),
                Request(p, adapter="beta", max_new_tokens=12, eos_token_ids=(), stop=[stop_first]),
                Request(p, adapter="beta", max_new_tokens=3, eos_token_ids=()),
                Request(p, adapter="beta", max_new_tokens=1, eos_token_ids=())]
    handles = engine.generate_many(requests)
    assert [(h.tokens, h.finish_reason) for h in handles] == [
        (ref[:cut_eos], "eos"), (ref[:cut_mid], "stop"), (ref[:2], "stop"), (ref[:3], "length"), (ref[:1], "length")]
    h = engine.submit(p, adapter="beta", max_new_tokens=12, eos_token_ids=())
    tokens = []
    for token in h:
        tokens.append(token)
        if len(tokens) == 3:
            h.cancel()
    assert h.finish_reason == "cancelled" and tokens == ref[:3] == h.tokens and engine.idle


def test_sampling_is_reproducible_with_a_seed(setup):
    """temperature / top_p / top_k with a seed: the same tokens alone and beside other requests (another row, other
    adapters, greedy neighbours); another seed gives other tokens; greedy rows stay exactly greedy."""
    mm, p = setup.model, setup.prompts[3]
    engine = _engine(mm)
    hot = dict(adapter="gamma", max_new_tokens=10, temperature=1.5, top_p=0.95, top_k=40, eos_token_ids=())
    solo = engine.generate_many([Request(p, seed=7, **hot)])[0].tokens
    crowd = engine.generate_many([Request(setup.prompts[0], adapter="alpha", max_new_tokens=9),
                                  Request(setup.prompts[4], adapter="alpha", max_new_tokens=8),
                                  Request(p, seed=7, **hot), Request(p, seed=8, **hot)])
    assert crowd[2].tokens == solo and crowd[3].tokens != solo
    assert [h.tokens for h in crowd[:2]] == [setup.want[0], setup.want[4]]
    greedy = alone(mm, p, "gamma", 10, eos=[])
    assert solo != greedy  # the draw is not the greedy continuation (temperature 1.5 on a random model)


def test_seed_none_draws_from_torch_only_for_sampled_requests(setup):
    """seed=None: a sampled request takes its seed from torch's default generator (so torch.manual_seed makes the
    run reproducible, as in transformers), a greedy one draws nothing (the user's random stream does not move)."""
    engine = _engine(setup.model)
    p = setup.prompts[0]
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    engine.submit(p, max_new_tokens=2)
    assert torch.equal(torch.rand(3), want)
    hot = dict(max_new_tokens=6, temperature=1.5, eos_token_ids=())
    torch.manual_seed(5)
    first = engine.submit(p, **hot)
    torch.manual_seed(5)
    second = engine.submit(p, **hot)
    assert first.result() == second.result()


def test_streaming_callbacks_and_background_thread(setup):
    """A handle streams its tokens (iterating drives the engine); on_token sees the same tokens in order; with the
    engine's own thread, requests submitted from other threads finish and result() waits for them."""
    mm = setup.model
    engine = _engine(mm)
    seen = []
    h = engine.submit(setup.prompts[0], adapter="alpha", max_new_tokens=9,
                      on_token=lambda handle, token: seen.append((handle.id, token)))
    assert list(h) == setup.want[0] == [t for _, t in seen] and {i for i, _ in seen} == {h.id}
    engine.start()
    try:
        results = [None] * 3

        def client(i):
            results[i] = engine.submit(setup.prompts[i], adapter=WORK[i][1], max_new_tokens=WORK[i][2]).result()

        threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert results == setup.want[:3]
        assert list(engine.submit(setup.prompts[5], adapter="beta", max_new_tokens=5)) == setup.want[5]
    finally:
        engine.stop()
    assert engine._thread is None


def test_grouped_schedule_serves_one_adapter_at_a_time(setup):
    """schedule="grouped" (the one-adapter-at-a-time baseline): every step's live requests share one adapter, and
    the tokens are the same."""
    engine = _engine(setup.model, schedule="grouped")
    adapters_per_step = []

    def watch(handle, token):
        adapters_per_step.append({x.handle.request.adapter for x in (*engine._running.values(), *engine._prefilling)})

    handles = engine.generate_many([Request(p, adapter=a, max_new_tokens=m, on_token=watch)
                                    for p, (_, a, m) in zip(setup.prompts, WORK)])
    assert [h.tokens for h in handles] == setup.want
    assert all(len(s) <= 1 for s in adapters_per_step)


@pytest.mark.parametrize("max_bypass", [0, 1, 2])
def test_grouped_schedule_bounds_how_often_a_request_is_overtaken(setup, max_bypass):
    """schedule="grouped", two rows: request 1 (alpha, long) opens alpha's group, request 2 (beta) waits, requests
    3.. (alpha) keep coming. At most ``max_bypass`` of them start before request 2; then alpha's group drains and
    beta's is next. Before, alpha's group stayed open while any alpha request was live: all six started first, and
    steady alpha traffic kept beta waiting forever. Every request's tokens still equal it alone."""
    engine = _engine(setup.model, schedule="grouped", max_rows=2, max_bypass=max_bypass)
    position, handles, requests = _overtaking_run(engine, setup.prompts, "alpha", "beta")
    assert position == 1 + max_bypass
    for h, r in zip(handles, requests):
        assert h.tokens == alone(setup.model, list(r.prompt_ids), r.adapter, r.max_new_tokens, eos=[])


def _overtaking_run(engine, prompts, first: str, other: str):
    """Request 1 (``first``, 12 tokens), request 2 (``other``), then six more of ``first`` (3 tokens each), in one
    generate_many -> (how many requests started before request 2, the handles, the requests)."""
    started = []

    def on_token(handle, token):
        if len(handle.tokens) == 1:
            started.append(handle.id)

    adapters = [first, other] + [first] * 6
    requests = [Request(prompts[i % len(prompts)], adapter=a, max_new_tokens=12 if i == 0 else 3,
                        eos_token_ids=(), on_token=on_token) for i, a in enumerate(adapters)]
    handles = engine.generate_many(requests)
    return started.index(handles[1].id), handles, requests


def test_submit_errors_change_nothing(setup):
    mm = setup.model
    engine = _engine(mm)
    p = setup.prompts[0]
    with pytest.raises(KeyError, match=r"unknown adapter 'nope'; known: \['alpha', 'beta', 'gamma'\]"):
        engine.submit(p, adapter="nope", max_new_tokens=4)
    for kwargs, message in [(dict(prompt_ids=[]), "non-empty"), (dict(prompt_ids=[1, 200]), r"ids \[200\] are outside"),
                            (dict(prompt_ids=[[1, 2]]), "1-D"), (dict(max_new_tokens=0), "positive int"),
                            (dict(max_new_tokens=45), "need 49 cache slots, more than max_cache_len=48"),
                            (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
                            (dict(top_k=-2), "top_k"), (dict(seed=1.5), "seed"), (dict(stop=[[]]), "stop"),
                            (dict(eos_token_ids=["x"]), "eos_token_ids"),
                            # a seed past int64 failed every live request inside step()
                            (dict(seed=2**63), r"seed must be an int in \[-2\*\*63"),
                            (dict(stop=[5, 6]), r"e\.g\. \[\[13, 13\]\]"),  # a flat list: a bare TypeError before
                            (dict(temperature=True), "temperature"), (dict(top_p=True), "top_p"),  # bools
                            (dict(eos_token_ids=[10**9]), "outside the vocabulary"),
                            (dict(temperature=10**400), "temperature"),  # past float's range: OverflowError
                            # stop ids no token can be: accepted before, a stop that never matched
                            (dict(stop=[[128]]), r"stop \[\[128\]\]: ids outside the vocabulary"),
                            (dict(stop=[[-7, 5]]), "stop .* outside the vocabulary")]:
        with pytest.raises(ValueError, match=message):
            engine.submit(**{"prompt_ids": p, "max_new_tokens": 4, **kwargs})
    with pytest.raises(KeyError, match="nope"):  # one bad request: none of the list is queued
        engine.generate_many([Request(p, max_new_tokens=4), Request(p, adapter="nope", max_new_tokens=4)])
    assert engine.idle and engine._next_id == 0  # ids are given when queued
    with pytest.raises(ValueError, match="schedule"):
        ServingEngine(mm, schedule="fifo", log=None)
    for max_rows in (-1, 2.0, True):  # named max_bypass (its default) before
        with pytest.raises(ValueError, match="max_rows must be an int >= 1"):
            ServingEngine(mm, max_rows=max_rows, log=None)
    with pytest.raises(ValueError, match="max_bypass must be an int >= 0"):
        ServingEngine(mm, max_bypass=True, log=None)
    other = AdapterStore(attach(copy.deepcopy(setup.base)))
    with pytest.raises(ValueError, match="another model"):
        ServingEngine(mm, other, log=None)


def test_an_adapter_that_fails_to_load_fails_only_its_request(setup):
    """A folder registered lazily and broken on disk: its request ends with finish_reason "error" (result() raises
    with the loader's message); the requests beside it are served as usual."""
    broken = os.path.join(setup.workdir, "broken")
    shutil.copytree(os.path.join(setup.workdir, "alpha"), broken)
    weights = os.path.join(broken, "adapter_model.safetensors")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    store = AdapterStore(setup.model)  # alpha, beta, gamma loaded directly stay usable by name
    store.register("broken", broken)
    engine = _engine(setup.model, store=store)
    bad = engine.submit(setup.prompts[0], adapter="broken", max_new_tokens=4)
    good = [engine.submit(setup.prompts[i], adapter=WORK[i][1], max_new_tokens=WORK[i][2]) for i in (0, 1)]
    engine.run()
    assert [h.tokens for h in good] == setup.want[:2]
    assert bad.finish_reason == "error" and bad.tokens == []
    with pytest.raises(RuntimeError, match="cannot be read"):
        bad.result()
    assert store.in_use == {} and "broken" not in setup.model.adapters


def test_a_request_for_an_adapter_a_cast_around_mm_made_infinite_fails(setup):
    """mm.model.half() bypasses mm's overflow check: an adapter whose factors it made infinite fails its request
    (finish_reason "error", naming it); a base-model request beside it is served. It decoded NaN logits before."""
    mm = attach(copy.deepcopy(setup.base), max_loras=2, max_rank=8)
    mm.load_adapter("big", os.path.join(setup.workdir, "alpha"))
    with torch.no_grad():  # factors beyond float16's range (as lora_alpha / r folded into B can make them)
        next(iter(mm.slots.linear_modules.values())).lora_b[mm.adapters["big"]].fill_(1e6)
    mm.model.half()
    engine = _engine(mm)
    bad = engine.submit(setup.prompts[0], adapter="big", max_new_tokens=3)
    base = engine.submit(setup.prompts[1], adapter=None, max_new_tokens=3)
    engine.run()
    assert bad.finish_reason == "error" and bad.tokens == []
    with pytest.raises(RuntimeError, match="adapter 'big' holds infinite factors"):
        bad.result()
    assert len(base.tokens) == 3


def test_a_request_no_slot_can_ever_serve_fails(setup):
    """Every slot taken by adapters loaded into mm directly and nothing live: a request for a store adapter ends
    with "error" (NoFreeSlot) instead of waiting forever (result() used to spin)."""
    mm = attach(copy.deepcopy(setup.base), max_loras=1, max_rank=8)
    mm.load_adapter("direct", os.path.join(setup.workdir, "alpha"))
    store = AdapterStore(mm)
    store.register("paged", os.path.join(setup.workdir, "beta"))
    engine = _engine(mm, store=store)
    handle = engine.submit(setup.prompts[0], adapter="paged", max_new_tokens=3)
    with pytest.raises(RuntimeError, match="no slot for"):
        handle.result()
    assert handle.finish_reason == "error" and engine.idle and store.in_use == {}


def test_a_request_no_slot_can_ever_serve_fails_beside_base_model_traffic(setup):
    """As above, with base-model requests live (they hold no slot, so none of them can free one): the request
    fails at its first try. It waited as long as anything was live, i.e. under steady traffic, forever."""
    mm = attach(copy.deepcopy(setup.base), max_loras=1, max_rank=8)
    mm.load_adapter("direct", os.path.join(setup.workdir, "alpha"))
    store = AdapterStore(mm)
    store.register("paged", os.path.join(setup.workdir, "beta"))
    engine = _engine(mm, store=store)
    base = [engine.submit(setup.prompts[i], max_new_tokens=12, eos_token_ids=()) for i in (0, 1)]
    engine.step()
    handle = engine.submit(setup.prompts[2], adapter="paged", max_new_tokens=3)
    engine.step()
    assert handle.finish_reason == "error" and isinstance(handle.error, NoFreeSlot)
    assert all(not h.done for h in base)  # failed while the base-model requests were still live
    engine.run()
    assert [h.tokens for h in base] == [alone(mm, setup.prompts[i], None, 12, eos=[]) for i in (0, 1)]


class _FlakyDraft:
    """Prompt-lookup drafts, except that call number ``fail_at`` raises (a transient failure inside a step)."""

    def __init__(self, fail_at: int = 2):
        self.calls, self.fail_at, self.lookup = 0, fail_at, PromptLookupDraft()

    def __call__(self, handles, k):
        self.calls += 1
        if self.calls == self.fail_at:
            raise ValueError("transient draft failure")
        return self.lookup(handles, k)


def test_a_failed_step_does_not_end_the_engine_thread(setup):
    """After start(), a step that raises fails its live requests; the engine's thread goes on serving the next
    ones (it returned, and a request streamed through on_token, with no one stepping, never got a token)."""
    import queue

    engine = _engine(setup.model, num_speculative_tokens=2, draft=_FlakyDraft()).start()
    try:
        first = engine.submit(setup.prompts[0], adapter="alpha", max_new_tokens=8)
        with pytest.raises(RuntimeError, match="transient draft failure"):
            first.result()
        tokens = queue.Queue()
        second = engine.submit(setup.prompts[1], adapter=WORK[1][1], max_new_tokens=WORK[1][2],
                               on_token=lambda handle, token: tokens.put(token))
        got = []
        while len(got) < len(setup.want[1]):
            got.append(tokens.get(timeout=60))  # the engine's thread alone steps: queue.Empty if it ended
        assert got == setup.want[1] and second.tokens == setup.want[1]
    finally:
        engine.stop()


@pytest.mark.parametrize("threaded", [False, True], ids=["caller_steps", "engine_thread"])
def test_generate_many_raises_requests_failed_whoever_steps(setup, threaded):
    """A step that raises inside generate_many: RequestsFailed with every handle, whether the caller's thread runs
    the steps or the engine's (the caller's thread let the step's own error escape, and the handles were lost)."""
    engine = _engine(setup.model, num_speculative_tokens=2, draft=_FlakyDraft())
    if threaded:
        engine.start()
    try:
        requests = [Request(setup.prompts[i], adapter="alpha", max_new_tokens=6) for i in range(3)]
        with pytest.raises(RequestsFailed, match="transient draft failure") as info:
            engine.generate_many(requests)
        assert len(info.value.handles) == 3 and info.value.failed
        assert all(h.finish_reason == "error" for h in info.value.failed)
        assert all(h.done for h in info.value.handles)
    finally:
        engine.stop()
    assert engine.idle and setup.model._pins == {}


def test_a_script_that_exits_without_stop_exits_cleanly(setup, tmp_path):
    """A started engine still stepping when the script ends: the interpreter stops it at exit (after its step).
    Its daemon thread was killed inside a step and the process aborted (SIGABRT, exit code 134)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "serve.py"
    script.write_text(textwrap.dedent(f"""
        import torch
        from moe_lora_compile.__main__ import build
        from moe_lora_compile.serving import ServingEngine
        s = build("qwen3_moe", dtype=torch.float32, device=torch.device("cpu"), batch=1, seq_len=4,
                  workdir={str(tmp_path)!r})
        engine = ServingEngine(s.model, max_rows=2, max_cache_len=64, compile_prefill=False, log=None).start()
        handles = [engine.submit([5, 6, 7], adapter=name, max_new_tokens=60, eos_token_ids=())
                   for name in ("alpha", "beta")]
        next(iter(handles[0]))
        print("exiting while the engine steps", flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for _ in range(3):  # the abort was a race with the step in flight: most runs of 3 hit it
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "exiting while the engine steps" in done.stdout


def test_a_raising_callback_fails_only_its_request(setup):
    """``on_token`` raising ends its own request with finish_reason "error" (row and adapter freed, result()
    re-raises the callback's error); the request beside it finishes with its usual tokens. Before, the error
    escaped step(): the request was lost with its row and adapter held, and result() waited forever."""
    store = AdapterStore(setup.model)
    engine = _engine(setup.model, store=store)

    def boom(handle, token):
        raise RuntimeError("callback boom")

    good = engine.submit(setup.prompts[0], adapter=WORK[0][1], max_new_tokens=WORK[0][2])
    bad = engine.submit(setup.prompts[1], adapter=WORK[1][1], max_new_tokens=4, on_token=boom)
    engine.run()
    assert good.tokens == setup.want[0] and good.finish_reason == "length"
    assert bad.finish_reason == "error" and len(bad.tokens) == 1
    with pytest.raises(RuntimeError, match="callback boom"):
        bad.result()
    assert engine.idle and sorted(engine._free_rows) == list(range(4)) and setup.model._pins == {}


def test_a_request_is_what_submit_checked(setup):
    """The handle keeps a copy of the checked request: a Request object changed and submitted again does not
    change the first request (it read adapter / max_new_tokens from the caller's object after submit: the wrong
    tokens, a cache overrun inside step(), an adapter pin released under another name and a handle that never
    ended). A top_k past the vocabulary (2**63 failed every live request inside step()) keeps every token."""
    engine = _engine(setup.model)
    req = Request(setup.prompts[0], adapter=WORK[0][1], max_new_tokens=WORK[0][2])
    first = engine.submit(req)
    req.adapter, req.max_new_tokens = WORK[1][1], 10**6
    engine.step()
    req.adapter = "gamma"
    huge_k = engine.submit(setup.prompts[1], adapter=WORK[1][1], max_new_tokens=WORK[1][2], top_k=2**63)
    engine.run()
    assert first.tokens == setup.want[0] and first.finish_reason == "length"
    assert huge_k.tokens == setup.want[1] and huge_k.request.top_k == engine.vocab_size
    assert engine.idle and setup.model._pins == {}


def test_waiting_inside_a_callback_is_an_error_not_a_deadlock(setup):
    """on_token calling result() of a handle would wait for the step that runs the callback (a silent hang): it
    raises instead, which fails that request only; the other request finishes with its usual tokens."""
    engine = _engine(setup.model)
    other = engine.submit(setup.prompts[0], adapter=WORK[0][1], max_new_tokens=WORK[0][2])
    waiting = engine.submit(setup.prompts[1], adapter=WORK[1][1], max_new_tokens=4,
                            on_token=lambda handle, token: other.result())
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("tokens", other.result()), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and result["tokens"] == setup.want[0]
    assert waiting.finish_reason == "error"
    with pytest.raises(RuntimeError, match="inside an engine step"):
        waiting.result()


def test_generate_many_inside_a_callback_queues_nothing(setup):
    """on_token calling generate_many is refused (it would wait for its own step) before its requests are queued:
    they ran anyway before, orphaned (the caller never got their handles)."""
    engine = _engine(setup.model)
    refused = []

    def on_token(handle, token):
        try:
            engine.generate_many([Request(setup.prompts[0], max_new_tokens=30, eos_token_ids=())])
        except RuntimeError as error:
            refused.append(str(error))
        assert engine._next_id == 1 and not engine._waiting  # nothing queued

    handle = engine.submit(setup.prompts[1], adapter=WORK[1][1], max_new_tokens=3, on_token=on_token)
    assert handle.result() == setup.want[1][:3]
    assert len(refused) == 3 and "generate_many was called from inside an engine step" in refused[0]
    assert engine.idle and engine.tokens_generated == 3


def test_stepping_inside_a_callback_is_an_error_not_a_deadlock(setup):
    """on_token calling engine.step() / run() waited forever for the step lock its own step holds (a silent hang):
    it raises instead, which fails that request only; the other request finishes with its usual tokens."""
    engine = _engine(setup.model)
    other = engine.submit(setup.prompts[0], adapter=WORK[0][1], max_new_tokens=WORK[0][2])
    stepping = [engine.submit(setup.prompts[1], adapter=WORK[1][1], max_new_tokens=4,
                              on_token=lambda handle, token, call=call: call()) for call in (engine.step, engine.run)]
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "engine.step() inside on_token deadlocked"
    assert other.tokens == setup.want[0] and other.finish_reason == "length"
    for handle in stepping:
        assert handle.finish_reason == "error"
        with pytest.raises(RuntimeError, match=r"step\(\) or run\(\) was called from inside an engine step"):
            handle.result()
    assert engine.idle and setup.model._pins == {}


def test_stop_hands_the_steps_to_waiting_handles(setup):
    """stop() while another thread waits in result(): the waiter runs the remaining steps itself (it slept on
    forever: stop() cleared the engine's thread without waking it)."""
    engine = _engine(setup.model)
    in_step, go = threading.Event(), threading.Event()
    step = engine.graphs.step

    def paused_step(num_rows):  # the engine's thread stays in its first decode step until `go`
        in_step.set()
        assert go.wait(30)
        return step(num_rows)

    engine.graphs.step = paused_step
    handle = engine.submit(setup.prompts[0], adapter=WORK[0][1], max_new_tokens=WORK[0][2])
    engine.start()
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("tokens", handle.result()), daemon=True)
    waiter.start()
    assert in_step.wait(30)
    stopper = threading.Thread(target=engine.stop, daemon=True)
    stopper.start()
    deadline = time.monotonic() + 30
    while not engine._stopping and time.monotonic() < deadline:
        time.sleep(0.001)
    go.set()  # the thread ends after this step, far from the request's end
    stopper.join(30)
    assert not stopper.is_alive() and engine._thread is None
    waiter.join(30)
    assert not waiter.is_alive(), "a handle waiting across stop() was never woken up"
    assert result["tokens"] == setup.want[0] and handle.finish_reason == "length"


def test_stop_from_a_callback_ends_the_thread_after_its_step(setup):
    """engine.stop() inside on_token (the engine's own thread) only signals: the thread ends after the step, the
    handles waiting for it take over, and start() works again. Before, join() raised "cannot join current thread":
    the request failed, the thread stayed registered, every other handle waited forever and start() refused."""
    engine = _engine(setup.model).start()
    try:
        other = engine.submit(setup.prompts[1], adapter=WORK[1][1], max_new_tokens=WORK[1][2])
        stopping = engine.submit(setup.prompts[0], adapter=WORK[0][1], max_new_tokens=WORK[0][2],
                                 on_token=lambda handle, token: engine.stop() if len(handle.tokens) == 2 else None)
        result = {}

        def wait():
            result["other"] = other.result()
            result["stopping"] = stopping.result()

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(60)
        assert not waiter.is_alive(), "handles waited forever after stop() from a callback"
        assert result == {"other": setup.want[1], "stopping": setup.want[0]}
        assert engine._thread is None
        engine.start()  # refused before: "already running"
        assert engine.submit(setup.prompts[5], adapter="beta", max_new_tokens=5).result() == setup.want[5]
    finally:
        engine.stop()
    assert engine._thread is None


def test_generate_many_failure_keeps_every_handle(setup, tmp_path):
    """One request of generate_many fails (its adapter folder is not an adapter): it still raises (a RuntimeError),
    and the error carries every handle: the finished requests' tokens are not lost."""
    store = AdapterStore(setup.model)
    store.register("broken", str(tmp_path))  # no adapter_config.json: fails at first use
    engine = _engine(setup.model, store=store)
    work = [Request(setup.prompts[i], adapter=a, max_new_tokens=WORK[i][2])
            for i, a in ((0, WORK[0][1]), (2, "broken"), (1, WORK[1][1]))]
    with pytest.raises(RequestsFailed, match="no adapter_config.json") as info:
        engine.generate_many(work)
    assert isinstance(info.value, RuntimeError)
    first, bad, second = info.value.handles
    assert (first.tokens, second.tokens) == (setup.want[0], setup.want[1])
    assert first.finish_reason == second.finish_reason == "length"
    assert info.value.failed == [bad] and bad.finish_reason == "error" and bad.tokens == []
    assert engine.idle and store.in_use == {}


def test_a_pad_id_outside_the_vocabulary_is_not_fed_to_padding_rows(setup):
    """A config with pad_token_id = -1 (transformers accepts it): padding rows get the eos id instead (the
    constructor died with a bare IndexError); an explicit pad_token_id is checked."""
    base = copy.deepcopy(setup.base)
    base.config.pad_token_id = base.generation_config.pad_token_id = -1
    mm = attach(base, max_loras=1, max_rank=8)
    engine = _engine(mm)
    assert engine.graphs.pad_token_id == mm.model.config.eos_token_id == 2
    p = setup.prompts[0]
    assert engine.submit(p, max_new_tokens=6, eos_token_ids=()).result() == alone(mm, p, None, 6, eos=[])
    assert _engine(mm, max_rows=1, pad_token_id=7).graphs.pad_token_id == 7
    for bad in (-1, engine.vocab_size, 1.5, True):
        with pytest.raises(ValueError, match=r"pad_token_id must be a token id in \[0, 128\)"):
            _engine(mm, max_rows=1, pad_token_id=bad)


def test_rows_and_tokens_are_checked_on_the_host(setup):
    """set_row / clear_row / advance took any row (a negative one staged the last rows, silently) and set_row any
    token id (a bare IndexError inside the next step): ValueError, nothing staged."""
    graphs = _engine(setup.model).graphs
    before = graphs._host_inputs.clone()
    for call in (lambda: graphs.set_row(-1, token=5, position=3, adapter_slot=0),
                 lambda: graphs.set_row(4, token=5, position=3), lambda: graphs.clear_row(-2),
                 lambda: graphs.clear_row(4), lambda: graphs.advance([0, -1], [5, 6])):
        with pytest.raises(ValueError, match=r"row must be in 0\.\.3, got"):
            call()
    for token in (-5, 128):
        with pytest.raises(ValueError, match=rf"ids \[{token}\] are outside the vocabulary \[0, 128\)"):
            graphs.set_row(0, token=token, position=3)
    assert torch.equal(graphs._host_inputs, before)
    spec = _engine(setup.model, num_speculative_tokens=2).graphs
    with pytest.raises(ValueError, match=r"ids \[128\] are outside the vocabulary"):
        spec.set_row(0, token=5, position=3, draft=[1, 128])


def test_adapters_an_engine_pins_are_never_evicted_by_the_store(setup):
    """An engine without the store serves a store adapter resident in mm by name (pinned in mm): the store does
    not choose it as LRU victim (its unload raised inside acquire, after the counters had changed), and a full
    cache raises NoFreeSlot with nothing changed."""
    mm = attach(copy.deepcopy(setup.base), max_loras=1, max_rank=8)
    store = AdapterStore(mm)
    store.register("a0", random_adapter(mm, 1))
    store.register("a1", random_adapter(mm, 2))
    with store.use(["a0"]):  # a0 resident, held by no store request
        pass
    engine = _engine(mm)  # no store: the name resolves through mm
    p = setup.prompts[0]
    handle = engine.submit(p, adapter="a0", max_new_tokens=6, eos_token_ids=())
    engine.step()  # admitted: a0 pinned in mm
    before = store.counters
    with pytest.raises(NoFreeSlot, match=r"1 held by in-flight requests \['a0'\]"):
        store.acquire(["a1"])
    assert store.counters == before and store.resident == {"a0": 0} and store.in_use == {}
    assert handle.result() == alone(mm, p, "a0", 6, eos=[])
    assert store.acquire(["a1"]) == [0]  # unpinned when the request ended: evictable again
    store.release(["a1"])


def test_a_request_waiting_on_a_slot_held_elsewhere_does_not_spin(setup):
    """Every slot held outside the engine (here the store's own acquire, as a DecodeGraphs batch does): a request
    for another adapter waits until the release. The thread stepping the engine (here its own) backs off between
    steps that cannot change anything (without it: ~11,000 empty steps in the 0.5 s here, a core busy) and serves
    the request once the slot is released elsewhere."""
    mm = attach(copy.deepcopy(setup.base), max_loras=1, max_rank=8)
    store = AdapterStore(mm)
    store.register("a0", random_adapter(mm, 1))
    store.register("a1", random_adapter(mm, 2))
    engine = _engine(mm, store=store)
    calls = [0]
    step = engine.step

    def counted_step():
        calls[0] += 1
        return step()

    engine.step = counted_step
    store.acquire(["a0"])  # held outside the engine
    p = setup.prompts[0]
    handle = engine.submit(p, adapter="a1", max_new_tokens=4, eos_token_ids=())
    engine.start()
    try:
        time.sleep(0.5)
        stalled_calls = calls[0]
        assert not handle.done
        store.release(["a0"])
        assert handle.result() == alone(mm, p, "a1", 4, eos=[])
    finally:
        engine.stop()
    assert 1 <= stalled_calls <= 200, stalled_calls  # ~50 at STALL_WAIT_S = 10 ms


@pytest.mark.parametrize("max_bypass", [0, 1, 2])
def test_at_most_max_bypass_requests_overtake_one_waiting_for_a_slot(setup, max_bypass):
    """One slot, two rows: request 1 (a0, long) holds the slot, request 2 (a1) finds none and waits, and requests
    3.. (a0) keep coming. At most ``max_bypass`` of them start before request 2, although every row is busy on most
    steps (the count used to restart whenever the rows ran out before the waiting request was reached: all eight
    overtook it at max_bypass=1). Every request's tokens still equal it alone."""
    weights = {"a0": random_adapter(setup.model, 1), "a1": random_adapter(setup.model, 2)}
    resident = attach(copy.deepcopy(setup.base), max_loras=2, max_rank=8)
    mm = attach(copy.deepcopy(setup.base), max_loras=1, max_rank=8)
    store = AdapterStore(mm)
    for name, w in weights.items():
        resident.load_adapter_weights(name, w)
        store.register(name, w)
    engine = _engine(mm, store=store, max_rows=2, max_bypass=max_bypass)
    position, handles, requests = _overtaking_run(engine, setup.prompts, "a0", "a1")
    assert position == 1 + max_bypass
    for h, r in zip(handles[:3], requests[:3]):
        assert h.tokens == alone(resident, list(r.prompt_ids), r.adapter, r.max_new_tokens, eos=[])


def test_a_hold_released_during_a_failed_acquire_is_waited_for(setup):
    """The slot's holder releases it right after the request's acquire failed: the engine decides from the holders
    the failed acquire saw (NoFreeSlot.held), so the request waits a step and is served. It read store.in_use
    afterwards, found nothing held, and failed the request as one no release could ever serve."""
    mm = attach(copy.deepcopy(setup.base), max_loras=1, max_rank=8)
    store = AdapterStore(mm)
    store.register("a0", random_adapter(mm, 1))
    store.register("a1", random_adapter(mm, 2))
    engine = _engine(mm, store=store)
    store.acquire(["a0"])
    acquire = store.acquire

    def racing_acquire(names):
        try:
            return acquire(names)
        except NoFreeSlot as error:
            assert error.held == ("a0",)
            if store.in_use:
                store.release(["a0"])  # the holder lets go between the failure and the engine's decision
            raise

    store.acquire = racing_acquire
    p = setup.prompts[0]
    handle = engine.submit(p, adapter="a1", max_new_tokens=4, eos_token_ids=())
    engine.run()
    assert handle.finish_reason == "length" and handle.tokens == alone(mm, p, "a1", 4, eos=[])


def test_engine_warns_of_generation_config_it_does_not_apply(setup):
    """A repetition penalty in the model's generation_config: mm.generate applies it even greedy, the engine's
    requests do not; the engine says so when built (the tiny model's own config: no word)."""
    import warnings

    mm = attach(copy.deepcopy(setup.base), max_loras=1, max_rank=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _engine(mm)
    mm.model.generation_config.repetition_penalty = 1.3
    with pytest.warns(RuntimeWarning, match="sets repetition_penalty=1.3, which mm.generate applies") as caught:
        _engine(mm)
    assert caught[0].filename == __file__


def test_adapters_in_use_cannot_be_unloaded_or_replaced(setup):
    """While a request decodes with an adapter (loaded in the model directly, or paged in by the store), unloading
    or hot-swapping it is refused; once the request ends both work. Before, both were accepted and the request went
    on with another adapter's factors (or an empty slot)."""
    mm = setup.model
    engine = _engine(mm)
    handle = engine.submit(setup.prompts[0], adapter="alpha", max_new_tokens=WORK[0][2])
    engine.step()  # admitted: its prompt prefilled
    with pytest.raises(RuntimeError, match="cannot unload adapter 'alpha': 1 in-flight request"):
        mm.unload_adapter("alpha")
    with pytest.raises(RuntimeError, match="cannot replace adapter 'alpha'"):
        mm.load_adapter("alpha", os.path.join(setup.workdir, "beta"), replace=True)
    engine.run()
    assert handle.tokens == setup.want[0] and mm._pins == {}
    slot = mm.adapters["alpha"]
    mm.unload_adapter("alpha")
    assert mm.load_adapter("alpha", os.path.join(setup.workdir, "alpha")) == slot


def test_paging_many_adapters_over_few_slots_equals_resident(setup):
    """16 adapters paged through 3 slots while requests come and go (each request holds its adapter; a request
    whose adapter finds no slot waits) give the tokens the same adapters give resident (all 16 loaded directly)."""
    names = [f"a{i}" for i in range(16)]
    weights = {n: random_adapter(setup.model, seed=100 + i) for i, n in enumerate(names)}
    resident = attach(copy.deepcopy(setup.base), max_loras=16, max_rank=8)
    for n in names:
        resident.load_adapter_weights(n, weights[n])
    paged = attach(copy.deepcopy(setup.base), max_loras=3, max_rank=8)
    store = AdapterStore(paged)
    for n in names:
        store.register(n, weights[n])
    work = [(prompt(3 + (5 * i) % 13, seed=50 + i), names[(7 * i) % 16], 2 + i % 4) for i in range(12)]
    handles = _engine(paged, store=store).generate_many([Request(p, adapter=a, max_new_tokens=m) for p, a, m in work])
    assert [h.tokens for h in handles] == [alone(resident, p, a, m) for p, a, m in work]
    c = store.counters
    assert c.loads >= 12 and c.evictions == c.loads - 3 and store.in_use == {}


def _compiled_frames() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("family", ["qwen3_moe"])  # Dynamo traces it faster than GPT-OSS
@pytest.mark.parametrize("spec", [0, 2], ids=["one-token-steps", "speculative-2"])
def test_compiled_no_recompiles_as_requests_come_and_go(setup, family, spec):
    """compile= (Dynamo with the eager backend: the recompile decisions are Dynamo's, Inductor is not needed to see
    them): capture() compiles the one bucket's step and the prefill at lengths 1 and 2; then requests of new
    lengths, rows, adapters, a chunked prefill and a length-1 prompt compile nothing, with the same tokens (with
    draft tokens too: kept and rejected drafts are data)."""
    torch._dynamo.reset()
    counters.clear()
    draft = _ReferenceDraft(setup.prompts, setup.want) if spec else None
    engine = _engine(setup.model, batch_sizes=(4,), compile={"backend": "eager"}, num_speculative_tokens=spec,
                     draft=draft)
    frames = _compiled_frames()
    assert frames == 3
    with torch._dynamo.config.patch(error_on_recompile=True):
        handles = engine.generate_many([Request(p, adapter=a, max_new_tokens=m)
                                        for p, (_, a, m) in zip(setup.prompts, WORK)])
    assert [h.tokens for h in handles] == setup.want
    assert _compiled_frames() == frames
    torch._dynamo.reset()


# --- GPU -----------------------------------------------------------------------------------------------------------
def _gpu_models(tmp_path, family, max_loras):
    """A tiny float32 model on CUDA attached with the Triton ops (``use_ops=True``), three PEFT adapters."""
    s = build(family, dtype=torch.float32, device=torch.device("cuda"), batch=1, seq_len=4, workdir=str(tmp_path))
    mm = attach(copy.deepcopy(s.base), max_loras=max_loras, max_rank=8, use_ops=True)
    return s, mm


@pytest.mark.gpu
@pytest.mark.parametrize("family, compiled, spec", [
    ("gpt_oss", False, 0),    # eager attention with sinks, sliding window: a dict of masks
    ("gpt_oss", True, 0),     # the compiled step captured (Inductor, one graph per bucket)
    ("qwen3_moe", False, 0),  # SDPA, one boolean mask
    ("gpt_oss", True, 3),     # speculative steps of 1 + 3 tokens a row, captured
])
def test_gpu_captured_engine_equals_each_alone(tmp_path, family, compiled, spec):
    """With CUDA graphs (and the Triton ops) the engine's tokens are those of mm.generate alone, and requests
    coming and going recapture nothing."""
    s, mm = _gpu_models(tmp_path, family, max_loras=4)
    for name in ("alpha", "beta", "gamma"):
        mm.load_adapter(name, str(tmp_path / name))
    prompts = [prompt(n, seed=i) for i, (n, _, _) in enumerate(WORK)]
    want = [alone(mm, p, a, m) for p, (_, a, m) in zip(prompts, WORK)]
    engine = _engine(mm, compile=compiled, num_speculative_tokens=spec,
                     draft=_ReferenceDraft(prompts, want) if spec else None)
    assert engine.graphs.use_graphs and engine.graphs.num_captures == len(engine.graphs.batch_sizes)
    handles = [engine.submit(p, adapter=a, max_new_tokens=m) for p, (_, a, m) in zip(prompts[:3], WORK)]
    engine.step()
    engine.step()
    handles += [engine.submit(p, adapter=a, max_new_tokens=m) for p, (_, a, m) in zip(prompts[3:], WORK[3:])]
    engine.run()
    assert [h.tokens for h in handles] == want
    assert engine.graphs.num_captures == len(engine.graphs.batch_sizes)  # nothing recaptured
    assert not spec or engine.accepted_draft_tokens > 0


@pytest.mark.gpu
def test_gpu_paging_every_step_never_corrupts_a_running_step(tmp_path):
    """200 steps, an adapter load on every one (side-stream copies into slots of finished requests while the
    others' steps are queued): a long request and a stream of short ones, each on its own adapter, all equal their
    tokens with every adapter resident."""
    s, mm = _gpu_models(tmp_path, "gpt_oss", max_loras=4)
    names = [f"a{i}" for i in range(16)]
    weights = {n: random_adapter(mm, seed=200 + i) for i, n in enumerate(names)}
    resident = attach(copy.deepcopy(s.base), max_loras=16, max_rank=8, use_ops=True)
    for n in names:
        resident.load_adapter_weights(n, weights[n])
    store = AdapterStore(mm)
    for n in names:
        store.register(n, weights[n])
    engine = _engine(mm, store=store, max_cache_len=240)
    long = engine.submit(prompt(8, seed=1), adapter=names[0], max_new_tokens=200, eos_token_ids=())
    short = []
    for i in range(200):  # one new short request per step, adapters cycling over the 15 others
        short.append(engine.submit(prompt(4, seed=10 + i), adapter=names[1 + i % 15], max_new_tokens=2,
                                   eos_token_ids=()))
        engine.step()
    engine.run()
    assert store.counters.loads >= 200
    assert long.tokens == alone(resident, prompt(8, seed=1), names[0], 200, eos=[])
    for i, h in enumerate(short):
        assert h.tokens == alone(resident, prompt(4, seed=10 + i), names[1 + i % 15], 2, eos=[]), i


@pytest.mark.parametrize("family, kind", [
    ("gpt_oss", "dict"),     # sliding (window 16) and full layers: a mask per layer type
    ("qwen3_moe", "full"),   # one causal mask
    ("mistral", "sliding"),  # one kind of layer, sliding everywhere (window from the config)
])
def test_row_masks_against_a_loop(family, kind):
    """Per-row masks equal their definition, slot by slot: query at position p sees slots s <= p (and s > p - W on
    sliding layers); additive for eager attention, boolean for SDPA."""
    from moe_lora_compile.graphs.rows import attention_masks, mask_spec
    from moe_lora_compile.models.tiny import tiny_config

    config = tiny_config(family, sliding_window=5) if family == "mistral" else tiny_config(family)
    spec = mask_spec(config, num_slots=24, dtype=torch.float32)
    positions = torch.tensor([[0, 1], [7, 8], [22, 23]])  # rows at different lengths, two queries each
    masks = attention_masks(positions, spec)
    by_type = masks if kind == "dict" else {spec.layer_types[0]: masks}
    assert set(by_type) == ({"sliding_attention", "full_attention"} if kind == "dict" else
                            {"full_attention" if kind == "full" else "sliding_attention"})
    for layer_type, mask in by_type.items():
        window = {"sliding_attention": 16 if family == "gpt_oss" else 5}.get(layer_type)
        assert mask.shape == (3, 1, 2, 24) and mask.dtype == torch.float32
        for b in range(3):
            for q in range(2):
                p = int(positions[b, q])
                for s in range(24):
                    allowed = s <= p and (window is None or s > p - window)
                    assert mask[b, 0, q, s].item() == (0.0 if allowed else torch.finfo(torch.float32).min)
    sdpa = type(spec)(spec.layer_types, spec.windows, spec.num_slots, False, spec.dtype)
    first = attention_masks(positions, sdpa)
    first = first[spec.layer_types[0]] if kind == "dict" else first
    assert first.dtype == torch.bool and torch.equal(first, by_type[spec.layer_types[0]] == 0)


def test_models_per_row_masks_cannot_express_are_refused():
    from moe_lora_compile.graphs.rows import mask_spec
    from moe_lora_compile.models.tiny import tiny_config

    with pytest.raises(ValueError, match="Llama-4 is not supported"):
        mask_spec(tiny_config("llama4"), 8, torch.float32)
    config = tiny_config("qwen3_moe")
    config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="'flash_attention_2' is not supported"):
        mask_spec(config, 8, torch.float32)
    config = tiny_config("gpt_oss", sliding_window=None)
    with pytest.raises(ValueError, match="without a sliding_window"):
        mask_spec(config, 8, torch.float32)


def test_row_inputs_are_checked_on_the_host(setup):
    """Replayed steps read each row's adapter slot unchecked (a slot past the stacks would read out of bounds), so
    set_row and prefill check it, and the draft's length, before staging anything."""
    graphs = _engine(setup.model, num_speculative_tokens=2).graphs
    for bad in (setup.model.max_loras, -2):
        with pytest.raises(ValueError, match="adapter_slot must be -1 or a slot"):
            graphs.set_row(0, token=5, position=3, adapter_slot=bad)
        with pytest.raises(ValueError, match="adapter_slot must be -1 or a slot"):
            graphs.prefill(0, [5, 6], adapter_slot=bad)
    with pytest.raises(ValueError, match="draft: 2 tokens"):
        graphs.set_row(0, token=5, position=3, draft=[1])
    with pytest.raises(RuntimeError, match="set_row"):
        graphs.advance([0], [5])


class _ReferenceDraft:
    """Drafts the reference continuation of each prompt (``want``), with its middle draft token wrong every other
    step of a request: steps with every draft kept, with some kept, and with none (a wrong first one) all occur."""

    def __init__(self, prompts, want, vocab=128):
        self.want = {tuple(p): w for p, w in zip(prompts, want)}
        self.vocab, self.calls = vocab, 0

    def __call__(self, handles, k):
        self.calls += 1
        out = []
        for h in handles:
            ref, i = self.want[tuple(h.prompt)], len(h.tokens)
            draft = [ref[i + j] if i + j < len(ref) else 0 for j in range(k)]
            if (i // 2) % 2:
                wrong = (i // 4) % k  # the first, middle or last draft token
                draft[wrong] = (draft[wrong] + 1) % self.vocab
            out.append(draft)
        return out


@both
def test_speculative_engine_equals_each_alone(setup, family):
    """num_speculative_tokens=3 with drafts right, partly right and wrong: every request gets exactly the tokens
    mm.generate gives it alone (eos and max_new_tokens cutting through a step's kept drafts), in fewer steps than
    one token a step; the counters see drafts kept and drafts rejected."""
    drafter = _ReferenceDraft(setup.prompts, setup.want)
    engine = _engine(setup.model, num_speculative_tokens=3, draft=drafter)
    handles = engine.generate_many([Request(p, adapter=a, max_new_tokens=n)
                                    for p, (_, a, n) in zip(setup.prompts, WORK)])
    assert [h.tokens for h in handles] == setup.want
    plain = _engine(setup.model)
    plain.generate_many([Request(p, adapter=a, max_new_tokens=n) for p, (_, a, n) in zip(setup.prompts, WORK)])
    assert engine.steps < plain.steps and drafter.calls == engine.steps
    assert 0 < engine.accepted_draft_tokens < engine.draft_tokens
    assert engine.idle and sorted(engine._free_rows) == [0, 1, 2, 3]


def test_a_cancel_in_on_token_ends_the_request_there_whatever_the_draft_count(setup):
    """on_token cancels at the request's 3rd token: no token follows it, with one-token steps and with steps that
    accept 3 correct drafts (those went on emitting the rest of the step's accepted tokens)."""
    mm, p = setup.model, setup.prompts[0]
    ref = alone(mm, p, "alpha", 9, eos=[])

    def cancel_at_3(handle, token):
        if len(handle.tokens) == 3:
            handle.cancel()

    for k in (0, 3):
        drafts = dict(num_speculative_tokens=k, draft=_ReferenceDraft([p], [ref])) if k else {}
        engine = _engine(mm, **drafts)
        handle = engine.submit(p, adapter="alpha", max_new_tokens=9, eos_token_ids=(), on_token=cancel_at_3)
        engine.run()
        assert (handle.tokens, handle.finish_reason) == (ref[:3], "cancelled"), k
        assert engine.idle and sorted(engine._free_rows) == [0, 1, 2, 3]


def test_speculative_sampling_and_stops_equal_one_token_steps(setup):
    """The default drafter (prompt lookup), requests sampled with seeds beside greedy ones, an eos and a stop
    sequence: the same tokens and finish reasons as the engine without drafts (sampling position j of a step uses
    the noise of output index len(tokens) + j)."""
    mm, p = setup.model, setup.prompts[1]
    ref = alone(mm, p, "beta", 12, eos=[])
    hot = dict(max_new_tokens=10, temperature=1.3, top_p=0.9, eos_token_ids=())
    requests = [Request(setup.prompts[3], adapter="gamma", seed=7, **hot), Request(p * 2, adapter=None, seed=3, **hot),
                Request(p, adapter="beta", max_new_tokens=12, eos_token_ids=[ref[5]]),
                Request(p, adapter="beta", max_new_tokens=12, eos_token_ids=(), stop=[ref[3:5]]),
                Request(setup.prompts[0], adapter="alpha", max_new_tokens=9)]
    plain = _engine(mm).generate_many(requests)
    expected = [(h.tokens, h.finish_reason) for h in plain]
    assert plain[2].finish_reason == "eos" and plain[3].finish_reason == "stop"
    spec = _engine(mm, num_speculative_tokens=2).generate_many(requests)  # prompt lookup: mostly rejected here
    assert [(h.tokens, h.finish_reason) for h in spec] == expected
    # drafts of the sampled continuations themselves (partly wrong): kept drafts of sampled requests
    longest = {}
    for r, h in zip(requests, plain):
        longest[tuple(r.prompt_ids)] = max(longest.get(tuple(r.prompt_ids), []), h.tokens, key=len)
    engine = _engine(mm, num_speculative_tokens=2, draft=_ReferenceDraft(list(longest), list(longest.values())))
    spec = engine.generate_many(requests)
    assert [(h.tokens, h.finish_reason) for h in spec] == expected and engine.accepted_draft_tokens > 0


def test_malformed_drafts_fail_clearly(setup):
    engine = _engine(setup.model, num_speculative_tokens=2, draft=lambda handles, k: [[1, 2, 3]] * len(handles))
    handle = engine.submit(setup.prompts[0], adapter="alpha", max_new_tokens=4)
    with pytest.raises(RuntimeError, match=r"draft must return \[1, 2\] integer token ids") as info:
        handle.result()  # the step that asked for drafts raises (and fails the live requests)
    assert isinstance(info.value.__cause__, ValueError)
    assert handle.finish_reason == "error" and engine.idle and setup.model._pins == {}
    with pytest.raises(ValueError, match="draft must be callable"):
        _engine(setup.model, num_speculative_tokens=2, draft=[1, 2])
    with pytest.raises(ValueError, match="draft= needs num_speculative_tokens > 0"):  # was never called, silently
        _engine(setup.model, draft=lambda handles, k: [[1] * k] * len(handles))


def test_prompt_lookup_draft():
    """The tokens after the latest earlier occurrence of the longest matching suffix (up to 3 tokens); none: the
    last token repeated; the index follows the request's new tokens."""

    class H:
        def __init__(self, prompt, tokens):
            self.prompt, self.tokens = prompt, tokens

    draft = PromptLookupDraft(max_ngram=3)
    h = H([5, 1, 2, 3, 9, 1, 2, 3, 4, 7, 2, 3], [])
    assert draft([h], 3) == [[4, 7, 2]]  # suffix [7, 2, 3] unseen, [2, 3] last followed by 4
    h.tokens += [4]  # [.., 2, 3, 4]: followed by 7 before
    assert draft([h], 4) == [[7, 2, 3, 4]]
    assert draft([H([8, 6], [])], 2) == [[6, 6]]  # no match
    assert draft([H([1, 2, 1], [])], 3) == [[2, 1, 1]]  # continuation shorter than k: its last token repeated
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDraft(max_ngram=0)


def test_fold_gqa_modes_as_decode_graphs():
    """fold_gqa takes DecodeGraphs' values: "off" / False leave an eager-attention model alone (it used to fold it:
    any non-empty string was true), True / "eager" fold it, "all" (a DecodeGraphs-only mode) and unknown values
    are refused."""
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.graphs.rows import RowGraphs
    from moe_lora_compile.models.attention import FOLDED_GQA
    from moe_lora_compile.models.tiny import tiny_config

    torch.manual_seed(0)
    mm = attach(AutoModelForCausalLM.from_config(tiny_config("gpt_oss")).eval(), max_loras=2, max_rank=4)
    assert mm.model.config._attn_implementation == "eager"
    for off in ("off", False):
        RowGraphs(mm, max_rows=2, max_cache_len=8, fold_gqa=off, log=None)
        assert mm.model.config._attn_implementation == "eager"
    for bad, match in (("all", "DecodeGraphs mode"), ("bogus", "fold_gqa must be")):
        with pytest.raises(ValueError, match=match):
            ServingEngine(mm, max_rows=2, max_cache_len=8, fold_gqa=bad, log=None)
        assert mm.model.config._attn_implementation == "eager"
    RowGraphs(mm, max_rows=2, max_cache_len=8, fold_gqa="eager", log=None)
    assert mm.model.config._attn_implementation == FOLDED_GQA


def test_batch_dependent_rope_is_refused_where_rows_would_change_each_other():
    """transformers' "dynamic" (and "longrope") RoPE rescales from the largest position of the whole batch: past
    max_position_embeddings a padding row (at the scratch positions past max_cache_len) or a longer request changed
    a short request's tokens (max_cache_len=64 = max_position_embeddings, buckets (4,): a request diverged from
    mm.generate at its 8th token). Refused there, naming the limit; below it the engine equals each request alone,
    padding rows included. Static RoPE types are not refused."""
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.graphs.rows import batch_dependent_rope, check_rope
    from moe_lora_compile.models.tiny import tiny_config

    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    config = tiny_config("qwen3_moe", max_position_embeddings=64, rope_parameters=rope)
    torch.manual_seed(0)
    mm = attach(AutoModelForCausalLM.from_config(config).eval(), max_loras=2, max_rank=4)
    mm.load_adapter_weights("a", random_adapter(mm, 1))
    with pytest.raises(ValueError, match=r"RoPE \('dynamic'\) .* <= 64 \(it is 65\), or use DecodeGraphs"):
        ServingEngine(mm, max_rows=4, max_cache_len=64, batch_sizes=(4,), log=None)
    with pytest.raises(ValueError, match=r"<= 64 \(it is 65\)"):  # 63 + 1 draft + 1
        ServingEngine(mm, max_rows=4, max_cache_len=63, batch_sizes=(4,), num_speculative_tokens=1, log=None)
    prompts = [prompt(5, seed=1), prompt(9, seed=2)]
    engine = ServingEngine(mm, max_rows=4, max_cache_len=60, batch_sizes=(4,), log=None)  # two padding rows a step
    handles = engine.generate_many([Request(p, adapter=a, max_new_tokens=12, eos_token_ids=())
                                    for p, a in zip(prompts, ["a", None])])
    assert [h.tokens for h in handles] == [alone(mm, p, a, 12, eos=[]) for p, a in zip(prompts, ["a", None])]
    longrope = tiny_config("qwen3_moe", rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 32})
    assert batch_dependent_rope(longrope) == ("longrope", 32)
    for static in ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32},
                   {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}):
        check_rope(tiny_config("qwen3_moe", max_position_embeddings=64, rope_parameters=static), 1000)
