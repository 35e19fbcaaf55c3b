"""Serving on top of :class:`~moe_lora_compile.models.MultiLoRAModel`: the paged adapter store."""

from .store import AdapterStore, StoreCounters

__all__ = ["AdapterStore", "StoreCounters"]
