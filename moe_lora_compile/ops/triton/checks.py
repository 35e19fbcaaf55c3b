"""@triton.jit data check of the ops' id inputs on CUDA: one launch, no host sync.

``torch._assert_async(((ids >= low) & (ids < high)).all())`` costs five launches (two compares, an and, a
reduction, the assert); a decode step of a 24-layer model runs 72 checked op calls, so the checks alone were ~480
of its ~1100 kernels (H200 profile, 2026-12-03). Here each program checks a block of ids with a device-side assert
(compiled in only with ``debug=True``), which fails the launch the way ``_assert_async`` does.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(debug=True, do_not_specialize=["n", "low", "high"])
def check_index_range_kernel(ids_ptr, n, low, high, MESSAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Device assert ``low <= ids[i] < high`` for i < n; ids int32 or int64, contiguous. Grid cdiv(n, BLOCK)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=low)
    tl.device_assert((ids >= low) & (ids < high), MESSAGE)
