"""Fixed-size adapter slots: load, unload and replace adapters by copying into the LoRA modules' stacked buffers.

The buffers live on the modules (experts: ``lora_a13 [L,E,R,H]``, ``lora_b13 [L,E,2I,R]``, ``lora_a2 [L,E,R,I]``,
``lora_b2 [L,E,H,R]``; dense: ``lora_a [L,R,in]``, ``lora_b [L,out,R]``) and are only ever written in place
(``copy_`` / ``zero_``), never reassigned, so compiled graphs and captured CUDA graphs that hold them stay valid.
Writing slot ``l`` of every module is all-or-nothing from the caller's view: the adapter is validated completely by
the loader before :meth:`AdapterSlots.write` touches any buffer. A module the adapter does not target gets zeros in
that slot; ranks below ``R`` are zero-padded, and each module's ``lora_ranks`` buffer (experts ``[2, L]``: w13, w2;
dense ``[L]``) gets the slot's real rank (0 where the adapter has no weights, and on unload), so the kernels read
only the adapter's own bytes. It is written in place too: a new rank recompiles nothing, and captured graphs see it.

:class:`AdapterWeights` marks a host copy that is known good for these slots (parsed and validated by the PEFT loader,
or checked by :meth:`AdapterSlots.validate`): ``{module name: ExpertsLoRA | LinearLoRA}`` in the slot buffers' dtypes.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn as nn
from torch import Tensor

from .peft_loader import ExpertsLoRA, LinearLoRA, ModuleLoRA

_EXPERTS_BUFFERS = ("lora_a13", "lora_b13", "lora_a2", "lora_b2")
_LINEAR_BUFFERS = ("lora_a", "lora_b")


def _copy_padded(dst: Tensor, src: Optional[Tensor], rank_dim: int, non_blocking: bool = False) -> None:
    """``dst`` (one slot's buffer view) <- ``src`` zero-padded along ``rank_dim``; zeros where ``src`` is None."""
    dst.zero_()
    if src is not None:
        dst.narrow(rank_dim, 0, src.shape[rank_dim]).copy_(src, non_blocking=non_blocking)


def _rank(a: Optional[Tensor], rank_dim: int) -> int:
    return 0 if a is None else a.shape[rank_dim]


def _set_rank(module: nn.Module, slot: int, ranks: tuple[int, ...]) -> None:
    """``module.lora_ranks[..., slot] = ranks`` in place (experts: (w13, w2); dense: (rank,)), if it has them."""
    buffer = getattr(module, "lora_ranks", None)
    if buffer is not None:
        buffer[..., slot].copy_(torch.tensor(ranks if buffer.dim() == 2 else ranks[0], dtype=buffer.dtype))


class AdapterWeights(dict):
    """``{module name: ExpertsLoRA | LinearLoRA}`` already validated for one model's slots, in the slot dtypes, on
    the host (pinned when asked). Made by :meth:`AdapterSlots.validate` or from the PEFT loader's result; writing it
    into a slot needs no further checks. ``owner``: the :class:`AdapterSlots` it was validated for (weights
    validated for another model's slots are checked again; so are weights whose dtypes are no longer the slot
    dtypes, after the model was cast). ``path``: the PEFT folder it was read from, if any (named in the errors of
    such a check). Mutating its tensors afterwards is the caller's risk."""

    def __init__(self, data=(), *, owner: Optional["AdapterSlots"] = None, path: Optional[str] = None):
        super().__init__(data)
        self.owner = owner
        self.path = path

    @property
    def nbytes(self) -> int:
        """Bytes of all factors (what a slot write copies, padding not counted)."""
        return sum(t.nbytes for lora in self.values() for t in vars(lora).values() if t is not None)

    def pinned(self) -> "AdapterWeights":
        """A copy with every factor in pinned (page-locked) host memory, for asynchronous host-to-device copies."""
        return self._map(torch.Tensor.pin_memory)

    def cloned(self) -> "AdapterWeights":
        """A copy with every factor in memory of its own."""
        return self._map(torch.Tensor.clone)

    def _map(self, fn) -> "AdapterWeights":
        return AdapterWeights({name: type(lora)(**{f: None if t is None else fn(t) for f, t in vars(lora).items()})
                               for name, lora in self.items()}, owner=self.owner, path=self.path)


def _check_pair(where: str, a, b, a_shape: tuple, b_shape: tuple, rank_dims: tuple[int, int], max_rank: int,
                dtype: torch.dtype) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """One (A, B) pair of parsed factors: both or neither, shapes ``a_shape``/``b_shape`` (``None`` at the rank dims
    ``rank_dims``; equal ranks <= ``max_rank``), floating, finite after the cast to ``dtype``; returns the cast host
    copies (contiguous, on the CPU)."""
    if a is None and b is None:
        return None, None
    if a is None or b is None:
        raise ValueError(f"weights: {where} has only one factor of a LoRA pair (A and B go together)")
    for factor, t, shape in (("A", a, a_shape), ("B", b, b_shape)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            raise ValueError(f"weights: {where} {factor} must be a floating-point tensor, got "
                             f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
        if t.dim() != len(shape) or any(d is not None and t.shape[i] != d for i, d in enumerate(shape)):
            want = ["r" if d is None else d for d in shape]
            raise ValueError(f"weights: {where} {factor} has shape {list(t.shape)}, expected {want} "
                             f"(made for another base model?)")
    ra, rb = a.shape[rank_dims[0]], b.shape[rank_dims[1]]
    if ra != rb:
        raise ValueError(f"weights: {where} A has rank {ra} but B rank {rb}")
    if ra > max_rank:
        raise ValueError(f"weights: rank {ra} of {where} exceeds max_rank={max_rank} (attach with a larger max_rank)")
    cast = [t.detach().to(device="cpu", dtype=dtype).contiguous() for t in (a, b)]
    for factor, t in zip("AB", cast):
        if not torch.isfinite(t).all():
            raise ValueError(f"weights: {where} {factor} is not finite in the slot dtype {dtype} (NaN, Inf, or "
                             f"values beyond its range)")
    return cast[0], cast[1]


class AdapterSlots:
    """Name -> slot bookkeeping over the slot buffers of ``experts_modules`` and ``linear_modules``.

    Buffers are looked up on the modules at every write (not cached), so moving the model keeps working.
    """

    def __init__(self, experts_modules: dict[str, nn.Module], linear_modules: dict[str, nn.Module], max_loras: int):
        self.experts_modules = experts_modules
        self.linear_modules = linear_modules
        self.max_loras = max_loras
        self._slot_of: dict[str, int] = {}
        self._writes = [0] * max_loras  # per slot: how many writes (loads, clears) it has seen

    def writes(self, slot: int) -> int:
        """A counter of the writes into ``slot`` (loads and clears): tells a slot's content apart from an earlier
        one under the same name (:class:`~moe_lora_compile.serving.AdapterStore` checks its own loads with it)."""
        return self._writes[slot]

    @property
    def names(self) -> dict[str, int]:
        """``{adapter name: slot}`` (a copy)."""
        return dict(self._slot_of)

    def holds(self, name: str, slot: int) -> bool:
        """Whether adapter ``name`` is loaded in ``slot`` (a hot swap keeps it there; an unload does not)."""
        return self._slot_of.get(name) == slot

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
    def validate(self, weights: Mapping[str, ModuleLoRA]) -> AdapterWeights:
        """Check already-parsed factors (the dict :func:`~moe_lora_compile.adapters.load_peft_adapter` returns)
        against these slots and return them as :class:`AdapterWeights` (host copies in the slot dtypes).

        Every module name must be a LoRA target here, experts modules take :class:`ExpertsLoRA` (``a13 [E,r,H]``,
        ``b13 [E,2I,r]``, ``a2 [E,r2,I]``, ``b2 [E,H,r2]``), dense ones :class:`LinearLoRA` (``a [r,in]``,
        ``b [out,r]``); ranks up to the slot rank; every value finite in the slot dtype. ValueError otherwise;
        nothing is written."""
        if not isinstance(weights, Mapping):
            raise ValueError(f"weights must be a dict {{module name: ExpertsLoRA | LinearLoRA}}, got "
                             f"{type(weights).__name__}")
        if not weights:  # as a folder without LoRA tensors: it would serve the base model under the adapter's name
            raise ValueError("weights: no LoRA factors (an empty dict); an adapter needs at least one module")
        out = AdapterWeights(owner=self)
        for name, lora in weights.items():
            if name in self.experts_modules:
                m = self.experts_modules[name]
                if not isinstance(lora, ExpertsLoRA):
                    raise ValueError(f"weights: {name!r} is an experts module and takes ExpertsLoRA, got "
                                     f"{type(lora).__name__}")
                _, E, R, H = m.lora_a13.shape
                I2, I = m.lora_b13.shape[2], m.lora_a2.shape[3]
                a13, b13 = _check_pair(f"{name!r} gate_up", lora.a13, lora.b13, (E, None, H), (E, I2, None), (1, 2),
                                       R, m.lora_b13.dtype)
                a2, b2 = _check_pair(f"{name!r} down", lora.a2, lora.b2, (E, None, I), (E, H, None), (1, 2), R,
                                     m.lora_b2.dtype)
                out[name] = ExpertsLoRA(a13, b13, a2, b2)
            elif name in self.linear_modules:
                m = self.linear_modules[name]
                if not isinstance(lora, LinearLoRA):
                    raise ValueError(f"weights: {name!r} is a dense module and takes LinearLoRA, got "
                                     f"{type(lora).__name__}")
                _, R, n_in = m.lora_a.shape
                n_out = m.lora_b.shape[1]
                a, b = _check_pair(repr(name), lora.a, lora.b, (None, n_in), (n_out, None), (0, 1), R, m.lora_b.dtype)
                out[name] = LinearLoRA(a, b)
            else:
                raise ValueError(f"weights: {name!r} is not a LoRA target of this model ({len(self.experts_modules)} "
                                 f"experts and {len(self.linear_modules)} dense modules)")
        if not any(t is not None and t.numel() for lora in out.values() for t in vars(lora).values()):
            # factors all None or of rank 0: like the empty dict, the base model served under the adapter's name
            raise ValueError("weights: no LoRA factors of rank >= 1 (every module's pair is None or of rank 0); an "
                             "adapter needs at least one")
        return out

    @torch.no_grad()
    def write(self, name: str, slot: int, weights: Mapping[str, ModuleLoRA], *, non_blocking: bool = False) -> None:
        """Copy a validated adapter into ``slot`` of every module (zeros where it has no weights) and record it.

        ``non_blocking``: asynchronous host-to-device copies (from pinned memory) on the current stream."""
        nb = non_blocking
        for module_name, module in self.experts_modules.items():
            lora = weights.get(module_name) or ExpertsLoRA()
            _copy_padded(module.lora_a13[slot], lora.a13, rank_dim=1, non_blocking=nb)
            _copy_padded(module.lora_b13[slot], lora.b13, rank_dim=2, non_blocking=nb)
            _copy_padded(module.lora_a2[slot], lora.a2, rank_dim=1, non_blocking=nb)
            _copy_padded(module.lora_b2[slot], lora.b2, rank_dim=2, non_blocking=nb)
            _set_rank(module, slot, (_rank(lora.a13, 1), _rank(lora.a2, 1)))
        self._zero_fused_b(slot)
        for module_name, module in self.linear_modules.items():
            lora = weights.get(module_name)
            _copy_padded(module.lora_a[slot], lora.a if isinstance(lora, LinearLoRA) else None, rank_dim=0,
                         non_blocking=nb)
            _copy_padded(module.lora_b[slot], lora.b if isinstance(lora, LinearLoRA) else None, rank_dim=1,
                         non_blocking=nb)
            _set_rank(module, slot, (_rank(lora.a if isinstance(lora, LinearLoRA) else None, 0),))
        self._slot_of[name] = slot
        self._writes[slot] += 1

    @torch.no_grad()
    def overflow_under(self, fn) -> Optional[str]:
        """Why the cast ``fn`` (what ``nn.Module._apply`` applies to each tensor, e.g. ``mm.half()``'s) would turn
        a loaded adapter's factors into Inf, or None: the finiteness check of a load in the new dtype, for the
        adapters loaded before the cast (they are scaled: ``lora_alpha / r`` is folded into B)."""
        if not self._slot_of:
            return None
        for module_name, module, buffer in self._buffers():
            t = getattr(module, buffer)
            new = fn(t.new_empty(0)).dtype
            if not new.is_floating_point or torch.finfo(new).max >= torch.finfo(t.dtype).max:
                continue
            for name, slot in sorted(self._slot_of.items(), key=lambda item: item[1]):
                if not torch.isfinite(t[slot].to(new)).all():
                    return (f"adapter {name!r}: {module_name!r} {buffer} holds values up to "
                            f"{t[slot].abs().max().item():.3g} (lora_alpha / r included), beyond {new}'s max "
                            f"{torch.finfo(new).max:.3g}; a load in {new} refuses it the same way (unload it "
                            f"first, or keep this dtype)")
        return None

    def _zero_fused_b(self, slot: int) -> None:
        """Zero ``slot`` of each fused group's block-diagonal ``lora_b_fused`` (:mod:`..models.dense`): its
        off-diagonal blocks are no member's view, so the members' writes never reach them; anything written there
        directly would otherwise outlive every later adapter of the slot."""
        for module in self.linear_modules.values():
            if getattr(module, "leads_fused_group", False):
                module.lora_b_fused[slot].zero_()

    def _buffers(self):
        """``(module name, module, buffer name)`` of every slot buffer holding factors."""
        for module_name, module in self.experts_modules.items():
            for buffer in _EXPERTS_BUFFERS:
                yield module_name, module, buffer
        for module_name, module in self.linear_modules.items():
            for buffer in _LINEAR_BUFFERS:
                yield module_name, module, buffer

    def dtypes(self) -> tuple:
        """The slot buffers' dtypes: a cast outside ``mm`` (e.g. ``mm.model.half()``) changes them without the
        check of :meth:`overflow_under`."""
        return tuple(getattr(m, b).dtype for _, m, b in self._buffers())

    @torch.no_grad()
    def nonfinite(self) -> dict[str, tuple[int, int, str]]:
        """``{adapter name: (slot, its write counter, where)}`` for the loaded adapters whose slots hold Inf / NaN
        (a host sync per buffer and adapter): a load never writes such values, so only a cast that bypassed
        :meth:`overflow_under` did; a later write of the slot (a reload) makes the entry stale."""
        found: dict[str, tuple[int, int, str]] = {}
        for module_name, module, buffer in self._buffers():
            t = getattr(module, buffer)
            for name, slot in self._slot_of.items():
                if name not in found and not torch.isfinite(t[slot]).all():
                    found[name] = (slot, self._writes[slot], f"{module_name!r} {buffer} ({t.dtype})")
        return found

    @torch.no_grad()
    def clear(self, name: str) -> int:
        """Zero the slot of ``name`` everywhere and forget it; returns the freed slot."""
        slot = self.slot_of(name)
        for module in self.experts_modules.values():
            for buffer in _EXPERTS_BUFFERS:
                getattr(module, buffer)[slot].zero_()
            _set_rank(module, slot, (0, 0))
        self._zero_fused_b(slot)
        for module in self.linear_modules.values():
            for buffer in _LINEAR_BUFFERS:
                getattr(module, buffer)[slot].zero_()
            _set_rank(module, slot, (0,))
        del self._slot_of[name]
        self._writes[slot] += 1
        return slot
