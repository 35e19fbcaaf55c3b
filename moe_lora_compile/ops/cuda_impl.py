"""CUDA impls of the ops. The Triton kernels plug in here; until a kernel covers a case, the reference serves.

``MOE_LORA_CHECK_IDS=0`` turns off the on-device range asserts of ``topk_ids`` / ``token_lora_ids`` (they never
sync the host, but cost a small launch each).
"""

from __future__ import annotations

import os

import torch

from .reference import fused_moe_lora_reference, lora_linear_reference


def check_values_on_device() -> bool:
    """Whether CUDA impls assert id ranges on device; off while a CUDA graph is being captured."""
    if os.environ.get("MOE_LORA_CHECK_IDS", "1") == "0":
        return False
    return not torch.cuda.is_current_stream_capturing()


def fused_moe_lora_cuda(*args, **kwargs):
    return fused_moe_lora_reference(*args, **kwargs)


def lora_linear_cuda(*args, **kwargs):
    return lora_linear_reference(*args, **kwargs)
