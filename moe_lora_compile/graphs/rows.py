"""Per-row decode steps for continuous batching: :class:`RowGraphs`, one request per KV-cache row.

:class:`~moe_lora_compile.graphs.DecodeGraphs` runs one batch at a time: all its rows share one write position, so a
row cannot join or leave mid-batch. Here each of ``max_rows`` rows of the cache is one request's own sequence: its
token at position ``t`` lives in cache slot ``t`` of its row (no left padding), so rows of any length sit side by
side, and a request joins (:meth:`RowGraphs.prefill` writes its prompt into its row, in chunks) or leaves between
steps without touching the other rows.

A step (:meth:`RowGraphs.step`) feeds one token per row to rows ``0..B-1`` of the smallest bucket ``B`` that covers
the highest row in use. What a step reads lives in static device buffers filled in place before each replay (one
host-to-device copy from a staging buffer the caller fills with :meth:`~RowGraphs.set_row`): per row its token, its
position and its adapter slot (copied into ``mm.token_lora_ids``). Inside the step every layer writes row ``b``'s K/V
at slot ``positions[b]`` (an indexed write), and the attention masks (causal, and the sliding window of local layers)
are built from the positions; so which rows run, how long each is and which adapter each uses are data, never
guards: requests come and go and replay the same graph (or the same compiled code, no recompile).

Rows that do not run in a step (free, or a request still being prefilled) are padding: pad token, adapter ``-1``,
positions ``max_cache_len ..``, scratch slots past the end that no real token reads. Every layer stores
``max_cache_len + q`` slots per row and a step attends over all of them (masked), as
:class:`~moe_lora_compile.graphs.DecodeGraphs` does over its slots.

Speculative decoding (``num_speculative_tokens = k > 0``): a step feeds ``q = 1 + k`` tokens per row (the row's last
token and ``k`` draft tokens, :meth:`RowGraphs.set_row` ``draft=``) at positions ``p .. p + k`` and returns logits
``[rows, q, V]``; the caller keeps the longest verified prefix and sets the row at its new position next time. Slots
of rejected drafts are simply written again by the row's next step (slot = position), so nothing stale is ever
attended to, sliding windows included: the result is exactly what one token a step gives.

The masks are passed to the model ready-made (4-D, or a ``{layer type: mask}`` dict for models that mix full and
sliding-window layers, e.g. GPT-OSS), so transformers' own mask construction, which assumes one query position for
the whole batch, is skipped. Attention implementations: ``eager`` and the folded-GQA eager attention (additive
masks) and ``sdpa`` (boolean masks).
Llama-4 is refused: its chunked attention and its attention-temperature scaling use one row's positions for all. So
is a batch-dependent RoPE ("dynamic", "longrope") wherever it would rescale (:func:`check_rope`).

``capture=False`` (the default without CUDA) runs the same static-buffer steps eagerly (the CPU tests).
``compile=True`` compiles the step once per bucket (static shapes) and, unless ``compile_prefill=False``, the
prefill once with a dynamic length, as :class:`~moe_lora_compile.graphs.DecodeGraphs` does; :meth:`~RowGraphs.capture`
compiles every bucket and warms the prefill at lengths 1 and 2 (a length-1 prefill gets its own specialised graph),
so serving compiles nothing. ``fold_gqa=True`` (default) runs eager attention with the grouped query heads folded
into the matmuls (:mod:`moe_lora_compile.models.attention`), which matters more here than in short batches: every
step attends over all ``max_cache_len + q`` slots of each row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from typing import Callable, Optional, Sequence, Union

import torch
from torch import Tensor
from transformers.cache_utils import Cache

from ..ops.contract import NO_ADAPTER
from ..compile import canonical_layout, without_duck_sizing
from .common import compile_limits, compile_options, in_range, own_code, padding_token, say
from .decode import ScalarsWithoutHostCopies
from .kv_cache import SharedKVStorage, StorageLayer

_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class MaskSpec:
    """How to build a step's attention masks. ``layer_types``: the distinct layer types (more than one: the model
    gets a ``{type: mask}`` dict); ``windows``: per type, ``None`` (causal) or the sliding window ``W`` (a query at
    position ``p`` sees slots ``p-W+1..p``); ``num_slots``: cache slots per row; ``additive``: float masks in
    ``dtype`` (0 / most negative) for eager attention, else boolean (True = attend) for SDPA."""

    layer_types: tuple
    windows: tuple
    num_slots: int
    additive: bool
    dtype: torch.dtype


def batch_dependent_rope(config) -> Optional[tuple[str, int]]:
    """``(rope type, length)`` when transformers' rotary embedding of this text config recomputes its frequencies
    from the largest position in the whole batch once a sequence passes ``length`` (``"dynamic"``: NTK scaling past
    ``max_position_embeddings``; ``"longrope"``: the long factors past ``original_max_position_embeddings``), else
    None: static RoPE (default, linear, YaRN, Llama-3, ...)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    flat = "rope_type" in params or "type" in params
    groups = [params] if flat else [p for p in params.values() if isinstance(p, dict)]
    for group in groups:  # one dict, or one per layer type
        kind = group.get("rope_type", group.get("type")) or ""
        if "dynamic" in kind:
            return kind, config.max_position_embeddings
        if kind == "longrope":
            return kind, group.get("original_max_position_embeddings") or config.max_position_embeddings
    return None


def check_rope(config, num_slots: int) -> None:
    """ValueError if rows of one step could change each other's rotary embedding: a batch-dependent RoPE
    (:func:`batch_dependent_rope`) takes the largest position of all rows (padding rows sit at ``num_slots - 1``),
    so once that passes its length a short request would decode with a long one's frequencies, unlike alone."""
    rope = batch_dependent_rope(config)
    if rope is not None and num_slots > rope[1]:
        kind, length = rope
        raise ValueError(f"model: its RoPE ({kind!r}) rescales for all rows of a step from the longest one past "
                         f"{length} positions (transformers takes one largest position for the batch), so per-row "
                         f"decoding would change requests by what runs beside them; keep max_cache_len + "
                         f"num_speculative_tokens + 1 <= {length} (it is {num_slots}), or use DecodeGraphs")


def mask_spec(config, num_slots: int, dtype: torch.dtype) -> MaskSpec:
    """The :class:`MaskSpec` of a transformers text config; ValueError for what per-row masks cannot express."""
    model_type = getattr(config, "model_type", "")
    if model_type.startswith("llama4"):
        raise ValueError("model: Llama-4 is not supported by per-row decoding (its chunked attention and attention "
                         "temperature use one query position for the whole batch); use DecodeGraphs")
    from ..models.attention import FOLDED_GQA

    attn = getattr(config, "_attn_implementation", None) or "eager"
    if attn not in ("eager", FOLDED_GQA, "sdpa"):
        raise ValueError(f"model: attention implementation {attn!r} is not supported by per-row decoding (it takes "
                         f"ready-made 4-D masks): load the model with attn_implementation='eager' or 'sdpa'")
    window = getattr(config, "sliding_window", None) or None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        distinct = tuple(dict.fromkeys(layer_types))
        unknown = [t for t in distinct if t not in _LAYER_TYPES]
        if unknown:
            raise ValueError(f"model: layer types {unknown} are not supported by per-row decoding "
                             f"(supported: {list(_LAYER_TYPES)})")
    else:  # one kind of layer: sliding everywhere when the config has a window (Mistral, Mixtral, Qwen3-MoE)
        distinct = ("sliding_attention",) if window else ("full_attention",)
    if "sliding_attention" in distinct and not window:
        raise ValueError("model: sliding-attention layers without a sliding_window size in the config")
    windows = tuple(window if t == "sliding_attention" else None for t in distinct)
    return MaskSpec(distinct, windows, num_slots, attn != "sdpa", dtype)


def attention_masks(position_ids: Tensor, spec: MaskSpec):
    """Masks ``[B, 1, q, num_slots]`` for queries at ``position_ids [B, q]`` over a row's slots (slot = position):
    causal, and windowed for sliding layers; a dict per layer type when the model mixes types."""
    slots = torch.arange(spec.num_slots, device=position_ids.device)
    positions = position_ids[:, None, :, None]
    causal = slots <= positions
    masks = {}
    for layer_type, window in zip(spec.layer_types, spec.windows):
        allowed = causal if window is None else causal & (slots > positions - window)
        masks[layer_type] = (~allowed).to(spec.dtype) * torch.finfo(spec.dtype).min if spec.additive else allowed
    return masks if len(masks) > 1 else masks[spec.layer_types[0]]


class RowLayer(StorageLayer):
    """One layer of :class:`RowCache`: writes ``key_states [n, h, q, d]`` of row ``rows[i]`` at its slots
    ``slots[i, :q]`` in the shared storage ``[max_rows, h, num_slots, d]``; returns rows ``[:batch]`` (a view: the
    decode step of a bucket) or, with ``batch=None``, the written rows gathered (a prefill)."""

    def __init__(self, storage: SharedKVStorage, layer_idx: int, rows: Tensor, slots: Tensor,
                 batch: Optional[int]):
        super().__init__(max_cache_len=storage.max_cache_len)
        self._storage, self._layer_idx = storage, layer_idx
        self._rows, self._slots, self._batch = rows, slots, batch

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:  # first write, eager: allocates the storage (a compiled step finds it bound)
            self.bind(*self._storage.rows(self._layer_idx, key_states, value_states, self._storage.max_batch))
        slots = self._slots[:, : key_states.shape[-2]]
        self._all_keys[self._rows, :, slots] = key_states.transpose(1, 2).to(self._all_keys.dtype)
        self._all_values[self._rows, :, slots] = value_states.transpose(1, 2).to(self._all_values.dtype)
        if self._batch is None:
            rows = self._rows[:, 0]
            return self._all_keys[rows], self._all_values[rows]
        return self.keys, self.values

    def bind(self, keys: Tensor, values: Tensor) -> None:
        """Point this layer at the storage (all rows; once, before anything is compiled)."""
        self._all_keys, self._all_values = keys, values
        batch = keys.shape[0] if self._batch is None else self._batch
        self.keys, self.values, self.device = keys[:batch], values[:batch], keys.device
        self.batch_size, self.num_heads = batch, keys.shape[1]
        self.is_initialized = True

    def get_seq_length(self, *args, **kwargs) -> int:
        return 0  # not used: positions and masks come ready-made


class RowCache(Cache):
    """A transformers ``Cache`` of :class:`RowLayer` s over one :class:`SharedKVStorage`."""

    def __init__(self, storage: SharedKVStorage, num_layers: int, rows: Tensor, slots: Tensor,
                 batch: Optional[int]):
        super().__init__(layers=[RowLayer(storage, i, rows, slots, batch) for i in range(num_layers)])
        self._storage = storage

    def bind(self) -> None:
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized and i in self._storage.keys:
                layer.bind(self._storage.keys[i], self._storage.values[i])


def _run_rows(model, input_ids: Tensor, position_ids: Tensor, cache: RowCache, spec: MaskSpec, cache_kw: str,
              extra: dict) -> Tensor:
    kwargs = dict(extra)
    if kwargs.pop("cache_position", False):  # older transformers 5.x: positions of the written slots (unused here)
        kwargs["cache_position"] = position_ids[0]
    kwargs[cache_kw] = cache
    return model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_masks(position_ids, spec),
                 use_cache=True, **kwargs).logits


def _row_step_forward(model, input_ids, position_ids, cache, spec, cache_kw, extra) -> Tensor:
    """One decode step over a bucket's rows (static shapes): its own function, so its Dynamo cache is its own."""
    return _run_rows(model, input_ids, position_ids, cache, spec, cache_kw, extra)


def _row_prefill_forward(model, input_ids, position_ids, cache, spec, cache_kw, extra) -> Tensor:
    """One prefill chunk of one row (compiled with a dynamic length)."""
    return _run_rows(model, input_ids, position_ids, cache, spec, cache_kw, extra)


class RowGraphs:
    """Per-row decode steps of ``mm`` (a :class:`~moe_lora_compile.models.MultiLoRAModel`) over ``max_rows`` cache
    rows of ``max_cache_len`` tokens each, one CUDA graph per bucket.

    ``batch_sizes``: the buckets (default: powers of two up to ``max_rows``, and ``max_rows``); ``prefill_chunk``:
    the most prompt tokens one :meth:`prefill` call takes (also bounded by ``mm.token_lora_ids``); ``capture``,
    ``compile``, ``compile_prefill``, ``fold_gqa``, ``warmup``, ``log``: as in
    :class:`~moe_lora_compile.graphs.DecodeGraphs` (``fold_gqa``: True / ``"eager"`` runs eager attention without
    ``repeat_kv`` copies of the cache, switching ``mm.model``'s attention implementation for good; False / ``"off"``
    changes nothing; ``"all"`` is refused, a DecodeGraphs-only mode). ``pad_token_id``: the token fed to padding rows
    (ValueError outside the vocabulary; default: the model's pad id, else its eos where the pad id is missing or
    out of range, e.g. -1, else 0). ``attention="triton"``: the steps'
    attention runs the flash-decoding Triton kernel (``moe_lora.decode_attention``; prefill unchanged), as in
    :class:`~moe_lora_compile.graphs.DecodeGraphs`. ``num_speculative_tokens``: ``k`` draft tokens per row and step
    (see the module docstring); steps then return ``[rows, 1 + k, V]``.

    Low-level use (what :class:`~moe_lora_compile.serving.ServingEngine` does)::

        graphs = RowGraphs(mm, max_rows=8, max_cache_len=1024).capture()
        logits = graphs.prefill(row=3, tokens=prompt, adapter_slot=slot)   # [V]: the prompt's last token
        graphs.set_row(3, token=next_token, position=len(prompt), adapter_slot=slot)
        logits = graphs.step(num_rows=4)    # [4, V]: rows 0..3 (rows not set this round: clear_row -> padding)
    """

    def __init__(self, mm, *, max_rows: int = 8, max_cache_len: int = 1024,
                 batch_sizes: Optional[Sequence[int]] = None, prefill_chunk: int = 512,
                 capture: Optional[bool] = None, compile=False, compile_prefill: bool = True,
                 fold_gqa: Union[bool, str] = True, pad_token_id: Optional[int] = None, warmup: int = 2,
                 log: Optional[Callable[[str], None]] = print, attention: str = "default",
                 num_speculative_tokens: int = 0):
        from ..models.attach import MultiLoRAModel
        from ..models.attention import attention_mode, fold_gqa_mode, use_folded_gqa_attention

        if not isinstance(mm, MultiLoRAModel):
            raise TypeError(f"mm must be a MultiLoRAModel (from moe_lora_compile.attach), got {type(mm).__name__}")
        fold = fold_gqa_mode(fold_gqa)
        if fold == "all":
            raise ValueError("fold_gqa='all' (SDPA models' steps through the folded attention) is a DecodeGraphs "
                             "mode; RowGraphs and ServingEngine take True / 'eager' (fold eager-attention models) "
                             "or False / 'off'")
        for arg, value, low in (("max_rows", max_rows, 1), ("max_cache_len", max_cache_len, 2),
                                ("prefill_chunk", prefill_chunk, 1), ("num_speculative_tokens", num_speculative_tokens, 0),
                                ("warmup", warmup, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{arg} must be an int >= {low}, got {value!r}")
        if batch_sizes is None:
            batch_sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < max_rows] + [max_rows]
        sizes = sorted(set(batch_sizes))
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or not 1 <= b <= max_rows for b in sizes):
            raise ValueError(f"batch_sizes must be ints in 1..max_rows={max_rows}, got {batch_sizes!r}")
        if sizes[-1] != max_rows:
            raise ValueError(f"batch_sizes: the largest bucket must be max_rows={max_rows}, got {sizes}")
        q = 1 + num_speculative_tokens
        if max_rows * q > mm.token_lora_ids.numel():
            raise ValueError(f"max_rows={max_rows} rows of {q} tokens exceed mm.token_lora_ids "
                             f"({mm.token_lora_ids.numel()}); attach with a larger max_tokens")
        param = next(mm.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if capture is None:
            capture = self.device.type == "cuda"
        if capture and self.device.type != "cuda":
            raise ValueError(f"capture=True needs the model on a CUDA device (it is on {self.device}); "
                             f"capture=False runs the same steps eagerly")
        config = mm.model.config
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        self.vocab_size = mm.model.get_input_embeddings().weight.shape[0]
        self.pad_token_id = padding_token(pad_token_id, (mm.model.generation_config, config, text_config),
                                           self.vocab_size)
        num_slots = max_cache_len + q  # the real slots, then q scratch slots for padding rows
        mask_spec(text_config, num_slots, self.dtype)  # refuse what per-row masks cannot express first
        check_rope(text_config, num_slots)
        self.attention = attention_mode(attention)
        if fold == "eager":
            use_folded_gqa_attention(mm.model)
        self.spec = mask_spec(text_config, num_slots, self.dtype)
        options = compile_options(compile)
        self.compiled = options is not None
        if self.compiled:  # its steps guard on the id buffers' size: a buffer grow (mm._grow) warns
            mm._compiled_steps = True
        self.compiled_prefill = self.compiled and bool(compile_prefill)
        if self.compiled:
            self._step_fn = torch.compile(own_code(_row_step_forward), dynamic=False, **options)
            prefill = torch.compile(own_code(_row_prefill_forward), dynamic=True, **options)
            self._prefill_fn = (without_duck_sizing(prefill)
                                if compile_prefill
                                else _row_prefill_forward)
        else:
            self._step_fn, self._prefill_fn = _row_step_forward, _row_prefill_forward

        self.mm = mm
        self.max_rows, self.max_cache_len = max_rows, max_cache_len
        self.num_speculative_tokens, self.query_len = num_speculative_tokens, q
        self.batch_sizes = tuple(sizes)
        self.prefill_chunk = min(prefill_chunk, mm.token_lora_ids.numel())
        self.use_graphs, self.warmup, self.log = bool(capture), warmup, log
        params = inspect.signature(type(mm.model).forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._step_extra = {"cache_position": True} if "cache_position" in params else {}
        self._prefill_extra = dict(self._step_extra)
        if "logits_to_keep" in params:
            self._prefill_extra["logits_to_keep"] = 1

        dev, R = self.device, max_rows
        on_cuda = dev.type == "cuda"
        # staged per row: q tokens, q positions, the adapter slot (rows of this [2q + 1, R] block); one copy a step
        self._host_inputs = torch.zeros((2 * q + 1, R), dtype=torch.long, pin_memory=on_cuda)
        self._inputs = torch.zeros((2 * q + 1, R), dtype=torch.long, device=dev)
        if q == 1:  # views of the copied block
            self._tokens, self._positions = self._inputs[0].view(R, 1), self._inputs[1].view(R, 1)
        else:  # [R, q] contiguous, filled from the block (models may view() their inputs)
            self._tokens = torch.zeros((R, q), dtype=torch.long, device=dev)
            self._positions = torch.zeros((R, q), dtype=torch.long, device=dev)
        self._row_slots = torch.full((R,), NO_ADAPTER, dtype=torch.int32, device=dev)
        # per-token slots, sequence-major (one token a row: the row slots themselves)
        self._ids = self._row_slots if q == 1 else torch.full((R * q,), NO_ADAPTER, dtype=torch.int32, device=dev)
        self._prefill_row = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self._prefill_positions = torch.zeros((1, self.prefill_chunk), dtype=torch.long, device=dev)
        self._storage = SharedKVStorage(R, num_slots)
        layers = text_config.num_hidden_layers
        rows = torch.arange(R, device=dev)[:, None]
        self._caches = {b: RowCache(self._storage, layers, rows[:b], self._positions[:b], b) for b in sizes}
        self._prefill_cache = RowCache(self._storage, layers, self._prefill_row, self._prefill_positions, None)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Tensor] = {}
        self._ids_buffer: Optional[Tensor] = None
        self.num_captures = 0
        for row in range(R):
            self.clear_row(row)

    # --- rows ----------------------------------------------------------------------------------------------------
    def _check_row(self, row) -> None:
        if not in_range(row, self.max_rows):
            raise ValueError(f"row must be in 0..{self.max_rows - 1}, got {row!r}")

    def bucket_for(self, num_rows: int) -> int:
        """The smallest bucket that holds rows ``0..num_rows-1``."""
        for b in self.batch_sizes:
            if b >= num_rows:
                return b
        raise ValueError(f"num_rows={num_rows} exceeds max_rows={self.max_rows}")

    def set_row(self, row: int, *, token: int, position: int, adapter_slot: int = NO_ADAPTER,
                draft: Optional[Sequence[int]] = None) -> None:
        """Row ``row`` feeds ``token`` at ``position`` (its cache slot) with ``adapter_slot`` in the next steps
        (host staging; copied to the device by :meth:`step`). With speculative decoding, ``draft`` (``k`` ids) follows
        ``token`` at ``position + 1 ..`` (None: pad tokens, which the verification will reject)."""
        self._check_row(row)
        if not 0 <= position < self.max_cache_len:
            raise ValueError(f"position {position} is outside the cache (max_cache_len={self.max_cache_len})")
        if not NO_ADAPTER <= adapter_slot < self.mm.max_loras:  # replayed steps read the slot unchecked
            raise ValueError(f"adapter_slot must be -1 or a slot in [0, {self.mm.max_loras}), got {adapter_slot}")
        q = self.query_len
        if draft is None:
            draft = [self.pad_token_id] * (q - 1)
        elif len(draft) != q - 1:
            raise ValueError(f"draft: {q - 1} tokens (num_speculative_tokens), got {len(draft)}")
        bad = [t for t in (token, *draft) if not in_range(t, self.vocab_size)]
        if bad:  # the step's embedding lookup would fail with a bare IndexError
            raise ValueError(f"token / draft: ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        self._host_inputs[:, row] = torch.tensor([token, *draft, *range(position, position + q), adapter_slot])

    def clear_row(self, row: int) -> None:
        """Row ``row`` is padding in the next steps: pad tokens, adapter -1, the scratch slots."""
        self._check_row(row)
        q = self.query_len
        self._host_inputs[:, row] = torch.tensor([self.pad_token_id] * q
                                                 + list(range(self.max_cache_len, self.max_cache_len + q)) + [NO_ADAPTER])

    def advance(self, rows: Sequence[int], tokens: Sequence[int]) -> None:
        """Each of ``rows`` feeds its token of ``tokens`` at its next position (after a step that fed it; one token
        a step only: with speculative decoding the caller sets each row with :meth:`set_row`)."""
        if self.query_len != 1:
            raise RuntimeError("advance: with num_speculative_tokens > 0 set each row with set_row(..., draft=...)")
        for row in rows:
            self._check_row(row)
        index = torch.tensor(rows, dtype=torch.long)
        self._host_inputs[0, index] = torch.tensor(tokens, dtype=torch.long)
        self._host_inputs[1, index] += 1

    # --- running the model ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, row: int, tokens, *, start: int = 0, adapter_slot: int = NO_ADAPTER) -> Tensor:
        """Write ``tokens`` (``[n]`` ids, ``n <= prefill_chunk``) into row ``row`` at slots ``start..start+n-1`` (the
        row's earlier slots hold its previous chunks); returns the logits ``[V]`` of the last one. No CUDA graph;
        compiled with a dynamic length when the steps are compiled. No host sync: it queues behind a running step."""
        tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        n = tokens.numel()
        if not 1 <= n <= self.prefill_chunk:
            raise ValueError(f"tokens: a prefill chunk has 1..{self.prefill_chunk} tokens, got {n}")
        if not NO_ADAPTER <= adapter_slot < self.mm.max_loras:
            raise ValueError(f"adapter_slot must be -1 or a slot in [0, {self.mm.max_loras}), got {adapter_slot}")
        if start < 0 or start + n > self.max_cache_len:
            raise ValueError(f"tokens: slots {start}..{start + n - 1} are outside the cache "
                             f"(max_cache_len={self.max_cache_len})")
        if not 0 <= row < self.max_rows:
            raise ValueError(f"row must be in 0..{self.max_rows - 1}, got {row}")
        self._allocate_cache()
        self._prefill_row.fill_(row)
        positions = torch.arange(start, start + n, device=self.device)[None]  # contiguous: no stride guards
        self._prefill_positions[:, :n].copy_(positions)  # where the layers write
        ids = torch.full((n,), adapter_slot, dtype=torch.int32, device=self.device)
        with self.mm.manual_token_lora_ids(), self._compile_limits():
            self.mm.write_lora_ids(ids, n)
            # canonical_layout: a view of a [1, S] tensor keeps its base's strides (another prefill graph)
            logits = self._prefill_fn(self.mm.model, canonical_layout(self._to_device(tokens)[None]), positions,
                                      self._prefill_cache, self.spec, self._cache_kw, self._prefill_extra)
        return logits[0, -1]

    def _to_device(self, t: Tensor) -> Tensor:
        """A host tensor on the device without a host sync (through pinned memory on CUDA)."""
        if self.device.type != "cuda" or t.device.type != "cpu":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.no_grad()
    def step(self, num_rows: int) -> Tensor:
        """One decode step of rows ``0..num_rows-1`` (and the padding rows of its bucket) with what :meth:`set_row`
        / :meth:`advance` / :meth:`clear_row` staged; returns the logits ``[num_rows, V]`` (a view of the bucket's
        static output, valid until the next step). The staged values are copied once (asynchronously from pinned
        memory on CUDA: change them only after this step's results were read on the host)."""
        batch = self.bucket_for(num_rows)
        self._inputs.copy_(self._host_inputs, non_blocking=True)  # all rows: one contiguous (pinned) copy
        self._unpack_inputs(batch)
        with self.mm.lock:  # ids in, model run: not interleaved with another thread's forward or adapter swap
            self.mm.write_lora_ids(self._ids[: batch * self.query_len], self.query_len)
            logits = self._run_step(batch)
        return logits[:num_rows, -1] if self.query_len == 1 else logits[:num_rows]

    def _unpack_inputs(self, batch: int) -> None:
        """Device side of a step's inputs from the copied block: per-token adapter slots (and, with drafts, the
        [R, q] token and position buffers)."""
        q = self.query_len
        self._row_slots[:batch].copy_(self._inputs[2 * q, :batch])
        if q > 1:
            self._tokens[:batch].copy_(self._inputs[:q, :batch].t())
            self._positions[:batch].copy_(self._inputs[q: 2 * q, :batch].t())
            self._ids[: batch * q].view(batch, q).copy_(self._row_slots[:batch, None].expand(batch, q))

    def _forward_step(self, batch: int) -> Tensor:
        from ..models.attention import decode_attention_steps

        with (self.mm.manual_token_lora_ids(), self._compile_limits(),
              decode_attention_steps(self.mm.model, enabled=self.attention == "triton")):
            return self._step_fn(self.mm.model, self._tokens[:batch], self._positions[:batch], self._caches[batch],
                                 self.spec, self._cache_kw, self._step_extra)

    def _run_step(self, batch: int) -> Tensor:
        if not self.use_graphs:
            self._allocate_cache()
            return self._forward_step(batch)
        if not self._graphs:
            raise RuntimeError("RowGraphs: no graphs captured yet: call .capture() first (or construct with "
                               "capture=False to run the steps eagerly)")
        if self.mm.token_lora_ids is not self._ids_buffer:
            raise RuntimeError("mm.token_lora_ids was reallocated after capture (a batch of more than max_tokens "
                               "tokens ran through mm): the graphs read the old buffer; call .capture() again")
        self._graphs[batch].replay()
        return self._outputs[batch]

    def _compile_limits(self):
        return compile_limits(self.compiled, len(self.batch_sizes))

    def _allocate_cache(self) -> None:
        """Allocate the K/V storage with one eager step of the largest bucket (padding rows) before anything is
        compiled or captured, then bind every cache to it."""
        if not self._storage.allocated:
            batch = self.max_rows
            self._inputs[:, :batch].copy_(self._host_inputs[:, :batch])
            self._unpack_inputs(batch)
            with self.mm.manual_token_lora_ids():
                self.mm.write_lora_ids(self._ids[: batch * self.query_len], self.query_len)
                _row_step_forward(self.mm.model, self._tokens[:batch], self._positions[:batch], self._caches[batch],
                                  self.spec, self._cache_kw, self._step_extra)
        for cache in (*self._caches.values(), self._prefill_cache):
            cache.bind()

    # --- capture -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> "RowGraphs":
        """Compile (``compile=True``) and capture (``capture=True``) one step per bucket, largest first, and warm the
        compiled prefill; one log line per bucket. Run it before any request is live: the warm-ups write padding
        rows and row 0's first slots. Holds ``mm.lock`` throughout (its warm-up ids must not land in another
        thread's forward)."""
        with self.mm.lock:
            return self._capture()

    def _capture(self) -> "RowGraphs":
        self._allocate_cache()
        total = time.perf_counter()
        if self.compiled_prefill:
            for n in (1, 2):  # a length-1 chunk is specialised by Dynamo; 2 makes the dynamic graph
                self.prefill(0, torch.full((n,), self.pad_token_id, dtype=torch.long))
        for row in range(self.max_rows):
            self.clear_row(row)
        order = sorted(self.batch_sizes, reverse=True)
        self._inputs.copy_(self._host_inputs)
        self._unpack_inputs(self.max_rows)
        if not self.use_graphs:
            for i, batch in enumerate(order if self.compiled else [], 1):
                t0 = time.perf_counter()
                self.step(batch)
                self._say(f"compiling row step {i}/{len(order)}: batch {batch} ... {time.perf_counter() - t0:.2f} s")
            self._say(f"row steps run without CUDA graphs (capture=False) on {self.device}: buckets "
                      f"{list(self.batch_sizes)}, {'compiled' if self.compiled else 'eager'}")
            return self
        self._graphs.clear()
        self._outputs.clear()
        torch.cuda.synchronize(self.device)
        self._ids_buffer = self.mm.token_lora_ids
        pool = torch.cuda.graph_pool_handle()
        for i, batch in enumerate(order, 1):
            t0 = time.perf_counter()
            self.mm.write_lora_ids(self._ids[: batch * self.query_len], self.query_len)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(max(self.warmup, 1 if self.compiled else 0)):
                    self._forward_step(batch)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            scalars = contextlib.nullcontext() if self.compiled else ScalarsWithoutHostCopies("cuda")
            with torch.cuda.graph(graph, pool=pool), scalars:
                out = self._forward_step(batch)
            torch.cuda.synchronize(self.device)
            self._graphs[batch], self._outputs[batch] = graph, out
            self.num_captures += 1
            self._say(f"capturing {'compiled ' if self.compiled else ''}row step {i}/{len(order)}: batch {batch} "
                      f"... {time.perf_counter() - t0:.2f} s")
        self._say(f"captured {len(order)} row-step graphs in {time.perf_counter() - total:.2f} s "
                  f"(KV cache {self._storage.nbytes() / 2**20:.1f} MiB)")
        return self

    def _say(self, line: str) -> None:
        say(self.log, line)
