"""A static KV cache whose write position is a device tensor the caller sets: what a captured CUDA graph needs.

transformers' own ``StaticCache`` keeps its position inside each layer and advances it itself (and its API for
rewinding differs between 5.x releases). Here every layer writes the ``S`` new tokens of a forward at physical slots
``start .. start+S-1``, where ``start`` is one 0-d int64 tensor shared by all layers and set (in place) by the
caller before each forward, so a replayed graph writes wherever ``start`` says. Nothing here advances it.

Rows may hold different numbers of real tokens: which slots hold a real token is the 2-D ``attention_mask`` the
caller passes to the model (``[B, max_cache_len]``, 1 = real), and each row's RoPE positions are the caller's
``position_ids``; that is how transformers' own masks treat left padding, and here it also covers the slots of
rejected speculative tokens. Every layer stores the full ``max_cache_len`` (sliding-window layers too: their
window is applied by the model's mask, over slots).

Built from public pieces of transformers 5.x: ``Cache(layers=[...])`` with ``StaticLayer`` subclasses.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import Cache, StaticLayer


class SharedKVStorage:
    """Per-layer K and V tensors ``[max_batch, kv_heads, max_cache_len, head_dim]`` (model dtype), allocated on
    the first write (shapes come from the model's key/value states); a cache of batch ``B`` uses rows ``[:B]``."""

    def __init__(self, max_batch: int, max_cache_len: int):
        self.max_batch, self.max_cache_len = max_batch, max_cache_len
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def rows(self, layer_idx: int, key_states: Tensor, value_states: Tensor, batch: int) -> tuple[Tensor, Tensor]:
        """Rows ``[:batch]`` of layer ``layer_idx``'s K and V (allocated on the first call, shaped like the states)."""
        if layer_idx not in self.keys:
            for store, states in ((self.keys, key_states), (self.values, value_states)):
                _, heads, _, dim = states.shape
                with torch.inference_mode(False):  # allocated lazily: maybe inside the caller's inference_mode
                    store[layer_idx] = torch.zeros(self.max_batch, heads, self.max_cache_len, dim,
                                                   dtype=states.dtype, device=states.device)
        return self.keys[layer_idx][:batch], self.values[layer_idx][:batch]

    @property
    def allocated(self) -> bool:
        return bool(self.keys)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values()))


class StorageLayer(StaticLayer):
    """A ``StaticLayer`` over a :class:`SharedKVStorage`: every slot of the cache is visible to the mask (positions
    and masks are built by the caller), and the owner of the storage, not the layer, clears it."""

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:  # the storage is shared: the owner decides when to clear it
        pass


class SlotLayer(StorageLayer):
    """One layer of :class:`SlotCache`: writes ``key_states [B, h, S, d]`` at slots ``start + arange(S)``."""

    def __init__(self, storage: SharedKVStorage, layer_idx: int, batch: int, start: Tensor):
        super().__init__(max_cache_len=storage.max_cache_len)
        self._storage, self._layer_idx, self._batch, self._start = storage, layer_idx, batch, start

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:  # first write, eager: allocates the storage (a compiled step finds it bound)
            self.bind(*self._storage.rows(self._layer_idx, key_states, value_states, self._batch))
        keys, values = self.keys, self.values
        slots = torch.arange(key_states.shape[-2], device=keys.device) + self._start
        keys.index_copy_(2, slots, key_states.to(keys.dtype))
        values.index_copy_(2, slots, value_states.to(values.dtype))
        return keys, values

    def bind(self, keys: Tensor, values: Tensor) -> None:
        """Point this layer at its rows of the storage (once; no Python state changes afterwards, so a compiled
        step traced after this never sees an attribute change, and never recompiles for one)."""
        self.keys, self.values, self.device = keys, values, keys.device
        self.batch_size, self.num_heads = keys.shape[:2]
        self.is_initialized = True

    def get_seq_length(self, *args, **kwargs) -> Tensor:
        """The first slot of the current forward (0-d int64 tensor): transformers' masks use it as the query
        offset; a tensor, so a captured graph reads it at replay."""
        return self._start


class SlotCache(Cache):
    """A transformers ``Cache`` of :class:`SlotLayer` s over ``storage`` rows ``[:batch]``; position ``start``."""

    def __init__(self, storage: SharedKVStorage, num_layers: int, batch: int, start: Tensor):
        super().__init__(layers=[SlotLayer(storage, i, batch, start) for i in range(num_layers)])
        self._storage, self._batch = storage, batch

    def bind(self) -> None:
        """Bind every layer to its rows of the (allocated) storage; layers the model never writes stay unbound."""
        for i, layer in enumerate(self.layers):
            if not layer.is_initialized and i in self._storage.keys:
                layer.bind(self._storage.keys[i][: self._batch], self._storage.values[i][: self._batch])
