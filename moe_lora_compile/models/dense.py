"""Dense linear with per-token multi-LoRA: a drop-in for a target ``nn.Linear``.

Keeps the original ``weight`` / ``bias`` parameters (same objects, same state-dict names) and adds slot buffers
``lora_a [L,R,in]``, ``lora_b [L,out,R]``, ``lora_ranks [L]`` int32 (each slot's rank: the kernels read no factor
entry past it; ``R`` until :class:`~..adapters.slots.AdapterSlots` writes a slot) plus the two shared id buffers
of the :class:`MultiLoRAModel`: ``token_lora_ids`` (one slot per token of the forward, row-major over ``[B, S]``)
and ``sequence_lora_ids`` (one
slot per sequence of the batch).

Which input row belongs to which sequence is read from the input's shape, never from adapter state:

- ``x [T, in]`` (2-D: flattened tokens, e.g. shared experts after ``view(-1, H)``): row ``t`` uses
  ``token_lora_ids[t]``;
- ``x [B, ..., in]`` (3-D or more): the leading dim is the batch, so every row of ``x[b]`` uses
  ``sequence_lora_ids[b]``, whatever the middle dims hold. That covers inputs whose row count is not the forward's
  token count, such as DeepSeek-V3's ``kv_b_proj``, applied after the cache update to the whole cached latent
  ``[B, 1, ctx, r]``.

Fused siblings (``attach(..., fuse=...)``, :func:`fuse_siblings`): LoRA linears that the model calls one after
another on the very same input tensor share one ``lora_linear`` call. :data:`FUSIBLE_GROUPS` lists them in call
order (as transformers 5.x calls them in every family we serve; the tests count the calls): an attention's
``q_proj, k_proj, v_proj``; a dense MLP's or shared expert's ``gate_proj, up_proj`` (``act(gate_proj(x)) *
up_proj(x)``); DeepSeek MLA's ``q_a_proj`` (or ``q_proj``) and ``kv_a_proj_with_mqa``. The first member, the
leader, holds the fused buffers (non-persistent): ``weight_fused [N, in]`` (``N`` = the members' out_features
summed), ``bias_fused [N]`` (or None), ``lora_a_fused [L, nR, in]`` (member ``i``'s rank block rows
``iR:(i+1)R``), ``lora_ranks_fused [n, L]`` (member ``i``'s ranks in row ``i``) and ``lora_b_fused [L, N, nR]``,
block-diagonal (the off-diagonal blocks are zero: no member writes them, and a slot write zeroes them first).
Each member's ``weight`` / ``bias`` (the same Parameter objects, same state-dict names) and ``lora_a`` /
``lora_b`` / ``lora_ranks`` buffers are views of its blocks, so state-dict loads and ``AdapterSlots`` writes
(in-place copies into ``module.lora_a[slot]`` ...) land in the fused buffers unchanged.

The leader's forward computes every member's output for its input ``x`` in one call and stashes ``(x, output)`` on
each other member (a peer); a peer returns its stash when called with that very tensor (an identity check, which
Dynamo decides at trace time: no guard, no graph break) and clears it, so nothing is left behind after the block.
Called alone or with another input a peer clears a stale stash and computes its own product from its views (one
extra launch, same result). A model that called a peer first would still be right, only slower (and would leave
the leader's stash on the peer until its next call).

Differences from unfused, all outside serving: the fused call reads ``weight_fused`` / ``bias_fused``
(buffers), so under autograd the base weights get no gradient (the op treats base weights as frozen anyway); a
forward with grad enabled while any of the group's LoRA buffers (fused or a member's view) requires grad is a
RuntimeError (the fused B's off-diagonal blocks would get gradient, the members' views none: train unfused); and
a non-finite value written straight into one member's ``lora_b`` slot (the adapter loader refuses those) turns that
slot's rows NaN in every member's output, not only in that member's.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor

from ..ops.reference import lora_linear_reference


# name -> alternatives, each the leaf names of sibling linears called in this order on the same input tensor
FUSIBLE_GROUPS: dict[str, tuple[tuple[str, ...], ...]] = {
    "qkv": (("q_proj", "k_proj", "v_proj"),),
    "gate_up": (("gate_proj", "up_proj"),),  # dense MLPs and shared experts
    "mla": (("q_a_proj", "kv_a_proj_with_mqa"), ("q_proj", "kv_a_proj_with_mqa")),  # DeepSeek; q_proj: no q LoRA
}


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
        self.register_buffer("lora_ranks", torch.full((max_loras,), max_rank, dtype=torch.int32,
                                                      device=base.weight.device), persistent=False)
        self.register_buffer("token_lora_ids", token_lora_ids, persistent=False)
        self.register_buffer("sequence_lora_ids", sequence_lora_ids, persistent=False)
        self.use_ops = use_ops
        self._fused_peers = None  # on a group's leader: the other members, in call order (see fuse_siblings)
        self._fused_sizes = None  # on a group's leader: every member's out_features, its own first
        self._is_fused_peer = False  # True on a fused group's other members
        self._fused_stash = None  # on a peer, between the leader's call and its own: (input, output)

    @property
    def leads_fused_group(self) -> bool:
        """True for the first member of a fused sibling group (it holds the fused buffers)."""
        return self._fused_peers is not None

    @property
    def in_fused_group(self) -> bool:
        """True for every member (leader or peer) of a fused sibling group."""
        return self.leads_fused_group or self._is_fused_peer

    def forward(self, x: Tensor) -> Tensor:
        stash = self._fused_stash
        if stash is not None:  # set by the group's leader for its input: ours is our slice of its output
            self._fused_stash = None
            if stash[0] is x:
                return stash[1]
        if self._fused_peers is not None:
            return self._forward_fused(x)
        y = self._lora_linear(x, self.weight, self.lora_a, self.lora_b, self.bias, self.lora_ranks)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _lora_linear(self, x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, bias, lora_ranks) -> Tensor:
        """``x [..., in]`` -> ``[rows, out]``: the op (or the reference, per ``use_ops``), each row on its slot."""
        token_lora_ids = rows_lora_ids(x, self.token_lora_ids, self.sequence_lora_ids)
        fn = torch.ops.moe_lora.lora_linear if self.use_ops else lora_linear_reference
        return fn(x.reshape(-1, self.in_features), weight, lora_a, lora_b, token_lora_ids, bias=bias,
                  lora_ranks=lora_ranks)

    def _forward_fused(self, x: Tensor) -> Tensor:
        """Our output; each peer's (for the same input) stashed on it for its own call."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in self._fused_lora_tensors()):
            raise RuntimeError(
                "fused LoRA linears (attach(fuse=...) / fuse_qkv=True) cannot be trained: their forward reads the "
                "fused buffers, so the members' lora_a / lora_b would get no gradient and the fused B's zero "
                "off-diagonal blocks would; attach with fuse=False, fuse_qkv=False to train, or run under "
                "torch.no_grad()")
        y = self._lora_linear(x, self.weight_fused, self.lora_a_fused, self.lora_b_fused, self.bias_fused,
                              self.lora_ranks_fused)
        own, *others = (part.reshape(*x.shape[:-1], part.shape[-1]) for part in y.split(self._fused_sizes, dim=-1))
        for peer, out in zip(self._fused_peers, others):
            peer._fused_stash = (x, out)
        return own

    def _fused_lora_tensors(self):
        yield self.lora_a_fused
        yield self.lora_b_fused
        for m in fused_members(self):
            yield m.lora_a
            yield m.lora_b

    def extra_repr(self) -> str:
        fused = (f", fused_group=leader of {len(self._fused_sizes)}" if self.leads_fused_group
                 else ", fused_group=peer" if self._is_fused_peer else "")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"slots={self.lora_a.shape[0]}, max_rank={self.lora_a.shape[1]}{fused}")


def fusion_problem(members: Sequence[nn.Module]) -> Optional[str]:
    """Why ``members`` (sibling linears, in call order) cannot be fused (a sentence), or None when they can."""
    if len(members) < 2:
        return "fewer than two members"
    if not all(isinstance(m, LoRALinear) for m in members):
        return "not all members are LoRA-wrapped linears"
    if any(m.in_fused_group for m in members) or len({id(m) for m in members}) != len(members):
        return "already fused"
    if len({m.in_features for m in members}) != 1:
        return "different in_features"
    tensors = [t for m in members for t in (m.weight, m.bias, m.lora_a, m.lora_b) if t is not None]
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return "different dtypes or devices"
    if len({m.bias is None for m in members}) != 1:
        return "biases on some members only"
    if len({tuple(m.lora_a.shape[:2]) for m in members}) != 1 or len({m.use_ops for m in members}) != 1:
        return "different slot counts, ranks or use_ops"
    return None


@torch.no_grad()
def fuse_siblings(members: Sequence[LoRALinear]) -> None:
    """Fuse sibling linears (in the order the model calls them; see the module docstring); check
    :func:`fusion_problem` first.

    Allocates the fused buffers on the leader ``members[0]``, copies every base weight (and bias, and whatever the
    slots hold) in, then points every member's ``weight`` / ``bias`` / ``lora_a`` / ``lora_b`` at its block, which
    frees the original tensors."""
    problem = fusion_problem(members)
    if problem is not None:
        raise ValueError(f"members: cannot fuse: {problem}")
    leader = members[0]
    L, R, _ = leader.lora_a.shape
    sizes = tuple(m.out_features for m in members)
    lora_b = leader.lora_b.new_zeros(L, sum(sizes), len(members) * R)
    row = 0
    for i, m in enumerate(members):
        lora_b[:, row:row + sizes[i], i * R:(i + 1) * R] = m.lora_b
        row += sizes[i]
    bias = None if leader.bias is None else torch.cat([m.bias.detach() for m in members])
    leader.register_buffer("weight_fused", torch.cat([m.weight.detach() for m in members]), persistent=False)
    leader.register_buffer("bias_fused", bias, persistent=False)
    leader.register_buffer("lora_a_fused", torch.cat([m.lora_a for m in members], dim=1), persistent=False)
    leader.register_buffer("lora_b_fused", lora_b, persistent=False)
    leader.register_buffer("lora_ranks_fused", torch.stack([m.lora_ranks for m in members]), persistent=False)
    leader._fused_sizes = sizes
    leader._fused_peers = tuple(members[1:])
    for peer in members[1:]:
        peer._is_fused_peer = True
    point_fused_views(leader)
    for i, m in enumerate(members):
        m.register_load_state_dict_post_hook(functools.partial(_reload_fused_block, leader, i))


@torch.no_grad()
def _reload_fused_block(leader: LoRALinear, index: int, module: LoRALinear, incompatible_keys) -> None:
    """``load_state_dict`` post hook of fused member ``index``: with ``assign=True`` its weight / bias are new
    tensors, no longer views of the leader's fused buffers (which the forward reads): copy them in and point the
    views back. (A plain load copies into the views and changes nothing here.) It computed with the old weights."""
    if fused_views_intact(leader):
        return
    row = sum(leader._fused_sizes[:index])
    block = slice(row, row + leader._fused_sizes[index])
    for new, fused in ((module.weight, leader.weight_fused), (module.bias, leader.bias_fused)):
        if new is None or new.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr():
            continue
        if new.dtype != fused.dtype or new.device != fused.device or new.shape != fused[block].shape:
            raise RuntimeError(f"load_state_dict: a fused linear's weight or bias became {list(new.shape)} "
                               f"{new.dtype} on {new.device}; its fused buffer is {list(fused[block].shape)} "
                               f"{fused.dtype} on {fused.device} (load with assign=False, or attach without fusion)")
        fused[block].copy_(new)
    point_fused_views(leader)


def fused_members(leader: LoRALinear) -> tuple[LoRALinear, ...]:
    """The members of ``leader``'s fused group, in call order (the leader first)."""
    return (leader, *leader._fused_peers)


def point_fused_views(leader: LoRALinear) -> None:
    """(Re)point the members' ``weight`` / ``bias`` (``.data``: the Parameter objects stay) and ``lora_a`` /
    ``lora_b`` buffers at their blocks of the leader's fused buffers. After ``nn.Module._apply`` (``.to()``)
    converted every tensor separately, this restores the sharing (the fused buffers were converted from the same
    values) and frees the separate copies."""
    members = fused_members(leader)
    R = leader.lora_a_fused.shape[1] // len(members)
    row = 0
    for i, (m, size) in enumerate(zip(members, leader._fused_sizes)):
        m.weight.data = leader.weight_fused[row:row + size]
        if leader.bias_fused is not None:
            m.bias.data = leader.bias_fused[row:row + size]
        m.lora_a = leader.lora_a_fused[:, i * R:(i + 1) * R]
        m.lora_b = leader.lora_b_fused[:, row:row + size, i * R:(i + 1) * R]
        m.lora_ranks = leader.lora_ranks_fused[i]
        row += size


def fused_views_intact(leader: LoRALinear) -> bool:
    """Whether every member's weight / bias / LoRA buffers still alias the leader's fused buffers (a ``.to()`` of
    the wrapped model itself, instead of the :class:`MultiLoRAModel`, converts them separately and breaks that)."""
    def same(view: Optional[Tensor], fused: Optional[Tensor]) -> bool:
        if view is None or fused is None:
            return view is None and fused is None
        return view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()

    return all(same(m.weight, leader.weight_fused) and same(m.bias, leader.bias_fused)
               and same(m.lora_a, leader.lora_a_fused) and same(m.lora_b, leader.lora_b_fused)
               and same(m.lora_ranks, leader.lora_ranks_fused)
               for m in fused_members(leader))
