"""Serving on top of :class:`~moe_lora_compile.models.MultiLoRAModel`: the paged adapter store and the continuous-
batching engine with its request API."""

from .drafts import PromptLookupDraft
from .engine import FINISH_REASONS, Request, RequestHandle, RequestsFailed, ServingEngine
from .store import AdapterStore, NoFreeSlot, StoreCounters

__all__ = ["AdapterStore", "FINISH_REASONS", "NoFreeSlot", "PromptLookupDraft", "Request", "RequestHandle",
           "RequestsFailed", "ServingEngine", "StoreCounters"]
