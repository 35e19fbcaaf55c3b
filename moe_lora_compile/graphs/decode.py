"""CUDA graphs of the decode step of a :class:`~moe_lora_compile.models.MultiLoRAModel`, one per batch bucket.

One step feeds ``q = 1 + num_speculative_tokens`` tokens per sequence (``q = 1``: plain decode; ``q > 1``: the
verify step of speculative decoding, which scores the draft tokens) and returns their logits ``[b, q, V]``. A batch
of ``b`` sequences runs in the smallest bucket ``B >= b``; rows ``b..B-1`` are padding (pad token, adapter ``-1``)
and are dropped from the result.

Everything a step reads lives in static buffers that are filled in place before each replay: the tokens, their
positions, the 2-D attention mask over the cache slots, the cache slot where the step writes, and the per-token
adapter slots (``mm.token_lora_ids``; the model's pre-hook that fills it from the host is bypassed while capturing,
so that copy is never recorded). Which adapter a token uses, or whether it uses one at all (``-1``), is data: a new
adapter mix, or an adapter hot-swapped with ``mm.load_adapter(name, path, replace=True)`` (written in place into its
slot), replays the same graphs; nothing is recaptured.

``capture=False`` (the default without CUDA) runs the very same static-buffer step eagerly: the CPU tests of
bucketing, padding, adapter ids and speculative decoding run that path.

Contract of the low-level API (:meth:`DecodeGraphs.prefill`, :meth:`~DecodeGraphs.step`, :meth:`~DecodeGraphs.accept`):
the cache has ``max_cache_len`` physical slots shared by the rows of a batch; a step writes its ``q`` tokens at
slots ``state.position .. +q-1`` of every row and advances ``state.position`` by ``q``. :meth:`~DecodeGraphs.accept`
keeps the first ``n[b]`` of them for row ``b`` and masks the others out (their slots stay unused), so each row
continues from its own length: per-row positions (RoPE) come from ``state.lengths``. One batch is live at a time
(all buckets share one KV storage of the largest bucket); a new :meth:`prefill` ends the previous state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import numbers
import operator
import time
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..ops.contract import NO_ADAPTER
from ..compile import canonical_layout, without_duck_sizing
from ..models.inputs import check_prompt_values, check_token_ids
from .common import (compile_limits, compile_options, greedy_processors, in_range, own_code, padding_token, say,
                     validated_draft)
from .kv_cache import SharedKVStorage, SlotCache


class ScalarsWithoutHostCopies(TorchFunctionMode):
    """Inside: ``torch.tensor(python scalar, device=<device_type>)`` is made with ``torch.full`` (a fill kernel)
    instead of a host-to-device copy, which CUDA-graph capture refuses. Active only while capturing; transformers
    before 5.24 builds the eager-attention mask's zero that way (e.g. GPT-OSS)."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.tensor and len(args) == 1 and isinstance(args[0], (bool, int, float)):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == self.device_type:
                value = args[0]
                dtype = kwargs.get("dtype") or (torch.bool if isinstance(value, bool) else torch.long
                                                if isinstance(value, int) else torch.get_default_dtype())
                return torch.full((), value, dtype=dtype, device=device)
        return func(*args, **kwargs)


def _decode_forward(model, input_ids: Tensor, **kwargs) -> Tensor:
    """One decode / verify step of ``model`` (static shapes per bucket) -> logits. Its own function, so that the
    compiled decode step has a Dynamo cache of its own (one static graph per bucket), apart from the prefill's."""
    return model(input_ids=input_ids, **kwargs).logits


def _prefill_forward(model, input_ids: Tensor, **kwargs) -> Tensor:
    """One prefill chunk of ``model`` -> logits (compiled with a dynamic chunk length)."""
    return model(input_ids=input_ids, **kwargs).logits


def _token_id(name: str, value, vocab: int) -> int:
    """``value`` (an int, a numpy integer or a one-element integer tensor) as a token id in ``[0, vocab)``, else a
    ValueError naming ``name``."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if not in_range(value, vocab):
        raise ValueError(f"{name} must be a token id in [0, {vocab}), got {value!r}")
    return operator.index(value)


def _window_warning(window: int, position: int, q: int, rejected: list) -> bool:
    """Warn (once; returns True) when the next step's queries, at slots ``position..position+q-1``, have a rejected
    slot inside their local-attention window while older tokens fall out of it: from there on speculative
    decoding may differ from greedy decoding (the window counts slots, not kept tokens)."""
    last = position + q - 1
    rows = [row for row, s in enumerate(rejected) if s >= 0 and last - window + 1 > 0 and s > position - window]
    if not rows:
        return False
    warnings.warn(f"speculative decoding: rows {rows} have rejected draft slots inside the {window}-slot local "
                  f"attention window at cache slot {position}; their tokens from here on may differ from greedy "
                  f"decoding", RuntimeWarning, stacklevel=4)
    return True


def _local_attention_window(config) -> Optional[int]:
    """The sliding-window / chunk size of the model's local-attention layers, if it has any."""
    layer_types = getattr(config, "layer_types", None) or []
    sizes = []
    if getattr(config, "sliding_window", None) and (not layer_types or "sliding_attention" in layer_types):
        sizes.append(config.sliding_window)
    if getattr(config, "attention_chunk_size", None) and "chunked_attention" in layer_types:
        sizes.append(config.attention_chunk_size)
    return min(sizes) if sizes else None


@dataclasses.dataclass(eq=False)
class DecodeState:
    """One live batch in a :class:`DecodeGraphs`.

    ``batch_size``: real sequences ``b``; ``bucket``: ``B``; ``position``: next free cache slot (host int);
    ``lengths``: ``[B]`` int64 on the device, tokens kept per row (the next token's RoPE position);
    ``adapters``: one name or None per sequence, resolved to slots at prefill (a hot swap into a slot applies from
    the next step on; an adapter unloaded meanwhile makes the next step a RuntimeError, as its slot may hold another
    adapter by then).
    """

    batch_size: int
    bucket: int
    adapters: list
    position: int
    lengths: Tensor
    token_lora_ids: Tensor  # [B * q] int32 on the device: the step's adapter slots, copied in before each replay
    epoch: int
    pending: int = 0  # tokens fed by the last step that accept() may still drop
    adapter_slots: dict = dataclasses.field(default_factory=dict)  # name -> slot at prefill, checked every step


class DecodeGraphs:
    """Decode (and speculative-decode verify) steps of ``mm`` captured as CUDA graphs, one per batch bucket.

    ``batch_sizes``: the buckets; ``max_cache_len``: cache slots per sequence (prompt + every step's ``q``);
    ``num_speculative_tokens``: ``k`` draft tokens per step, so ``q = 1 + k`` tokens per sequence and step;
    ``capture``: capture CUDA graphs (default: when the model is on CUDA) or run the same step eagerly;
    ``pad_token_id``: for padding rows (ValueError outside the vocabulary; default: the model's pad id, else its eos
    where the pad id is missing or out of range, e.g. -1, else 0: :func:`.common.padding_token`); ``warmup``: eager
    runs before each capture; ``log``: progress lines (``None`` = silent).

    ``compile=True`` (or a dict of ``torch.compile`` keyword arguments) compiles the whole step with Inductor before
    it is captured: norms, rotary embeddings, residual adds, the router and the attention around the fused
    ``moe_lora`` ops become a few generated kernels instead of ~65 small ones per layer. The decode step is compiled
    with static shapes (one graph per bucket, ``dynamic=False``) in Inductor's default mode, not
    ``"reduce-overhead"``: this class captures the compiled step in its own CUDA graph per bucket, so Inductor's
    CUDA graphs would only nest inside ours. The prefill is compiled once with a dynamic chunk length
    (``dynamic=True``), unless ``compile_prefill=False`` (the prefill then runs eagerly: a slower first token, but
    no prefill compile, ~2 minutes for a 20B model on the H200). The compile happens during :meth:`capture` (warm-up
    runs) and the first prefill; later adapter mixes, hot swaps and batches within a bucket reuse the graphs.

    ``fold_gqa=True`` (default, same as ``"eager"``) switches a model on transformers' ``"eager"`` attention
    (GPT-OSS, or any model loaded with ``attn_implementation="eager"``) to the same attention with grouped query heads
    folded into the matmuls (:mod:`moe_lora_compile.models.attention`): no ``repeat_kv`` copies of the cache in every
    step. It changes ``mm.model``'s attention implementation for good (its own ``generate`` too); same results.
    ``fold_gqa="all"`` also runs the decode steps of a model on ``"sdpa"`` attention through the folded attention
    (the step's mask makes SDPA copy the cache for ``repeat_kv``); prefill and ``mm.generate`` keep SDPA. Off by
    default for SDPA models: two matmuls and a softmax replace the copies and one fused SDPA kernel, not yet
    measured. ``fold_gqa=False`` (``"off"``) changes nothing.

    ``attention="triton"`` runs the attention of every decode step (eager, folded or SDPA models) through the
    flash-decoding Triton kernel ``moe_lora.decode_attention`` (one launch per layer, the cache blocks the mask hides
    are never read; :mod:`moe_lora_compile.models.attention`); the prefill keeps the model's attention. Default
    ``"default"``: the model's own (as ``fold_gqa`` sets it).
    """

    def __init__(self, mm, *, batch_sizes: Sequence[int] = (1, 2, 4, 8), max_cache_len: int = 512,
                 num_speculative_tokens: int = 0, capture: Optional[bool] = None,
                 pad_token_id: Optional[int] = None, warmup: int = 2,
                 log: Optional[Callable[[str], None]] = print, compile=False, compile_prefill: bool = True,
                 fold_gqa=True, attention: str = "default"):
        from ..models.attach import MultiLoRAModel

        if not isinstance(mm, MultiLoRAModel):
            raise TypeError(f"mm must be a MultiLoRAModel (from moe_lora_compile.attach), got {type(mm).__name__}")
        sizes = sorted(set(batch_sizes)) if not isinstance(batch_sizes, int) else [batch_sizes]
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
            raise ValueError(f"batch_sizes must be positive ints, got {batch_sizes!r}")
        if not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool) \
                or num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be an int >= 0, got {num_speculative_tokens!r}")
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 (eager runs of each bucket before its capture), "
                             f"got {warmup!r}")
        q = 1 + num_speculative_tokens
        if not isinstance(max_cache_len, int) or max_cache_len < q + 1:
            raise ValueError(f"max_cache_len must be an int > q = {q}, got {max_cache_len!r}")
        param = next(mm.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture=True needs the model on a CUDA device (it is on {self.device}); "
                             f"capture=False runs the same steps eagerly")
        max_batch = sizes[-1]
        if max_batch * q > mm.token_lora_ids.numel():
            raise ValueError(f"batch_sizes: {max_batch} x {q} tokens exceed mm.token_lora_ids "
                             f"({mm.token_lora_ids.numel()}); attach with a larger max_tokens")
        self.vocab_size = mm.model.get_input_embeddings().num_embeddings
        config = mm.model.config
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.pad_token_id = padding_token(pad_token_id, (mm.model.generation_config, config, text_config),
                                          self.vocab_size)

        from ..models.attention import attention_mode, fold_gqa_mode, use_folded_gqa_attention

        self.fold_gqa = fold_gqa_mode(fold_gqa)
        self.attention = attention_mode(attention)
        self.mm = mm
        if self.fold_gqa != "off":
            use_folded_gqa_attention(mm.model)
        self.batch_sizes = tuple(sizes)
        self.max_cache_len = max_cache_len
        self.num_speculative_tokens = num_speculative_tokens
        self.query_len = q
        self.use_graphs = bool(capture)
        self.warmup = warmup
        options = compile_options(compile)
        self.compiled = options is not None
        if self.compiled:  # its steps guard on the id buffers' size: a buffer grow (mm._grow) warns
            mm._compiled_steps = True
        self._decode_code = self._prefill_code = None  # the compiled functions' own code (compiled_graphs)
        if self.compiled:
            decode, prefill = own_code(_decode_forward), own_code(_prefill_forward)
            self._decode_code = decode.__code__
            self._decode_fn = torch.compile(decode, dynamic=False, **options)
            if compile_prefill:
                self._prefill_code = prefill.__code__
                self._prefill_fn = without_duck_sizing(torch.compile(prefill, dynamic=True, **options))
            else:
                self._prefill_fn = _prefill_forward
        else:
            self._decode_fn, self._prefill_fn = _decode_forward, _prefill_forward
        self.log = log
        config = mm.model.config
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self._num_layers = text_config.num_hidden_layers
        window = _local_attention_window(text_config)
        self._local_window = window
        if num_speculative_tokens and window is not None and window < max_cache_len:
            warnings.warn(f"this model has local attention over {window} tokens: its window counts cache slots, "
                          f"and rejected draft tokens leave masked slots, so a token fed at cache slot p attends to "
                          f"the kept tokens of slots p-{window - 1}..p (fewer than {window} once a rejected slot lies "
                          f"there) where greedy decoding attends to the last {window} tokens: speculative decoding "
                          f"equals greedy decoding while prompt + cache slots used stay <= {window} or no draft is "
                          f"rejected, and can differ afterwards (generate warns when that point is reached)",
                          stacklevel=2)

        # which keyword the installed transformers takes for the cache (5.24 renamed past_key_values -> cache)
        params = inspect.signature(type(mm.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._pass_cache_position = "cache_position" in params  # older 5.x: positions of the written slots
        self._has_logits_to_keep = "logits_to_keep" in params

        dev = self.device
        self._start = torch.zeros((), dtype=torch.long, device=dev)  # slot of the current forward's first token
        self._arange_q = torch.arange(q, device=dev)
        self._input_ids = torch.full((max_batch, q), self.pad_token_id, dtype=torch.long, device=dev)
        self._position_ids = torch.zeros((max_batch, q), dtype=torch.long, device=dev)
        self._attention_mask = torch.zeros((max_batch, max_cache_len), dtype=torch.long, device=dev)
        self._storage = SharedKVStorage(max_batch, max_cache_len)
        self._caches = {b: SlotCache(self._storage, self._num_layers, b, self._start) for b in self.batch_sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Tensor] = {}  # static logits [B, q, V] of each captured graph
        self._ids_buffer: Optional[Tensor] = None  # the mm.token_lora_ids the graphs were captured with
        self._pool = None
        self._epoch = 0
        self.num_captures = 0  # CUDA graphs captured so far, over this object's life
        self._warned_processors = False  # generate warned once of generation_config settings it does not apply

    # --- buckets ---------------------------------------------------------------------------------------------
    def bucket_for(self, batch_size: int) -> int:
        """The smallest bucket that holds ``batch_size`` sequences; ValueError above the largest."""
        for b in self.batch_sizes:
            if b >= batch_size:
                return b
        raise ValueError(f"batch of {batch_size} sequences is larger than the largest captured bucket "
                         f"({self.batch_sizes[-1]}); batch_sizes={self.batch_sizes}: split the batch or add a bucket")

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    # --- running the model -----------------------------------------------------------------------------------
    def _model_kwargs(self, batch: int, attention_mask: Tensor, position_ids: Tensor, num_tokens: int) -> dict:
        kwargs = {self._cache_kw: self._caches[batch], "use_cache": True, "attention_mask": attention_mask,
                  "position_ids": position_ids}
        if self._pass_cache_position:
            kwargs["cache_position"] = torch.arange(num_tokens, device=self.device) + self._start
        return kwargs

    def _forward_step(self, batch: int) -> Tensor:
        """The step captured per bucket: static buffers in, logits ``[B, q, V]`` out. No host work on data."""
        kwargs = self._model_kwargs(batch, self._attention_mask[:batch], self._position_ids[:batch], self.query_len)
        from ..models.attention import decode_attention_steps, folded_gqa_decode

        with (self.mm.manual_token_lora_ids(), self._compile_limits(),
              folded_gqa_decode(self.mm.model, enabled=self.fold_gqa == "all"),  # an SDPA model's step runs folded
              decode_attention_steps(self.mm.model, enabled=self.attention == "triton")):
            return self._decode_fn(self.mm.model, self._input_ids[:batch], **kwargs)

    def compiled_graphs(self) -> dict[str, int]:
        """``{"decode": n, "prefill": m}``: the graphs Dynamo holds for this instance's compiled decode step (one
        per bucket once captured) and prefill (0 where not compiled): a count that a recompile would raise."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        return {name: 0 if code is None else len(_debug_get_cache_entry_list(code))
                for name, code in (("decode", self._decode_code), ("prefill", self._prefill_code))}

    def _compile_limits(self):
        return compile_limits(self.compiled, len(self.batch_sizes))

    def _allocate_cache(self) -> None:
        """Allocate the shared K/V storage with one eager (uncompiled) step of the largest bucket, on the current
        stream, before anything is compiled or captured (it is allocated lazily, at the first write)."""
        with self.mm.lock:  # its warm-up ids would otherwise land in another thread's forward
            if not self._storage.allocated:
                self._allocate_storage()
            for cache in self._caches.values():
                cache.bind()

    def _allocate_storage(self) -> None:
        batch = self.batch_sizes[-1]
        self._fill_dummy(batch)
        kwargs = self._model_kwargs(batch, self._attention_mask[:batch], self._position_ids[:batch], self.query_len)
        with self.mm.manual_token_lora_ids():
            _decode_forward(self.mm.model, self._input_ids[:batch], **kwargs)

    def _run_step(self, batch: int) -> Tensor:
        if not self.use_graphs:
            return self._forward_step(batch)
        if not self._graphs:
            raise RuntimeError("DecodeGraphs: no graphs captured yet: call .capture() first "
                               "(or construct with capture=False to run the steps eagerly)")
        if self.mm.token_lora_ids is not self._ids_buffer:
            raise RuntimeError("mm.token_lora_ids was reallocated after capture (a batch of more than max_tokens "
                               "tokens ran through mm): the graphs read the old buffer; call .capture() again")
        self._graphs[batch].replay()
        return self._outputs[batch]

    def _fill_dummy(self, batch: int) -> None:
        """Valid inputs for warm-up and capture: pad tokens at slots 0..q-1, no adapter."""
        self._input_ids[:batch].fill_(self.pad_token_id)
        self._position_ids[:batch].copy_(self._arange_q.expand(batch, -1))
        self._attention_mask[:batch].zero_()
        self._attention_mask[:batch, : self.query_len].fill_(1)
        self._start.fill_(0)
        self.mm.write_lora_ids(torch.full((batch * self.query_len,), NO_ADAPTER, dtype=torch.int32,
                                          device=self.device), self.query_len)

    # --- capture ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> "DecodeGraphs":
        """Warm up and capture one CUDA graph per bucket (largest first, one shared memory pool), logging one line
        per bucket. Capturing again replaces the graphs. With ``capture=False`` it allocates the cache and runs
        warm-up steps eagerly: one of the largest bucket (``compile=False``), or one per bucket (``compile=True``,
        which compiles each bucket's step now rather than in the first :meth:`step`).
        Ends any live :class:`DecodeState`. Holds ``mm.lock`` throughout: its warm-up ids would otherwise land in
        another thread's forward."""
        with self.mm.lock:
            return self._capture()

    def _capture(self) -> "DecodeGraphs":
        self._epoch += 1
        self._allocate_cache()
        if not self.use_graphs:
            order = sorted(self.batch_sizes, reverse=True) if self.compiled else self.batch_sizes[-1:]
            for i, batch in enumerate(order, 1):  # compiled: compile every bucket's step now, not in step()
                t0 = time.perf_counter()
                self._fill_dummy(batch)
                self._forward_step(batch)
                if self.compiled:
                    self._say(f"compiling decode step {i}/{len(order)}: batch {batch}, q {self.query_len} ... "
                              f"{time.perf_counter() - t0:.2f} s")
            self._say(f"decode steps run without CUDA graphs (capture=False) on {self.device}: buckets "
                      f"{list(self.batch_sizes)}, q {self.query_len}, {'compiled' if self.compiled else 'eager'}")
            return self
        self._graphs.clear()
        self._outputs.clear()
        torch.cuda.synchronize(self.device)
        self._ids_buffer = self.mm.token_lora_ids
        self._pool = torch.cuda.graph_pool_handle()
        order = sorted(self.batch_sizes, reverse=True)
        total = time.perf_counter()
        for i, batch in enumerate(order, 1):
            t0 = time.perf_counter()
            self._fill_dummy(batch)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(max(self.warmup, 1 if self.compiled else 0)):  # compiled: compiles here
                    self._forward_step(batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # the compiled step holds no host-made scalars (and a mode entered only now would fail Dynamo's guards)
            scalars = contextlib.nullcontext() if self.compiled else ScalarsWithoutHostCopies("cuda")
            with torch.cuda.graph(graph, pool=self._pool), scalars:
                out = self._forward_step(batch)
            torch.cuda.synchronize(self.device)
            self._graphs[batch], self._outputs[batch] = graph, out
            self.num_captures += 1
            self._say(f"capturing {'compiled ' if self.compiled else ''}decode graph {i}/{len(order)}: batch {batch}, "
                      f"q {self.query_len} ... "
                      f"{time.perf_counter() - t0:.2f} s")
        self._say(f"captured {len(order)} decode graphs in {time.perf_counter() - total:.2f} s "
                  f"(KV cache {self._storage.nbytes() / 2**20:.1f} MiB)")
        return self

    def _say(self, line: str) -> None:
        say(self.log, line)

    # --- the low-level API -----------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, input_ids: Tensor, *, adapters: Optional[Sequence[Optional[str]]] = None,
                attention_mask: Optional[Tensor] = None) -> tuple[DecodeState, Tensor]:
        """Run the prompts ``input_ids [b, S]`` into the cache (chunked to fit ``mm.token_lora_ids``; no CUDA graph;
        compiled with a dynamic length when the steps are compiled);
        returns the new :class:`DecodeState` and the logits of each prompt's last token ``[b, V]``.

        ``attention_mask [b, S]`` (1 = token, 0 = left padding) for prompts of different lengths, as in
        transformers. ``adapters``: one name or None per sequence (validated as ``mm.forward`` does).
        """
        check_token_ids("input_ids", input_ids)
        b, S = input_ids.shape
        batch = self.bucket_for(b)
        if S < 1 or S + self.query_len > self.max_cache_len:
            raise ValueError(f"input_ids: a prompt of {S} tokens plus one step of {self.query_len} does not fit "
                             f"max_cache_len={self.max_cache_len}")
        self.mm.slots_for(adapters, b)  # same validation (and errors) as mm.forward, before touching anything
        adapters = None if adapters is None else list(adapters)
        check_prompt_values(input_ids, attention_mask, self.vocab_size)
        self._epoch += 1
        self._allocate_cache()  # (may run a dummy step: before this prefill fills the static buffers)
        dev = self.device
        mask = self._attention_mask[:batch]
        mask.zero_()
        mask[:, :S].fill_(1)
        if attention_mask is not None:
            mask[:b, :S].copy_(attention_mask)
        tokens = torch.full((batch, S), self.pad_token_id, dtype=torch.long, device=dev)
        tokens[:b].copy_(input_ids)
        prompt_mask = mask[:, :S]
        position_ids = (prompt_mask.cumsum(-1) - 1).clamp_(min=0)
        lengths = prompt_mask.sum(-1)
        chunk = max(1, self.mm.token_lora_ids.numel() // batch)
        logits = None
        with self.mm.manual_token_lora_ids(), self._compile_limits():
            for c0 in range(0, S, chunk):
                c1 = min(S, c0 + chunk)
                self._start.fill_(c0)
                self.mm.set_token_lora_ids(adapters, c1 - c0, batch_size=batch)
                # a chunk of a longer prompt is a slice (strides of the whole): copied to its own layout, or its
                # stride guards compiled another prefill graph
                kwargs = self._model_kwargs(batch, mask, canonical_layout(position_ids[:, c0:c1]), c1 - c0)
                if self._has_logits_to_keep:
                    kwargs["logits_to_keep"] = 1
                logits = self._prefill_fn(self.mm.model, canonical_layout(tokens[:, c0:c1]), **kwargs)
            ids = self.mm.set_token_lora_ids(adapters, self.query_len, batch_size=batch).clone()
            held = {name: self.mm.slots.slot_of(name) for name in (adapters or ()) if name is not None}
        state = DecodeState(batch_size=b, bucket=batch, adapters=adapters if adapters is not None else [None] * b,
                            position=S, lengths=lengths, token_lora_ids=ids, epoch=self._epoch, adapter_slots=held)
        return state, logits[:b, -1]

    def _check_adapters_held(self, state: DecodeState) -> None:
        """RuntimeError when an adapter of the batch left the slot it had at prefill (unloaded, maybe another
        adapter in its slot now): its rows would decode with whatever the slot holds. A hot swap keeps the slot."""
        for name, slot in state.adapter_slots.items():
            if not self.mm.slots.holds(name, slot):
                raise RuntimeError(f"adapters: adapter {name!r} was unloaded after this batch's prefill (its slot "
                                   f"{slot} may hold another adapter now); prefill the batch again (a hot swap with "
                                   f"load_adapter(..., replace=True) keeps a live batch going)")

    def _check_live(self, state: DecodeState) -> None:
        if state.epoch != self._epoch:
            raise RuntimeError("DecodeGraphs: this DecodeState has ended (a newer prefill or capture reused the "
                               "cache); one batch is live at a time")

    @torch.no_grad()
    def step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Feed ``tokens [b, q]`` (``q = 1 + num_speculative_tokens``) of every sequence; returns their logits
        ``[b, q, V]``: a view of the bucket's static output, valid until the next step (``.clone()`` to keep).

        Writes the tokens' K/V at slots ``state.position .. +q-1`` and advances ``state.position`` and
        ``state.lengths`` by ``q``; :meth:`accept` then drops the rejected ones. One graph replay on CUDA.
        Host (CPU) ``tokens`` outside the vocabulary are a ValueError; device tokens are used without a host sync,
        unchecked (there an id outside the vocabulary is a device-side assert).
        """
        self._check_live(state)
        b, batch, q, p = state.batch_size, state.bucket, self.query_len, state.position
        check_token_ids("tokens", tokens)
        if tuple(tokens.shape) != (b, q):
            raise ValueError(f"tokens must be [{b}, {q}] (batch, 1 + num_speculative_tokens), "
                             f"got {tuple(tokens.shape)}")
        if tokens.device.type == "cpu":
            ids = tokens.long()  # int64: a narrow dtype wraps the bound (int8 >= 128), unsigned ones have no `<`
            if bool(((ids < 0) | (ids >= self.vocab_size)).any()):
                raise ValueError(f"tokens: ids outside the vocabulary [0, {self.vocab_size}) "
                                 f"(min {int(ids.min())}, max {int(ids.max())})")
        if p + q > self.max_cache_len:
            raise ValueError(f"cache full: slot {p} + {q} tokens > max_cache_len={self.max_cache_len}")
        with self.mm.lock:  # ids in, model run: not interleaved with another thread's forward or adapter swap
            self._check_adapters_held(state)
            self._input_ids[:b].copy_(tokens)
            if batch > b:
                self._input_ids[b:batch].fill_(self.pad_token_id)
            self._position_ids[:batch].copy_(state.lengths[:, None] + self._arange_q)
            self._attention_mask[:batch, p:p + q].fill_(1)
            self._start.fill_(p)
            self.mm.write_lora_ids(state.token_lora_ids, q)
            logits = self._run_step(batch)
        state.position += q
        state.lengths += q
        state.pending = q
        return logits[:b]

    @torch.no_grad()
    def accept(self, state: DecodeState, num_tokens) -> None:
        """Keep only the first ``num_tokens[i]`` (1..q) of the tokens row ``i`` fed in the last :meth:`step`.

        ``num_tokens``: an int or ``[b]`` ints (a device tensor is used without a host sync, unchecked). The dropped
        tokens' slots are masked out for good; the row's next token takes the next position (RoPE) anyway.
        """
        self._check_live(state)
        q, b, batch = state.pending, state.batch_size, state.bucket
        if q == 0:
            raise RuntimeError("accept() must follow a step() (once)")
        keep = torch.full((batch,), q, dtype=torch.long, device=self.device)
        if isinstance(num_tokens, Tensor) and num_tokens.device.type == self.device.type != "cpu":
            keep[:b].copy_(num_tokens.reshape(b))
        else:
            counts = torch.as_tensor(num_tokens)
            if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool \
                    or counts.numel() not in (1, b) or counts.dim() > 1:
                raise ValueError(f"num_tokens must be an int or {b} ints (one per row), got {num_tokens!r}")
            counts = counts.long().reshape(-1).expand(b)
            if bool(((counts < 1) | (counts > q)).any()):
                raise ValueError(f"num_tokens must be in 1..{q}, got {counts.tolist()}")
            keep[:b].copy_(counts)
        drop = self._arange_q[:q] >= keep[:, None]  # [B, q]
        p0 = state.position - q
        self._attention_mask[:batch, p0:state.position].masked_fill_(drop, 0)
        state.lengths -= q - keep
        state.pending = 0

    # --- generation ------------------------------------------------------------------------------------------
    def _special_ids(self, eos_token_id, pad_token_id):
        gen = self.mm.model.generation_config
        eos = gen.eos_token_id if eos_token_id is None else eos_token_id
        if isinstance(eos, Tensor) and not eos.is_floating_point() and eos.dim() <= 1:  # as mm.generate takes it
            eos = eos.tolist()
        elif not isinstance(eos, (Tensor, int, list, tuple)) and hasattr(eos, "tolist"):  # numpy scalars and arrays
            eos = eos.tolist()
        integer = lambda t: isinstance(t, numbers.Integral) and not isinstance(t, bool)  # noqa: E731
        if eos is not None and not integer(eos) and not (isinstance(eos, (list, tuple)) and all(map(integer, eos))):
            raise ValueError(f"eos_token_id must be an int or a list of ints, got {eos!r}")
        eos = [] if eos is None else [eos] if integer(eos) else list(eos)
        eos = [_token_id("eos_token_id", t, self.vocab_size) for t in eos]
        pad = gen.pad_token_id if pad_token_id is None else pad_token_id
        if pad is None:
            pad = eos[0] if eos else self.pad_token_id
        return torch.tensor(eos, dtype=torch.long, device=self.device), _token_id("pad_token_id", pad, self.vocab_size)

    def _inferred_mask(self, input_ids: Tensor, pad_token_id, eos: Tensor) -> Optional[Tensor]:
        """The mask ``mm.generate`` infers without one (transformers' rule): ``input_ids != pad`` where the pad id
        (``pad_token_id``, else the generation config's) is set, occurs in the prompts and is not an EOS id; else
        None (every token counts). Pad ids that are not left padding: a ValueError (pass the mask), where
        ``mm.generate`` would mask those tokens out of the middle of a prompt."""
        pad = self.mm.model.generation_config.pad_token_id if pad_token_id is None else pad_token_id
        if pad is None:
            return None
        pad = _token_id("pad_token_id", pad, self.vocab_size)
        if pad in eos.tolist():
            return None
        mask = (input_ids != pad).long()
        if bool(mask.all()):
            return None
        if bool((mask[:, 1:] < mask[:, :-1]).any()) or bool((mask.sum(-1) == 0).any()):
            raise ValueError(f"input_ids hold the pad id {pad} other than as left padding: pass attention_mask "
                             f"(mm.generate would infer input_ids != {pad}, masking those tokens)")
        return mask

    @torch.no_grad()
    def generate(self, input_ids: Tensor, *, adapters: Optional[Sequence[Optional[str]]] = None,
                 max_new_tokens: int = 20, attention_mask: Optional[Tensor] = None,
                 draft: Optional[Callable[[list[Tensor]], Tensor]] = None,
                 eos_token_id=None, pad_token_id: Optional[int] = None) -> Tensor:
        """Greedy decoding: ``[b, S]`` prompts -> ``[b, S + n]`` (prompts then new tokens, ``n <= max_new_tokens``),
        the same tokens as ``mm.generate(..., do_sample=False)``: after a sequence's EOS it gets pad tokens; stops
        when all have ended. The prompt is prefilled by :meth:`prefill` (compiled with ``compile=True`` and
        ``compile_prefill``, else eager), every step replays one graph.

        With ``num_speculative_tokens = k > 0``, ``draft(sequences) -> [b, k]`` proposes the next ``k`` tokens of
        each sequence (``sequences[i]``: its tokens so far, 1-D, without left padding); a step verifies them and
        keeps the longest prefix that greedy decoding agrees with, plus the model's next token. The result is the
        same as plain greedy decoding, whatever the drafts, except on models with local (sliding-window / chunked)
        attention of ``W`` tokens: their window counts cache slots, and a rejected draft's slot stays (masked), so a
        token whose last ``W`` slots hold a rejected one while older tokens fall out of the window sees fewer than
        ``W`` tokens; output is exact while prompt + slots used stay ``<= W`` (or nothing is rejected), and a
        RuntimeWarning marks the first step where it may differ. ``draft`` must return ``[b, k]`` integer ids in
        ``[0, vocab)`` (a tensor or nested lists); anything else is a ValueError.
        """
        check_token_ids("input_ids", input_ids)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        max_new_tokens = int(max_new_tokens)  # a numpy int too, as mm.generate and the serving engine take it
        if self.query_len > 1 and draft is None:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens}: generate needs draft= "
                             f"(a callable giving {self.num_speculative_tokens} tokens per sequence)")
        if self.query_len == 1 and draft is not None:
            raise ValueError("draft= needs a DecodeGraphs built with num_speculative_tokens > 0 (its steps verify "
                             "the drafts); this one decodes a token a step")
        S = input_ids.shape[-1]
        steps_worst = max(max_new_tokens - 1, 1)  # prefill keeps room for one step (see prefill), even for 1 token
        if S + steps_worst * self.query_len > self.max_cache_len:
            raise ValueError(f"max_cache_len={self.max_cache_len} is too small for {S} prompt tokens + "
                             f"{max_new_tokens} new ones at {self.query_len} cache slots per step "
                             f"(needs {S + steps_worst * self.query_len})")
        eos, pad = self._special_ids(eos_token_id, pad_token_id)
        config = self.mm.model.generation_config
        ignored = greedy_processors(config)
        sampled = bool(getattr(config, "do_sample", False))
        if (ignored or sampled) and not self._warned_processors:
            self._warned_processors = True
            why = []
            if sampled:  # e.g. Qwen3's checkpoints: mm.generate then samples unless told do_sample=False
                why.append("do_sample=True, so mm.generate samples by default (mm.generate(..., do_sample=False) "
                           "gives this method's tokens)")
            if ignored:
                why.append(f"{', '.join(ignored)}, which mm.generate(do_sample=False) applies: their tokens can "
                           f"differ (set those fields to their defaults for the same tokens)")
            warnings.warn(f"DecodeGraphs.generate is greedy (the argmax of the logits); the model's "
                          f"generation_config sets {'; and '.join(why)}", RuntimeWarning, stacklevel=3)
        if attention_mask is None:
            attention_mask = self._inferred_mask(input_ids, pad_token_id, eos)
        state, logits = self.prefill(input_ids, adapters=adapters, attention_mask=attention_mask)
        if self.query_len == 1:
            new = self._greedy_loop(state, logits, max_new_tokens, eos, pad)
        else:
            new = self._speculative_loop(state, logits, input_ids, attention_mask, max_new_tokens, eos, pad, draft)
        return torch.cat([input_ids.to(new.device), new], dim=1)

    def _greedy_loop(self, state, logits, max_new_tokens, eos, pad) -> Tensor:
        b = state.batch_size
        out = torch.full((b, max_new_tokens), pad, dtype=torch.long, device=self.device)
        all_done = torch.zeros(max_new_tokens, dtype=torch.bool, device=self.device)
        unfinished = torch.ones(b, dtype=torch.bool, device=self.device)
        token = logits.argmax(-1)
        done_steps = max_new_tokens
        for t in range(max_new_tokens):
            token = torch.where(unfinished, token, pad)
            out[:, t] = token
            if eos.numel():
                unfinished &= ~torch.isin(token, eos)
                all_done[t] = ~unfinished.any()
                if t % 8 == 7 and bool(all_done[t]):  # a host sync every 8 steps, to stop early
                    done_steps = t + 1
                    break
            if t + 1 < max_new_tokens:
                token = self.step(state, token[:, None])[:, -1].argmax(-1)
        if eos.numel():
            ended = all_done[:done_steps].nonzero()
            if ended.numel():
                done_steps = int(ended[0, 0]) + 1
        return out[:, :done_steps]

    def _speculative_loop(self, state, logits, input_ids, attention_mask, max_new_tokens, eos, pad, draft):
        b, k = state.batch_size, self.num_speculative_tokens
        eos_set = set(eos.tolist())
        ids = input_ids.to(self.device)
        prompts = [ids[i] if attention_mask is None else ids[i][attention_mask[i].to(self.device).bool()]
                   for i in range(b)]
        generated: list[list[int]] = [[] for _ in range(b)]
        done = [False] * b

        def emit(row: int, tokens: list[int]) -> None:
            for tok in tokens:
                if done[row]:
                    return
                generated[row].append(tok)
                done[row] = tok in eos_set or len(generated[row]) >= max_new_tokens

        first = logits.argmax(-1).tolist()
        for row in range(b):
            emit(row, [first[row]])
        vocab = logits.shape[-1]
        window = self._local_window
        rejected = [-1] * b  # per row: its first rejected slot (-1: none yet)
        warned = False
        while not all(done):
            last = torch.tensor([g[-1] if not d else pad for g, d in zip(generated, done)], device=self.device)
            sequences = [torch.cat([prompts[i], torch.tensor(generated[i], dtype=torch.long, device=self.device)])
                         for i in range(b)]
            proposal = validated_draft(draft(sequences), b, k, vocab).to(self.device)
            if window is not None and not warned:
                warned = _window_warning(window, state.position, self.query_len, rejected)
            greedy = self.step(state, torch.cat([last[:, None], proposal], dim=1)).argmax(-1)  # [b, q]
            accepted = (greedy[:, :k] == proposal).long().cumprod(1).sum(1)  # [b]: leading matches
            self.accept(state, accepted + 1)
            greedy, accepted = greedy.tolist(), accepted.tolist()
            for row in range(b):  # slots of rejected drafts: masked, but still inside local-attention windows
                if accepted[row] < k:
                    rejected[row] = state.position - 1  # the step's last slot is among its rejected ones
            for row in range(b):
                emit(row, greedy[row][: accepted[row] + 1])
        width = max(len(g) for g in generated)
        out = torch.full((b, width), pad, dtype=torch.long)
        for row, g in enumerate(generated):
            out[row, : len(g)] = torch.tensor(g, dtype=torch.long)
        return out.to(self.device)
