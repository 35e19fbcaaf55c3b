"""Pure-PyTorch reference impls of the ops: the definition of correctness.

Static shapes, fp32 accumulation, no ``.item()`` and no data-dependent Python control flow, so the same code runs on
CPU and CUDA and traces under ``torch.compile``; called eagerly (the ops' CPU impls), the MoE reference takes the
tokens in chunks that bound its per-pair weight gathers (``GATHER_BYTES_PER_CHUNK``). "No adapter"
(``token_lora_ids == -1``) is data, never a branch.
A row's LoRA delta is *selected* (``torch.where``, gathers), never multiplied by a 0/1 mask, so a non-finite value
in a slot the row does not use cannot reach it (``0 * inf`` is NaN), and ``-1`` rows get exactly the base result.
Per-slot ranks (``lora_ranks``): each slot's factor entries past its rank are dropped (``where``, so whatever the
padding holds, NaN included, never reaches a result), as the kernels never read them.
Layouts: :mod:`moe_lora_compile.ops.layout`; argument meanings: :mod:`moe_lora_compile.ops.contract`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .contract import GPTOSS_ALPHA, GPTOSS_LIMIT
from .layout import CONCAT, is_transposed, merge_gate_up, split_gate_up


def glu_activation(gate: Tensor, up: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
    """``silu``: ``silu(gate) * up``; ``gptoss_swiglu``: GPT-OSS's clamped swiglu with ``alpha``/``limit``."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def rank_keep(lora_ranks: Optional[Tensor], R: int, block: int) -> Optional[Tensor]:
    """[L, R] bool: the rank entries each slot uses, or None (all). ``lora_ranks`` [L] or [n, L]: the rank axis in
    blocks of ``block`` entries, entry ``r`` of slot ``l`` kept when ``r % block < lora_ranks[r // block, l]`` (a
    1-D ``lora_ranks`` serves every block)."""
    if lora_ranks is None:
        return None
    ranks = (lora_ranks if lora_ranks.dim() == 2 else lora_ranks.unsqueeze(0)).long()  # [n, L]
    r = torch.arange(R, device=lora_ranks.device)
    block_rank = ranks[(r // block).clamp(max=ranks.shape[0] - 1)]  # [R, L]
    return ((r % block).unsqueeze(1) < block_rank).t()


def _pair_lora(xp: Tensor, a: Tensor, b: Tensor, lora_ids: Tensor, experts: Tensor,
               split_layout: Optional[str] = None, keep: Optional[Tensor] = None) -> Tensor:
    """Per (token, k) pair LoRA delta ``B[l,e] @ (A[l,e] @ x)``, exactly zero where ``l == -1``.

    xp [P, in] fp32; a [L, E, R, in]; b [L, E, out, R]; lora_ids/experts [P] int64 -> [P, out] fp32.
    Each pair gathers its own slot's factors (``-1`` pairs read slot 0, then ``where`` drops the result).
    ``split_layout``: b is the split gate/up form ``[L, E, 2I, R/2]`` (see :mod:`.contract`), its gate/up rows in
    that layout's order: gate rows times rank entries ``[0, R/2)``, up rows times ``[R/2, R)``.
    ``keep`` ([L, R] bool, :func:`rank_keep`): the rank entries each slot uses (None: all).
    """
    has_lora = lora_ids >= 0
    slot = lora_ids.clamp(min=0)
    a_p = a[slot, experts].to(xp.dtype)  # [P, R, in]
    b_p = b[slot, experts].to(xp.dtype)  # [P, out, R] (split: [P, 2I, R/2])
    if keep is not None:  # split form: both halves keep the same entries, B's R/2 columns are either half's
        keep_p = keep[slot]  # [P, R]
        a_p = torch.where(keep_p.unsqueeze(-1), a_p, 0.0)
        b_p = torch.where(keep_p[:, : b_p.shape[-1]].unsqueeze(1), b_p, 0.0)
    shrunk = torch.bmm(a_p, xp.unsqueeze(-1))  # [P, R, 1]
    if split_layout is None:
        delta = torch.bmm(b_p, shrunk)
    else:
        half = b_p.shape[-1]
        gate_b, up_b = split_gate_up(b_p, split_layout, dim=1)  # [P, I, R/2] each
        delta = merge_gate_up(torch.bmm(gate_b, shrunk[:, :half]), torch.bmm(up_b, shrunk[:, half:]), split_layout,
                              dim=1)
    return torch.where(has_lora.unsqueeze(-1), delta.squeeze(-1), 0.0)


def _pair_matmul(xp: Tensor, w: Tensor, experts: Tensor, transposed: bool) -> Tensor:
    """xp [P, in] fp32 times expert weights ``w[e]`` (``[E, out, in]``, or ``[E, in, out]`` if transposed)."""
    w_p = w[experts].to(xp.dtype)
    if transposed:
        return torch.bmm(xp.unsqueeze(1), w_p).squeeze(1)
    return torch.bmm(w_p, xp.unsqueeze(-1)).squeeze(-1)


# Eager calls take the tokens in chunks whose per-pair gathers (each pair's expert weights and LoRA factors, in
# their dtype and the accumulation dtype) stay under this many bytes: the gathers grow with T * k, and unchunked a
# prefill of T = 2048 at Qwen3-30B-A3B's shape would gather ~300 GB. Each token's result is the same either way, up
# to rounding (the CPU's batched matmul may sum in another order for another batch size).
GATHER_BYTES_PER_CHUNK = 256 << 20


def _tokens_per_chunk(x: Tensor, k: int, per_expert: tuple) -> int:
    """Tokens per eager chunk: ``per_expert`` the tensors gathered per pair, each ``[..., E, a, b]`` (one expert's
    ``[a, b]`` gathered, then converted to the accumulation dtype)."""
    acc_bytes = 8 if x.dtype == torch.float64 else 4
    per_pair = sum(t.shape[-1] * t.shape[-2] * (t.element_size() + acc_bytes) for t in per_expert)
    return max(1, GATHER_BYTES_PER_CHUNK // max(1, per_pair * k))


def fused_moe_lora_reference(
    x: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    token_lora_ids: Tensor,
    w13: Tensor,
    w2: Tensor,
    lora_a13: Tensor,
    lora_b13: Tensor,
    lora_a2: Tensor,
    lora_b2: Tensor,
    *,
    w13_bias: Optional[Tensor] = None,
    w2_bias: Optional[Tensor] = None,
    layout: str = CONCAT,
    activation: str = "silu",
    alpha: float = GPTOSS_ALPHA,
    limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False,
    lora_b13_split: bool = False,
    lora_ranks: Optional[Tensor] = None,
) -> Tensor:
    """One MoE layer with per-token multi-LoRA. Returns ``y [T, H]`` in ``x.dtype``.

    ``y[t] = sum_j w[t,j] * down_e(act(gate_up_e(x[t])))`` with ``e = topk_ids[t,j]``; every projection adds
    ``B[l,e] A[l,e] x`` for ``l = token_lora_ids[t]`` (nothing when ``l == -1``). With ``routing_weight_on_input``
    (Llama-4) the weight scales the expert's input instead of its output. ``lora_b13_split``: ``lora_b13`` is
    ``[L, E, 2I, R/2]``, the split gate/up form of :mod:`.contract`. ``lora_ranks`` [2, L] (w13, w2) or None: each
    slot's rank (see :mod:`.contract`).
    """
    T, H = x.shape
    k = topk_ids.shape[1]
    if not torch.compiler.is_compiling():  # eager (the ops' CPU impls, the CUDA fallback): bounded gathers
        step = _tokens_per_chunk(x, k, (w13, w2, lora_a13, lora_b13, lora_a2, lora_b2))
        if T > step:
            kwargs = dict(w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha,
                          limit=limit, routing_weight_on_input=routing_weight_on_input,
                          lora_b13_split=lora_b13_split, lora_ranks=lora_ranks)
            return torch.cat([fused_moe_lora_reference(x[i:i + step], topk_ids[i:i + step], topk_weights[i:i + step],
                                                       token_lora_ids[i:i + step], w13, w2, lora_a13, lora_b13,
                                                       lora_a2, lora_b2, **kwargs) for i in range(0, T, step)])
    transposed = is_transposed(layout)
    acc = torch.float32 if x.dtype != torch.float64 else torch.float64

    experts = topk_ids.reshape(-1).long()  # [P], P = T*k, token-major
    lora_ids = token_lora_ids.long().unsqueeze(1).expand(T, k).reshape(-1)
    expert_ok = None
    if not torch.compiler.is_compiling():
        # eager, where this runs as the CUDA impl's fallback (mixed dtypes, float64) and unchecked ids can reach it
        # (MOE_LORA_CHECK_IDS=0, graph capture): read them as the kernels do, as data: an expert outside [0, E) adds
        # nothing, a slot outside [-1, L) is -1. Not in traced code, whose graph the fusion pass matches (a mask
        # there hid the MoE pattern from it); the CPU impl refuses such ids on the host anyway.
        E, L = w13.shape[0], lora_a13.shape[0]
        expert_ok = (experts >= 0) & (experts < E)
        experts = torch.where(expert_ok, experts, 0)
        lora_ids = torch.where(lora_ids < L, lora_ids, -1)
    weights = topk_weights.to(acc).reshape(-1, 1)
    xp = x.to(acc).unsqueeze(1).expand(T, k, H).reshape(-1, H)  # [P, H]
    if routing_weight_on_input:
        xp = xp * weights

    R, R2 = lora_a13.shape[2], lora_a2.shape[2]
    keep13 = None if lora_ranks is None else rank_keep(lora_ranks[0], R, R // 2 if lora_b13_split else R)
    keep2 = None if lora_ranks is None else rank_keep(lora_ranks[1], R2, R2)
    h = _pair_matmul(xp, w13, experts, transposed) + _pair_lora(xp, lora_a13, lora_b13, lora_ids, experts,
                                                                  layout if lora_b13_split else None, keep13)
    if w13_bias is not None:
        h = h + w13_bias[experts].to(acc)
    gate, up = split_gate_up(h, layout)
    act = glu_activation(gate, up, activation, alpha, limit)  # [P, I]

    out = _pair_matmul(act, w2, experts, transposed) + _pair_lora(act, lora_a2, lora_b2, lora_ids, experts,
                                                                      keep=keep2)
    if w2_bias is not None:
        out = out + w2_bias[experts].to(acc)
    if not routing_weight_on_input:
        out = out * weights
    if expert_ok is not None:
        out = torch.where(expert_ok.unsqueeze(-1), out, 0.0)
    return out.reshape(T, k, H).sum(dim=1).to(x.dtype)


def lora_linear_reference(
    x: Tensor,
    weight: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    token_lora_ids: Tensor,
    *,
    bias: Optional[Tensor] = None,
    lora_ranks: Optional[Tensor] = None,
) -> Tensor:
    """``y = x @ weight^T (+ bias) + B[l] A[l] x`` per token, ``l = token_lora_ids[t]`` (-1 = none).

    x [T, in]; weight [out, in]; lora_a [L, R, in]; lora_b [L, out, R] -> y [T, out] in ``x.dtype``.
    One shrink over all L slots (cheap), then each token keeps only its own slot's rank vector (``where``, so a
    non-finite value from another slot's A is dropped, not multiplied by 0) and one expand over the ``[L*R]`` axis
    (no per-token gather of B). Non-finite entries of B are zeroed for that expand, where the other tokens' zeros
    meet them; a token whose own slot's B has one gets NaN instead (``poison``) in every output column, where a
    per-slot loop (and the Triton kernels) give a non-finite value in that entry's column only: the token's row is
    non-finite either way, and no other token's is.
    ``lora_ranks`` [L] or [n, L] (n rank blocks) or None: each slot's rank (see :mod:`.contract`); entries past it
    are dropped first (so they can poison nothing).
    """
    acc = torch.float32 if x.dtype != torch.float64 else torch.float64
    L, R, n_in = lora_a.shape
    if lora_ranks is not None:
        keep = rank_keep(lora_ranks, R, R // (lora_ranks.shape[0] if lora_ranks.dim() == 2 else 1))  # [L, R]
        lora_a = torch.where(keep.unsqueeze(-1), lora_a, 0.0)
        lora_b = torch.where(keep.unsqueeze(1), lora_b, 0.0)
    xf = x.to(acc)
    y = xf @ weight.to(acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    shrunk = (xf @ lora_a.to(acc).reshape(L * R, n_in).t()).reshape(-1, L, R)  # [T, L, R]
    one_hot = token_lora_ids.long().unsqueeze(1) == torch.arange(L, device=x.device).unsqueeze(0)  # [T, L]
    b = lora_b.to(acc)
    b_finite = torch.isfinite(b)
    poison = torch.where(b_finite.flatten(1).all(dim=1), 0.0, float("nan")).to(acc)  # [L]: NaN for a bad slot
    shrunk = torch.where(one_hot.unsqueeze(-1), shrunk + poison.unsqueeze(-1), 0.0)
    b_flat = torch.where(b_finite, b, 0.0).permute(0, 2, 1).reshape(L * R, -1)  # [L*R, out]
    return (y + shrunk.reshape(-1, L * R) @ b_flat).to(x.dtype)
