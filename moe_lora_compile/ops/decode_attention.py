"""``torch.ops.moe_lora.decode_attention``: attention of a decode (or speculative verify) step over a static KV cache.

``query [B, H, S, D]`` (S: 1, or ``1 + k`` draft tokens), ``key`` / ``value [B, Hkv, L, D]`` (the whole static
cache, ``H = n_rep * Hkv``; query head ``h`` reads key/value head ``h // n_rep``, transformers' ``repeat_kv``
order), the additive ``mask [B or 1, 1, S, >= L]`` transformers' eager attention gets (its first ``L`` columns:
0 where a slot is seen, the dtype's most negative value or -inf where not) or None, ``scaling`` and GPT-OSS's
per-head ``sinks [H]`` (or None) -> ``out [B, S, H, D]`` in query's dtype, what transformers' attention functions
return as their first output. Semantics: transformers' eager attention (``softmax(q k^T * scaling + mask)`` over
the slots, with sinks the softmax over ``[slots, sink]`` without the sink column), computed in fp32, with two
differences: mask entries at or below half the dtype's most negative value count as exactly masked, and a row with
every slot masked gives zeros (eager would average the values uniformly), and what the cache holds in a slot no
query row sees never reaches a result (eager's ``0 * NaN`` would).

CUDA (fp32/fp16/bf16, ``n_rep * S <= 128``, ``D <= 256``): the flash-decoding Triton kernel
(:mod:`.triton.attention_kernels`), which never reads the K/V blocks a mask hides entirely. CPU, float64 and
larger queries (a prefill): :func:`decode_attention_reference`; under ``TRITON_INTERPRET=1`` the CPU impl runs the
kernel in Triton's interpreter (the CPU tests of whole models go through it). Inference only: the op has no
backward (calling one is a RuntimeError).
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from .. import settings

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_decode_attention_args(query, key, value, mask, scaling, sinks) -> None:
    """Shape/dtype/device checks; ValueError/TypeError naming the argument."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor [B, heads, len, D], got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ([B, heads, len, D]), got shape {_shape(t)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}; all tensors must share one "
                             f"device")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"key and value must have query's dtype {query.dtype}, got {key.dtype} / {value.dtype}")
    B, H, S, D = query.shape
    Hkv = key.shape[1]
    torch._check_value(tuple(key.shape[:2]) == (B, Hkv) and key.shape[3] == D and Hkv >= 1,
                       lambda: f"key must be [B={B}, Hkv, L, D={D}], got {_shape(key)}")
    torch._check_value(key.shape[2] >= 1, lambda: f"key must hold at least one cache position (L >= 1), got "
                                                   f"{_shape(key)}")
    torch._check_value(tuple(value.shape) == tuple(key.shape),
                       lambda: f"value must have key's shape {_shape(key)}, got {_shape(value)}")
    torch._check_value(H % Hkv == 0, lambda: f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if not isinstance(scaling, (float, int, torch.SymFloat)) or isinstance(scaling, bool):
        raise TypeError(f"scaling must be a float, got {scaling!r}")
    if mask is not None:
        if mask.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"mask must be an additive floating mask (0 / most negative), got {mask.dtype}")
        if mask.device != query.device:
            raise ValueError(f"mask is on {mask.device} but query is on {query.device}")
        torch._check_value(mask.dim() == 4 and mask.shape[0] in (1, B) and mask.shape[1] == 1
                           and mask.shape[2] == S and mask.shape[3] >= key.shape[2],
                           lambda: f"mask must be [B={B} or 1, 1, S={S}, >= L={key.shape[2]}], got {_shape(mask)}")
    if sinks is not None:
        torch._check_value(sinks.dim() == 1 and sinks.shape[0] == H,
                           lambda: f"sinks must be [H={H}] (one per query head), got {_shape(sinks)}")
        if not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must be a floating tensor, got {sinks.dtype}")
        if sinks.device != query.device:
            raise ValueError(f"sinks must be on {query.device} (query's device), got {sinks.device}")


def decode_attention_reference(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], scaling: float,
                               sinks: Optional[Tensor]) -> Tensor:
    """The op's semantics in plain PyTorch (fp32, float64 for float64 inputs) -> out [B, S, H, D] in query's
    dtype."""
    B, H, S, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(work).reshape(B, Hkv, (H // Hkv) * S, D)
    scores = torch.matmul(q, key.to(work).transpose(2, 3)).view(B, H, S, L) * scaling
    values = value.to(work)
    if mask is not None:
        bias = mask[..., :L].to(work)
        keep = bias > torch.finfo(mask.dtype).min / 2  # [B or 1, 1, S, L]
        scores = torch.where(keep, scores + bias, float("-inf"))
        # a slot no query row sees is 0, not whatever the cache holds there (0 * NaN is NaN), as in the kernel
        values = torch.where(keep.any(dim=2, keepdim=True).transpose(2, 3), values, 0.0)
    logits = scores
    if sinks is not None:
        logits = torch.cat([scores, sinks.to(work).reshape(1, H, 1, 1).expand(B, H, S, 1)], dim=-1)
    top = logits.amax(dim=-1, keepdim=True)
    exp = torch.exp(logits - torch.where(top == float("-inf"), 0.0, top))
    denom = exp.sum(dim=-1, keepdim=True)
    probs = (exp / torch.where(denom > 0, denom, 1.0))[..., :L]
    out = torch.matmul(probs.reshape(B, Hkv, (H // Hkv) * S, L), values).view(B, H, S, D)
    return out.transpose(1, 2).to(query.dtype).contiguous()


def _triton_takes(query, key, value, mask, sinks) -> bool:
    from .triton.attention_launch import kernel_covers

    return kernel_covers(query, key, value, mask, sinks)


def _run(query, key, value, mask, scaling, sinks) -> Tensor:
    if _triton_takes(query, key, value, mask, sinks):
        from .triton.attention_launch import decode_attention_triton

        return decode_attention_triton(query, key, value, mask, float(scaling), sinks)
    return decode_attention_reference(query, key, value, mask, scaling, sinks)


@torch.library.custom_op("moe_lora::decode_attention", mutates_args=())
def _decode_attention_op(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], scaling: float,
                         sinks: Optional[Tensor]) -> Tensor:
    check_decode_attention_args(query, key, value, mask, scaling, sinks)
    if settings.TRITON_INTERPRET.enabled():  # the CPU tests: the kernel in Triton's interpreter
        return _run(query, key, value, mask, scaling, sinks)
    return decode_attention_reference(query, key, value, mask, scaling, sinks)


@_decode_attention_op.register_kernel("cuda")
def _decode_attention_cuda(query, key, value, mask, scaling, sinks):
    check_decode_attention_args(query, key, value, mask, scaling, sinks)
    return _run(query, key, value, mask, scaling, sinks)


@_decode_attention_op.register_fake
def _decode_attention_fake(query, key, value, mask, scaling, sinks):
    check_decode_attention_args(query, key, value, mask, scaling, sinks)
    B, H, S, D = query.shape
    return query.new_empty((B, S, H, D))


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad_out):
    raise RuntimeError("moe_lora.decode_attention has no backward: it is the attention of inference decode steps "
                       "(DecodeGraphs / RowGraphs attention='triton'); train with transformers' eager or SDPA "
                       "attention")


_decode_attention_op.register_autograd(_backward, setup_context=_setup_context)


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor] = None, *,
                     scaling: Optional[float] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """``torch.ops.moe_lora.decode_attention``: query [B, H, S, D], key / value [B, Hkv, L, D], additive mask
    [B or 1, 1, S, >= L] or None, ``scaling`` (default ``D ** -0.5``), sinks [H] or None -> out [B, S, H, D]."""
    if scaling is None:
        if not isinstance(query, Tensor) or query.dim() != 4 or query.shape[-1] < 1:
            check_decode_attention_args(query, key, value, mask, 1.0, sinks)  # names the problem
            raise ValueError(f"query's head dim D must be >= 1 for the default scaling D ** -0.5, got shape "
                             f"{_shape(query)}")
        scaling = query.shape[-1] ** -0.5
    elif isinstance(scaling, bool) or not isinstance(scaling, numbers.Real):
        raise TypeError(f"scaling must be a float, got {scaling!r}")
    return torch.ops.moe_lora.decode_attention(query, key, value, mask, float(scaling), sinks)
