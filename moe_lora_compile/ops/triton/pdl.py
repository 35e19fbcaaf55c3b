"""Programmatic dependent launch (PDL) for the chain of kernels of one layer: whether to use it, and the launch
arguments of each kernel in the chain.

With PDL (SM90+), a kernel launched with ``launch_pdl=True`` may start while the previous kernel in the stream
is still running; each of our kernels calls ``gdc_wait`` before touching memory
(:func:`.moe_kernels.grid_dependency_sync`), so only the launch latency and prologue overlap, and every kernel
finishes after its predecessor did. The exceptions are the kernels after a LoRA shrink: the w13 kernel and the
dense GEMV / GEMM stream their weights before they wait for the shrink, since their main loops read nothing it
writes. Each kernel lets its successor launch once its programs are past their main loop (PDL_LATE), or right after
its wait (PDL_EARLY); a shrink followed by such a kernel uses the early trigger by default (``MOE_LORA_EARLY_SHRINK``,
:meth:`LaunchChain.next`).

Used only where it is safe:
- a CUDA device of compute capability >= 9.0, not ROCm, not Triton's interpreter;
- a Triton that has ``tl.extra.cuda.gdc_wait`` / ``gdc_launch_dependents`` and the ``launch_pdl`` launch option
  (present in Triton 3.6, the H200 image, and 3.9; checked here, not assumed): otherwise the kernels compile
  without them;
- only kernels *after the first* of a chain get ``launch_pdl=True``: the first one follows whatever the caller ran
  before (a torch kernel, a memcpy, an event wait), which keeps its ordinary full dependency;
- the launches happen in our own Python launcher (the ``moe_lora`` ops are opaque custom ops, also under
  ``torch.compile``, so Inductor never re-launches these kernels without the flag); stream capture into a CUDA
  graph records the programmatic edges (CUDA >= 12.3).

What is requested (``MOE_LORA_PDL``, a config's ``"pdl"``, and which wins) is decided in one place,
:func:`.configs.requested_pdl`; this module says whether the device can run it and builds the launch arguments.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ... import settings
from .moe_kernels import PDL_EARLY, PDL_LATE, PDL_OFF

__all__ = ["PDL_EARLY", "PDL_LATE", "PDL_OFF", "LaunchChain", "pdl_supported", "supported_mode"]


@functools.lru_cache(maxsize=None)
def triton_has_pdl() -> bool:
    """This Triton has the GDC intrinsics and the ``launch_pdl`` launch option of the NVIDIA backend."""
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
        cuda = tl.extra.cuda
        return (hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")
                and any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions)))
    except Exception:  # no NVIDIA backend, an old Triton, an unexpected layout
        return False


@functools.lru_cache(maxsize=None)
def _device_supports_pdl(index: int) -> bool:
    if torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_supported(device: torch.device) -> bool:
    """PDL can be used for kernels on ``device``."""
    if device.type != "cuda" or settings.TRITON_INTERPRET.enabled() or not triton_has_pdl():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_supports_pdl(index)


def supported_mode(device: torch.device, mode: int) -> int:
    """The mode to launch with on ``device``: ``mode`` where PDL is supported, else PDL_OFF."""
    return mode if mode and pdl_supported(device) else PDL_OFF


class LaunchChain:
    """Launch keyword arguments for the kernels of one chain, in launch order: every kernel compiles with
    ``USE_PDL=mode``; with PDL on, all but the first also get ``launch_pdl=True`` (the first one follows
    whatever the caller launched before, so it keeps its ordinary full dependency)."""

    def __init__(self, mode: int):
        self.mode = int(mode)
        self._first = True

    def next(self, *, next_overlaps: bool = False) -> dict:
        """The next kernel's launch arguments. ``next_overlaps``: the kernel after this one reads nothing this one
        writes before its own wait (a LoRA shrink opening the chain, then the dense GEMV / GEMM or w13 with
        ``w13_overlap``): with ``MOE_LORA_EARLY_SHRINK`` on (the default) and the chain in PDL_LATE, this kernel
        triggers its successor's launch right after its own wait (PDL_EARLY), so the successor's weights stream
        meanwhile. Measured on the H200 (2026-12-06, GPT-OSS-20B whole step, BENCHMARKS.md): alone it changed
        nothing; with the shrinks split 8 ways instead of 16-32 (fewer slices for the consumer's epilogue to sum)
        the LoRA cost fell from +10.5 % to +7.3 % at batch 1 and from +14.1 % to +12.5 % at batch 8, where the
        fewer slices without it gained 0.05 ms at batch 1 and nothing at batch 8."""
        mode = self.mode
        if next_overlaps and mode == PDL_LATE and settings.EARLY_SHRINK.enabled():
            mode = PDL_EARLY
        kwargs = {"USE_PDL": mode}
        if self.mode and not self._first:
            kwargs["launch_pdl"] = True
        self._first = False
        return kwargs
