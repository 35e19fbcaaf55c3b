"""CUDA graphs of decode and speculative-decode steps per batch bucket: :class:`DecodeGraphs`."""

from .decode import DecodeGraphs, DecodeState
from .kv_cache import SharedKVStorage, SlotCache

__all__ = ["DecodeGraphs", "DecodeState", "SharedKVStorage", "SlotCache"]
