"""The one builder of random op inputs (``fused_moe_lora``: :class:`MoECase`; ``lora_linear``: :func:`make_linear`) and
the per-dtype tolerances against the float64 oracle (:mod:`.oracle`)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields
from typing import Optional

import torch

from .oracle import TRANSPOSED

# Comparison tolerances against the float64 oracle, per dtype (bf16 output rounding dominates).
TOLERANCES = {
    torch.float64: dict(atol=1e-10, rtol=1e-10),
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


@dataclass(frozen=True)
class MoECase:
    """One random ``fused_moe_lora`` problem; :meth:`make` -> ``(args, kwargs)`` of the op. The draws depend on the
    fields alone (the seed is a hash of them).

    ``routing``: ``"random"`` (k distinct experts per token, drawn from ``experts``, default all) or
    ``"one_expert"`` (every token's first expert is 0, the others 1..k-1: all pairs of expert 0 in one group).
    ``lora``: ``"mixed"`` (ids in [-1, L), token 0 at -1 and token 1 at L-1), ``"alternate"`` (every other token
    -1, the rest in [0, L)), ``"all"`` (ids in [0, L)), ``"none"`` (all -1). ``ranks``: true rank per slot (the
    rest of R zero-padded). Weights are scaled by 1/sqrt(fan-in), so ``h`` and ``y`` have a std of about 1."""

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
    limit: float = 7.0
    routing: str = "random"
    experts: Optional[tuple] = None
    lora: str = "mixed"
    ranks: Optional[tuple] = None
    dtype: torch.dtype = torch.float32
    topk_dtype: torch.dtype = torch.int64

    @classmethod
    def of_geometry(cls, g, T: int, L: int, R: int, lora: str, **overrides) -> "MoECase":
        """A case of a real model's MoE layer (``moe_lora_compile.shapes.MoEGeometry``), int32 routing ids."""
        return cls(T=T, H=g.H, I=g.I, E=g.E, k=g.k, L=L, R=R, layout=g.layout, activation=g.activation,
                   bias=g.bias, lora=lora, topk_dtype=torch.int32, **overrides)

    def label(self) -> str:
        """The fields that differ from the defaults, for test ids."""
        parts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self) if getattr(self, f.name) != f.default]
        return ",".join(parts).replace("torch.", "") or "default"

    def make(self, device="cpu", scale: float = 1.0, dtype: Optional[torch.dtype] = None):
        """``(args, kwargs)`` for ``fused_moe_lora`` on ``device``; ``scale`` multiplies x, the expert weights and
        biases and the LoRA factors (not the routing weights); ``dtype`` overrides the case's."""
        T, H, I, E, k, L, R = self.T, self.H, self.I, self.E, self.k, self.L, self.R
        dtype = dtype or self.dtype
        g = torch.Generator().manual_seed(zlib.crc32(repr(self).encode()))

        def rnd(*shape, std=1.0):
            return (torch.randn(*shape, generator=g) * std * scale).to(dtype)

        if self.routing == "one_expert":
            ids = torch.arange(k).expand(T, k).clone()
        elif self.routing == "random":
            pool = torch.tensor(self.experts if self.experts is not None else range(E))
            ids = (torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(T)]) if T
                   else torch.zeros(0, k, dtype=torch.int64))
        else:
            raise ValueError(f"routing {self.routing!r}")
        weights = torch.rand(T, k, generator=g).softmax(-1).to(dtype)
        lora_ids = self._lora_ids(g)
        transposed = TRANSPOSED[self.layout]
        w13 = rnd(*((E, H, 2 * I) if transposed else (E, 2 * I, H)), std=H ** -0.5)
        w2 = rnd(*((E, I, H) if transposed else (E, H, I)), std=I ** -0.5)
        a13, b13 = rnd(L, E, R, H, std=H ** -0.5), rnd(L, E, 2 * I, R, std=R ** -0.5)
        a2, b2 = rnd(L, E, R, I, std=I ** -0.5), rnd(L, E, H, R, std=R ** -0.5)
        if self.ranks is not None:  # slot l has true rank r_l: rows of A / columns of B past r_l are zero
            for slot, r in enumerate(self.ranks):
                for t in (a13, a2):
                    t[slot, :, r:] = 0
                for t in (b13, b2):
                    t[slot, :, :, r:] = 0
        kwargs = dict(layout=self.layout, activation=self.activation, limit=self.limit,
                      routing_weight_on_input=self.routing_weight_on_input)
        if self.bias:
            kwargs.update(w13_bias=rnd(E, 2 * I, std=0.5), w2_bias=rnd(E, H, std=0.5))
        x = rnd(T, H)
        args = (x, ids.to(self.topk_dtype), weights, lora_ids, w13, w2, a13, b13, a2, b2)
        return tuple(t.to(device) for t in args), {key: (v.to(device) if torch.is_tensor(v) else v)
                                                   for key, v in kwargs.items()}

    def _lora_ids(self, g: torch.Generator) -> torch.Tensor:
        T, L = self.T, self.L
        if self.lora == "none":
            return torch.full((T,), -1, dtype=torch.int32)
        if self.lora == "all":
            return torch.randint(0, L, (T,), generator=g, dtype=torch.int32)
        if self.lora == "alternate":
            ids = torch.randint(0, L, (T,), generator=g, dtype=torch.int32)
            ids[::2] = -1
            return ids
        if self.lora != "mixed":
            raise ValueError(f"lora {self.lora!r}")
        ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
        if T >= 2:
            ids[0], ids[1] = -1, L - 1  # always both kinds
        return ids


def make_linear(T, n_in, n_out, L, R, ids="mixed", bias=False, dtype=torch.float32, ranks=None, seed=0):
    """Random ``lora_linear`` inputs -> ``((x, weight, lora_a, lora_b, token_lora_ids), bias or None)``. ``ids``:
    ``"mixed"`` (in [-1, L)), ``"none"`` (all -1), ``"all"`` (in [0, L)); ``ranks``: true rank per slot."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, n_in, generator=g).to(dtype)
    weight = (torch.randn(n_out, n_in, generator=g) * 0.3).to(dtype)
    lora_a = (torch.randn(L, R, n_in, generator=g) * 0.3).to(dtype)
    lora_b = (torch.randn(L, n_out, R, generator=g) * 0.3).to(dtype)
    if ranks is not None:
        for slot, r in enumerate(ranks):
            lora_a[slot, r:] = 0
            lora_b[slot, :, r:] = 0
    low = {"mixed": -1, "none": -1, "all": 0}[ids]
    high = 0 if ids == "none" else L
    token_lora_ids = torch.randint(low, high, (T,), generator=g, dtype=torch.int32)
    b = (torch.randn(n_out, generator=g) * 0.3).to(dtype) if bias else None
    return (x, weight, lora_a, lora_b, token_lora_ids), b
