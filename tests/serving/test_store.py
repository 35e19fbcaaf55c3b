"""AdapterStore: five PEFT adapters paged through two slots of a tiny Qwen3-MoE model.

LRU order of evictions, in-use adapters never evicted, a full cache of in-use adapters refused with nothing changed,
reloads bit-identical to the first load, clear errors (unknown names, bad folders, bad weights) with every slot
buffer and all bookkeeping unchanged, counters that add up, already-parsed factors registered directly, no Dynamo
recompile across paging, and the DecodeGraphs recipe.
"""

import contextlib
import copy
import os
import shutil
import threading

import pytest
import torch
from peft import get_peft_model
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM

from moe_lora_compile.adapters import ExpertsLoRA, LinearLoRA
from moe_lora_compile.graphs import DecodeGraphs
from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config
from moe_lora_compile.serving import AdapterStore, NoFreeSlot

FAMILY = "qwen3_moe"
NAMES = ["a", "b", "c", "d", "e"]
RANKS = [4, 2, 8, 4, 6]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Base model, five adapter folders (different ranks), a corrupt folder, and each adapter's logits from a model
    with all five loaded directly (the truth)."""
    root = tmp_path_factory.mktemp("store")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(FAMILY)).eval()
    paths = {}
    for i, (name, r) in enumerate(zip(NAMES, RANKS)):
        peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(FAMILY, r=r, lora_alpha=2 * r))
        randomize_lora_(peft_model, seed=i)
        paths[name] = str(root / name)
        peft_model.save_pretrained(paths[name])
    bad = str(root / "bad")
    shutil.copytree(paths["a"], bad)
    weights_file = os.path.join(bad, "adapter_model.safetensors")
    with open(weights_file, "r+b") as f:
        f.truncate(os.path.getsize(weights_file) // 2)
    input_ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    truth_mm = attach(copy.deepcopy(base), max_loras=5, max_rank=8)
    truth = {}
    for name in NAMES:
        truth_mm.load_adapter(name, paths[name])
    with torch.no_grad():
        for name in NAMES:
            truth[name] = truth_mm(input_ids, adapters=[name, None], use_cache=False).logits
    return dict(base=base, paths=paths, bad=bad, input_ids=input_ids, truth=truth)


def _store(setup, max_loras=2, preload=False):
    mm = attach(copy.deepcopy(setup["base"]), max_loras=max_loras, max_rank=8)
    store = AdapterStore(mm)
    for name in NAMES:
        store.register(name, setup["paths"][name], preload=preload)
    return mm, store


def _logits(mm, store, setup, names):
    """Logits of the first prompt, once per entry of ``names`` (its adapter), inside ``store.use(names)``."""
    input_ids = setup["input_ids"][:1].expand(len(names), -1)
    with torch.no_grad(), store.use(names):
        return mm(input_ids, adapters=names, use_cache=False).logits


def _snapshot(mm, store):
    """Every slot buffer (cloned) and its identity, the model's name -> slot map and the store's bookkeeping."""
    modules = list(mm.slots.experts_modules.items()) + list(mm.slots.linear_modules.items())
    buffers = {f"{n}.{b}": getattr(m, b) for n, m in modules for b, _ in m.named_buffers(recurse=False)
               if b.startswith("lora_")}
    return dict(values={k: v.clone() for k, v in buffers.items()}, ids={k: id(v) for k, v in buffers.items()},
                adapters=mm.adapters, resident=list(store.resident.items()), in_use=store.in_use,
                counters=store.counters, registered=store.registered)


def _assert_same(before, after):
    assert after["ids"] == before["ids"]
    for key, value in before["values"].items():
        assert torch.equal(after["values"][key], value), key
    for key in ("adapters", "resident", "in_use", "counters", "registered"):
        assert after[key] == before[key], key


def _slot_buffers(mm, slot):
    """One slot's part of every LoRA buffer: the factors' row ``slot``, the ranks' column ``slot`` (experts keep
    ``lora_ranks [2, L]``: w13 and w2 ranks; a fused group's leader ``lora_ranks_fused [n, L]``)."""
    modules = list(mm.slots.experts_modules.values()) + list(mm.slots.linear_modules.values())
    return [(buf[..., slot] if name.startswith("lora_ranks") else buf[slot]).clone()
            for m in modules for name, buf in m.named_buffers(recurse=False) if name.startswith("lora_")]


def test_lru_order_and_counters(setup):
    mm, store = _store(setup)
    assert store.resident == {} and mm.adapters == {}  # registering writes nothing
    for names, resident in [(["a"], {"a": 0}),
                            (["b", None], {"a": 0, "b": 1}),
                            (["a"], {"b": 1, "a": 0}),               # hit: a becomes the most recent
                            (["c"], {"a": 0, "c": 1}),               # evicts b, the least recently used
                            ([None, "d", "d"], {"c": 1, "d": 0}),    # evicts a
                            (["c", "e"], {"c": 1, "e": 0})]:         # c hit, e evicts d
        logits = _logits(mm, store, setup, names)
        assert list(store.resident.items()) == list(resident.items()), names
        assert mm.adapters == resident
        for row, name in enumerate(names):
            if name is not None:
                torch.testing.assert_close(logits[row], setup["truth"][name][0], rtol=1e-5, atol=1e-5)
    c = store.counters
    assert (c.hits, c.misses, c.loads, c.evictions, c.disk_loads) == (2, 5, 5, 3, 5)
    assert c.loads == c.misses and c.evictions == c.loads - mm.max_loras
    expected_bytes = sum(store._entries[n].weights.nbytes for n in ["a", "b", "c", "d", "e"])
    assert c.bytes_copied == expected_bytes > 0
    assert c.load_seconds > 0 and c.parse_seconds > 0
    assert store.in_use == {}


def test_in_use_adapters_are_never_evicted_and_a_full_cache_changes_nothing(setup):
    mm, store = _store(setup, preload=True)
    slots = store.acquire(["a", None])              # a is held from here on (and is the least recently used)
    assert slots == [0, -1]
    assert store.acquire(["b"]) == [1]
    store.release(["b"])
    assert store.acquire(["c"]) == [1]              # evicts b, not the older but held a
    assert store.resident == {"a": 0, "c": 1} and store.in_use == {"a": 1, "c": 1}
    before = _snapshot(mm, store)
    with pytest.raises(RuntimeError, match=r"no slot for \['d'\]: of the 2 slots, 0 free, 2 held by in-flight "
                                           r"requests \['a', 'c'\]"):
        store.acquire(["d"])
    with pytest.raises(RuntimeError, match=r"0 free, 1 holding this request's own adapters \['a'\], 1 held by "
                                           r"in-flight requests \['c'\]; this request alone uses 3 adapters, more "
                                           r"than the 2 slots"):
        store.acquire(["a", "d", "e"])
    _assert_same(before, _snapshot(mm, store))
    # a second hold of a held adapter is a hit and needs no slot
    assert store.acquire(["a"]) == [0]
    store.release(["a"])
    store.release(["c"])
    assert store.acquire(["d"]) == [1]              # c is free now: d takes its slot, a stays
    store.release(["d"])
    store.release(["a", None])
    assert store.in_use == {}
    with pytest.raises(ValueError, match="not held"):
        store.release(["a"])


def test_reload_after_eviction_is_bit_identical(setup):
    mm, store = _store(setup)
    first = _logits(mm, store, setup, ["a", None])
    slot = store.resident["a"]
    first_buffers = _slot_buffers(mm, slot)
    for names in (["b"], ["c"], ["d"]):  # a is evicted on the way
        _logits(mm, store, setup, names)
    assert "a" not in store.resident and store.resident == {"c": slot, "d": 1 - slot}
    again = _logits(mm, store, setup, ["a", None])
    assert store.resident["a"] == slot   # evicts c, the least recently used: the same slot as the first load
    assert torch.equal(again, first)
    assert all(torch.equal(x, y) for x, y in zip(_slot_buffers(mm, slot), first_buffers))
    torch.testing.assert_close(again[0], setup["truth"]["a"][0], rtol=1e-5, atol=1e-5)
    assert store.counters.disk_loads == 4  # a, b, c, d once: the reload came from the host copy, not from disk


def test_errors_leave_everything_intact(setup):
    mm, store = _store(setup)
    store.register("bad", setup["bad"])   # lazily: the folder is read on first use
    with store.use(["a"]):
        pass
    store.acquire(["b"])                  # held
    before = _snapshot(mm, store)
    with pytest.raises(KeyError, match=r"unknown adapter\(s\) \['nope'\]"):
        store.acquire(["c", "nope"])
    with pytest.raises(ValueError, match="adapter_model.safetensors: cannot be read"):
        store.acquire(["c", "bad"])       # parsed before any eviction: a stays, c is not loaded
    with pytest.raises(ValueError, match="adapter_model.safetensors: cannot be read"):
        store.acquire(["bad"])            # would evict a: it does not
    with pytest.raises(FileNotFoundError, match="does not exist"):
        store.register("missing", os.path.join(setup["bad"], "nowhere"))
    with pytest.raises(ValueError, match="already registered"):
        store.register("a", setup["paths"]["c"])
    with pytest.raises(ValueError, match="cannot be read"):
        store.register("bad2", setup["bad"], preload=True)
    with pytest.raises(ValueError, match="not held"):
        store.release(["a"])
    with pytest.raises(RuntimeError, match="in use by 1 in-flight"):
        store.unregister("b")
    with pytest.raises(KeyError):
        store.unregister("nope")
    with pytest.raises(TypeError, match="one adapter name"):
        store.acquire("a")
    weights = mm.parse_adapter(setup["paths"]["c"])
    experts = next(iter(mm.slots.experts_modules))
    broken = dict(weights)
    broken[experts] = ExpertsLoRA(weights[experts].a13[:, :, :-1], weights[experts].b13)
    with pytest.raises(ValueError, match=r"gate_up A has shape \[4, 8, 31\], expected \[4, 'r', 32\]"):
        store.register("broken", broken)
    with pytest.raises(ValueError, match="exceeds max_rank=8"):
        store.register("broken", {experts: ExpertsLoRA(torch.zeros(4, 9, 32), torch.zeros(4, 48, 9))})
    with pytest.raises(ValueError, match="not finite"):
        store.register("broken", {experts: ExpertsLoRA(torch.full((4, 2, 32), float("nan")), torch.zeros(4, 48, 2))})
    with pytest.raises(ValueError, match="not a LoRA target"):
        store.register("broken", {"model.nowhere": LinearLoRA(torch.zeros(2, 32), torch.zeros(32, 2))})
    # weights validated for another model (8 experts) are checked again here, not trusted
    other = attach(AutoModelForCausalLM.from_config(tiny_config(FAMILY, num_experts=8)).eval(), max_loras=1,
                   max_rank=8)
    foreign = other.slots.validate({experts: ExpertsLoRA(torch.zeros(8, 2, 32), torch.zeros(8, 48, 2))})
    with pytest.raises(ValueError, match=r"gate_up A has shape \[8, 2, 32\], expected \[4, 'r', 32\]"):
        store.register("broken", foreign)
    with pytest.raises(ValueError, match="slot 1 holds adapter 'b'"):
        mm.load_adapter_weights("direct", weights, slot=1)
    _assert_same(before, _snapshot(mm, store))
    store.release(["b"])
    store.unregister("bad")
    store.unregister("a")                 # frees its slot (zeroed)
    assert store.resident == {"b": 1} and mm.adapters == {"b": 1}
    assert all(not x.any() for x in _slot_buffers(mm, 0))


def test_already_parsed_weights_register_directly(setup):
    mm, store = _store(setup)
    parsed = mm.parse_adapter(setup["paths"]["c"])   # what load_peft_adapter returns, in the slot dtype
    as_float64 = {name: type(lora)(**{f: None if t is None else t.double() for f, t in vars(lora).items()})
                  for name, lora in parsed.items()}
    store.register("c_parsed", as_float64)            # validated and cast to the slot dtype now
    logits = _logits(mm, store, setup, ["c_parsed", "c"])
    # the same factors in both slots, bit for bit (the logits agree to rounding: the dense expand sums over all
    # slots' rank columns, so a slot's position changes the summation order)
    resident = store.resident
    assert all(torch.equal(x, y) for x, y in zip(_slot_buffers(mm, resident["c_parsed"]),
                                                 _slot_buffers(mm, resident["c"])))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logits[0], setup["truth"]["c"][0], rtol=1e-5, atol=1e-5)
    assert store.counters.disk_loads == 1             # only the folder "c"


def test_adapters_loaded_directly_keep_their_slot(setup):
    mm = attach(copy.deepcopy(setup["base"]), max_loras=2, max_rank=8)
    mm.load_adapter("direct", setup["paths"]["e"])
    store = AdapterStore(mm)
    for name in NAMES[:3]:
        store.register(name, setup["paths"][name])
    with pytest.raises(ValueError, match="loaded into the model outside this store"):
        store.register("direct", setup["paths"]["e"])
    for name in NAMES[:3]:
        assert _logits(mm, store, setup, [name, None]) is not None
        assert mm.adapters["direct"] == 0 and store.resident == {name: 1}
    with store.use(["a"]):
        with pytest.raises(RuntimeError, match=r"no slot for \['b'\]: of the 2 slots, 0 free, 1 held by in-flight "
                                               r"requests \['a'\], 1 loaded into the model outside this store "
                                               r"\(mm.load_adapter, or another AdapterStore on the same model\) "
                                               r"\['direct'\]; release finished requests first"):
            store.acquire(["b"])


def test_no_recompile_across_paging(setup):
    mm, store = _store(setup)
    counter = CompileCounter()
    torch._dynamo.reset()
    original = mm.model.forward
    try:
        mm.model.forward = torch.compile(original, backend=counter, fullgraph=True)
        results = {}
        with torch._dynamo.config.patch(error_on_recompile=True):
            for names in (["a", None], ["b", "a"], ["c", "d"], ["e", None], ["a", "b"], ["d", "c"]):
                results[tuple(names)] = _logits(mm, store, setup, names)
        assert counter.frame_count == 1
        assert store.counters.evictions >= 5
        for names, logits in results.items():
            for row, name in enumerate(names):
                if name is not None and row == 0:
                    torch.testing.assert_close(logits[0], setup["truth"][name][0], rtol=1e-5, atol=1e-5)
    finally:
        mm.model.forward = original
        torch._dynamo.reset()


def test_threads_share_the_store(setup):
    mm, store = _store(setup, max_loras=3, preload=True)
    errors = []

    def worker(seed):
        generator = torch.Generator().manual_seed(seed)
        try:
            for _ in range(6):
                name = NAMES[int(torch.randint(0, len(NAMES), (1,), generator=generator))]
                logits = _logits(mm, store, setup, [name, None])
                torch.testing.assert_close(logits[0], setup["truth"][name][0], rtol=1e-5, atol=1e-5)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.in_use == {}
    c = store.counters
    assert c.hits + c.misses == 18 and c.loads == c.misses


def test_decode_graphs_recipe(setup):
    mm, store = _store(setup)
    graphs = DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=16, capture=False, log=None)
    truth_mm = attach(copy.deepcopy(setup["base"]), max_loras=2, max_rank=8)
    for names in (["a", "b"], ["c", None], ["a", "d"]):
        with store.use(names):
            tokens = graphs.generate(setup["input_ids"], adapters=names, max_new_tokens=4)
        for name in names:
            if name is not None and name not in truth_mm.adapters:
                for old in list(truth_mm.adapters):
                    truth_mm.unload_adapter(old)
                break
        for name in names:
            if name is not None and name not in truth_mm.adapters:
                truth_mm.load_adapter(name, setup["paths"][name])
        expected = truth_mm.generate(setup["input_ids"], adapters=names, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, expected), names


@pytest.mark.gpu
def test_gpu_paging_with_captured_graphs(setup):
    """On CUDA: pinned host copies, side-stream loads, captured decode graphs replayed across evictions give the
    tokens of a model with the adapters loaded directly."""
    device = torch.device("cuda")
    mm = attach(copy.deepcopy(setup["base"]).to(device), max_loras=2, max_rank=8)
    store = AdapterStore(mm)
    for name in NAMES:
        store.register(name, setup["paths"][name], preload=True)
    assert store.pin_memory
    assert all(t.is_pinned() for lora in store._entries["a"].weights.values() for t in vars(lora).values()
               if t is not None)
    graphs = DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=16, log=None).capture()
    assert graphs.captured
    truth_mm = attach(copy.deepcopy(setup["base"]).to(device), max_loras=5, max_rank=8)
    for name in NAMES:
        truth_mm.load_adapter(name, setup["paths"][name])
    input_ids = setup["input_ids"].to(device)
    for names in (["a", "b"], ["c", None], ["d", "e"], ["a", "c"], ["b", "b"], ["e", "a"]):
        with store.use(names):
            tokens = graphs.generate(input_ids, adapters=names, max_new_tokens=4)
        expected = truth_mm.generate(input_ids, adapters=names, max_new_tokens=4, do_sample=False)
        assert torch.equal(tokens, expected), names
    assert store.counters.evictions >= 6 and store.counters.bytes_copied > 0


def test_direct_loads_under_store_names_are_never_taken_for_the_stores_own(setup):
    """Adapters loaded with mm.load_adapter under a name the store also knows: acquire refuses them before anything
    changes (it used to evict a resident adapter first), and a resident adapter unloaded and loaded again directly
    under its name is no longer taken as the store's copy (it used to be served as a hit with the other weights)."""
    mm, store = _store(setup)
    store.acquire(["b"])
    store.release(["b"])
    mm.load_adapter("a", setup["paths"]["c"])  # "a"'s name, "c"'s weights, loaded directly into the free slot
    before = _snapshot(mm, store)
    with pytest.raises(ValueError, match=r"\['a'\] are loaded into the model outside this store"):
        store.acquire(["a"])
    _assert_same(before, _snapshot(mm, store))  # "b" stays resident
    mm.unload_adapter("a")
    store.acquire(["a"])  # the store's own "a" now
    store.release(["a"])
    mm.unload_adapter("a")
    mm.load_adapter("a", setup["paths"]["d"])  # same name, same slot, other weights: written since the store's load
    assert "a" not in store.resident
    with pytest.raises(ValueError, match="loaded into the model outside this store"):
        store.acquire(["a"])
    mm.unload_adapter("a")
    torch.testing.assert_close(_logits(mm, store, setup, ["a"]), setup["truth"]["a"][:1], rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def _race_while_parsing(mm, setup, folder: str, action):
    """Within: mm.parse_adapter runs ``action`` in another thread (and waits for it) after parsing ``folder``."""
    parse = mm.parse_adapter

    def parse_then_race(source):
        out = parse(source)
        if source == setup["paths"][folder]:
            thread = threading.Thread(target=action)
            thread.start()
            thread.join()
        return out

    mm.parse_adapter = parse_then_race
    try:
        yield
    finally:
        del mm.parse_adapter  # the class's method again


def test_a_direct_load_while_acquire_parses_changes_nothing(setup):
    """Another thread loads a store name into mm directly while acquire parses a folder: acquire raises before it
    writes anything. It checked for direct loads only before parsing, so its writes raised half-way: the first
    adapter written and resident, loads counted, hits / misses not."""
    mm, store = _store(setup, max_loras=3)
    before = _snapshot(mm, store)
    # "b" loaded directly from another thread, between parse and plan
    with _race_while_parsing(mm, setup, "a", lambda: mm.load_adapter("b", setup["paths"]["c"])), \
            pytest.raises(ValueError, match=r"\['b'\] are loaded into the model outside this store"):
        store.acquire(["a", "b"])
    after = _snapshot(mm, store)
    assert after["resident"] == before["resident"] == [] and after["counters"] == before["counters"]
    assert store.in_use == {} and set(mm.adapters) == {"b"}
    mm.unload_adapter("b")
    torch.testing.assert_close(_logits(mm, store, setup, ["a", "b"]),
                               torch.cat([setup["truth"]["a"][:1], setup["truth"]["b"][:1]]), rtol=1e-5, atol=1e-5)


def test_a_direct_unload_while_acquire_parses(setup):
    """Another thread unloads a resident, unheld store adapter from mm directly while acquire parses folders: the
    freed slot serves the request. The store re-read mm only before parsing, so its plan gave that slot twice (free,
    and as the unloaded adapter's) and acquire died half-way with a KeyError for an adapter nobody asked for, one
    adapter written and its load counted."""
    mm, store = _store(setup, max_loras=2)
    store.acquire(["a", "b"])
    store.release(["a", "b"])
    with _race_while_parsing(mm, setup, "c", lambda: mm.unload_adapter("a")):
        slots = store.acquire(["c", "d"])  # c into a's freed slot, d evicts b
    assert sorted(slots) == [0, 1] and set(store.resident) == {"c", "d"} and set(mm.adapters) == {"c", "d"}
    assert store.in_use == {"c": 1, "d": 1}
    counters = store.counters
    assert (counters.loads, counters.evictions, counters.misses, counters.hits) == (4, 1, 4, 0)
    store.release(["c", "d"])
    torch.testing.assert_close(_logits(mm, store, setup, ["c", "d"]),
                               torch.cat([setup["truth"]["c"][:1], setup["truth"]["d"][:1]]), rtol=1e-5, atol=1e-5)


def test_a_direct_replace_while_acquire_parses_is_kept(setup):
    """Another thread hot-swaps a resident, unheld store adapter in mm directly (replace=True) while acquire parses:
    the name is the user's direct load from then on, never evicted by the store (as without the race: NoFreeSlot
    with one slot). The store evicted it as its own, and the user's load was gone without a word."""
    mm, store = _store(setup, max_loras=1)
    store.acquire(["a"])
    store.release(["a"])
    with _race_while_parsing(mm, setup, "b", lambda: mm.load_adapter("a", setup["paths"]["c"], replace=True)), \
            pytest.raises(NoFreeSlot):
        store.acquire(["b"])
    assert mm.adapters == {"a": 0} and store.resident == {} and store.in_use == {}
    with torch.no_grad():  # still the user's adapter: c's weights under the name a
        torch.testing.assert_close(mm(setup["input_ids"][:1], adapters=["a"], use_cache=False).logits,
                                   setup["truth"]["c"][:1], rtol=1e-5, atol=1e-5)


def test_held_adapters_are_pinned_in_the_model(setup):
    """acquire pins (mm refuses to unload or replace the adapter), release unpins; a waiting request's folder is read
    once however often it finds no slot."""
    mm, store = _store(setup, max_loras=1)
    store.acquire(["a"])
    with pytest.raises(RuntimeError, match="cannot unload adapter 'a'"):
        mm.unload_adapter("a")
    with pytest.raises(RuntimeError, match="cannot replace adapter 'a'"):
        mm.load_adapter("a", setup["paths"]["b"], replace=True)
    for _ in range(3):
        with pytest.raises(NoFreeSlot):
            store.acquire(["b"])
    assert store.counters.disk_loads == 2  # a, then b once (kept while it waits)
    store.release(["a"])
    assert mm._pins == {} and store.acquire(["b"]) == [0] and store.counters.disk_loads == 2
    store.release(["b"])


def _scaled_copy(src, dst, factor):
    """A copy of the adapter folder ``src`` with every lora_B times ``factor``."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    save_file({k: v * factor if "lora_B" in k else v for k, v in load_file(path).items()}, path)
    return str(dst)


# (how the adapter is registered, lora_B scale, error expected): host copies parsed for fp32 slots, then mm.half().
HOST_COPY_THEN_CAST = [
    # a folder read at register (preload): B of 2e5 is past fp16's range (it was written as Inf)
    pytest.param("preload", 2e5, True, id="preloaded-folder-overflows-fp16"),
    # mm.parse_adapter's result registered as is (kept, not copied)
    pytest.param("parsed", 2e5, True, id="parsed-weights-overflow-fp16"),
    # fits fp16: loaded as a fresh fp16 load would be, and the host copy is kept in fp16 from then on
    pytest.param("preload", 1.0, False, id="preloaded-folder-fits-fp16"),
]


@pytest.mark.parametrize("how,scale,fails", HOST_COPY_THEN_CAST)
def test_host_copies_are_checked_again_after_the_model_is_cast(setup, tmp_path, how, scale, fails):
    """The store's host copies are in the slot dtype of their parse; after ``mm.half()`` an acquire casts and checks
    them again (the error a fresh load of the folder gives, nothing changed) and keeps the cast copy."""
    path = _scaled_copy(setup["paths"]["a"], tmp_path / "scaled", scale)
    mm = attach(copy.deepcopy(setup["base"]), max_loras=2, max_rank=8)
    store = AdapterStore(mm)
    if how == "preload":
        store.register("s", path, preload=True)
    else:
        store.register("s", mm.parse_adapter(path))
    store.register("b", setup["paths"]["b"])
    mm.half()
    fresh = attach(copy.deepcopy(setup["base"]).half(), max_loras=2, max_rank=8)
    if fails:
        with pytest.raises(ValueError) as want:
            fresh.load_adapter("s", path)
        with store.use(["b"]):
            pass
        before = _snapshot(mm, store)
        with pytest.raises(ValueError) as got:
            store.acquire(["s"])
        assert str(got.value) == str(want.value)
        _assert_same(before, _snapshot(mm, store))
        return
    with store.use(["s"]):
        slot = store.resident["s"]
    fresh.load_adapter("s", path)
    assert all(torch.equal(x, y) for x, y in zip(_slot_buffers(mm, slot), _slot_buffers(fresh, 0)))
    host = store._entries["s"].weights
    assert all(t.dtype == torch.float16 for lora in host.values() for t in vars(lora).values() if t is not None)
    with store.use(["b"]), store.use(["s"]):  # acquired again: the kept copy is not cast again
        assert store._entries["s"].weights is host


def test_a_failed_slot_write_leaves_the_counters_as_they_were(setup, monkeypatch):
    """A slot write that fails (here: mm.load_adapter_weights raising) changes nothing, counters included: hits and
    misses were counted before the writes."""
    mm, store = _store(setup, preload=True)
    with store.use(["a"]):
        pass
    before = _snapshot(mm, store)

    def fail(*args, **kwargs):
        raise RuntimeError("write failed")

    monkeypatch.setattr(mm, "load_adapter_weights", fail)
    with pytest.raises(RuntimeError, match="write failed"):
        store.acquire(["a", "b"])  # a: a hit, b: a miss into the free slot 1
    _assert_same(before, _snapshot(mm, store))
    monkeypatch.undo()
    assert store.acquire(["a", "b"]) == [0, 1]
    c = store.counters
    assert (c.hits, c.misses, c.loads) == (1, 2, 2)
    store.release(["a", "b"])


def _rank0(mm):
    """Factors of rank 0 for every dense module (shapes right, no LoRA in them)."""
    return {name: LinearLoRA(torch.zeros(0, m.in_features), torch.zeros(m.out_features, 0))
            for name, m in mm.slots.linear_modules.items()}


@pytest.mark.parametrize("make", [
    pytest.param(lambda mm: {n: ExpertsLoRA() for n in mm.slots.experts_modules}, id="experts-pairs-all-None"),
    pytest.param(lambda mm: {n: LinearLoRA(None, None) for n in mm.slots.linear_modules}, id="dense-pairs-None"),
    pytest.param(_rank0, id="rank-0-factors"),
])
def test_factors_without_lora_are_refused(setup, make):
    """Parsed factors with no pair of rank >= 1 would serve the base model under the adapter's name (as the empty
    dict, refused before): refused by register and by mm.load_adapter_weights, nothing registered or loaded."""
    mm, store = _store(setup)
    with pytest.raises(ValueError, match="no LoRA factors of rank >= 1"):
        store.register("empty", make(mm))
    with pytest.raises(ValueError, match="no LoRA factors of rank >= 1"):
        mm.load_adapter_weights("empty", make(mm))
    assert "empty" not in store and "empty" not in mm.adapters


def test_use_releases_what_it_acquired_when_the_callers_list_changes(setup):
    """``store.use(names)`` releases the names it acquired: a caller editing its list inside the block released the
    edited list (a ValueError for a name not held) and left the acquired adapters held for good."""
    mm, store = _store(setup, preload=True)
    names = ["a"]
    with store.use(names):
        names[0] = "b"
    assert store.in_use == {} and mm._pins == {}
    assert store.acquire(["b", "c"]) == [1, 0]  # both slots free to take: a is held by nobody
    store.release(["b", "c"])


def test_a_cast_and_back_serves_the_first_copy_unrounded(setup):
    """mm.half() then mm.float(): an adapter paged in again is the folder's fp32 factors, not the fp16 copy widened
    (bit-identical slots to a fresh load into the same model), as are the logits."""
    mm, store = _store(setup, max_loras=1, preload=True)
    for name in ("a", "b"):  # a paged in as fp32, then evicted by b
        with store.use([name]):
            pass
    mm.half()
    for name in ("a", "b"):  # a paged in as fp16 (a miss: its host copy cast), then evicted by b
        with store.use([name]):
            pass
    mm.float()
    logits = _logits(mm, store, setup, ["a"])
    fresh = attach(copy.deepcopy(setup["base"]).half().float(), max_loras=1, max_rank=8)
    fresh.load_adapter("a", setup["paths"]["a"])
    assert all(torch.equal(x, y) for x, y in zip(_slot_buffers(mm, 0), _slot_buffers(fresh, 0)))
    with torch.no_grad():
        want = fresh(setup["input_ids"][:1], adapters=["a"], use_cache=False).logits
    assert torch.equal(logits, want)


def test_least_recently_used_counts_until_release(setup):
    """A long request on a, a short one on b that ends first, then a's ends: the next miss evicts b (the adapter used
    longest ago), not a (acquired first, used until just now)."""
    mm, store = _store(setup, preload=True)
    store.acquire(["a"])
    with store.use(["b"]):
        pass
    store.release(["a"])
    with store.use(["c"]):
        pass
    assert store.resident == {"a": 0, "c": 1}
    assert store.counters.evictions == 1


def test_a_slot_write_failing_part_way_keeps_records_and_counters_true(setup, monkeypatch):
    """The second of two writes fails after its eviction: the first adapter stays resident and counts as a load and
    a miss, the evicted one counts as an eviction, the store's records match the model, nothing is held; the store
    serves correctly after."""
    mm, store = _store(setup, preload=True)
    with store.use(["a"]):
        pass
    real = mm.load_adapter_weights

    def fail_for_c(name, *args, **kwargs):
        if name == "c":
            raise RuntimeError("write failed")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(mm, "load_adapter_weights", fail_for_c)
    with pytest.raises(RuntimeError, match="write failed"):
        store.acquire(["b", "c"])  # b into the free slot 1, c evicts a from slot 0 and fails
    monkeypatch.undo()
    assert store.resident == mm.adapters == {"b": 1}
    c = store.counters
    assert (c.loads, c.misses, c.evictions) == (2, 2, 1) and store.in_use == {} and mm._pins == {}
    logits = _logits(mm, store, setup, ["c", "b"])
    torch.testing.assert_close(logits[0], setup["truth"]["c"][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1], setup["truth"]["b"][0], rtol=1e-5, atol=1e-5)


def test_bad_store_arguments_are_named(setup):
    mm, store = _store(setup)
    with pytest.raises(TypeError, match="MultiLoRAModel that attach"):
        AdapterStore(setup["base"])                      # the transformers model, not attach's result
    with pytest.raises(TypeError, match="MultiLoRAModel that attach"):
        AdapterStore(None)
    file = os.path.join(setup["paths"]["a"], "adapter_model.safetensors")
    with pytest.raises(ValueError, match="is a file, not an adapter folder"):
        store.register("f", file)                        # the weights file instead of its folder
    with pytest.raises(TypeError, match="source must be a PEFT adapter folder"):
        store.register("n", 42)
    with pytest.raises(TypeError, match="name must be a str"):
        store.unregister(["a"])                          # a list where one name goes
    assert ["a"] not in store and "a" in store
    for i in range(40):
        store.register(f"extra{i}", setup["paths"]["a"])
    with pytest.raises(KeyError, match=r"\.\.\. \(45 in all\)") as error:
        store.acquire(["nope"])
    assert len(str(error.value)) < 400                   # the first names and a count, not all of them
    assert store.registered[:5] == NAMES and "f" not in store and "n" not in store
