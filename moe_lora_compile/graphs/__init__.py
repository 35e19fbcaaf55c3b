"""CUDA graphs of decode and speculative-decode steps per batch bucket (:class:`DecodeGraphs`), and per-row steps
for continuous batching (:class:`RowGraphs`)."""

from .decode import DecodeGraphs, DecodeState
from .kv_cache import SharedKVStorage, SlotCache
from .rows import RowGraphs

__all__ = ["DecodeGraphs", "DecodeState", "RowGraphs", "SharedKVStorage", "SlotCache"]
