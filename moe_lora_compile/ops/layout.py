"""Expert weight layouts, in one place: how each layout stores the base experts and orders gate/up.

Notation: E experts, H hidden, I expert intermediate. Base expert weights keep the model's own layout:

=========================  ===============  ============  ====================================
layout                     w13              w2            gate/up order inside the 2I axis
=========================  ===============  ============  ====================================
``concat``                 ``[E, 2I, H]``   ``[E, H, I]`` gate ``[0, I)``, up ``[I, 2I)``
``interleaved``            ``[E, 2I, H]``   ``[E, H, I]`` gate ``0::2``, up ``1::2`` (vLLM's GPT-OSS)
``transposed_concat``      ``[E, H, 2I]``   ``[E, I, H]`` same, along the last axis (Llama-4)
``transposed_interleaved`` ``[E, H, 2I]``   ``[E, I, H]`` gate ``0::2``, up ``1::2`` (GPT-OSS)
=========================  ===============  ============  ====================================

``concat``: Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V3 (which family uses which: the family table,
:mod:`moe_lora_compile.models.families`). ``interleaved``: vLLM's own GPT-OSS experts (``w13 [E, 2I, H]`` with its
``swigluoai`` activation reading gate/up from alternating rows; no transformers family stores it). A weight is ``[E, out, in]`` (``concat``) or ``[E, in, out]``
(``transposed_*``), for w13 (``in = H``, ``out = 2I``) and w2 (``in = I``, ``out = H``) alike. LoRA stacks
(``lora_b13 [L, E, 2I, R]``) put their 2I axis in the base weight's own gate/up order.

A layout is a plain string (:data:`Layout`), the value the op schema takes (``layout="concat"``): the names below
are the only spellings, and the helpers are what every module asks (the contract, the reference, the adapter
loader, the Triton launcher, the pass, our experts, the tuner and the benchmarks). Plain functions of strings, so
they trace under ``torch.compile`` as constants.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Layout = Literal["concat", "interleaved", "transposed_concat", "transposed_interleaved"]
CONCAT: Layout = "concat"
INTERLEAVED: Layout = "interleaved"
TRANSPOSED_CONCAT: Layout = "transposed_concat"
TRANSPOSED_INTERLEAVED: Layout = "transposed_interleaved"
LAYOUTS: tuple[Layout, ...] = (CONCAT, INTERLEAVED, TRANSPOSED_CONCAT, TRANSPOSED_INTERLEAVED)


def check_layout(layout: str) -> None:
    """ValueError unless ``layout`` is one of :data:`LAYOUTS`."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def is_transposed(layout: str) -> bool:
    """True when base weights are stored ``[E, in, out]`` (GPT-OSS, Llama-4)."""
    return layout in (TRANSPOSED_CONCAT, TRANSPOSED_INTERLEAVED)


def is_interleaved(layout: str) -> bool:
    """True when gate and up alternate along the 2I axis (GPT-OSS, transformers' or vLLM's)."""
    return layout in (INTERLEAVED, TRANSPOSED_INTERLEAVED)


def layout_of(*, transposed: bool, interleaved: bool) -> Layout:
    """The layout with these two properties."""
    if interleaved:
        return TRANSPOSED_INTERLEAVED if transposed else INTERLEAVED
    return TRANSPOSED_CONCAT if transposed else CONCAT


def w13_shape(layout: str, E: int, H: int, I: int) -> tuple[int, int, int]:
    """Shape of the base gate/up weight: ``[E, H, 2I]`` transposed, else ``[E, 2I, H]``."""
    return (E, H, 2 * I) if is_transposed(layout) else (E, 2 * I, H)


def w2_shape(layout: str, E: int, H: int, I: int) -> tuple[int, int, int]:
    """Shape of the base down weight: ``[E, I, H]`` transposed, else ``[E, H, I]``."""
    return (E, I, H) if is_transposed(layout) else (E, H, I)


def expert_geometry(layout: str, w13_shape: tuple, w2_shape: tuple) -> tuple[int, int, int]:
    """``(E, H, I)`` from the base weights' shapes (``torch.Size`` or tuples) in ``layout``; no checks (the
    contract checks)."""
    if is_transposed(layout):
        return w13_shape[0], w13_shape[1], w2_shape[1]
    return w13_shape[0], w13_shape[2], w2_shape[2]


def in_out_strides(weight: Tensor, layout: str) -> tuple[int, int, int]:
    """``(stride_e, stride_in, stride_out)`` of a base expert weight (w13 or w2): element ``(e, in, out)`` sits at
    ``e * stride_e + in * stride_in + out * stride_out`` in either layout (what the Triton kernels address)."""
    if is_transposed(layout):  # [E, in, out]
        return weight.stride(0), weight.stride(1), weight.stride(2)
    return weight.stride(0), weight.stride(2), weight.stride(1)  # [E, out, in]


def split_gate_up(h: Tensor, layout: str, dim: int = -1) -> tuple[Tensor, Tensor]:
    """``h [..., 2I, ...]`` (the 2I axis at ``dim``) in the layout's gate/up order -> ``(gate, up)``, each with I
    there. Views (slices), no copies."""
    if is_interleaved(layout):
        index = [slice(None)] * h.dim()
        index[dim] = slice(0, None, 2)
        gate = h[tuple(index)]
        index[dim] = slice(1, None, 2)
        return gate, h[tuple(index)]
    gate, up = h.chunk(2, dim=dim)
    return gate, up


def merge_gate_up(gate: Tensor, up: Tensor, layout: str, dim: int = -1) -> Tensor:
    """Inverse of :func:`split_gate_up`: ``gate`` and ``up`` (I along ``dim``) -> 2I along ``dim`` in the layout's
    order (a new tensor)."""
    if is_interleaved(layout):
        dim = dim % gate.dim()
        return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)
    return torch.cat([gate, up], dim=dim)
