"""An independent float64 per-token loop reference of the op contract, and random test cases.

Written straight from the contract (DESIGN.md), not from ``moe_lora_compile.ops.reference``: one token, one routed
expert, one adapter at a time, in float64. Shared by the op tests and the Triton kernel tests.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


def _gate_up(h, layout):
    if layout == "transposed_interleaved":
        return h[0::2], h[1::2]
    n = h.shape[0] // 2
    return h[:n], h[n:]


def _act(gate, up, activation, alpha, limit):
    if activation == "silu":
        return F.silu(gate) * up
    gate = torch.clamp(gate, max=limit)
    up = torch.clamp(up, -limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def moe_lora_loop(x, topk_ids, topk_weights, token_lora_ids, w13, w2, a13, b13, a2, b2, *, w13_bias=None,
                  w2_bias=None, layout="concat", activation="silu", alpha=1.702, limit=7.0,
                  routing_weight_on_input=False):
    """float64 loop over tokens and their routed experts; returns y [T, H] float64."""
    d = torch.float64
    T, H = x.shape
    transposed = layout.startswith("transposed")
    rows = []
    for t in range(T):
        y_t = torch.zeros(H, dtype=d)
        lid = int(token_lora_ids[t])
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            w = topk_weights[t, j].to(d)
            xt = x[t].to(d) * w if routing_weight_on_input else x[t].to(d)
            W13 = w13[e].to(d).T if transposed else w13[e].to(d)  # [2I, H]
            h = W13 @ xt
            if lid >= 0:
                h = h + b13[lid, e].to(d) @ (a13[lid, e].to(d) @ xt)
            if w13_bias is not None:
                h = h + w13_bias[e].to(d)
            act = _act(*_gate_up(h, layout), activation, alpha, limit)
            W2 = w2[e].to(d).T if transposed else w2[e].to(d)  # [H, I]
            o = W2 @ act
            if lid >= 0:
                o = o + b2[lid, e].to(d) @ (a2[lid, e].to(d) @ act)
            if w2_bias is not None:
                o = o + w2_bias[e].to(d)
            y_t = y_t + (o if routing_weight_on_input else w * o)
        rows.append(y_t)
    return torch.stack(rows) if rows else torch.zeros(0, H, dtype=d)


def linear_lora_loop(x, weight, lora_a, lora_b, token_lora_ids, bias=None):
    """float64 loop over tokens; returns y [T, out] float64."""
    d = torch.float64
    y = x.to(d) @ weight.to(d).T
    if bias is not None:
        y = y + bias.to(d)
    rows = []
    for t in range(x.shape[0]):
        lid = int(token_lora_ids[t])
        delta = lora_b[lid].to(d) @ (lora_a[lid].to(d) @ x[t].to(d)) if lid >= 0 else 0
        rows.append(y[t] + delta)
    return torch.stack(rows) if rows else y


@dataclass(frozen=True)
class MoECase:
    """One random problem. ``routing``: "random", "one_expert" (all pairs on expert 0), "skip_last" (expert E-1 gets
    no tokens). ``lora``: "mixed" (ids in [-1, L)), "none" (all -1), "all" (ids in [0, L)). ``ranks``: true rank per
    slot (the rest of R zero-padded), or None for full rank everywhere."""

    T: int = 5
    H: int = 16
    I: int = 12
    E: int = 4
    k: int = 2
    L: int = 3
    R: int = 4
    layout: str = "concat"
    activation: str = "silu"
    bias: bool = False
    routing_weight_on_input: bool = False
    routing: str = "random"
    lora: str = "mixed"
    ranks: tuple | None = None
    dtype: torch.dtype = torch.float32

    def label(self) -> str:
        """The fields that differ from the defaults, for test ids."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default]
        return ",".join(parts).replace("torch.", "") or "default"

    def make(self, device="cpu", scale=0.3):
        """Returns (args tuple, kwargs dict) for ``fused_moe_lora``."""
        T, H, I, E, k, L, R = self.T, self.H, self.I, self.E, self.k, self.L, self.R
        g = torch.Generator().manual_seed(zlib.crc32(repr(self).encode()))

        def rnd(*shape):
            return (torch.randn(*shape, generator=g) * scale).to(self.dtype)

        x = rnd(T, H) / scale
        if self.routing == "one_expert":
            ids = torch.zeros(T, k, dtype=torch.int64)
            if k > 1:  # distinct experts per token, expert 0 always among them
                ids[:, 1:] = torch.arange(1, k)
        else:
            n = E - 1 if self.routing == "skip_last" else E
            ids = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
            ids = ids.to(torch.int64)
        weights = torch.rand(T, k, generator=g).softmax(-1).to(self.dtype)
        if self.lora == "none":
            lora_ids = torch.full((T,), -1, dtype=torch.int32)
        elif self.lora == "all":
            lora_ids = torch.randint(0, L, (T,), generator=g, dtype=torch.int32)
        else:
            lora_ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
            if T >= 2:
                lora_ids[0], lora_ids[1] = -1, L - 1  # always both kinds
        transposed = self.layout.startswith("transposed")
        w13 = rnd(E, H, 2 * I) if transposed else rnd(E, 2 * I, H)
        w2 = rnd(E, I, H) if transposed else rnd(E, H, I)
        a13, b13, a2, b2 = rnd(L, E, R, H), rnd(L, E, 2 * I, R), rnd(L, E, R, I), rnd(L, E, H, R)
        if self.ranks is not None:  # zero-pad each slot beyond its true rank
            for slot, r in enumerate(self.ranks):
                for t in (a13, a2):
                    t[slot, :, r:] = 0
                for t in (b13, b2):
                    t[slot, :, :, r:] = 0
        kwargs = dict(layout=self.layout, activation=self.activation,
                      routing_weight_on_input=self.routing_weight_on_input)
        if self.bias:
            kwargs.update(w13_bias=rnd(E, 2 * I), w2_bias=rnd(E, H))
        args = (x, ids, weights, lora_ids, w13, w2, a13, b13, a2, b2)
        return tuple(t.to(device) for t in args), {k_: (v.to(device) if torch.is_tensor(v) else v)
                                                   for k_, v in kwargs.items()}


# Comparison tolerances against the float64 loop, per dtype (bf16 output rounding dominates).
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}
