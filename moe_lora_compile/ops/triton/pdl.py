"""Programmatic dependent launch (PDL) for the chain of kernels of one layer: whether to use it, and the launch
arguments of each kernel in the chain.

With PDL (SM90+), a kernel launched with ``launch_pdl=True`` may start while the previous kernel in the stream
is still running; each of our kernels calls ``gdc_wait`` (then ``gdc_launch_dependents``) before touching memory
(:func:`.moe_kernels.grid_dependency_sync`), so only the launch latency and prologue overlap, and every kernel
finishes after its predecessor did. One exception: the w13 kernel streams its weights before it waits for the
shrink13 kernel, since its main loop reads nothing shrink13 writes.

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

    def next(self) -> dict:
        kwargs = {"USE_PDL": self.mode}
        if self.mode and not self._first:
            kwargs["launch_pdl"] = True
        self._first = False
        return kwargs
