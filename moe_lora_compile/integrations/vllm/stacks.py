"""The tensor side of the vLLM plugin, importable without vLLM: vLLM's MoE LoRA stacks as the op reads them, each
token's slot, and one experts call. :mod:`._plugin` wires these into vLLM; the tests call them directly with
vLLM-shaped tensors (also on a GPU whose image has no vLLM).

vLLM's stacks of one MoE layer (L slots, E local experts, r = ``max_lora_rank``, scaling already in B; an adapter of
lower rank fills the first rows / columns, the rest stay zero):

- 3-D (``FusedMoE3DWithLoRA``): w13 A ``(a,)`` ``[L,E,r,H]``, w13 B ``(b,)`` ``[L,E,2I,r]`` (its 2I rows in the
  base w13's gate/up order); w2 A ``(a2,)`` ``[L,E,r,I]``, w2 B ``(b2,)`` ``[L,E,H,r]``. The op's own layout: read
  as it is.
- 2-D (``FusedMoEWithLoRA``): gate and up apart, ``(a_gate, a_up)`` ``[L,E,r,H]`` and ``(b_gate, b_up)``
  ``[L,E,I,r]``; w2 as above. :func:`op_stacks` re-seats the four w13 tensors, once, as views of the op's split
  gate/up form (``lora_b13_split=True``): ``A13 = [A_gate; A_up]`` ``[L,E,2r,H]`` along the rank and
  ``B13 [L,E,2I,r]`` holding B_gate's rows and B_up's where the layout puts gate and up (``[0,I)`` / ``[I,2I)``, or
  ``0::2`` / ``1::2``); the op multiplies gate rows by rank entries ``[0,r)`` and up rows by ``[r,2r)``. No zero
  padding anywhere: the new stacks are exactly as large as vLLM's buffers they replace (which are freed), and w2's
  stacks are read as they are (the op's w2 rank is its own). vLLM's ``set_lora`` / ``reset_lora`` then write
  straight into them.

Base experts: w13 ``[E,2I,H]``, w2 ``[E,H,I]``, optional biases ``[E,2I]`` / ``[E,H]``. vLLM's activation picks the
gate/up order and the op's activation (:func:`op_activation`): ``silu`` (gate rows first), ``swigluoai`` (GPT-OSS:
rows interleaved, the op's ``interleaved`` layout) and ``swigluoai_uninterleave`` (gate rows first) with GPT-OSS's
clamped swiglu (the op's ``gptoss_swiglu``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ...ops.contract import GPTOSS_ALPHA, GPTOSS_LIMIT, NO_ADAPTER
from ...ops.layout import CONCAT, INTERLEAVED, split_gate_up

_PACKED_ATTR = "_moe_lora_op_stacks"  # set on vLLM's gate A tensor once its 2-D stacks are re-seated
_WATCHED_ATTR = "_moe_lora_unmapped_rows_cleared"  # set on a punica wrapper once its update is wrapped


class OpStacks(NamedTuple):
    """The op's LoRA stacks: ``lora_a13 [L,E,R,H]``, ``lora_b13 [L,E,2I,R]`` (``lora_b13_split``: the split
    gate/up form ``[L,E,2I,R/2]``), ``lora_a2 [L,E,R2,I]``, ``lora_b2 [L,E,H,R2]`` (scaling in B)."""

    lora_a13: Tensor
    lora_b13: Tensor
    lora_a2: Tensor
    lora_b2: Tensor
    lora_b13_split: bool = False

    @property
    def tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The four stacks, in the op's argument order."""
        return self.lora_a13, self.lora_b13, self.lora_a2, self.lora_b2


class OpActivation(NamedTuple):
    """How the op computes one of vLLM's MoE activations: the base weights' ``layout`` and the op's ``activation``
    with its ``alpha`` / ``limit`` (read by ``gptoss_swiglu`` only)."""

    layout: str = CONCAT
    activation: str = "silu"
    alpha: float = GPTOSS_ALPHA
    limit: float = GPTOSS_LIMIT


SILU = OpActivation()
# vLLM's ``swigluoai`` (``_C.swigluoai_and_mul`` with its default alpha 1.702 and limit 7.0, which vLLM 0.32's
# unquantized experts never override): GPT-OSS's clamped swiglu on interleaved gate/up rows.
SWIGLUOAI = OpActivation(INTERLEAVED, "gptoss_swiglu", GPTOSS_ALPHA, GPTOSS_LIMIT)


def op_activation(name: str, clamp_limit: Optional[float] = None, alpha: float = 1.0, beta: float = 0.0,
                  situ_betas: Sequence[Optional[float]] = ()) -> OpActivation | str:
    """vLLM's MoE activation (``MoEActivation.value``) and its ``ApplyMoEActivationConfig`` fields -> the op's
    :class:`OpActivation`, or why the op cannot compute it (a string).

    ``silu``: plain SiLU only (no clamp, alpha 1, beta 0). ``swigluoai``: :data:`SWIGLUOAI` (vLLM reads none of
    the config there). ``swigluoai_uninterleave``: ``gate * sigmoid(alpha * gate) * (up + beta)`` on clamped,
    concatenated gate/up, which is ``gptoss_swiglu`` with vLLM's ``alpha`` and ``clamp_limit`` when ``beta == 1``."""
    if any(b is not None for b in situ_betas):
        return "activation with situ betas"
    if name == "silu":
        if clamp_limit is not None or alpha != 1.0 or beta != 0.0:
            return "clamped / scaled activation"
        return SILU
    if name == "swigluoai":
        return SWIGLUOAI
    if name == "swigluoai_uninterleave":
        if clamp_limit is None:
            return "activation swigluoai_uninterleave without a clamp limit"
        if beta != 1.0:
            return f"activation swigluoai_uninterleave with beta {beta} (the op's gptoss_swiglu adds 1 to up)"
        return OpActivation(CONCAT, "gptoss_swiglu", float(alpha), float(clamp_limit))
    return f"activation {name}"


def _same_kind(tensors: Sequence[Tensor]) -> bool:
    first = tensors[0]
    return all(t.dim() == 4 and t.dtype == first.dtype and t.device == first.device for t in tensors)


def _owns_storage(t: Tensor) -> bool:
    """True when ``t`` is the only thing its storage holds (offset 0, every byte its own)."""
    return (t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _reseat(t: Tensor, view: Tensor) -> None:
    """Make tensor object ``t`` a view of ``view``'s storage (same shape), in place, after copying its values, and
    free ``t``'s old storage when ``t`` owned all of it (views vLLM keeps of it elsewhere, only ever read for
    their shape and dtype, keep those; reading their data would raise)."""
    old = t.untyped_storage()
    free_old = _owns_storage(t)
    view.copy_(t)
    t.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
    if free_old:
        old.resize_(0)


@torch.no_grad()
def op_stacks(w13_a: Sequence[Tensor], w13_b: Sequence[Tensor], w2_a: Sequence[Tensor],
              w2_b: Sequence[Tensor], layout: str = CONCAT) -> Optional[OpStacks]:
    """vLLM's stacks of one layer (its tuples, as in ``MoELoRAContext``) as :class:`OpStacks`; None for a layout
    the op does not read (non-gated experts, experts-shared or rank-sharded factors, mismatched shapes).

    3-D: vLLM's tensors themselves. 2-D: the split gate/up form, A13 and B13 stacks that vLLM's four w13 tensors
    become views of (see the module docstring; gate/up rows of B13 in ``layout``'s order, that of the base w13),
    and vLLM's w2 tensors themselves; made on the first call for these tensors and returned again on later calls.
    Nothing is copied per step: vLLM's later writes land in these stacks."""
    if len(w2_a) != 1 or len(w2_b) != 1 or len(w13_a) != len(w13_b) or len(w13_a) not in (1, 2):
        return None
    a2, b2 = w2_a[0], w2_b[0]
    if not _same_kind([*w13_a, *w13_b, a2, b2]):
        return None
    L, E, r, I = a2.shape
    H = b2.shape[2]
    if b2.shape != (L, E, H, r):
        return None
    if len(w13_a) == 1:
        (a13,), (b13,) = w13_a, w13_b
        if a13.shape != (L, E, r, H) or b13.shape != (L, E, 2 * I, r):
            return None
        return OpStacks(a13, b13, a2, b2)
    (a_g, a_u), (b_g, b_u) = w13_a, w13_b
    if any(a.shape != (L, E, r, H) for a in (a_g, a_u)) or any(b.shape != (L, E, I, r) for b in (b_g, b_u)):
        return None
    packed = getattr(a_g, _PACKED_ATTR, None)
    if packed is not None:
        return packed
    like = dict(dtype=a_g.dtype, device=a_g.device)
    a13, b13 = torch.empty(L, E, 2 * r, H, **like), torch.empty(L, E, 2 * I, r, **like)  # every element re-seated
    _reseat(a_g, a13[:, :, :r])
    _reseat(a_u, a13[:, :, r:])
    gate_rows, up_rows = split_gate_up(b13, layout, dim=2)
    _reseat(b_g, gate_rows)
    _reseat(b_u, up_rows)
    packed = OpStacks(a13, b13, a2, b2, lora_b13_split=True)
    setattr(a_g, _PACKED_ATTR, packed)
    return packed


def slot_ids(token_slots: Tensor, num_tokens: int) -> Tensor:
    """The first ``num_tokens`` entries of vLLM's per-token slot buffer (``-1`` = no adapter), as a view when the
    buffer is long enough (a captured graph then reads the buffer's current values); rows past its end get -1."""
    if token_slots.shape[0] >= num_tokens:
        return token_slots[:num_tokens]
    return torch.cat([token_slots, token_slots.new_full((num_tokens - token_slots.shape[0],), NO_ADAPTER)])


def token_slot_buffer(punica_wrapper) -> Tensor:
    """vLLM's persistent per-token slot buffer of a punica wrapper (``_token_lora_indices``, ``-1`` = none), whole,
    or its ``token_lora_indices`` (the mapped rows) where it has none. Past the mapped rows the buffer holds -1
    once :func:`keep_unmapped_rows_unadapted` watches the wrapper."""
    buffer = getattr(punica_wrapper, "_token_lora_indices", None)
    return punica_wrapper.token_lora_indices if buffer is None else buffer


def keep_unmapped_rows_unadapted(punica_wrapper) -> None:
    """Once per punica wrapper (vLLM 0.32's ``_token_lora_indices`` buffer and ``indices_len``): fill the rows past
    the current mapping with -1 (all of them before the first mapping), and again after each ``update_metadata``
    (host side, once per step, before a captured graph replays), so rows that a captured batch pads with read -1,
    not an older step's slot. One small fill per step, none per layer. No-op for a wrapper without those fields."""
    buffer = getattr(punica_wrapper, "_token_lora_indices", None)
    lengths = getattr(punica_wrapper, "indices_len", None)
    if buffer is None or lengths is None or getattr(punica_wrapper, _WATCHED_ATTR, False):
        return
    buffer[lengths[0] or 0:].fill_(NO_ADAPTER)
    update = punica_wrapper.update_metadata

    def update_metadata(*args, **kwargs):
        result = update(*args, **kwargs)
        buffer[punica_wrapper.indices_len[0] or 0:].fill_(NO_ADAPTER)
        return result

    punica_wrapper.update_metadata = update_metadata
    setattr(punica_wrapper, _WATCHED_ATTR, True)


def experts_forward(output: Tensor, hidden_states: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor,
                    topk_ids: Tensor, token_lora_ids: Tensor, stacks: OpStacks, *,
                    activation: OpActivation = SILU, w13_bias: Optional[Tensor] = None,
                    w2_bias: Optional[Tensor] = None, weights_on_input: bool = False,
                    op: Optional[Callable] = None) -> Tensor:
    """One MoE layer with each token's LoRA (vLLM's ``TritonExperts.apply`` contract), written into ``output``.

    output ``[T,H]`` (hidden_states' dtype; any strides, e.g. a view into vLLM's workspace); hidden_states
    ``[T,H]``; w13 ``[E,2I,H]`` (gate/up rows in ``activation.layout``'s order), w2 ``[E,H,I]``; biases ``[E,2I]``
    (same order) / ``[E,H]`` or None; topk_ids/topk_weights ``[T,k]``; token_lora_ids ``[T]`` (``-1`` = none);
    ``weights_on_input``: vLLM already scaled the input by the routing weight (then the output is not scaled
    again). ``op`` defaults to ``torch.ops.moe_lora.fused_moe_lora_out`` (the op's ``out=`` form: on CUDA the
    kernel's final write lands in ``output``, no [T, H] copy); it is called exactly once, as
    ``op(output, hidden_states, ...)``. Returns ``output``."""
    op = torch.ops.moe_lora.fused_moe_lora_out if op is None else op
    if weights_on_input:
        topk_weights = torch.ones_like(topk_weights)
    op(output, hidden_states, topk_ids, topk_weights, token_lora_ids, w13, w2, *stacks.tensors, w13_bias=w13_bias,
       w2_bias=w2_bias, layout=activation.layout, activation=activation.activation, alpha=activation.alpha,
       limit=activation.limit, lora_b13_split=stacks.lora_b13_split)
    return output


__all__ = ["SILU", "SWIGLUOAI", "OpActivation", "OpStacks", "experts_forward",
           "keep_unmapped_rows_unadapted", "op_activation", "op_stacks", "slot_ids", "token_slot_buffer"]
