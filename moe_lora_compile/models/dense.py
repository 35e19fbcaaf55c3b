"""Dense linear with per-token multi-LoRA: a drop-in for a target ``nn.Linear``.

Keeps the original ``weight`` / ``bias`` parameters (same objects, same state-dict names) and adds slot buffers
``lora_a [L,R,in]``, ``lora_b [L,out,R]`` plus the two shared id buffers of the :class:`MultiLoRAModel`:
``token_lora_ids`` (one slot per token of the forward, row-major over ``[B, S]``) and ``sequence_lora_ids`` (one
slot per sequence of the batch).

Which input row belongs to which sequence is read from the input's shape, never from adapter state:

- ``x [T, in]`` (2-D: flattened tokens, e.g. shared experts after ``view(-1, H)``): row ``t`` uses
  ``token_lora_ids[t]``;
- ``x [B, ..., in]`` (3-D or more): the leading dim is the batch, so every row of ``x[b]`` uses
  ``sequence_lora_ids[b]``, whatever the middle dims hold. That covers inputs whose row count is not the forward's
  token count, such as DeepSeek-V3's ``kv_b_proj``, applied after the cache update to the whole cached latent
  ``[B, 1, ctx, r]``.

Fused q/k/v (``attach(..., fuse_qkv=True)``, :func:`fuse_qkv`): an attention's ``q_proj``, ``k_proj`` and
``v_proj`` share one ``lora_linear`` call. The q module holds the fused buffers (non-persistent):
``weight_qkv [q+k+v, in]``, ``bias_qkv [q+k+v]`` (or None), ``lora_a_qkv [L, 3R, in]`` (q's rank block rows
``0:R``, k's ``R:2R``, v's ``2R:3R``) and ``lora_b_qkv [L, q+k+v, 3R]``, block-diagonal (the off-diagonal blocks are
zero and are never written). Each projection's ``weight`` / ``bias`` (the same Parameter objects, same state-dict
names) and ``lora_a`` / ``lora_b`` buffers are views of its blocks, so state-dict loads and ``AdapterSlots`` writes
(in-place copies into ``module.lora_a[slot]`` ...) land in the fused buffers unchanged.

The attention calls ``q_proj(h)``, ``k_proj(h)``, ``v_proj(h)`` in that order with the same ``h`` (every
transformers family we serve does). q's forward computes ``[q | k | v]`` for ``h`` in one call and stashes
``(h, k_out)`` on k and ``(h, v_out)`` on v; k / v return their stash when called with that very tensor (an
identity check, which Dynamo decides at trace time: no guard, no graph break) and clear it, so nothing is left
behind after the attention. Called alone or with another input they clear a stale stash and compute their own
product from their views (one extra launch, same result).

Two differences from unfused, both outside serving: the fused call reads ``weight_qkv`` / ``bias_qkv`` (buffers),
so under autograd the base q/k/v weights get no gradient (the LoRA path's gradients are unchanged; the op treats
base weights as frozen anyway); and a non-finite value written straight into one projection's ``lora_b`` slot
(the adapter loader refuses those) turns that slot's rows NaN in all three outputs, not only in that projection's.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from ..ops.reference import lora_linear_reference


def rows_lora_ids(x: Tensor, token_lora_ids: Tensor, sequence_lora_ids: Tensor) -> Tensor:
    """The slot of every row of ``x.reshape(-1, x.shape[-1])``: see the module docstring."""
    if x.dim() <= 2:
        return token_lora_ids[: x.reshape(-1, x.shape[-1]).shape[0]]
    batch = x.shape[0]
    per_sequence = sequence_lora_ids[:batch].view(batch, *([1] * (x.dim() - 2)))
    return per_sequence.expand(x.shape[:-1]).reshape(-1)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, *, max_loras: int, max_rank: int, token_lora_ids: Tensor,
                 sequence_lora_ids: Tensor, use_ops: bool):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, self.in_features, **like), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, **like), persistent=False)
        self.register_buffer("token_lora_ids", token_lora_ids, persistent=False)
        self.register_buffer("sequence_lora_ids", sequence_lora_ids, persistent=False)
        self.use_ops = use_ops
        self._qkv_peers = None  # on a fused q projection: (k_proj, v_proj), see fuse_qkv
        self._qkv_sizes = None  # on a fused q projection: (q, k, v) output features
        self._qkv_stash = None  # on a fused k / v projection, between q's call and its own: (input, output)

    @property
    def fused_qkv(self) -> bool:
        """True for the q projection of a fused q/k/v group (it holds the fused buffers)."""
        return self._qkv_peers is not None

    def forward(self, x: Tensor) -> Tensor:
        stash = self._qkv_stash
        if stash is not None:  # set by the fused q projection for its input: ours is its slice of [q | k | v]
            self._qkv_stash = None
            if stash[0] is x:
                return stash[1]
        if self._qkv_peers is not None:
            return self._forward_qkv(x)
        y = self._lora_linear(x, self.weight, self.lora_a, self.lora_b, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _lora_linear(self, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, bias) -> Tensor:
        """``x [..., in]`` -> ``[rows, out]``: the op (or the reference, per ``use_ops``), each row on its slot."""
        token_lora_ids = rows_lora_ids(x, self.token_lora_ids, self.sequence_lora_ids)
        fn = torch.ops.moe_lora.lora_linear if self.use_ops else lora_linear_reference
        return fn(x.reshape(-1, self.in_features), weight, lora_a, lora_b, token_lora_ids, bias=bias)

    def _forward_qkv(self, x: Tensor) -> Tensor:
        """q's output; k's and v's (the same input's) stashed on their modules for their own calls."""
        y = self._lora_linear(x, self.weight_qkv, self.lora_a_qkv, self.lora_b_qkv, self.bias_qkv)
        q, k, v = (part.reshape(*x.shape[:-1], part.shape[-1]) for part in y.split(self._qkv_sizes, dim=-1))
        k_proj, v_proj = self._qkv_peers
        k_proj._qkv_stash = (x, k)
        v_proj._qkv_stash = (x, v)
        return q

    def extra_repr(self) -> str:
        fused = ", fused_qkv=True" if self.fused_qkv else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}{fused}")


def qkv_fusion_problem(q: nn.Module, k: nn.Module, v: nn.Module) -> Optional[str]:
    """Why ``q``, ``k``, ``v`` cannot be fused (a sentence), or None when they can."""
    members = (q, k, v)
    if not all(isinstance(m, LoRALinear) for m in members):
        return "not all three are LoRA-wrapped linears"
    if any(m.fused_qkv for m in members) or len({id(m) for m in members}) != 3:
        return "already fused"
    if len({m.in_features for m in members}) != 1:
        return "different in_features"
    tensors = [t for m in members for t in (m.weight, m.bias, m.lora_a, m.lora_b) if t is not None]
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return "different dtypes or devices"
    if len({m.bias is None for m in members}) != 1:
        return "biases on some projections only"
    if len({tuple(m.lora_a.shape[:2]) for m in members}) != 1 or len({m.use_ops for m in members}) != 1:
        return "different slot counts, ranks or use_ops"
    return None


@torch.no_grad()
def fuse_qkv(q: LoRALinear, k: LoRALinear, v: LoRALinear) -> None:
    """Fuse one attention's q/k/v projections (see the module docstring); check :func:`qkv_fusion_problem` first.

    Allocates the fused buffers on ``q``, copies the three base weights (and biases, and whatever the slots hold)
    in, then points every projection's ``weight`` / ``bias`` / ``lora_a`` / ``lora_b`` at its block, which frees
    the original tensors."""
    problem = qkv_fusion_problem(q, k, v)
    if problem is not None:
        raise ValueError(f"q/k/v: cannot fuse: {problem}")
    members = (q, k, v)
    L, R, _ = q.lora_a.shape
    sizes = tuple(m.out_features for m in members)
    lora_b = q.lora_b.new_zeros(L, sum(sizes), 3 * R)
    row = 0
    for i, m in enumerate(members):
        lora_b[:, row:row + sizes[i], i * R:(i + 1) * R] = m.lora_b
        row += sizes[i]
    q.register_buffer("weight_qkv", torch.cat([m.weight.detach() for m in members]), persistent=False)
    q.register_buffer("bias_qkv", None if q.bias is None else torch.cat([m.bias.detach() for m in members]),
                      persistent=False)
    q.register_buffer("lora_a_qkv", torch.cat([m.lora_a for m in members], dim=1), persistent=False)
    q.register_buffer("lora_b_qkv", lora_b, persistent=False)
    q._qkv_sizes = sizes
    q._qkv_peers = (k, v)
    point_qkv_views(q)


def qkv_members(q: LoRALinear) -> tuple[LoRALinear, LoRALinear, LoRALinear]:
    return (q, *q._qkv_peers)


def point_qkv_views(q: LoRALinear) -> None:
    """(Re)point the three projections' ``weight`` / ``bias`` (``.data``: the Parameter objects stay) and
    ``lora_a`` / ``lora_b`` buffers at their blocks of ``q``'s fused buffers. After ``nn.Module._apply`` (``.to()``)
    converted every tensor separately, this restores the sharing (the fused buffers were converted from the same
    values) and frees the separate copies."""
    R = q.lora_a_qkv.shape[1] // 3
    row = 0
    for i, (m, size) in enumerate(zip(qkv_members(q), q._qkv_sizes)):
        m.weight.data = q.weight_qkv[row:row + size]
        if q.bias_qkv is not None:
            m.bias.data = q.bias_qkv[row:row + size]
        m.lora_a = q.lora_a_qkv[:, i * R:(i + 1) * R]
        m.lora_b = q.lora_b_qkv[:, row:row + size, i * R:(i + 1) * R]
        row += size


def qkv_views_intact(q: LoRALinear) -> bool:
    """Whether every projection's weight / bias / LoRA buffers still alias ``q``'s fused buffers (a ``.to()`` of the
    wrapped model itself, instead of the :class:`MultiLoRAModel`, converts them separately and breaks that)."""
    def same(view: Optional[Tensor], fused: Optional[Tensor]) -> bool:
        if view is None or fused is None:
            return view is None and fused is None
        return view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()

    return all(same(m.weight, q.weight_qkv) and same(m.bias, q.bias_qkv) and same(m.lora_a, q.lora_a_qkv)
               and same(m.lora_b, q.lora_b_qkv) for m in qkv_members(q))
