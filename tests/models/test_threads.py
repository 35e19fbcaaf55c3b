"""Concurrent use of one MultiLoRAModel from several threads: serialized by ``mm.lock`` (documented on the class).

Two threads running forwards with different adapter lists each get exactly their single-threaded logits; a hot swap
(``load_adapter(replace=True)``) racing with forwards gives each forward exactly one of the two adapters. The GIL's
switch interval is shortened so that the threads really interleave inside a forward.
"""

import copy
import sys
import threading

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(FAMILY)).eval()
    paths = {}
    for i, name in enumerate(("a", "b")):
        peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(FAMILY)).eval()
        randomize_lora_(peft_model, std=0.5, seed=i)
        paths[name] = tmp_path_factory.mktemp(name)
        peft_model.save_pretrained(paths[name])
    mm = attach(copy.deepcopy(base), max_loras=2, max_rank=8)
    for name, path in paths.items():
        mm.load_adapter(name, path)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    return mm, paths, ids


@pytest.fixture
def fast_switching():
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def _run_threads(*targets):
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported in the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _logits(mm, ids, adapters):
    with torch.no_grad():
        return mm(ids, adapters=adapters, use_cache=False).logits


def test_two_threads_with_different_adapter_lists_get_their_own_results(setup, fast_switching):
    mm, _, ids = setup
    mixes = (["a", None], [None, "b"])
    alone = [_logits(mm, ids, mix) for mix in mixes]
    assert not torch.allclose(alone[0], alone[1], atol=1e-3)
    wrong = []

    def worker(i):
        def run():
            for _ in range(15):
                got = _logits(mm, ids, mixes[i])
                if not torch.allclose(got, alone[i], atol=1e-5, rtol=1e-5):
                    wrong.append(i)
        return run

    _run_threads(worker(0), worker(1))
    assert not wrong, f"{len(wrong)} of 30 concurrent forwards got another thread's adapters"


def test_hot_swap_during_forwards_gives_exactly_one_adapter(setup, fast_switching):
    mm, paths, ids = setup
    mm.load_adapter("a", paths["a"], replace=True)
    with_a = _logits(mm, ids, ["a", "a"])
    with_b = _logits(mm, ids, ["b", "b"])
    results = []

    def forwards():
        for _ in range(15):
            results.append(_logits(mm, ids, ["a", "a"]))

    def swaps():
        for i in range(6):
            mm.load_adapter("a", paths["b" if i % 2 == 0 else "a"], replace=True)

    try:
        _run_threads(forwards, swaps)
    finally:
        mm.load_adapter("a", paths["a"], replace=True)
    mixed = [i for i, r in enumerate(results)
             if not (torch.allclose(r, with_a, atol=1e-5, rtol=1e-5) or torch.allclose(r, with_b, atol=1e-5, rtol=1e-5))]
    assert not mixed, f"forwards {mixed} saw a half-swapped adapter"


def test_a_direct_model_call_waits_for_a_running_call_and_runs_without_adapters(setup):
    """mm.model(...) called directly while another thread's mm.generate is between two of its forwards: it read that
    call's adapter list (its rows got adapter a) and wrote the shared id buffers the running call reads. It now
    takes mm.lock (waits), runs every row without an adapter, and the running call's tokens are its own."""
    from transformers import LogitsProcessor, LogitsProcessorList

    mm, _, ids = setup
    inside, release = threading.Event(), threading.Event()

    class Pause(LogitsProcessor):  # holds generate between two of its forwards
        def __call__(self, input_ids, scores):
            inside.set()
            release.wait(timeout=30)
            return scores

    with torch.no_grad():
        want_generate = mm.generate(ids, adapters=["a", "b"], max_new_tokens=3, do_sample=False)
        other = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(5))
        want_direct = mm(other).logits  # no adapter
    got = {}

    def run_generate():
        with torch.no_grad():
            got["generate"] = mm.generate(ids, adapters=["a", "b"], max_new_tokens=3, do_sample=False,
                                          logits_processor=LogitsProcessorList([Pause()]))

    def run_direct():
        with torch.no_grad():
            got["direct"] = mm.model(other).logits

    generating = threading.Thread(target=run_generate)
    generating.start()
    assert inside.wait(timeout=30)
    direct = threading.Thread(target=run_direct)
    direct.start()
    direct.join(timeout=0.5)
    waited = direct.is_alive()
    release.set()
    generating.join(timeout=60)
    direct.join(timeout=60)
    assert waited  # it ran only after the generate call ended
    assert torch.equal(got["generate"], want_generate)
    assert torch.equal(got["direct"], want_direct)
    assert mm.lock.acquire(blocking=False)  # released after the direct call
    mm.lock.release()
