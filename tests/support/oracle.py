"""The float64 oracle of ``fused_moe_lora`` and ``lora_linear``: written straight from the op contract (README, "The
op contract"), not from ``moe_lora_compile.ops.reference``, and importing nothing of the package.

Every (token, routed expert) pair gets ``down_e(act(gate_up_e(x) + B13 A13 x + b13)) + B2 A2 act + b2`` with the
token's slot ``l`` (no LoRA term when ``l == -1``), times its routing weight (on the input instead when
``routing_weight_on_input``), summed over the token's k pairs. Pairs are grouped per expert so that each expert's
weights are read once (fast enough for real model shapes on a GPU), and per slot inside an expert, so a slot's
factors only ever touch its own rows (a non-finite slot cannot reach other rows here either). Differentiable
(out-of-place adds) for the gradient tests.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The layouts of the contract: whether the base weights are [E, in, out] ("transposed"), and whether gate/up
# alternate along the 2I axis (else gate is the first half, up the second).
TRANSPOSED = {"concat": False, "interleaved": False, "transposed_concat": True, "transposed_interleaved": True}
INTERLEAVED = {"concat": False, "interleaved": True, "transposed_concat": False, "transposed_interleaved": True}
F64 = torch.float64


def _gate_up(h: Tensor, layout: str) -> tuple[Tensor, Tensor]:
    if INTERLEAVED[layout]:
        return h[:, 0::2], h[:, 1::2]
    n = h.shape[1] // 2
    return h[:, :n], h[:, n:]


def _activation(gate: Tensor, up: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
    if activation == "silu":
        return gate * torch.sigmoid(gate) * up
    if activation != "gptoss_swiglu":
        raise ValueError(f"unknown activation {activation!r}")
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def _add_lora(out: Tensor, inp: Tensor, slots: Tensor, a: Tensor, b: Tensor, expert: int) -> Tensor:
    """``out[rows of slot l] += inp[rows] A[l, e]^T B[l, e]^T`` for every slot present (not -1)."""
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = (slots == slot).nonzero().squeeze(1)
        delta = (inp[rows] @ a[slot, expert].to(F64).T) @ b[slot, expert].to(F64).T
        out = out.index_add(0, rows, delta)
    return out


def moe_lora_oracle(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2, *,
                    w13_bias=None, w2_bias=None, layout="concat", activation="silu", alpha=1.702, limit=7.0,
                    routing_weight_on_input=False) -> Tensor:
    """The op's arguments (any float dtype, any device) -> ``y [T, H]`` float64 on ``x``'s device."""
    T, H = x.shape
    k = topk_ids.shape[1]
    transposed = TRANSPOSED[layout]
    tokens = torch.arange(T, device=x.device).repeat_interleave(k)  # pair p = token-major (t, j)
    experts = topk_ids.reshape(-1).long()
    slots = token_lora_ids.long().repeat_interleave(k)
    weights = topk_weights.reshape(-1).to(F64)
    y = torch.zeros(T, H, dtype=F64, device=x.device)
    for e in torch.unique(experts).tolist():
        pairs = (experts == e).nonzero().squeeze(1)
        xin = x[tokens[pairs]].to(F64)
        if routing_weight_on_input:
            xin = xin * weights[pairs, None]
        w13_e = w13[e].to(F64) if transposed else w13[e].to(F64).T  # [H, 2I]
        h = _add_lora(xin @ w13_e, xin, slots[pairs], lora_a13, lora_b13, e)
        if w13_bias is not None:
            h = h + w13_bias[e].to(F64)
        act = _activation(*_gate_up(h, layout), activation, alpha, limit)
        w2_e = w2[e].to(F64) if transposed else w2[e].to(F64).T  # [I, H]
        out = _add_lora(act @ w2_e, act, slots[pairs], lora_a2, lora_b2, e)
        if w2_bias is not None:
            out = out + w2_bias[e].to(F64)
        if not routing_weight_on_input:
            out = out * weights[pairs, None]
        y = y.index_add(0, tokens[pairs], out)
    return y


def lora_linear_oracle(x, weight, lora_a, lora_b, token_lora_ids, bias=None) -> Tensor:
    """``x [T, in] @ weight^T (+ bias) + B[l] A[l] x`` per token (none for -1) -> ``[T, out]`` float64."""
    y = x.to(F64) @ weight.to(F64).T
    if bias is not None:
        y = y + bias.to(F64)
    ids = token_lora_ids.long()
    for slot in torch.unique(ids).tolist():
        if slot < 0:
            continue
        rows = (ids == slot).nonzero().squeeze(1)
        y = y.index_add(0, rows, (x[rows].to(F64) @ lora_a[slot].to(F64).T) @ lora_b[slot].to(F64).T)
    return y
