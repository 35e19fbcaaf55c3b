"""``attach(model)``: serve many PEFT LoRA adapters on one transformers model, one adapter (or none) per sequence.

Per-token adapter ids live in one int32 buffer ``token_lora_ids [max_tokens]`` owned by the
:class:`MultiLoRAModel` and registered (the same tensor object, non-persistent) on every LoRA module; per-sequence
slots live in a second one, ``sequence_lora_ids [max_tokens]``, registered on every dense LoRA module. Experts (and
dense inputs flattened to ``[T, in]``) read ``token_lora_ids[:T]``; a dense input with a batch dim ``[B, ..., in]``
maps every row of ``x[b]`` to ``sequence_lora_ids[b]`` (by shape: e.g. DeepSeek-V3's ``kv_b_proj`` runs on all
``ctx`` cached positions, more rows than the forward has tokens). A forward pre-hook on the wrapped model fills both
in place from the per-sequence slots before every forward, prefill and decode alike (decode steps have one token per
sequence), so new adapter mixes never recompile. When a batch has more than ``max_tokens`` tokens both buffers are
reallocated (doubled until they fit) and re-registered everywhere: compiled graphs and CUDA graphs captured before then hold the old buffer, so size
``max_tokens`` for the largest batch (default 8192). Code that runs the wrapped model itself (CUDA-graph capture,
:mod:`moe_lora_compile.graphs`) fills the buffer with ``set_token_lora_ids`` inside ``manual_token_lora_ids()``,
where the hook stays out of the way.

Compile with ``mlc.compile(mm, ...)``: it compiles the wrapped model's forward in place (duck sizing off, the KV
cache made contiguous, a raised recompile limit) and leaves the wrapper and the id-writing pre-hook eager; do not
``torch.compile(mm)`` itself: the wrapper maps adapter names to slots on the host.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import warnings
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch import Tensor

from ..adapters.peft_loader import ExpertsTarget, LinearTarget, load_peft_adapter, recast_parsed
from ..adapters.slots import AdapterSlots, AdapterWeights
from .inputs import as_embedding_ids, check_prompt_values, check_token_ids
from ..ops.contract import NO_ADAPTER
from .dense import (FUSIBLE_GROUPS, LoRALinear, fuse_siblings, fused_views_intact, fusion_problem,
                    point_fused_views)
from .experts import (EXPERTS_IMPLEMENTATION, Llama4MoELoRABlock, add_lora_buffers, experts_geometry,
                      lora_buffer_shapes, register_experts_implementation)
from .families import Family, family_for, find_dense_targets, find_experts, find_zero_width_targets
from .routers import fuse_routers, verified_spec



def _child(model: nn.Module, name: str) -> Optional[nn.Module]:
    """The submodule ``name`` of ``model``, or None if there is none."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


class MultiLoRAModel(nn.Module):
    """A transformers causal LM serving up to ``max_loras`` LoRA adapters at once, chosen per sequence.

    Build it with :func:`attach`. ``forward``/``generate`` take ``adapters=[name or None, ...]`` (one entry per
    sequence; ``None`` = base model; omitted = base model for all).

    Threads: one forward runs at a time. The adapter ids of a call live in shared buffers, so ``forward``,
    ``generate``, ``load_adapter``/``unload_adapter`` (the slot write) and :meth:`manual_token_lora_ids` hold one
    re-entrant lock, ``self.lock``, from writing the ids to the end of the model run: concurrent calls from several
    threads are serialized (each gets exactly the result it would get alone), and a hot swap waits for the running
    forward, which sees exactly one version of the adapter. Calling ``self.model`` directly takes the lock too (for
    its whole run: it waits for a call running in another thread, never reads or overwrites that call's ids) and
    runs every row without an adapter (``-1``; never an earlier call's adapters), unless inside
    :meth:`manual_token_lora_ids`, where the caller writes the ids: take ``self.lock`` yourself, as
    :mod:`moe_lora_compile.graphs` does.
    """

    def __init__(self, model: nn.Module, family: Family, *, max_loras: int, max_rank: int, max_tokens: int,
                 use_ops: bool, target_modules: Optional[Sequence[str]], fuse: Sequence[str] = (),
                 fused_router: bool = False):
        super().__init__()
        self.model = model
        self.family = family
        self.max_loras, self.max_rank = max_loras, max_rank
        device = next(model.parameters()).device
        self.register_buffer("token_lora_ids", torch.full((max_tokens,), NO_ADAPTER, dtype=torch.int32,
                                                          device=device), persistent=False)
        # one slot per sequence: dense LoRA inputs with a batch dim map their rows to sequences by shape
        self.register_buffer("sequence_lora_ids", torch.full((max_tokens,), NO_ADAPTER, dtype=torch.int32,
                                                             device=device), persistent=False)
        self.lock = threading.RLock()  # held across "write ids, run the model" and across adapter loads
        self._pins: dict[str, int] = {}  # adapter name -> in-flight requests decoding with it (a ServingEngine's)
        self._sequence_slots = torch.full((1,), NO_ADAPTER, dtype=torch.int32)
        self._manual_ids = False  # True inside manual_token_lora_ids(): the pre-hook leaves the buffer alone
        self._manual_shape: Optional[tuple[int, int]] = None  # [B, S] of the last set_token_lora_ids / write_lora_ids
        self.fused_routers: list[str] = []  # routers running as moe_lora.route (module names)
        experts = self._attach_experts(use_ops, fused_router=use_ops and fused_router)
        linears = self._attach_linears(target_modules, use_ops)
        # fused sibling groups (member module names, in call order), the groups left unfused -> why
        self.fused_groups: list[tuple[str, ...]] = []
        self.unfused_groups: dict[tuple[str, ...], str] = {}
        self._fused_leaders = self._fuse_siblings(linears, fuse)
        self.slots = AdapterSlots(experts, linears, max_loras)
        self._checked_dtypes, self._nonfinite = self.slots.dtypes(), {}  # see _nonfinite_adapters
        self._experts_targets = {name: self._experts_target(m) for name, m in experts.items()}
        self._linear_targets = {name: LinearTarget(m.in_features, m.out_features) for name, m in linears.items()}
        self._zero_width = find_zero_width_targets(model, family, target_modules)  # (their factors are dropped)
        self._aliases = {old: family.block_attr for old in family.legacy_block_attrs}
        self._hook = model.register_forward_pre_hook(self._fill_token_lora_ids, with_kwargs=True)
        # a direct call of self.model takes self.lock for its whole run (released even if it raises)
        self._direct = threading.local()
        self._post_hook = model.register_forward_hook(self._end_direct_call, always_call=True)

    def __getstate__(self):  # copy.deepcopy / pickle: a lock is not copied, each copy gets its own
        state = self.__dict__.copy()
        state.pop("lock", None)
        state.pop("_direct", None)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self.lock = threading.RLock()
        self._direct = threading.local()
        # deepcopy / pickle copy a fused member's weight (Parameter.__deepcopy__ clones it) and, under pickle, its
        # LoRA views each on its own: point them back at the copied fused buffers (same values), as _apply does
        for leader in self.__dict__.get("_fused_leaders", ()):
            point_fused_views(leader)

    # --- attaching -------------------------------------------------------------------------------------------
    def _attach_experts(self, use_ops: bool, fused_router: bool) -> dict[str, nn.Module]:
        family = self.family
        experts = find_experts(self.model, family)
        if family.is_moe and not experts:
            suffix = f".{family.block_attr}.experts"
            if any(name.endswith(suffix) for name, _ in self.model.named_modules()):
                raise ValueError(f"model: the MoE experts under '{suffix[1:]}' of this {family.name} model are in "
                                 f"no layout this library reads (fused 3-D gate_up_proj / down_proj parameters)")
            warnings.warn(f"model: this {family.name} model has no MoE layer (its config makes every layer dense): "
                          f"only its dense LoRA targets are attached", stacklevel=4)
        if family.activation == "silu" and getattr(self.model.config, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"model: hidden_act {self.model.config.hidden_act!r} is not supported (silu only, "
                             f"which transformers also calls 'swish')")
        for name, module in experts.items():
            add_lora_buffers(module, layout=family.layout, activation=family.activation,
                             routing_weight_on_input=family.routing_weight_on_input, max_loras=self.max_loras,
                             max_rank=self.max_rank, token_lora_ids=self.token_lora_ids, use_ops=use_ops)
            if not family.decorated:
                block_name = name.rpartition(".")[0]
                block = self.model.get_submodule(block_name)
                fuse = fused_router and verified_spec(block.router) is not None
                _set_submodule(self.model, block_name, Llama4MoELoRABlock(block, fused_router=fuse))
                if fuse:
                    self.fused_routers.append(f"{block_name}.router")
        if experts and family.decorated:
            register_experts_implementation()
            self.model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
            if fused_router:
                self.fused_routers = fuse_routers(self.model, [name.rpartition(".")[0] for name in experts])
        return experts

    def _attach_linears(self, target_modules, use_ops: bool) -> dict[str, nn.Module]:
        linears = {}
        for name, linear in find_dense_targets(self.model, self.family, target_modules).items():
            wrapped = LoRALinear(linear, max_loras=self.max_loras, max_rank=self.max_rank,
                                 token_lora_ids=self.token_lora_ids, sequence_lora_ids=self.sequence_lora_ids,
                                 use_ops=use_ops)
            _set_submodule(self.model, name, wrapped)
            linears[name] = wrapped
        return linears

    def _fuse_siblings(self, linears: dict[str, nn.Module], groups: Sequence[str]) -> list[LoRALinear]:
        """Fuse every group of :data:`~moe_lora_compile.models.dense.FUSIBLE_GROUPS` named in ``groups`` whose
        members are children of one module, all wrapped and compatible; returns the leaders (holders of the fused
        buffers). A group whose members all exist, some wrapped, but that cannot be fused is recorded in
        ``unfused_groups`` with the reason."""
        leaders = []
        for parent in dict.fromkeys(name.rpartition(".")[0] for name in linears):
            prefix = f"{parent}." if parent else ""
            for group in groups:
                for leaves in FUSIBLE_GROUPS[group]:
                    names = tuple(prefix + leaf for leaf in leaves)
                    modules = [_child(self.model, n) for n in names]
                    if any(m is None for m in modules) or not any(n in linears for n in names):
                        continue  # not this family's layout (or nothing adapted here)
                    missing = [leaf for leaf, n in zip(leaves, names) if n not in linears]
                    problem = (f"{', '.join(missing)} not a LoRA target (not wrapped)" if missing
                               else fusion_problem(modules))
                    if problem is not None:
                        self.unfused_groups[names] = problem
                        continue
                    fuse_siblings(modules)
                    self.fused_groups.append(names)
                    leaders.append(modules[0])
        return leaders

    def _check_fusion(self) -> None:
        for leader in self._fused_leaders:
            if not fused_views_intact(leader):
                raise RuntimeError(
                    "model: the fused buffers no longer alias the fused linears' weights and LoRA buffers, which "
                    "their forward reads (was the wrapped model moved or cast by itself, e.g. mm.model.to(...)? or "
                    "a member's weight or bias re-bound, e.g. k_proj.weight = nn.Parameter(w) or .data = w?); move "
                    "the MultiLoRAModel (mm.to(...)), which keeps them fused, change weights in place "
                    "(k_proj.weight.copy_(w) under torch.no_grad()), or attach without fusion (fuse=False, "
                    "fuse_qkv=False)")

    def _experts_target(self, module: nn.Module) -> ExpertsTarget:
        E, H, I = experts_geometry(module, self.family.layout)
        return ExpertsTarget(E, H, I, self.family.layout, self.family.per_expert_names, self.family.peft_a_on_output,
                             self.family.per_expert_targets)

    def _lora_modules(self):
        yield from self.slots.experts_modules.values()
        yield from self.slots.linear_modules.values()

    def _apply(self, fn, recurse=True):
        # nn.Module.to() converts each module's copy of the shared buffer separately: re-share ours afterwards.
        # Likewise it converts the fused sibling buffers and their views separately: point the views back at the
        # (converted) fused buffers, which frees the separate copies. A cast that would overflow a loaded adapter
        # (e.g. mm.half() over factors beyond float16's range) is refused first: nothing is converted.
        if hasattr(self, "slots") and (why := self.slots.overflow_under(fn)) is not None:
            raise ValueError(f"model: the cast would make LoRA factors infinite: {why}")
        result = super()._apply(fn, recurse)
        if hasattr(self, "slots"):
            self._share_id_buffers()
            for leader in self._fused_leaders:
                point_fused_views(leader)
        return result

    def _share_id_buffers(self) -> None:
        for module in self._lora_modules():
            module.token_lora_ids = self.token_lora_ids
        for module in self.slots.linear_modules.values():
            module.sequence_lora_ids = self.sequence_lora_ids

    # --- adapters --------------------------------------------------------------------------------------------
    @property
    def adapters(self) -> dict[str, int]:
        """``{adapter name: slot}`` of the loaded adapters."""
        return self.slots.names

    def load_adapter(self, name: str, path: str | os.PathLike, *, replace: bool = False) -> int:
        """Load the PEFT adapter folder ``path`` as ``name``; returns its slot.

        ``replace=True`` hot-swaps an adapter already loaded under ``name`` (same slot, in place), and loads a name
        not loaded yet into a free slot, as a plain load does; without it a taken name is a ValueError. The adapter
        is validated completely, in the slot buffers' dtype, before any slot buffer is written, so a failing load
        leaves every loaded adapter intact.
        """
        self._check_name(name, replace)
        if name not in self.slots.names:
            self.slots.free_slot()  # a full model says so before the folder is read
        return self.load_adapter_weights(name, self.parse_adapter(path), replace=replace)

    def parse_adapter(self, source) -> AdapterWeights:
        """A PEFT adapter folder (read and validated exactly as :meth:`load_adapter` does) or already-parsed factors
        (the dict :func:`~moe_lora_compile.adapters.load_peft_adapter` returns, checked against this model's slots)
        -> :class:`~moe_lora_compile.adapters.slots.AdapterWeights`: host copies in the slot dtypes, ready for
        :meth:`load_adapter_weights`. Touches no slot; ValueError / FileNotFoundError naming the problem.

        This model's own result is returned as is while the slot dtypes are still those it was cast to; after a cast
        of the model (``mm.half()``) it is checked again in the new dtypes (a value past fp16's range would be
        written as Inf), with the error a fresh load gives: a copy in the new dtypes (cast from the parsed copy: a cast
        up keeps the parse's precision)."""
        dtypes = self._slot_dtypes()
        if isinstance(source, AdapterWeights) and source.owner is self.slots:
            if all(t.dtype == dtypes[name] for name, lora in source.items() for t in vars(lora).values()
                   if t is not None):
                return source
            if source.path is not None:  # a folder's factors: its scaled values, re-checked as a load of it
                return AdapterWeights(recast_parsed(source.path, source, dtypes), owner=self.slots, path=source.path)
            return self.slots.validate(source)
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            return AdapterWeights(load_peft_adapter(path, self._experts_targets, self._linear_targets,
                                                    max_rank=self.max_rank, aliases=self._aliases, dtype=dtypes,
                                                    model_type=getattr(self.model.config, "model_type", None),
                                                    model_module=type(self.model).__module__,
                                                    dropped=self._zero_width), owner=self.slots,
                                  path=path)
        if not isinstance(source, Mapping):
            raise TypeError(f"path must be a PEFT adapter folder (str or os.PathLike) or parsed factors (a dict "
                            f"{{module name: ExpertsLoRA | LinearLoRA}}), got {type(source).__name__}")
        return self.slots.validate(source)

    def _slot_dtypes(self) -> dict[str, torch.dtype]:
        """``{LoRA module name: its slot buffers' dtype}`` now (the model may have been cast since a parse)."""
        dtypes = {name: m.lora_b13.dtype for name, m in self.slots.experts_modules.items()}
        dtypes.update({name: m.lora_b.dtype for name, m in self.slots.linear_modules.items()})
        return dtypes

    def load_adapter_weights(self, name: str, weights, *, replace: bool = False, slot: Optional[int] = None,
                             non_blocking: bool = False) -> int:
        """Write already-parsed factors (:meth:`parse_adapter`'s result, or a dict it accepts: then validated first)
        into a slot as ``name``; returns the slot. ``replace`` as in :meth:`load_adapter`; ``slot``: a free slot to
        use (default: the lowest free one; for ``replace``, the adapter's own). ``non_blocking``: asynchronous
        copies on the current stream (from pinned host memory; the caller orders the streams). Written in place
        under ``self.lock``; any error leaves every slot as it was."""
        self._check_name(name, replace)
        weights = self.parse_adapter(weights)
        if slot is not None and (not isinstance(slot, int) or isinstance(slot, bool)
                                 or not 0 <= slot < self.max_loras):
            raise ValueError(f"slot must be an int in [0, {self.max_loras}), got {slot!r}")
        with self.lock:  # waits for a running forward: a hot swap never lands in the middle of one
            self._check_fusion()
            self._check_name(name, replace)  # another thread may have loaded it meanwhile
            if name in self.slots.names:
                self._check_unpinned(name, "replace")
                if slot is not None and slot != self.slots.slot_of(name):
                    raise ValueError(f"slot: adapter {name!r} is loaded in slot {self.slots.slot_of(name)}; "
                                     f"replace keeps it there (unload it to move it to slot {slot})")
                slot = self.slots.slot_of(name)
            elif slot is None:
                slot = self.slots.free_slot()
            else:
                holder = next((n for n, s in self.slots.names.items() if s == slot), None)
                if holder is not None:
                    raise ValueError(f"slot: slot {slot} holds adapter {holder!r}; unload it first")
            self.slots.write(name, slot, weights, non_blocking=non_blocking)
        return slot

    def _check_name(self, name: str, replace: bool) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"name must be a non-empty str, got {name!r}")
        if name in self.slots.names and not replace:
            raise ValueError(f"name: adapter {name!r} is already loaded in slot {self.slots.slot_of(name)}; "
                             f"pass replace=True to hot-swap it")
        if name in self.slots.names:
            self._check_unpinned(name, "replace")  # before the folder is read (checked again under the lock)

    def unload_adapter(self, name: str) -> None:
        """Zero the slot of ``name`` and free it; KeyError if not loaded, RuntimeError while requests of a
        :class:`~moe_lora_compile.serving.ServingEngine` decode with it. Waits for a running forward."""
        with self.lock:
            self._check_fusion()
            self._check_unpinned(name, "unload")
            self.slots.clear(name)

    def _pin_adapter(self, name: str) -> int:
        """``name``'s slot, marked in use by one more in-flight request (a serving engine's): unloading or replacing
        it is refused until :meth:`_unpin_adapter`. KeyError if not loaded."""
        with self.lock:
            slot = self.slots.slot_of(name)
            self._pins[name] = self._pins.get(name, 0) + 1
            return slot

    def _unpin_adapter(self, name: str) -> None:
        with self.lock:
            self._pins[name] -= 1
            if not self._pins[name]:
                del self._pins[name]

    def _check_unpinned(self, name: str, action: str) -> None:
        if self._pins.get(name):
            raise RuntimeError(f"name: cannot {action} adapter {name!r}: {self._pins[name]} in-flight request(s) "
                               f"decode with it; let them finish (or cancel them) first")

    # --- running ---------------------------------------------------------------------------------------------
    def slots_for(self, adapters: Optional[Sequence[Optional[str]]], batch_size: int) -> list[int]:
        """One slot per sequence (``-1`` = none) from ``adapters``, validated: length, names."""
        if adapters is None:
            return [NO_ADAPTER] * batch_size
        if isinstance(adapters, (bytes, bytearray, set, frozenset, Mapping)) or not (
                hasattr(adapters, "__len__") and hasattr(adapters, "__getitem__")):
            # a set / dict has no row order (a set of names would give rows arbitrary adapters), bytes are ints
            raise TypeError(f"adapters must be a list (or tuple) with one adapter name (or None) per sequence, in "
                            f"row order, got {type(adapters).__name__}")
        if isinstance(adapters, str) or len(adapters) != batch_size:
            raise ValueError(f"adapters must be a list with one adapter name (or None) per sequence "
                             f"({batch_size}), got {adapters!r}")
        bad = next((a for a in adapters if a is not None and not isinstance(a, str)), None)
        if bad is not None:
            raise TypeError(f"adapters: entries are adapter names (str) or None, got {bad!r} "
                            f"({type(bad).__name__}); slot ids are not accepted")
        slots = [NO_ADAPTER if a is None else self.slots.slot_of(a) for a in adapters]
        broken = self._nonfinite_adapters()
        bad = next((a for a in adapters if a in broken), None)
        if bad is not None:
            raise ValueError(f"adapters: adapter {bad!r} holds infinite factors ({broken[bad]}): the model was cast "
                             f"outside mm (e.g. mm.model.half() or model.to(...) after attach), and its scaled "
                             f"factors (lora_alpha / r folded into B) do not fit the new dtype; unload it or cast "
                             f"back and reload it (mm.half() / mm.to(dtype) refuse such a cast up front)")
        return slots

    def _nonfinite_adapters(self) -> dict[str, str]:
        """``{name: where}`` of the loaded adapters made infinite by a cast that bypassed :meth:`_apply`'s check:
        looked for (:meth:`AdapterSlots.nonfinite`, host syncs) only when the slot buffers' dtypes changed since
        the last look, so a call costs a tuple of dtypes; an adapter written since (a reload) is dropped."""
        dtypes = self.slots.dtypes()
        if dtypes != self._checked_dtypes:
            self._nonfinite, self._checked_dtypes = self.slots.nonfinite(), dtypes
        return {name: where for name, (slot, writes, where) in self._nonfinite.items()
                if self.slots.names.get(name) == slot and self.slots.writes(slot) == writes}

    def _select(self, adapters: Optional[Sequence[Optional[str]]], batch_size: int) -> None:
        """Per-sequence slots from ``adapters`` (validated: length, names) for the next forward/generate."""
        self._sequence_slots = torch.tensor(self.slots_for(adapters, batch_size), dtype=torch.int32)

    @torch.no_grad()
    def set_token_lora_ids(self, adapters: Optional[Sequence[Optional[str]]], seq_len: int, *,
                           batch_size: Optional[int] = None) -> Tensor:
        """Write ``token_lora_ids[:batch_size * seq_len]`` and ``sequence_lora_ids[:batch_size]`` in place (host-to-device
        copies) and return the token view.

        Sequence ``b < len(adapters)`` gets ``adapters[b]``'s slot on each of its ``seq_len`` tokens (row-major, as
        the model flattens ``[B, S]``); padding sequences ``len(adapters) <= b < batch_size`` get ``-1``.
        ``adapters=None`` means no adapter on every row (then ``batch_size`` is required). Names are validated
        exactly as in :meth:`forward`. Never reallocates the buffer: more tokens than it holds is a ValueError.
        For callers that run the wrapped model themselves, e.g. inside :meth:`manual_token_lora_ids`.
        """
        if adapters is None and batch_size is None:
            raise ValueError("batch_size is required when adapters is None")
        if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
            raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
        num_real = batch_size if adapters is None else 0 if isinstance(adapters, str) else len(adapters)
        slots = self.slots_for(adapters, num_real)  # raises for a bare str, like forward()
        batch_size = num_real if batch_size is None else batch_size
        if batch_size < num_real:
            raise ValueError(f"batch_size ({batch_size}) is smaller than the number of adapters entries ({num_real})")
        slots += [NO_ADAPTER] * (batch_size - num_real)
        num_tokens = batch_size * seq_len
        if num_tokens > self.token_lora_ids.numel():
            raise ValueError(f"seq_len: {batch_size} x {seq_len} tokens exceed token_lora_ids "
                             f"({self.token_lora_ids.numel()}); attach with a larger max_tokens")
        per_sequence = torch.tensor(slots, dtype=torch.int32)
        self.sequence_lora_ids[:batch_size].copy_(per_sequence)
        view = self.token_lora_ids[:num_tokens]
        view.copy_(per_sequence.repeat_interleave(seq_len))
        self._manual_shape = (batch_size, seq_len)
        return view

    @torch.no_grad()
    def write_lora_ids(self, token_lora_ids: Tensor, tokens_per_sequence: int) -> None:
        """Copy per-token slots ``token_lora_ids [B * q]`` (int32, on the model's device, sequence-major) into
        ``self.token_lora_ids[:B * q]`` and each sequence's slot (its first token's) into
        ``self.sequence_lora_ids[:B]``, in place: device-to-device, no host sync, never a reallocation. For steps
        replayed from CUDA graphs (:mod:`moe_lora_compile.graphs`), whose ids were resolved once, at prefill."""
        if not isinstance(tokens_per_sequence, int) or isinstance(tokens_per_sequence, bool) \
                or tokens_per_sequence < 1:
            raise ValueError(f"tokens_per_sequence must be an int >= 1, got {tokens_per_sequence!r}")
        if token_lora_ids.is_floating_point() or token_lora_ids.dtype == torch.bool:  # a float id was truncated
            raise ValueError(f"token_lora_ids must hold integer slot ids (int32), got {token_lora_ids.dtype}")
        n = token_lora_ids.numel()
        if n % tokens_per_sequence or n > self.token_lora_ids.numel():
            raise ValueError(f"token_lora_ids: {n} ids are not whole sequences of {tokens_per_sequence} tokens "
                             f"within the {self.token_lora_ids.numel()} the buffers hold")
        self.token_lora_ids[:n].copy_(token_lora_ids)
        self.sequence_lora_ids[: n // tokens_per_sequence].copy_(token_lora_ids[::tokens_per_sequence])
        self._manual_shape = (n // tokens_per_sequence, tokens_per_sequence)

    @contextlib.contextmanager
    def manual_token_lora_ids(self):
        """Within this context the forward pre-hook leaves ``token_lora_ids`` alone: the caller fills it (e.g. with
        :meth:`set_token_lora_ids`) before calling ``self.model`` directly. Needed while capturing CUDA graphs,
        where the hook's host-to-device copy must not be recorded."""
        with self.lock:
            previous, self._manual_ids = self._manual_ids, True
            try:
                yield self
            finally:
                self._manual_ids = previous

    def _fill_token_lora_ids(self, module, args, kwargs):
        """Forward pre-hook: ``sequence_lora_ids[:B]`` <- each sequence's slot; ``token_lora_ids[:B*S]`` <- the same,
        repeated over its S tokens."""
        # self.model called directly, not from mm(...) / generate / manual ids (compiled steps: DecodeGraphs and
        # RowGraphs, which hold the lock; traced, so no lock calls there)
        direct = not torch.compiler.is_compiling() and not self.lock._is_owned()
        if self._fused_leaders and not torch.compiler.is_compiling():
            self._check_fusion()  # (before the lock) a re-bound member weight would be ignored by the fused forward
        if direct:  # wait for a call running in another thread; run without its adapters (released after the run)
            self.lock.acquire()
            self._direct.depth = getattr(self._direct, "depth", 0) + 1
        if torch.is_grad_enabled() and self.model.training and any(
                getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()):
            # the ids live in buffers every forward overwrites: a checkpointed layer recomputed in backward() after
            # another forward (a reference pass, say) would read that forward's adapters, and the gradients be wrong
            raise RuntimeError("model: gradient checkpointing is on (model.gradient_checkpointing_enable()) in "
                               "training mode with grad enabled: not supported, the recomputed layers would read a "
                               "later forward's adapter ids; disable it (model.gradient_checkpointing_disable()), or "
                               "run under torch.no_grad() / mm.eval()")
        tokens = kwargs.get("inputs_embeds")
        if tokens is None:
            tokens = kwargs.get("input_ids", args[0] if args else None)
        if self._manual_ids:  # (after the check: manual ids are rewritten in place between forwards too)
            written = self._manual_shape
            if (not torch.compiler.is_compiling() and written is not None and isinstance(tokens, Tensor)
                    and tokens.dim() >= 2 and (tokens.shape[1] != written[1] or tokens.shape[0] > written[0])):
                raise ValueError(f"model: a forward of {tokens.shape[0]} x {tokens.shape[1]} tokens inside "
                                 f"manual_token_lora_ids(), whose ids were written for {written[0]} x {written[1]} "
                                 f"(the experts read the first B x S of them, sequence-major: rows would take other "
                                 f"rows' adapters); write them for this shape first")
            return
        if not isinstance(tokens, Tensor) or tokens.dim() < 2:
            return  # no ids to write: the model's own check names the problem
        batch, seq_len = tokens.shape[0], tokens.shape[1]
        per_sequence = torch.full((1,), NO_ADAPTER, dtype=torch.int32) if direct else self._sequence_slots
        if batch != per_sequence.numel():  # generate(num_beams / num_return_sequences) repeats each sequence
            if batch % per_sequence.numel():
                raise ValueError(f"adapters: {per_sequence.numel()} entries for a batch of {batch} sequences")
            per_sequence = per_sequence.repeat_interleave(batch // per_sequence.numel())
        num_tokens = batch * seq_len
        if num_tokens > self.token_lora_ids.numel():
            self._grow(num_tokens)
        per_sequence = per_sequence.to(self.token_lora_ids.device)
        self.sequence_lora_ids[:batch].copy_(per_sequence)
        self.token_lora_ids[:num_tokens].copy_(per_sequence.repeat_interleave(seq_len))

    def _end_direct_call(self, module, args, output):
        if not torch.compiler.is_compiling() and getattr(self._direct, "depth", 0):
            self._direct.depth -= 1
            self.lock.release()

    def _grow(self, num_tokens: int) -> None:
        size = old = self.token_lora_ids.numel()
        while size < num_tokens:
            size *= 2
        from ..compile import is_compiled

        if is_compiled(self) or getattr(self, "_compiled_steps", False):
            # the compiled code (mlc.compile, or compiled DecodeGraphs / RowGraphs steps) guards on the buffers' size
            warnings.warn(f"a forward of {num_tokens} tokens exceeds max_tokens: the per-token adapter-id buffers grow "
                          f"from {old} to {size}, and every graph compiled for the old size compiles again as its "
                          f"shapes come (each batch class, prefill and decode steps; captured CUDA graphs keep the "
                          f"old buffers); attach with max_tokens >= the largest batch x length", RuntimeWarning,
                          stacklevel=2)
        device = self.token_lora_ids.device
        with torch.inference_mode(False):  # a forward under inference_mode must not leave inference tensors here:
            # every later forward outside it writes them in place
            self.token_lora_ids = torch.full((size,), NO_ADAPTER, dtype=torch.int32, device=device)
            self.sequence_lora_ids = torch.full((size,), NO_ADAPTER, dtype=torch.int32, device=device)
        self._share_id_buffers()

    def _batch_size(self, input_ids: Optional[Tensor], kwargs: dict) -> int:
        """The batch of ``input_ids [B, S]`` (integer ids) or ``inputs_embeds [B, S, D]`` (floating); a ValueError
        naming the argument for anything else (shape checks only: no host sync)."""
        embeds = kwargs.get("inputs_embeds")
        name, tokens, dims = ("input_ids", input_ids, 2) if input_ids is not None else ("inputs_embeds", embeds, 3)
        if tokens is None:
            raise ValueError("input_ids (or inputs_embeds) is required")
        if dims == 2:
            check_token_ids(name, tokens)
        elif not isinstance(tokens, Tensor) or tokens.dim() != 3 or not tokens.is_floating_point():
            got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"{name} must be [batch, seq_len, hidden] floats, got {got}")
        if tokens.shape[0] < 1 or tokens.shape[1] < 1:
            raise ValueError(f"{name} must have batch, seq_len >= 1, got {tuple(tokens.shape)}")
        return tokens.shape[0]

    @contextlib.contextmanager
    def _selected(self, adapters: Optional[Sequence[Optional[str]]], batch_size: int):
        """Within: the pre-hook applies ``adapters`` (validated). After it, the previous selection again (at the top
        level: none), so a later direct call of ``self.model`` runs the base model, never this call's adapters."""
        with self.lock:
            if self._manual_ids and adapters is not None:  # the pre-hook would leave the caller's ids in place
                raise ValueError("adapters: inside manual_token_lora_ids() the forward reads the ids written with "
                                 "set_token_lora_ids / write_lora_ids, and would ignore these; pass adapters=None "
                                 "there, or call outside the context")
            previous = self._sequence_slots
            self._select(adapters, batch_size)
            try:
                yield
            finally:
                self._sequence_slots = previous

    def forward(self, input_ids: Optional[Tensor] = None, *, adapters: Optional[Sequence[Optional[str]]] = None,
                **kwargs):
        """The wrapped model's forward (``input_ids [B,S]`` -> its output, e.g. ``.logits [B,S,V]``) with
        ``adapters[b]`` applied to sequence ``b``. Shapes and dtypes are checked, not the ids' values (that would be a
        host sync per forward): an id outside the vocabulary fails in the embedding (an IndexError on the CPU, a
        device-side assert on CUDA); :meth:`generate` checks them."""
        _refuse_adapter_synonyms(kwargs)
        batch = self._batch_size(input_ids, kwargs)
        if input_ids is not None:
            input_ids = as_embedding_ids(input_ids)
        with self._selected(adapters, batch):
            return self.model(input_ids=input_ids, **kwargs)

    @torch.no_grad()
    def generate(self, input_ids: Optional[Tensor] = None, *, adapters: Optional[Sequence[Optional[str]]] = None,
                 **kwargs):
        """``model.generate`` (KV cache as usual) with ``adapters[b]`` applied to sequence ``b`` at every step.
        Prompt ids outside the vocabulary are a ValueError (one host sync, before anything runs). ``inputs=`` (the
        name of transformers' first argument) is taken for ``input_ids``. ``cache_implementation="paged"`` is
        refused: transformers then runs its continuous batching, whose forwards pack every sequence into one row
        (from a thread of its own), so per-row adapters cannot apply (:class:`~moe_lora_compile.serving.ServingEngine`
        is continuous batching with them)."""
        if input_ids is None and "inputs" in kwargs:
            input_ids = kwargs.pop("inputs")
        if kwargs.get("cache_implementation") == "paged":
            raise NotImplementedError(
                "generate: cache_implementation='paged' switches transformers to continuous batching, which packs "
                "all sequences into one row and cannot apply per-row adapters (it waited forever on the model's "
                "lock); use the default cache or cache_implementation='static', or "
                "moe_lora_compile.serving.ServingEngine for continuous batching with adapters")
        _refuse_adapter_synonyms(kwargs)
        batch = self._batch_size(input_ids, kwargs)
        if input_ids is not None:
            input_ids = as_embedding_ids(input_ids)
            check_prompt_values(input_ids, kwargs.get("attention_mask"),
                                self.model.get_input_embeddings().num_embeddings, left_padding=False)
        with self._selected(adapters, batch):
            return self.model.generate(input_ids=input_ids, **kwargs)


# keywords of other libraries' mixed-adapter calls (PEFT's adapter_names) and their likely misspellings: the wrapped
# transformers forward takes any keyword and drops those it does not know, so every row ran the base model
_ADAPTER_SYNONYMS = ("adapter_names", "adapter_name", "adapter", "lora_adapters", "lora_ids", "adapter_ids")


def _refuse_adapter_synonyms(kwargs: dict) -> None:
    given = [k for k in _ADAPTER_SYNONYMS if k in kwargs]
    if given:
        raise TypeError(f"{given[0]}=: not a keyword of this model (it would be dropped, every row run without an "
                        f"adapter); name each row's adapter with adapters=[name or None, ...]")


def attach(model: nn.Module, *, max_loras: int = 8, max_rank: int = 64, max_tokens: int = 8192,
           use_ops: bool = True, target_modules: Optional[Sequence[str]] = None,
           fuse_qkv: bool = False, fuse: Union[bool, str, Sequence[str]] = False,
           fused_router: bool = True) -> MultiLoRAModel:
    """Prepare a transformers causal LM (modified in place) for multi-LoRA serving.

    Routes its MoE experts through our experts implementation and wraps its dense LoRA targets (the family's
    attention / MLP / shared-expert linears, or the leaf names in ``target_modules``) with slot buffers of
    ``max_loras`` adapters of rank up to ``max_rank``; ``max_tokens``: the length of the per-token adapter-id buffers,
    the most tokens one forward takes without reallocating them (see the module docstring: size it for the largest
    batch when compiled code or CUDA graphs are in use). By default (``use_ops=True``) they call
    ``torch.ops.moe_lora.*`` directly: the Triton kernels on CUDA, eager or compiled (the ops are opaque to
    ``torch.compile``, no pass needed), the reference impls on the CPU. ``use_ops=False`` emits the plain-PyTorch
    references (``moe_lora_compile.ops.reference``, the definition of correctness) instead, which the compile pass
    turns back into the fused ops (what the pass's tests and the demo exercise). Move the model to its device and dtype first. The base
    model's parameters are frozen (``requires_grad=False``): the ops take no gradient for base weights, and a model
    fresh from ``from_pretrained`` would otherwise make ``mm(...)`` outside ``torch.no_grad()`` an error.

    ``fuse`` computes sibling LoRA linears that the model calls on the same input in one ``lora_linear`` call
    over fused buffers: ``True`` fuses every group in :data:`~moe_lora_compile.models.dense.FUSIBLE_GROUPS`, or
    name some (a str or a list): ``"qkv"`` (an attention's q/k/v projections), ``"gate_up"`` (gate/up of dense MLPs
    and shared experts), ``"mla"`` (DeepSeek's ``q_a_proj`` or ``q_proj`` with ``kv_a_proj_with_mqa``).
    ``fuse_qkv=True`` is ``"qkv"``. The leader (first member) holds ``weight_fused [N, in]``, ``lora_a_fused [L,
    nR, in]`` and a block-diagonal ``lora_b_fused [L, N, nR]``; the members' own weights and slot buffers become
    views of them, so state-dict names and values, adapter loading and hot swaps are unchanged (see
    :mod:`moe_lora_compile.models.dense`). Same result as unfused (the fused call's rows are the members' rows).
    Fused only where all members are wrapped (LoRA targets), with the same ``in_features``, dtype and device and
    biases on all or none; other groups stay unfused and ``mm.unfused_groups`` says why (e.g. ``target_modules``
    naming only some of q/k/v); ``mm.fused_groups`` lists the fused ones. Moving or casting after attach:
    ``mm.to(...)`` keeps the fusion (it re-points the views at the converted fused buffers); moving the wrapped model
    alone (``mm.model.to(...)``) breaks it, and the next ``load_adapter`` / ``unload_adapter`` raises. Default off:
    ``"qkv"`` has run on the H200 (GPU tests, the whole-model benchmark), but fused and unfused have not been
    compared in one run yet; ``"gate_up"`` and ``"mla"`` have run on the CPU and in Triton's interpreter only.

    ``fused_router`` (with ``use_ops=True``): the MoE routers whose transformers forward has been verified
    (GPT-OSS, Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, Llama-4; see :mod:`moe_lora_compile.models.routers`) run as
    one ``torch.ops.moe_lora.route`` call each (one Triton launch at decode on CUDA), returning what transformers'
    router returns; ``mm.fused_routers`` names them. DeepSeek-V3's router stays on transformers' code.
    """
    for arg, value in (("max_loras", max_loras), ("max_rank", max_rank), ("max_tokens", max_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arg} must be a positive int, got {value!r}")
    for arg, value in (("fuse_qkv", fuse_qkv), ("fused_router", fused_router), ("use_ops", use_ops)):
        if not isinstance(value, bool):
            raise TypeError(f"{arg} must be a bool, got {value!r}")
    if target_modules is not None and (isinstance(target_modules, (str, bytes))
                                       or not all(isinstance(t, str) for t in target_modules)):
        raise TypeError(f"target_modules must be a list of leaf names such as ['q_proj', 'v_proj'], got "
                        f"{target_modules!r}")
    groups = _fusion_groups(fuse) + (("qkv",) if fuse_qkv else ())
    if isinstance(model, MultiLoRAModel) or any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("model: already attached")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):  # (its names gain '_orig_mod.')
        raise ValueError("model: a torch.compile'd module, whose module names start with '_orig_mod.' where "
                         "PEFT adapter keys have none: attach the model itself (attach(model._orig_mod)), then "
                         "compile with mlc.compile(mm)")
    peft_layers = [name for name, m in model.named_modules() if type(m).__module__.startswith("peft.")]
    if peft_layers:  # its LoRA layers would run for every token, adapters=None included, and hide the targets
        where = "is a PeftModel" if not peft_layers[0] else f"holds PEFT layers ({peft_layers[0]!r}, ...)"
        raise ValueError(f"model: {where}: a model get_peft_model changed runs its LoRA for every token; attach "
                         f"takes the base model: pass peft_model.unload() "
                         f"(or merge_and_unload() to serve one adapter merged into the weights), then load each "
                         f"adapter folder with mm.load_adapter(name, folder)")
    family = family_for(model)
    find_dense_targets(model, family, target_modules)  # unknown names refused before the model is touched
    _refuse_oversized_slots(model, family, max_loras, max_rank, max_tokens, target_modules)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)
    try:
        # the slot, id and fused buffers are written in place by every later load and forward: never inference
        # tensors, even when attach runs under torch.inference_mode() (every load outside it failed then)
        with torch.inference_mode(False):
            return MultiLoRAModel(model, family, max_loras=max_loras, max_rank=max_rank, max_tokens=max_tokens,
                                  use_ops=use_ops, target_modules=target_modules,
                                  fuse=tuple(g for g in FUSIBLE_GROUPS if g in groups), fused_router=fused_router)
    except BaseException:  # refused (the checks run before any module is replaced): the model as it was
        for p in trainable:
            p.requires_grad_(True)
        raise


def _slot_bytes(model: nn.Module, family: Family, max_loras: int, max_rank: int, max_tokens: int,
                target_modules) -> tuple[int, torch.device]:
    """Bytes of the zeroed buffers attach allocates (expert and dense LoRA slots, the two id buffers; the fused
    siblings' copies not counted), and the device they go on."""
    device = next(model.parameters()).device
    total = 2 * 4 * max_tokens  # token_lora_ids, sequence_lora_ids: int32
    for experts in find_experts(model, family).values():
        weight = getattr(experts, "gate_up_proj", None)
        size = (weight if weight is not None else experts.gate_up_proj_bias).element_size()
        shapes = lora_buffer_shapes(max_loras, *experts_geometry(experts, family.layout), max_rank).values()
        total += sum(math.prod(shape) for shape in shapes) * size
    for linear in find_dense_targets(model, family, target_modules).values():
        total += max_loras * max_rank * (linear.in_features + linear.out_features) * linear.weight.element_size()
    return total, device


def _device_memory(device: torch.device) -> Optional[int]:
    """Bytes a new allocation on ``device`` can have at most (CUDA: what is free now; CPU: the physical memory),
    None where unknown."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        if device.type == "cpu":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None


def _refuse_oversized_slots(model, family, max_loras, max_rank, max_tokens, target_modules) -> None:
    """A ValueError naming the sizes when the slot buffers cannot fit the device, before any is allocated (on the
    CPU a zeroed buffer larger than the memory got the process killed, with no Python error)."""
    need, device = _slot_bytes(model, family, max_loras, max_rank, max_tokens, target_modules)
    have = _device_memory(device)
    if have is not None and need > have:
        where = "free on " + str(device) if device.type == "cuda" else "of memory on this machine"
        raise ValueError(f"max_loras={max_loras}, max_rank={max_rank}, max_tokens={max_tokens}: the LoRA slot and id "
                         f"buffers would take {need / 2**30:.1f} GiB, over the {have / 2**30:.1f} GiB {where}; "
                         f"lower max_loras, max_rank (the largest rank an adapter may have) or max_tokens")


def _fusion_groups(fuse) -> tuple[str, ...]:
    """``attach``'s ``fuse`` (a bool, a group name or a list of them) -> group names; errors name the problem."""
    if isinstance(fuse, bool):
        return tuple(FUSIBLE_GROUPS) if fuse else ()
    names = (fuse,) if isinstance(fuse, str) else fuse
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"fuse must be a bool, a group name or a list of them, got {fuse!r}")
    unknown = sorted(set(names) - set(FUSIBLE_GROUPS))
    if unknown:
        raise ValueError(f"fuse: unknown group(s) {unknown}; choose from {list(FUSIBLE_GROUPS)}")
    return tuple(names)
