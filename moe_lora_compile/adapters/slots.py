"""Fixed-size adapter slots: load, unload and replace adapters by copying into the LoRA modules' stacked buffers.

The buffers live on the modules (experts: ``lora_a13 [L,E,R,H]``, ``lora_b13 [L,E,2I,R]``, ``lora_a2 [L,E,R,I]``,
``lora_b2 [L,E,H,R]``; dense: ``lora_a [L,R,in]``, ``lora_b [L,out,R]``) and are only ever written in place
(``copy_`` / ``zero_``), never reassigned, so compiled graphs and captured CUDA graphs that hold them stay valid.
Writing slot ``l`` of every module is all-or-nothing from the caller's view: the adapter is validated completely by
the loader before :meth:`AdapterSlots.write` touches any buffer. A module the adapter does not target gets zeros in
that slot; ranks below ``R`` are zero-padded.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .peft_loader import ExpertsLoRA, LinearLoRA, ModuleLoRA

_EXPERTS_BUFFERS = ("lora_a13", "lora_b13", "lora_a2", "lora_b2")
_LINEAR_BUFFERS = ("lora_a", "lora_b")


def _copy_padded(dst: Tensor, src: Optional[Tensor], rank_dim: int) -> None:
    """``dst`` (one slot's buffer view) <- ``src`` zero-padded along ``rank_dim``; zeros where ``src`` is None."""
    dst.zero_()
    if src is not None:
        dst.narrow(rank_dim, 0, src.shape[rank_dim]).copy_(src)


class AdapterSlots:
    """Name -> slot bookkeeping over the slot buffers of ``experts_modules`` and ``linear_modules``.

    Buffers are looked up on the modules at every write (not cached), so moving the model keeps working.
    """

    def __init__(self, experts_modules: dict[str, nn.Module], linear_modules: dict[str, nn.Module], max_loras: int):
        self.experts_modules = experts_modules
        self.linear_modules = linear_modules
        self.max_loras = max_loras
        self._slot_of: dict[str, int] = {}

    @property
    def names(self) -> dict[str, int]:
        """``{adapter name: slot}`` (a copy)."""
        return dict(self._slot_of)

    def slot_of(self, name: str) -> int:
        if name not in self._slot_of:
            raise KeyError(f"adapters: unknown adapter {name!r}; loaded: {sorted(self._slot_of)}")
        return self._slot_of[name]

    def free_slot(self) -> int:
        """The lowest free slot; ValueError when all ``max_loras`` are taken."""
        used = set(self._slot_of.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        raise ValueError(f"name: all {self.max_loras} adapter slots are in use ({sorted(self._slot_of)}); "
                         f"unload one first or attach with a larger max_loras")

    @torch.no_grad()
    def write(self, name: str, slot: int, weights: dict[str, ModuleLoRA]) -> None:
        """Copy a validated adapter into ``slot`` of every module (zeros where it has no weights) and record it."""
        for module_name, module in self.experts_modules.items():
            lora = weights.get(module_name) or ExpertsLoRA()
            _copy_padded(module.lora_a13[slot], lora.a13, rank_dim=1)
            _copy_padded(module.lora_b13[slot], lora.b13, rank_dim=2)
            _copy_padded(module.lora_a2[slot], lora.a2, rank_dim=1)
            _copy_padded(module.lora_b2[slot], lora.b2, rank_dim=2)
        for module_name, module in self.linear_modules.items():
            lora = weights.get(module_name)
            _copy_padded(module.lora_a[slot], lora.a if isinstance(lora, LinearLoRA) else None, rank_dim=0)
            _copy_padded(module.lora_b[slot], lora.b if isinstance(lora, LinearLoRA) else None, rank_dim=1)
        self._slot_of[name] = slot

    @torch.no_grad()
    def clear(self, name: str) -> int:
        """Zero the slot of ``name`` everywhere and forget it; returns the freed slot."""
        slot = self.slot_of(name)
        for module in self.experts_modules.values():
            for buffer in _EXPERTS_BUFFERS:
                getattr(module, buffer)[slot].zero_()
        for module in self.linear_modules.values():
            for buffer in _LINEAR_BUFFERS:
                getattr(module, buffer)[slot].zero_()
        del self._slot_of[name]
        return slot
