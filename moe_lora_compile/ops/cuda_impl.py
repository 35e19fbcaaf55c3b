"""CUDA impls of the ops: the Triton kernels of :mod:`.triton`, the reference for what they do not cover (float64,
or LoRA/weight dtypes that differ from ``x``'s: a RuntimeWarning, once per op and dtypes).

``MOE_LORA_CHECK_IDS=0`` turns off the on-device range asserts of ``topk_ids`` / ``token_lora_ids`` (they never
sync the host, but cost a small launch each).
"""

from __future__ import annotations

import warnings

import torch

from .. import settings

from .reference import fused_moe_lora_reference, lora_linear_reference

# Triton is imported on the first CUDA call, not with the package: CPU installs need no triton at all.


def check_values_on_device() -> bool:
    """Whether CUDA impls assert id ranges on device; off while a CUDA graph is being captured."""
    if not settings.CHECK_IDS.enabled():
        return False
    return not torch.cuda.is_current_stream_capturing()


_WARNED: set = set()  # (op, dtypes) whose fallback to the reference has been reported


def _kernel_covers(op: str, x: torch.Tensor, **others) -> bool:
    """The kernels take one float dtype (fp32/fp16/bf16) for x, weights, biases and LoRA stacks. Otherwise the call
    runs the reference; where x's dtype is one the kernels take and others differ (a mistake more often than a
    choice: float64 is the reference's on purpose), a RuntimeWarning says so, once per op and dtypes."""
    from .triton.launch import SUPPORTED_DTYPES

    if x.dtype not in SUPPORTED_DTYPES:
        return False
    other = {name: t.dtype for name, t in others.items() if t is not None and t.dtype != x.dtype}
    if not other:
        return True
    key = (op, x.dtype, tuple(sorted(other.items(), key=str)))
    if key not in _WARNED:
        _WARNED.add(key)
        listed = ", ".join(f"{name} {dtype}" for name, dtype in other.items())
        warnings.warn(f"{op} on CUDA: x is {x.dtype} but {listed}; the Triton kernels take one dtype for all of them, "
                      f"so this runs the PyTorch reference (much slower); cast them "
                      f"to x's dtype to run the kernels (a PeftModel keeps its LoRA weights in float32 on a half "
                      f"model: load it with autocast_adapter_dtype=False, or cast it after loading)", RuntimeWarning,
                      stacklevel=3)
    return False


def fused_moe_lora_cuda(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
                        out=None, **kwargs):
    """Same signature and result as :func:`.reference.fused_moe_lora_reference`; y [T, H] in x.dtype, written into
    ``out`` (and returned) when given."""
    args = (x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2)
    if _kernel_covers("fused_moe_lora", x, w13=w13, w2=w2, lora_a13=lora_a13, lora_b13=lora_b13, lora_a2=lora_a2,
                      lora_b2=lora_b2, w13_bias=kwargs.get("w13_bias"), w2_bias=kwargs.get("w2_bias")):
        from .triton.launch import fused_moe_lora_triton

        return fused_moe_lora_triton(*args, out=out, **kwargs)
    y = fused_moe_lora_reference(*args, **kwargs)
    return y if out is None else out.copy_(y)


def lora_linear_cuda(x, weight, lora_a, lora_b, token_lora_ids, *, bias=None, lora_ranks=None):
    """Same signature and result as :func:`.reference.lora_linear_reference`; y [T, out] in x.dtype."""
    if _kernel_covers("lora_linear", x, weight=weight, lora_a=lora_a, lora_b=lora_b, bias=bias):
        from .triton.launch import lora_linear_triton

        return lora_linear_triton(x, weight, lora_a, lora_b, token_lora_ids, bias=bias, lora_ranks=lora_ranks)
    return lora_linear_reference(x, weight, lora_a, lora_b, token_lora_ids, bias=bias, lora_ranks=lora_ranks)
