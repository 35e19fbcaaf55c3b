"""``ServingEngine``: continuous batching of requests, each with its own prompt, adapter, sampling and stop condition.

Requests join and leave between decode steps. Each engine step (:meth:`ServingEngine.step`):

1. launches one decode step of every running request (:class:`~moe_lora_compile.graphs.rows.RowGraphs`: one CUDA
   graph per bucket; each row's token, position and adapter slot are data) and its sampling, without waiting;
2. admits waiting requests (arrival order) into free cache rows, acquiring their adapters from the
   :class:`~moe_lora_compile.serving.AdapterStore`: an adapter not in a slot is copied in on the store's side stream
   while the step computes (into a slot no live request holds, after the GPU work that last read it); a request
   whose adapter finds no slot waits, and at most ``max_bypass`` later requests that need a slot overtake it (then
   only requests without an adapter do, until it gets one). Under ``schedule="grouped"`` at most ``max_bypass``
   requests of the live adapter overtake the oldest waiting request of another adapter; then the group drains and
   that request's adapter is next;
3. launches up to ``prefill_chunk`` prompt tokens of the admitted requests (a long prompt takes several steps, so
   the running requests keep decoding beside it; the prefill waits on the GPU for its adapter's copy);
4. waits for the step's tokens (a host sync), streams them, and retires finished requests (row freed, adapter
   released); then samples the first token of each prompt prefilled to its end (a second sync): those requests
   decode from the next step on.

Speculative decoding (``num_speculative_tokens = k > 0``): each decode step feeds every running request its last
token and ``k`` draft tokens (``draft``: a callable, default :class:`~moe_lora_compile.serving.drafts.PromptLookupDraft`),
samples all ``1 + k`` positions with the request's own settings (position ``j`` with the noise of output index
``len(tokens) + j``) and keeps the drafts up to the first one that differs from the sampled token, plus that token:
exactly the tokens of one-token steps (greedy or seeded sampling alike), in fewer steps when drafts hit.

Why not transformers' continuous batching (``generate_batch`` / ``init_continuous_batching``)? Its batches are packed
(all requests' tokens flattened into one ``[1, T]`` sequence), and nothing in it carries per-request data to the
model: per-token adapter ids would have to be written by its private batch-preparation code
(``ContinuousBatchingIOs.prepare_batch_tensors`` in 5.24, no extension point, and in its asynchronous mode batch
``n+1`` is prepared while batch ``n`` runs), and our dense LoRA layers map a ``[1, T, H]`` input to the adapter of
sequence 0. It also samples every request with one setting. So the engine runs our own per-row decode steps instead.

Usage::

    engine = ServingEngine(mm, store, max_rows=16, max_cache_len=2048)   # captures the graphs (CUDA) first
    handle = engine.submit(prompt_ids, adapter="sql", max_new_tokens=64)
    for token in handle: ...              # streams (drives the engine, or waits for engine.start()'s thread)
    handles = engine.generate_many([Request(p, adapter=a) for p, a in work])   # blocking
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import math
import numbers
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Callable, Iterator, Optional, Union

import torch

from ..graphs.common import greedy_processors, validated_draft
from ..graphs.rows import RowGraphs
from ..ops.contract import NO_ADAPTER
from .drafts import PromptLookupDraft
from .sampling import sample
from .store import AdapterStore, NoFreeSlot

FINISH_REASONS = ("length", "eos", "stop", "cancelled", "error")

# Engines whose thread runs: stopped at interpreter exit (after their current step). A daemon thread still inside a
# step when the interpreter finalizes aborted the process (SIGABRT, "terminate called without an active exception")
# for a script that ended without stop().
_STARTED: "weakref.WeakSet[ServingEngine]" = weakref.WeakSet()


@atexit.register
def _stop_started_engines() -> None:
    for engine in list(_STARTED):
        engine.stop()


# Requests wait and none is live (their adapters find no slot: every one is held outside the engine, e.g. by a
# DecodeGraphs batch through the store): no step of ours can change that, only a release elsewhere. The stepping
# thread then waits this long between steps (a submit or cancel wakes it at once) instead of spinning a core.
STALL_WAIT_S = 0.01


@dataclasses.dataclass
class Request:
    """One generation request.

    ``prompt_ids``: token ids (a list or a 1-D tensor); ``adapter``: a name (in the engine's store, or loaded into the
    model directly) or None for the base model; ``max_new_tokens``; sampling: ``temperature`` (0 = greedy),
    ``top_p`` (1 = off), ``top_k`` (0 = off), ``seed`` (None: drawn from torch's default generator at submit, when
    ``temperature > 0``);
    stopping: ``eos_token_ids`` (None: the model's generation config; ``()``: none), ``stop`` (token sequences; the
    request ends after the first one it generates, which stays in its tokens), and ``max_new_tokens``;
    ``on_token(handle, token)``: called from the engine's thread for every new token, holding the engine's lock
    (:meth:`~ServingEngine.submit` from other threads waits for it: keep it short) (inside a step: waiting for a
    handle, :meth:`~ServingEngine.generate_many`, :meth:`~ServingEngine.step` and :meth:`~ServingEngine.run` raise
    there; :meth:`~ServingEngine.stop` only signals)."""

    prompt_ids: Sequence[int]
    adapter: Optional[str] = None
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    eos_token_ids: Optional[Sequence[int]] = None
    stop: Sequence[Sequence[int]] = ()
    on_token: Optional[Callable[["RequestHandle", int], None]] = None


class RequestHandle:
    """A submitted request: its new ``tokens`` so far, ``finish_reason`` (one of :data:`FINISH_REASONS`, None while
    live), ``error`` (for ``"error"``), and host timestamps (``time.perf_counter()``): ``submitted_at``,
    ``first_token_at``, ``token_times`` (one per token). Iterating streams the tokens; :meth:`result` blocks."""

    def __init__(self, engine: "ServingEngine", request: Request, prompt: list[int], eos: frozenset, stop: tuple,
                 seed: int):
        self.engine, self.request, self.id = engine, request, None  # the id is given when queued
        self.prompt, self.eos, self.stop, self.seed = prompt, eos, stop, seed
        self.tokens: list[int] = []
        self.finish_reason: Optional[str] = None
        self.error: Optional[BaseException] = None
        self.submitted_at = time.perf_counter()
        self.first_token_at: Optional[float] = None
        self.token_times: list[float] = []
        self._cancel = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        """End the request (``finish_reason="cancelled"``): at its next token, or at the next engine step if it gets
        none before (waiting, prefilling). No token follows the one whose ``on_token`` cancels it, however many
        tokens a speculative step accepted."""
        self._cancel = True
        with self.engine._cond:
            self.engine._cond.notify_all()  # a stalled engine steps now

    def __iter__(self) -> Iterator[int]:
        seen = 0
        while True:
            self.engine._wait(lambda: len(self.tokens) > seen or self.done)
            while seen < len(self.tokens):
                seen += 1
                yield self.tokens[seen - 1]
            if self.done and seen == len(self.tokens):
                self._raise()
                return

    def result(self) -> list[int]:
        """The new tokens, once finished (drives the engine, or waits for its thread); re-raises an engine error."""
        self.engine._wait(lambda: self.done)
        self._raise()
        return list(self.tokens)

    def _raise(self) -> None:
        if self.finish_reason == "error":
            raise RuntimeError(f"request {self.id} failed: {self.error!r}") from self.error

    def __repr__(self) -> str:
        state = self.finish_reason or "live"
        return f"RequestHandle(id={self.id}, adapter={self.request.adapter!r}, tokens={len(self.tokens)}, {state})"


class RequestsFailed(RuntimeError):
    """:meth:`ServingEngine.generate_many`: some requests failed. ``handles``: every request's handle, in order (the
    others finished: their tokens are there); ``failed``: the handles that ended with ``"error"``."""

    def __init__(self, message: str, handles: list[RequestHandle]):
        super().__init__(message)
        self.handles = handles
        self.failed = [h for h in handles if h.finish_reason == "error"]


@dataclasses.dataclass(eq=False)
class _Live:
    """Engine-side state of an admitted request."""

    handle: RequestHandle
    row: int
    slot: int
    held: bool  # an adapter acquired from the store (released when the request ends)
    prefilled: int = 0


class ServingEngine:
    """Continuous batching over :class:`~moe_lora_compile.graphs.rows.RowGraphs` of ``mm``.

    ``store``: the :class:`AdapterStore` that adapter names resolve through (names loaded into ``mm`` directly work
    too, without paging); ``max_rows``: requests decoding at once; ``max_cache_len``: prompt + new tokens per request
    (a request needs ``len(prompt) + max_new_tokens - 1`` slots); ``batch_sizes``, ``prefill_chunk``, ``capture``,
    ``compile``, ``compile_prefill``, ``fold_gqa``, ``attention``, ``pad_token_id``, ``log``: as in :class:`RowGraphs`
    (its graphs are captured here); ``schedule``: ``"mixed"`` (any adapters side by side) or ``"grouped"`` (one
    adapter at a time, the baseline of a one-adapter server such as plain PEFT: the adapter of the oldest waiting
    request, admitted until ``max_bypass`` of its requests overtook an older one of another adapter; then the group
    drains and that adapter is next);
    ``max_bypass``: see the module docstring (default ``max_rows``); ``num_speculative_tokens``, ``draft``: see the
    module docstring (``draft(handles, k) -> [len(handles), k]`` token ids; counters ``draft_tokens`` and
    ``accepted_draft_tokens``).

    Threads: :meth:`submit` is thread-safe; the steps run in one thread at a time: the caller's (iterating a handle,
    :meth:`result`, :meth:`generate_many` or :meth:`run` drive them) or the engine's own after :meth:`start`.
    """

    def __init__(self, mm, store: Optional[AdapterStore] = None, *, max_rows: int = 8, max_cache_len: int = 1024,
                 batch_sizes: Optional[Sequence[int]] = None, prefill_chunk: int = 512,
                 capture: Optional[bool] = None, compile=False, compile_prefill: bool = True,
                 fold_gqa: Union[bool, str] = True, schedule: str = "mixed", max_bypass: Optional[int] = None,
                 log: Optional[Callable[[str], None]] = print, attention: str = "default",
                 num_speculative_tokens: int = 0, draft: Optional[Callable] = None,
                 pad_token_id: Optional[int] = None):
        if store is not None and store.mm is not mm:
            raise ValueError("store: the AdapterStore serves another model (store.mm is not mm)")
        if not isinstance(max_rows, int) or isinstance(max_rows, bool) or max_rows < 1:  # (max_bypass's default)
            raise ValueError(f"max_rows must be an int >= 1, got {max_rows!r}")
        max_bypass = max_rows if max_bypass is None else max_bypass
        if not isinstance(max_bypass, int) or isinstance(max_bypass, bool) or max_bypass < 0:
            raise ValueError(f"max_bypass must be an int >= 0, got {max_bypass!r}")
        if draft is not None and not callable(draft):
            raise ValueError(f"draft must be callable (handles, k) -> [len(handles), k] token ids, got {draft!r}")
        if draft is not None and num_speculative_tokens == 0:  # as DecodeGraphs.generate refuses it
            raise ValueError("draft= needs num_speculative_tokens > 0 (the steps verify k drafts a row); with 0 "
                             "it would never be called")
        self.mm, self.store, self.max_bypass = mm, store, max_bypass
        self.schedule = schedule
        self.graphs = RowGraphs(mm, max_rows=max_rows, max_cache_len=max_cache_len, batch_sizes=batch_sizes,
                                prefill_chunk=prefill_chunk, capture=capture, compile=compile,
                                compile_prefill=compile_prefill, fold_gqa=fold_gqa, log=log,
                                attention=attention, num_speculative_tokens=num_speculative_tokens,
                                pad_token_id=pad_token_id).capture()
        self.num_speculative_tokens = num_speculative_tokens
        self.draft = draft if draft is not None else PromptLookupDraft()
        self.device = self.graphs.device
        self.vocab_size = mm.model.get_output_embeddings().weight.shape[0]
        eos = mm.model.generation_config.eos_token_id
        self.default_eos = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        ignored = greedy_processors(mm.model.generation_config)
        if ignored:
            warnings.warn(f"ServingEngine samples each request with its own settings (temperature, top_p, top_k); "
                          f"the model's generation_config sets {', '.join(ignored)}, which mm.generate applies and "
                          f"the engine does not: their tokens can differ", RuntimeWarning, stacklevel=2)
        self._cond = threading.Condition()  # guards the queue, the handles' progress and the thread's state
        self._step_lock = threading.Lock()  # one step at a time
        self._step_thread: Optional[int] = None  # the thread running a step (on_token callbacks run in it)
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._prefilling: list[_Live] = []
        self._running: dict[int, _Live] = {}
        self._free_rows = list(range(max_rows))
        self._blocked: Optional[RequestHandle] = None  # the oldest waiting request that found no slot (_admit)
        self._bypassed = 0  # requests that need a slot admitted past it since
        self._group_bypassed = 0  # "grouped": requests admitted past an older one of another adapter, this group
        self._stalled = False  # the last step left requests waiting and none live (see STALL_WAIT_S)
        self._next_id = 0
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._tokens_host = torch.empty(max_rows * (1 + num_speculative_tokens), dtype=torch.long,
                                        pin_memory=self.device.type == "cuda")
        self.steps = 0  # decode steps run
        self.tokens_generated = 0
        self.draft_tokens = 0  # draft tokens verified (speculative decoding)
        self.accepted_draft_tokens = 0  # of which kept

    @property
    def schedule(self) -> str:
        """``"mixed"`` or ``"grouped"`` (see the class docstring); may be changed between requests."""
        return self._schedule

    @schedule.setter
    def schedule(self, value: str) -> None:
        if value not in ("mixed", "grouped"):
            raise ValueError(f"schedule must be 'mixed' or 'grouped', got {value!r}")
        self._schedule = value

    # --- submitting ----------------------------------------------------------------------------------------------
    def submit(self, prompt_ids, **kwargs) -> RequestHandle:
        """Queue ``Request(prompt_ids, **kwargs)`` (or pass a :class:`Request` as ``prompt_ids``); returns its
        handle. Everything is checked first: ValueError for a bad field, KeyError for an unknown adapter; nothing
        is queued then."""
        if isinstance(prompt_ids, Request) and kwargs:
            raise TypeError("submit: pass a Request or keyword arguments, not both")
        request = prompt_ids if isinstance(prompt_ids, Request) else Request(prompt_ids, **kwargs)
        handle = self._handle(request)
        self._queue([handle])
        return handle

    def generate_many(self, requests: Sequence) -> list[RequestHandle]:
        """Submit every request (:class:`Request` s or dicts of its fields; all checked before any is queued) and
        run until all have finished; returns their handles (``handle.tokens``, ``handle.finish_reason``).
        :class:`RequestsFailed` (a RuntimeError) when one failed (e.g. its adapter did not load): the others still
        finished, and its ``handles`` holds every handle."""
        self._check_not_in_step("generate_many")  # (before queueing: refused, it leaves nothing behind)
        requests = [r if isinstance(r, Request) else Request(**r) for r in requests]
        handles = [self._handle(r) for r in requests]
        self._queue(handles)
        self._wait(lambda: all(h.done for h in handles))
        failed = [h for h in handles if h.finish_reason == "error"]
        if failed:
            more = f" (and {len(failed) - 1} more; see .failed)" if len(failed) > 1 else ""
            raise RequestsFailed(f"request {failed[0].id} failed: {failed[0].error!r}{more}",
                                 handles) from failed[0].error
        return handles

    def _handle(self, r: Request) -> RequestHandle:
        """A checked :class:`RequestHandle` for ``r`` (not queued yet)."""
        prompt = r.prompt_ids.tolist() if hasattr(r.prompt_ids, "tolist") else r.prompt_ids  # tensor, numpy array
        if not isinstance(prompt, (list, tuple)) or not prompt or not all(_is_int(t) for t in prompt):
            raise ValueError(f"prompt_ids must be a non-empty 1-D list (or tensor) of token ids, got {r.prompt_ids!r}")
        prompt = [int(t) for t in prompt]
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_ids: ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})")
        n = r.max_new_tokens
        if not _is_int(n) or n < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {n!r}")
        n = int(n)
        if len(prompt) + n - 1 > self.graphs.max_cache_len:
            raise ValueError(f"max_new_tokens: {len(prompt)} prompt tokens + {n} new ones need "
                             f"{len(prompt) + n - 1} cache slots, more than max_cache_len={self.graphs.max_cache_len}")
        temperature = _finite_float(r.temperature)
        if temperature is None or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {r.temperature!r}")
        top_p = _finite_float(r.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {r.top_p!r}")
        if not _is_int(r.top_k) or r.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {r.top_k!r}")
        top_k = min(int(r.top_k), self.vocab_size)  # past the vocabulary it keeps every token
        if r.seed is not None and (not _is_int(r.seed) or not -2**63 <= r.seed < 2**63):
            raise ValueError(f"seed must be an int in [-2**63, 2**63) or None, got {r.seed!r}")
        eos = self.default_eos if r.eos_token_ids is None else r.eos_token_ids
        eos = [eos] if _is_int(eos) else eos
        if not isinstance(eos, (list, tuple, set, frozenset)) or not all(_is_int(t) for t in eos):
            raise ValueError(f"eos_token_ids must be an int or a list of ints, got {r.eos_token_ids!r}")
        if r.eos_token_ids is not None and any(not 0 <= t < self.vocab_size for t in eos):
            raise ValueError(f"eos_token_ids {r.eos_token_ids!r}: ids outside the vocabulary [0, {self.vocab_size})")
        if (isinstance(r.stop, (str, bytes)) or not isinstance(r.stop, Sequence)
                or not all(isinstance(s, Sequence) and not isinstance(s, (str, bytes)) and s
                           and all(_is_int(t) for t in s) for s in r.stop)):
            raise ValueError(f"stop must be a list of non-empty token-id sequences (e.g. [[13, 13]]), got {r.stop!r}")
        stop = tuple(tuple(int(t) for t in s) for s in r.stop)
        if any(not 0 <= t < self.vocab_size for s in stop for t in s):  # as eos_token_ids: it could never match
            raise ValueError(f"stop {r.stop!r}: ids outside the vocabulary [0, {self.vocab_size})")
        if r.on_token is not None and not callable(r.on_token):
            raise ValueError(f"on_token must be callable, got {r.on_token!r}")
        self._check_adapter(r.adapter)
        if r.seed is not None:
            seed = int(r.seed)
        else:  # greedy requests draw none: submitting one does not move the user's random stream
            seed = 0 if temperature == 0 else int(torch.randint(0, 2**62, ()))
        eos = frozenset(int(t) for t in eos)
        # the handle keeps a copy of what was checked: a Request object changed or submitted again later cannot
        # change this request (its adapter pin, its length against the cache, its sampling)
        checked = dataclasses.replace(r, prompt_ids=tuple(prompt), max_new_tokens=n, temperature=temperature,
                                      top_p=top_p, top_k=top_k, seed=seed, eos_token_ids=tuple(sorted(eos)), stop=stop)
        return RequestHandle(self, checked, prompt, eos, stop, seed)

    def _queue(self, handles: list[RequestHandle]) -> None:
        with self._cond:
            for handle in handles:
                self._next_id += 1
                handle.id = self._next_id
                handle.submitted_at = time.perf_counter()
                self._waiting.append(handle)
            self._cond.notify_all()

    def _check_adapter(self, name) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise ValueError(f"adapter must be a name (str) or None, got {name!r}")
        if (self.store is None or name not in self.store) and name not in self.mm.adapters:
            known = sorted(set(self.store.registered if self.store is not None else []) | set(self.mm.adapters))
            raise KeyError(f"adapter: unknown adapter {name!r}; known: {known}")

    # --- running -------------------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """No request waiting or live."""
        return not (self._waiting or self._prefilling or self._running)

    @property
    def num_running(self) -> int:
        """Requests decoding (their prompt prefilled)."""
        return len(self._running)

    def step(self) -> bool:
        """One engine step; returns whether work remains. In this order, so that the GPU never waits for the host
        or for an adapter copy: launch the decode step of the running requests (no host sync), admit waiting
        requests (adapter loads run on the store's side stream while the step computes), launch up to
        ``prefill_chunk`` prompt tokens, then read the step's tokens, and last the first tokens of the prompts
        prefilled to their end (those requests decode from the next step on)."""
        self._check_not_in_step("step() or run()")
        with self._step_lock:
            self._step_thread = threading.get_ident()
            try:
                with self._cond:
                    self._retire_cancelled()
                launched = self._launch_decode()
                with self._cond:
                    self._admit()
                prefilled = self._prefill()
                self._finish_decode(launched)
                self._start_decoding(prefilled)
            except BaseException as error:  # every live and waiting request ends with this error
                self._fail_all(error)
                raise
            finally:
                self._step_thread = None
            with self._cond:
                self._stalled = bool(self._waiting) and not (self._prefilling or self._running)
                self._cond.notify_all()
                return not self.idle

    def _back_off(self) -> None:
        """After a step that left requests waiting with none live: wait :data:`STALL_WAIT_S` (or a submit/cancel)."""
        with self._cond:
            if self._stalled:
                self._cond.wait(STALL_WAIT_S)

    def run(self) -> None:
        """Step until no request is waiting or live."""
        while self.step():
            self._back_off()

    def start(self) -> "ServingEngine":
        """Run the steps in a background thread (until :meth:`stop`; at interpreter exit it is stopped after its
        current step); handles then wait instead of stepping. A step that raises fails every live and waiting
        request (their handles re-raise the error) and the thread goes on with the next ones."""
        with self._cond:
            if self._thread is not None:
                raise RuntimeError("the engine's thread is already running")
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="moe-lora-serving", daemon=True)
            self._thread.start()
            _STARTED.add(self)
        return self

    def stop(self) -> None:
        """Stop the background thread after its current step and wait for it (live requests stay: handles waiting
        for them run the steps themselves; step or start again). From inside a step (an on_token callback) it only
        signals: the thread ends after that step."""
        with self._cond:
            thread, self._stopping = self._thread, True
            self._cond.notify_all()
        if thread is None or thread is threading.current_thread() or self._step_thread == threading.get_ident():
            return
        thread.join()

    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while self.idle and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                try:
                    self.step()
                except Exception:  # step() failed every live and waiting request with the error: serve the next
                    pass
                except BaseException:  # KeyboardInterrupt, SystemExit: the thread ends (waiting handles step)
                    return
                self._back_off()
        finally:  # waiting handles take over the steps
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None
                    _STARTED.discard(self)
                self._cond.notify_all()

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Until ``ready()``: wait for the engine's thread, or run steps here."""
        self._check_not_in_step("a handle's result(), iteration or generate_many")
        while True:
            with self._cond:
                if ready():
                    return
                if self._thread is not None:
                    self._cond.wait()
                    continue
            try:
                self.step()
            except Exception:  # step() ended every live and waiting request with the error: their handles hold
                if not ready():  # it, and result() / generate_many raise it as they do under start()
                    raise
                return
            self._back_off()

    def _check_not_in_step(self, what: str) -> None:
        if self._step_thread == threading.get_ident():
            raise RuntimeError(f"{what} was called from inside an engine step (an on_token callback): it would wait "
                               f"for the step that calls it; read handle.tokens / handle.done there instead")

    # --- the steps -----------------------------------------------------------------------------------------------
    def _retire_cancelled(self) -> None:
        for handle in [h for h in self._waiting if h._cancel]:
            self._waiting.remove(handle)
            self._finish_handle(handle, "cancelled")
        for live in [x for x in (*self._prefilling, *self._running.values()) if x.handle._cancel]:
            self._retire(live, "cancelled")

    def _admit(self) -> None:
        # the oldest waiting request that found no slot: remembered across steps (a step whose rows run out before
        # reaching it cannot tell whether it still finds none), forgotten once it leaves the queue
        blocked = self._blocked if self._blocked is not None and self._blocked in self._waiting else None
        if blocked is None:
            self._bypassed = 0
        passed = False  # the loop is past the blocked request: admitting a later one that needs a slot overtakes it
        group = self._group()
        for handle in list(self._waiting):
            if not self._free_rows:
                break
            adapter = handle.request.adapter
            if group is not _ANY and adapter != group:
                continue
            if group is not _ANY and self._overtakes_other_group(handle):
                break  # the group is closed to later requests: it drains, then the oldest one's adapter is next
            passed = passed or handle is blocked
            needs_slot = adapter is not None and self.store is not None and adapter in self.store
            if passed and handle is not blocked and needs_slot and self._bypassed >= self.max_bypass:
                continue
            try:
                slot, held = self._acquire(adapter)
            except NoFreeSlot as error:  # every slot is held by live requests: wait for one to end
                # (error.held: the holders when acquire failed; store.in_use read now could miss a hold released
                # in between, and fail a request that the next step serves)
                if error.held:
                    if blocked is None:
                        blocked, passed = handle, True
                    continue
                # no live request holds a slot (they are taken by adapters loaded into mm directly): none will ever
                # be freed by this engine, so waiting would never end (live requests without a slot, e.g. of the
                # base model, free none either)
                self._fail_waiting(handle, error)
            except Exception as error:  # the adapter failed to load: this request fails, nothing else changes
                self._fail_waiting(handle, error)
            else:
                oldest = self._waiting[0]
                self._waiting.remove(handle)
                if passed and handle is not blocked and needs_slot:
                    self._bypassed += 1
                self._prefilling.append(_Live(handle, self._free_rows.pop(0), slot, held))
                if group is not _ANY:
                    group = adapter
                    if oldest.request.adapter != adapter:  # overtook an older request of another adapter
                        self._group_bypassed += 1
            if handle is blocked:  # it left the queue (served or failed): the later ones overtake nobody now
                blocked, passed, self._bypassed = None, False, 0
        self._blocked = blocked

    def _fail_waiting(self, handle: RequestHandle, error: Exception) -> None:
        self._waiting.remove(handle)
        handle.error = error
        self._finish_handle(handle, "error")

    def _group(self):
        """The adapter allowed in under ``schedule="grouped"`` (``_ANY`` under ``"mixed"``)."""
        if self.schedule == "mixed":
            return _ANY
        live = [*self._prefilling, *self._running.values()]
        if live:
            return live[0].handle.request.adapter
        self._group_bypassed = 0  # a new group
        return self._waiting[0].request.adapter if self._waiting else _ANY

    def _overtakes_other_group(self, handle: RequestHandle) -> bool:
        """``"grouped"``: admitting ``handle`` would overtake an older waiting request of another adapter once more
        than ``max_bypass`` requests of this group did."""
        oldest = self._waiting[0]
        return (oldest is not handle and oldest.request.adapter != handle.request.adapter
                and self._group_bypassed >= self.max_bypass)

    def _acquire(self, adapter) -> tuple[int, bool]:
        """The adapter's slot for a request being admitted (paged in through the store, or loaded in ``mm``
        directly), pinned in ``mm`` until the request ends: unloading or replacing it meanwhile is refused."""
        if adapter is None:
            return NO_ADAPTER, False
        if self.store is not None and adapter in self.store:
            return self.store.acquire([adapter])[0], True  # (the store pins what it holds)
        self.mm.slots_for([adapter], 1)  # a forward's checks (e.g. an adapter a cast around mm made infinite)
        return self.mm._pin_adapter(adapter), False

    def _prefill(self) -> list[tuple[_Live, torch.Tensor]]:
        """Launch up to ``prefill_chunk`` prompt tokens of the admitted requests, oldest first; returns the
        requests whose prompt is now complete, with the logits of its last token."""
        budget, done = self.graphs.prefill_chunk, []
        for live in list(self._prefilling):
            if budget <= 0:
                break
            prompt = live.handle.prompt
            n = min(len(prompt) - live.prefilled, budget)
            logits = self.graphs.prefill(live.row, prompt[live.prefilled: live.prefilled + n],
                                         start=live.prefilled, adapter_slot=live.slot)
            live.prefilled += n
            budget -= n
            if live.prefilled == len(prompt):
                done.append((live, logits))
        return done

    def _start_decoding(self, prefilled: list[tuple[_Live, torch.Tensor]]) -> None:
        """First token of each prefilled request (one host sync); those that go on join the next decode step."""
        if not prefilled:
            return
        lives = [live for live, _ in prefilled]
        tokens = self._sample(torch.stack([logits for _, logits in prefilled]), lives).tolist()
        with self._cond:
            for live, token in zip(lives, tokens):
                if self._emit(live, token):  # (a request that ends here is retired by _emit)
                    self._prefilling.remove(live)
                    self._running[live.row] = live
                    self.graphs.set_row(live.row, token=token, position=len(live.handle.prompt),
                                        adapter_slot=live.slot)

    def _launch_decode(self):
        """Launch one decode step of the running requests and its sampling, and start copying the tokens to the
        host (no sync); returns what :meth:`_finish_decode` needs, or None."""
        if not self._running:
            return None
        rows = sorted(self._running)
        lives = [self._running[r] for r in rows]
        k = self.num_speculative_tokens
        drafts = self._set_drafts(lives) if k else None
        logits = self.graphs.step(rows[-1] + 1)  # [B, V], or [B, 1 + k, V] with drafts
        if len(rows) < logits.shape[0]:
            logits = logits.index_select(0, self._to_device(torch.tensor(rows)))
        if k:  # every position of every row, position j sampled as output index len(tokens) + j
            logits = logits.reshape(len(rows) * (1 + k), -1)
            tokens = self._sample(logits, [x for x in lives for _ in range(1 + k)], list(range(1 + k)) * len(rows))
        else:
            tokens = self._sample(logits, lives)
        self.steps += 1
        if tokens.device.type != "cuda":
            return lives, tokens, None, drafts
        host = self._tokens_host[: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return lives, host, ready, drafts

    def _set_drafts(self, lives: list[_Live]) -> list[list[int]]:
        """Stage each running row's last token and its ``k`` draft tokens at its position; returns the drafts."""
        k = self.num_speculative_tokens
        handles = [x.handle for x in lives]
        drafts = validated_draft(self.draft(handles, k), len(lives), k, self.vocab_size).tolist()
        for live, draft in zip(lives, drafts):
            h = live.handle
            self.graphs.set_row(live.row, token=h.tokens[-1], position=len(h.prompt) + len(h.tokens) - 1,
                                adapter_slot=live.slot, draft=draft)
        return drafts

    def _finish_decode(self, launched) -> None:
        """Wait for the launched step's tokens; stream them, retire the finished requests, advance the others."""
        if launched is None:
            return
        lives, tokens, ready, drafts = launched
        if ready is not None:
            ready.synchronize()
        if drafts is not None:
            self._accept(lives, tokens, drafts)
            return
        go_on_rows, go_on_tokens = [], []
        with self._cond:
            for live, token in zip(lives, tokens.tolist()):
                if self._emit(live, token):
                    go_on_rows.append(live.row)
                    go_on_tokens.append(token)
        if go_on_rows:
            self.graphs.advance(go_on_rows, go_on_tokens)

    def _accept(self, lives: list[_Live], tokens: torch.Tensor, drafts: list[list[int]]) -> None:
        """Speculative step: per row, the sampled tokens up to and including the first that differs from its draft
        (the rows are set again, at their new positions, when the next step is launched)."""
        k = self.num_speculative_tokens
        sampled = tokens.view(len(lives), 1 + k).tolist()
        with self._cond:
            for live, row_tokens, draft in zip(lives, sampled, drafts):
                kept = 0
                while kept < k and row_tokens[kept] == draft[kept]:
                    kept += 1
                self.draft_tokens += k
                self.accepted_draft_tokens += kept
                for token in row_tokens[: kept + 1]:
                    if not self._emit(live, token):
                        break

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small host tensor on the device without a host sync (through pinned memory on CUDA)."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _sample(self, logits: torch.Tensor, lives: list[_Live], offsets: Optional[list[int]] = None) -> torch.Tensor:
        """One token per row of ``logits [n, V]`` for ``lives``, on the device (no host sync); row ``i`` is output
        index ``len(tokens) + offsets[i]`` of its request (offsets: speculative positions; default 0)."""
        requests = [x.handle.request for x in lives]
        if all(r.temperature == 0 for r in requests):
            return logits.argmax(-1)
        offsets = offsets or [0] * len(lives)
        params = self._to_device(torch.tensor([[r.temperature, r.top_p] for r in requests], dtype=torch.float64))
        ints = self._to_device(torch.tensor([[r.top_k, x.handle.seed, len(x.handle.tokens) + j]
                                             for r, x, j in zip(requests, lives, offsets)], dtype=torch.long))
        filtered = any(r.temperature > 0 and (r.top_p < 1 or r.top_k > 0) for r in requests)
        return sample(logits, params[:, 0], params[:, 1], ints[:, 0], ints[:, 1], ints[:, 2], filtered=filtered)

    def _emit(self, live: _Live, token: int) -> bool:
        """Give ``token`` to the request (under ``_cond``); returns whether it goes on (else it was retired)."""
        handle, now = live.handle, time.perf_counter()
        handle.tokens.append(token)
        handle.token_times.append(now)
        if handle.first_token_at is None:
            handle.first_token_at = now
        self.tokens_generated += 1
        if handle.request.on_token is not None:
            try:
                handle.request.on_token(handle, token)
            except Exception as error:  # the callback's failure ends its own request only
                handle.error = error
                self._retire(live, "error")
                return False
        reason = None
        if token in handle.eos:
            reason = "eos"
        elif any(len(handle.tokens) >= len(s) and tuple(handle.tokens[-len(s):]) == s for s in handle.stop):
            reason = "stop"
        elif len(handle.tokens) >= handle.request.max_new_tokens:
            reason = "length"
        elif handle._cancel:  # cancelled (in the callback, or by another thread): none of the step's later tokens
            reason = "cancelled"
        if reason is None:
            return True
        self._retire(live, reason)
        return False

    def _retire(self, live: _Live, reason: str) -> None:
        """End a live request: free its row (padding from the next step on), release its adapter."""
        if live in self._prefilling:
            self._prefilling.remove(live)
        self._running.pop(live.row, None)
        self.graphs.clear_row(live.row)
        self._free_rows.append(live.row)
        self._free_rows.sort()
        adapter = live.handle.request.adapter
        if live.held:
            self.store.release([adapter])
        elif adapter is not None:
            self.mm._unpin_adapter(adapter)
        self._finish_handle(live.handle, reason)

    def _finish_handle(self, handle: RequestHandle, reason: str) -> None:
        handle.finish_reason = reason
        self._cond.notify_all()

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            for live in [*self._prefilling, *self._running.values()]:
                live.handle.error = error
                try:
                    self._retire(live, "error")
                except Exception:  # its row or adapter could not be released: the handle still ends
                    self._finish_handle(live.handle, "error")
            while self._waiting:
                handle = self._waiting.popleft()
                handle.error = error
                self._finish_handle(handle, "error")


_ANY = object()  # "mixed": every waiting request may be admitted


def _is_int(x) -> bool:
    """An integer (Python or numpy, e.g. a tensor's ``.item()``; not a tensor itself), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _finite_float(x) -> Optional[float]:
    """``float(x)`` for a finite real number (not a bool), else None (an int past float's range included)."""
    if not _is_number(x):
        return None
    try:
        value = float(x)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None
