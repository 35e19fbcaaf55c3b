"""Arrival counters of the kernels whose last-arriving program combines the others' partials (router, decode
attention): one int32 buffer per device, all zero between launches (each group's last program resets its counter),
zeroed once when allocated, never per call. A first call inside a CUDA-graph capture puts the buffer in the graph's
pool, where it stays allocated while its owner holds it. Two launches of one kernel family on two streams at once
would share counters: not supported."""

from __future__ import annotations

import torch
from torch import Tensor


class ArrivalCounters:
    """Per-device counter buffers of at least ``minimum`` entries (grown, then kept, when a launch needs more)."""

    def __init__(self, minimum: int):
        self.minimum = minimum
        self._buffers: dict[torch.device, Tensor] = {}

    def get(self, device: torch.device, n: int) -> Tensor:
        """The device's counters, at least ``n`` of them (int32, all zero)."""
        buf = self._buffers.get(device)
        if buf is None or buf.numel() < n:
            buf = torch.zeros(max(n, self.minimum), dtype=torch.int32, device=device)
            self._buffers[device] = buf
        return buf

    def all_clear(self, device: torch.device) -> bool:
        """Whether every counter of ``device`` is back at zero (tests)."""
        buf = self._buffers.get(device)
        return buf is None or not bool(buf.any())
