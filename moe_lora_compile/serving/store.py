"""``AdapterStore``: any number of named adapters over the fixed GPU slots of one :class:`MultiLoRAModel`, paged.

Register adapters by name (a PEFT folder, read and validated on first use or at once with ``preload=True``; or
already-parsed factors, validated at once; :meth:`MultiLoRAModel.parse_adapter`'s result is kept as is, not copied
(unless it must be pinned), so several names can share one host copy). Each is parsed and validated once and kept as one
host copy in the slot dtype (pinned when the model is on CUDA); after a cast of the model (``mm.half()``) a second copy
in the new dtype is made from the first, which stays (a cast back serves the factors unrounded). The model's
``max_loras`` slots are a cache: :meth:`AdapterStore.acquire` returns the slots of a request's adapters, loading the
ones not in a slot from their host copy and evicting the least recently used resident adapter that no in-flight request
holds (through this store, or pinned in ``mm`` by a serving engine that uses it by name); the adapters stay pinned in
their slots until :meth:`AdapterStore.release` (or use :meth:`AdapterStore.use`, a context manager).

Slot writes go through :meth:`MultiLoRAModel.load_adapter_weights`: in place (compiled graphs and captured CUDA
graphs stay valid), under ``mm.lock`` (never between a running forward's id write and its model run). On CUDA the
host-to-device copies run ``non_blocking`` on a side stream: they wait only for the GPU work that last read the slot
(an event recorded when its previous adapter was released), so they overlap the compute already queued; the caller's
current stream then waits for the copies before anything it enqueues next. On the CPU they are plain copies.

Every error (unknown name, a bad folder, every slot held by in-flight requests) is raised before anything changes:
slots, residency, LRU order, in-use counts and counters stay exactly as they were (a folder read before a
:class:`NoFreeSlot` keeps its parsed copy). The one exception is a slot write failing part-way (an internal error,
such as running out of memory): the adapters written before it stay resident, counted as loads and misses, not held.
"Least recently used" counts an adapter as used until its last holder releases it. The store recognizes its own
loads (``mm.slots.writes``): an adapter unloaded from ``mm`` directly, or loaded again there under the same name, is
no longer taken as resident.

With :class:`~moe_lora_compile.graphs.DecodeGraphs` (a prefill resolves names to slots for the whole generation, so
hold the adapters until its last step)::

    store = AdapterStore(mm)
    for name, folder in folders.items():
        store.register(name, folder, preload=True)
    with store.use(names):                       # names: one adapter name (or None) per row
        tokens = graphs.generate(input_ids, adapters=names, max_new_tokens=32)

Adapters the store manages must only be run inside ``acquire``/``release`` (or ``use``): outside it their slot may
be given to another adapter. Adapters loaded into ``mm`` directly (``mm.load_adapter``) keep their slots; the store
pages through the other slots. Once its cache fills every free slot, a later direct load finds none: unregister a
store adapter, or unload one that no request holds from ``mm`` (``mm.unload_adapter(name)``; the store notices).
Use one store per model: a second store sees the first one's adapters as loaded outside it, never evicts them, and
refuses names the other has loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections import OrderedDict
from typing import Iterator, Mapping, Optional, Sequence

import torch

from ..adapters.slots import AdapterWeights
from ..ops.contract import NO_ADAPTER



class NoFreeSlot(RuntimeError):
    """:meth:`AdapterStore.acquire` found no slot: every slot holds an adapter that in-flight requests use.
    ``held``: the names that held slots then (empty: the slots hold adapters loaded into the model outside this
    store, which no release of a request frees)."""

    def __init__(self, message: str, held: Sequence[str] = ()):
        super().__init__(message)
        self.held = tuple(held)


@dataclasses.dataclass
class StoreCounters:
    """What the store did so far (a snapshot from :attr:`AdapterStore.counters`).

    ``hits`` / ``misses``: adapters of an :meth:`~AdapterStore.acquire` that were / were not in a slot (each distinct
    name once per call); ``loads``: slot writes from host copies; ``evictions``: resident adapters dropped to make
    room; ``disk_loads``: folders read and validated; ``load_seconds``: host time of the slot writes (on CUDA the time
    to issue the asynchronous copies, not their transfer); ``parse_seconds``: time reading and validating folders;
    ``bytes_copied``: host-to-slot bytes of the loads (factors only, not the zero padding)."""

    hits: int = 0
    misses: int = 0
    loads: int = 0
    evictions: int = 0
    disk_loads: int = 0
    load_seconds: float = 0.0
    parse_seconds: float = 0.0
    bytes_copied: int = 0


@dataclasses.dataclass(eq=False)
class _Entry:
    path: Optional[str]  # the folder, if registered from one
    weights: Optional[AdapterWeights]  # the host copy once parsed, in the slot dtypes of the model now
    original: Optional[AdapterWeights] = None  # the first host copy: casts of the model start from it, never from a
    # copy cast since (half then float would otherwise serve factors rounded to half)

    def set_weights(self, weights: AdapterWeights) -> None:
        self.weights = weights
        if self.original is None:
            self.original = weights


class AdapterStore:
    """Named adapters paged through the slots of ``mm`` (a :class:`~moe_lora_compile.models.MultiLoRAModel`).

    ``pin_memory``: keep the host copies in pinned memory (default: when the model is on CUDA), so loads are
    asynchronous copies. Thread-safe: one re-entrant lock guards the bookkeeping (taken before ``mm.lock``, never
    after it).
    """

    def __init__(self, mm, *, pin_memory: Optional[bool] = None):
        from ..models.attach import MultiLoRAModel

        if not isinstance(mm, MultiLoRAModel):
            raise TypeError(f"mm must be the MultiLoRAModel that attach(model) returns, got {type(mm).__name__}")
        self.mm = mm
        self.device = mm.token_lora_ids.device
        on_cuda = self.device.type == "cuda"
        self.pin_memory = on_cuda if pin_memory is None else bool(pin_memory)
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True needs CUDA (pinned host memory is page-locked for GPU copies)")
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._lru: OrderedDict[str, int] = OrderedDict()  # resident name -> slot, least recently used first
        self._written: dict[str, int] = {}  # resident name -> mm.slots.writes(slot) right after the store loaded it
        self._in_use: dict[str, int] = {}  # name -> acquire count (only names > 0)
        self._counters = StoreCounters()
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._released: dict[int, torch.cuda.Event] = {}  # slot -> event after the last GPU work that read it

    # --- what is known -------------------------------------------------------------------------------------------
    @property
    def counters(self) -> StoreCounters:
        """A snapshot of the counters."""
        with self._lock:
            return dataclasses.replace(self._counters)

    @property
    def resident(self) -> dict[str, int]:
        """``{name: slot}`` of the store's adapters now in a slot, least recently used first."""
        with self._lock:
            self._sync()
            return dict(self._lru)

    @property
    def in_use(self) -> dict[str, int]:
        """``{name: number of acquires not yet released}`` (names held by in-flight requests)."""
        with self._lock:
            return dict(self._in_use)

    @property
    def registered(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    # --- registering ---------------------------------------------------------------------------------------------
    def register(self, name: str, source, *, preload: bool = False) -> None:
        """Make ``name`` available. ``source``: a PEFT adapter folder (read and validated on first use, or now with
        ``preload=True``) or already-parsed factors (the dict :func:`~moe_lora_compile.adapters.load_peft_adapter`
        returns, ``{module name: ExpertsLoRA | LinearLoRA}``; validated now). Nothing is written to a slot.
        ValueError for a taken name or bad weights, FileNotFoundError for a missing folder; nothing changes then.

        A folder is read under the store's lock (other threads' acquires wait meanwhile): for large adapters served
        to live traffic, preload them before serving."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if not isinstance(source, (str, os.PathLike, Mapping)):
            raise TypeError(f"source must be a PEFT adapter folder (str or os.PathLike) or parsed factors (a dict "
                            f"{{module name: ExpertsLoRA | LinearLoRA}}), got {type(source).__name__}")
        with self._lock:
            self._check_free_name(name)
            if isinstance(source, (str, os.PathLike)):
                entry = _Entry(os.fspath(source), None)
                if os.path.isfile(entry.path):
                    raise ValueError(f"source: {entry.path!r} of {name!r} is a file, not an adapter folder (pass the "
                                     f"folder holding adapter_config.json and adapter_model.safetensors)")
                if not os.path.isdir(entry.path):
                    raise FileNotFoundError(f"source: adapter folder {entry.path!r} of {name!r} does not exist")
                if preload:
                    weights, seconds = self._parse(entry)
                    entry.set_weights(weights)
                    self._counters.disk_loads += 1
                    self._counters.parse_seconds += seconds
            else:
                weights = self.mm.parse_adapter(source)
                if not isinstance(source, AdapterWeights) and not self.pin_memory:
                    weights = weights.cloned()  # the caller's dict may share its tensors: keep a copy of our own
                entry = _Entry(None, None)
                entry.set_weights(self._host_copy(weights))
            self._entries[name] = entry

    def unregister(self, name: str) -> None:
        """Forget ``name`` (its host copy too) and free its slot if it has one. KeyError if unknown, RuntimeError
        while an in-flight request holds it."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a str (one adapter name), got {name!r}")
        with self._lock:
            self._check_known([name])
            if self._in_use.get(name):
                raise RuntimeError(f"adapters: {name!r} is in use by {self._in_use[name]} in-flight request(s); "
                                   f"release it before unregistering")
            self._sync()
            if name in self._lru:
                with self.mm.lock:
                    self.mm.unload_adapter(name)
                self._released.pop(self._lru.pop(name), None)
                del self._written[name]
            del self._entries[name]

    # --- serving -------------------------------------------------------------------------------------------------
    def acquire(self, names: Sequence[Optional[str]]) -> list[int]:
        """The slots of a request's adapters (one name or None per row; None -> ``-1``), loading the ones not in a
        slot and evicting least-recently-used adapters that no in-flight request holds. The adapters stay in their
        slots until :meth:`release` with the same ``names``.

        KeyError for an unknown name; ValueError / FileNotFoundError for a folder that fails to load, or for a name that
        was loaded into the model outside this store; :class:`NoFreeSlot` (a RuntimeError) when the adapters not in a
        slot do not fit in the slots that are free or held by no request. On any error nothing changes (slots,
        residency, LRU order, in-use counts, counters), except that folders read before a :class:`NoFreeSlot` keep their
        parsed host copy (counted in ``disk_loads``): a request waiting for a slot does not re-read them. Held adapters
        are pinned in ``mm``: its unload / replace of them raise until :meth:`release`."""
        wanted = _distinct(names)
        with self._lock:
            self._check_known(wanted)
            prepared: set[str] = set()  # names whose host copy is parsed and checked against mm's dtype
            while True:  # once, unless another thread unloads or replaces a resident name while folders parse
                self._sync()
                missing = [n for n in wanted if n not in self._lru]
                self._refuse_direct_loads(missing)  # before minutes of parsing; checked again under mm.lock below
                # parse first (may fail: nothing changed yet); committed to the entries once all parsed
                parsed, parse_seconds, recast = {}, 0.0, {}
                for n in missing:
                    if n in prepared:
                        continue
                    entry = self._entries[n]
                    if entry.weights is None:
                        parsed[n], seconds = self._parse(entry)
                        parse_seconds += seconds
                    elif (current := self.mm.parse_adapter(entry.weights)) is not entry.weights:
                        # the model was cast since this copy was made (mm.half()): checked and cast again, from the
                        # first copy (a cast back to its dtype serves it unrounded)
                        if entry.original is not entry.weights:
                            current = self.mm.parse_adapter(entry.original)
                        recast[n] = current if current is entry.original else self._host_copy(current)
                prepared.update(missing)
                with self.mm.lock:  # no pin, load or unload in mm between the plan and the writes
                    # what another thread did in mm while the folders parsed: a direct load of a store name is
                    # refused; a direct unload or replace of a resident one makes it no longer the store's (_sync)
                    self._sync()
                    missing = [n for n in wanted if n not in self._lru]
                    self._refuse_direct_loads(missing)
                    for n, weights in {**parsed, **recast}.items():  # kept even if no slot is found below: a
                        self._entries[n].set_weights(weights)  # waiting request does not re-read its folder
                    self._counters.disk_loads += len(parsed)
                    self._counters.parse_seconds += parse_seconds
                    if not set(missing) <= prepared:  # a resident name dropped meanwhile: prepare it, unlocked
                        continue
                    return self._commit(names, wanted, missing)

    def _commit(self, names, wanted: list[str], missing: list[str]) -> list[int]:
        """:meth:`acquire`'s plan and writes, under both locks, every name of ``missing`` prepared."""
        free = self._free_slots()
        evictable = [n for n in self._lru if not self._pinned(n) and n not in wanted]
        if len(missing) > len(free) + len(evictable):
            raise NoFreeSlot(self._full_message(wanted, missing, free),
                             held=[n for n in self._lru if self._pinned(n)])
        plan = []
        for n in missing:
            if free:
                plan.append((n, free.pop(0), None))
            else:
                victim = evictable.pop(0)
                plan.append((n, self._lru[victim], victim))
        # from here on nothing is expected to fail
        c = self._counters
        written = 0
        for n, slot, victim in plan:
            weights = self._entries[n].weights
            start = time.perf_counter()
            try:
                self._write(n, slot, victim, weights)
            except BaseException:  # a slot write failed (out of memory, say): the records follow what mm holds now
                if victim is not None and not self.mm.slots.holds(victim, slot):
                    c.evictions += 1
                c.misses += written  # the adapters written before it stay resident, not held
                self._sync()
                raise
            c.load_seconds += time.perf_counter() - start
            c.loads += 1
            written += 1
            c.bytes_copied += weights.nbytes
            if victim is not None:
                c.evictions += 1
                del self._lru[victim]
                del self._written[victim]
            self._lru[n] = slot
            self._written[n] = self.mm.slots.writes(slot)
        for n in wanted:
            self._lru.move_to_end(n)
            self._in_use[n] = self._in_use.get(n, 0) + 1
            self.mm._pin_adapter(n)  # mm refuses to unload or replace it while held
        c.hits += len(wanted) - len(missing)
        c.misses += len(missing)
        return [NO_ADAPTER if n is None else self._lru[n] for n in names]

    def _refuse_direct_loads(self, missing: Sequence[str]) -> None:
        """ValueError if a store name not in a slot of ours is loaded into ``mm`` directly (mm.load_adapter):
        neither may silently replace the other."""
        direct = [n for n in missing if n in self.mm.adapters]
        if direct:
            raise ValueError(f"adapters: {direct} are loaded into the model outside this store (mm.load_adapter, or "
                             f"another AdapterStore on the same model) under names registered in this store; unload "
                             f"them from the model first")

    def release(self, names: Sequence[Optional[str]]) -> None:
        """End a request's hold on its adapters (the ``names`` given to :meth:`acquire`). On CUDA, later loads into
        their slots wait for the GPU work enqueued on the current stream until now. ValueError (nothing changes)
        for a name that is not held."""
        wanted = _distinct(names)
        with self._lock:
            not_held = [n for n in wanted if not self._in_use.get(n)]
            if not_held:
                raise ValueError(f"adapters: {not_held} are not held by any request (release without acquire?)")
            for n in wanted:
                self._in_use[n] -= 1
                if not self._in_use[n]:
                    del self._in_use[n]
                self.mm._unpin_adapter(n)
                if n in self._lru:  # used until now: the last to be evicted (not when it was acquired)
                    self._lru.move_to_end(n)
                if self._stream is not None and n in self._lru:
                    event = torch.cuda.Event()
                    event.record(torch.cuda.current_stream(self.device))
                    self._released[self._lru[n]] = event

    @contextlib.contextmanager
    def use(self, names: Sequence[Optional[str]]) -> Iterator[list[int]]:
        """``with store.use(names) as slots:`` acquire on entry, release on exit (what was acquired: a change to the
        caller's ``names`` list inside the block does not change what is released)."""
        slots = self.acquire(names)
        held = list(names)
        try:
            yield slots
        finally:
            self.release(held)

    # --- internals -----------------------------------------------------------------------------------------------
    def _check_free_name(self, name: str) -> None:
        if name in self._entries:
            raise ValueError(f"name: adapter {name!r} is already registered; unregister it first")
        if name in self.mm.adapters:
            raise ValueError(f"name: adapter {name!r} is already loaded into the model outside this store (slot "
                             f"{self.mm.adapters[name]}; mm.load_adapter, or another AdapterStore on the same model); "
                             f"unload it there first")

    def _check_known(self, names: Sequence[str]) -> None:
        unknown = [n for n in names if n not in self._entries]
        if unknown:
            raise KeyError(f"adapters: unknown adapter(s) {unknown}; registered: {_some(sorted(self._entries))}")

    def _sync(self) -> None:
        """Drop residency records that the model no longer backs: an adapter unloaded from ``mm`` directly, or its
        slot written since the store's own load (unloaded and loaded again under that name, directly)."""
        loaded = self.mm.adapters
        for n, slot in list(self._lru.items()):
            if loaded.get(n) != slot or self.mm.slots.writes(slot) != self._written[n]:
                del self._lru[n], self._written[n]

    def _pinned(self, name: str) -> bool:
        """Held by an in-flight request: this store's, or a serving engine's that uses it by name in ``mm``."""
        return bool(self._in_use.get(name) or self.mm._pins.get(name))

    def _free_slots(self) -> list[int]:
        used = set(self.mm.adapters.values())
        return [s for s in range(self.mm.max_loras) if s not in used]

    def _host_copy(self, weights: AdapterWeights) -> AdapterWeights:
        """``weights`` in pinned memory when the store pins (already pinned weights are kept, not copied: names
        registered with one pinned :class:`AdapterWeights` share its memory)."""
        return weights.pinned() if self.pin_memory and not _all_pinned(weights) else weights

    def _parse(self, entry: _Entry) -> tuple[AdapterWeights, float]:
        start = time.perf_counter()
        weights = self._host_copy(self.mm.parse_adapter(entry.path))
        return weights, time.perf_counter() - start

    def _full_message(self, wanted, missing, free) -> str:
        """Why ``missing`` (of the request's ``wanted``) find no slot: where each of the slots went."""
        L = self.mm.max_loras
        own = sorted(n for n in self._lru if n in wanted)
        held = sorted(n for n in self._lru if self._pinned(n) and n not in wanted)
        outside = sorted(set(self.mm.adapters) - set(self._lru))
        where = [f"{len(free)} free"]
        if own:
            where.append(f"{len(own)} holding this request's own adapters {_some(own)}")
        if held:
            where.append(f"{len(held)} held by in-flight requests {_some(held)}")
        if outside:
            where.append(f"{len(outside)} loaded into the model outside this store (mm.load_adapter, or another "
                         f"AdapterStore on the same model) {_some(outside)}")
        text = f"adapters: no slot for {missing}: of the {L} slots, {', '.join(where)}"
        if len(wanted) > L - len(outside):
            text += (f"; this request alone uses {len(wanted)} adapters, more than the {L - len(outside)} slots the "
                     f"store can use")
        way = "release finished requests first" if held else "unload adapters loaded outside this store"
        return text + f"; {way}, or attach with a larger max_loras"

    def _write(self, name: str, slot: int, victim: Optional[str], weights: AdapterWeights) -> None:
        """``weights`` into ``slot`` as ``name`` (after evicting ``victim`` from it), under ``mm.lock``."""
        mm = self.mm
        with mm.lock:
            if self._stream is None:
                if victim is not None:
                    mm.unload_adapter(victim)
                mm.load_adapter_weights(name, weights, slot=slot)
                return
            released = self._released.pop(slot, None)
            if released is not None:  # the GPU work that last read this slot comes first
                self._stream.wait_event(released)
            with torch.cuda.stream(self._stream):
                if victim is not None:
                    mm.unload_adapter(victim)
                mm.load_adapter_weights(name, weights, slot=slot, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self._stream)
            torch.cuda.current_stream(self.device).wait_event(ready)  # the caller's next work sees the new slot


def _some(names: list, limit: int = 16) -> str:
    """``names`` as a list, the first ``limit`` of them and a count when there are more (stores of thousands)."""
    if len(names) <= limit:
        return str(names)
    return f"{str(names[:limit])[:-1]}, ... ({len(names)} in all)]"


def _all_pinned(weights: AdapterWeights) -> bool:
    return all(t.is_pinned() for lora in weights.values() for t in vars(lora).values() if t is not None)


def _distinct(names: Sequence[Optional[str]]) -> list[str]:
    """The distinct adapter names of a request, in order (None dropped); TypeError for anything but a list of
    str/None."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise TypeError(f"names must be a list with one adapter name (or None) per row, got {names!r}")
    bad = [n for n in names if n is not None and not isinstance(n, str)]
    if bad:
        raise TypeError(f"names: adapter names must be str or None, got {bad!r}")
    return list(dict.fromkeys(n for n in names if n is not None))
