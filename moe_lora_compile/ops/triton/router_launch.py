"""Host launcher of :func:`.router_kernels.route_kernel`: tile sizes, the H split and the arrival counters.

The grid is ``(E_PAD / 16 E blocks) x (H slices)`` per 16-token block, with the slices chosen so that a token
block has about one program per SM (capped at :data:`MAX_SPLITS`, the partials the last program sums): GPT-OSS-20B
(E=32, H=2880) gets 2 x 23 programs of 16 x 128 weights each, Qwen3-30B-A3B (E=128, H=2048) 8 x 16. One launch, no
memset: the counters live in one int32 buffer per device, zeroed once and reset by the kernel itself. Launches on
one stream are ordered; two routers running at the same time on two streams of one device would share the
counters, which this module does not support.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
from torch import Tensor

from .counters import ArrivalCounters
from . import router_kernels as RK

SCORING_IDS = {"topk_softmax": RK.TOPK_SOFTMAX, "softmax_topk": RK.SOFTMAX_TOPK, "topk_sigmoid": RK.TOPK_SIGMOID}
BLOCK_T = 16  # tokens per program (tl.dot needs >= 16 rows; decode pads T=1 up to it)
BLOCK_E = 16
MAX_SPLITS = 32
MAX_TOP_K = 16  # k rounds are unrolled in the kernel
MAX_EXPERTS = 256  # one program holds a [16, E] tile of logits for the top-k
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_counters = ArrivalCounters(minimum=64)


def kernel_covers(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], top_k: int) -> bool:
    """Whether :func:`route_triton` takes these inputs (dtype, E, k); the op falls back to the aten ops otherwise."""
    return (hidden.dtype in SUPPORTED_DTYPES and weight.dtype == hidden.dtype
            and (bias is None or bias.dtype == hidden.dtype)
            and weight.shape[0] <= MAX_EXPERTS and top_k <= MAX_TOP_K)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few slices, so tests cover the split sum
    return torch.cuda.get_device_properties(device).multi_processor_count


def _block_k(H: int) -> int:
    """The largest of 128/64/32/16 dividing H (no K masks), else 128 (or less for a small H), masked."""
    for block in (128, 64, 32, 16):
        if H % block == 0:
            return block
    return max(16, min(128, triton.next_power_of_2(H)))


def route_triton(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], *, top_k: int, scoring: str,
                 renormalize: bool, scores_dtype: torch.dtype, split_k: Optional[int] = None,
                 block_k: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor]:
    """hidden [T, H], weight [E, H], bias [E] or None (one dtype) -> (logits [T, E] in hidden's dtype,
    scores [T, top_k] in ``scores_dtype``, ids [T, top_k] int64). ``split_k`` / ``block_k``: override the H split
    (tests)."""
    T, H = hidden.shape
    E = weight.shape[0]
    device = hidden.device
    logits = torch.empty((T, E), dtype=hidden.dtype, device=device)
    scores = torch.empty((T, top_k), dtype=scores_dtype, device=device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=device)
    if T == 0:
        return logits, scores, ids
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    e_pad = max(BLOCK_E, triton.next_power_of_2(E))
    e_blocks = e_pad // BLOCK_E
    block_k = block_k or _block_k(H)
    k_steps = triton.cdiv(H, block_k)
    splits = split_k or max(1, min(MAX_SPLITS, _num_sms(device) // e_blocks))
    splits = min(splits, k_steps)
    k_per_split = triton.cdiv(k_steps, splits) * block_k
    num_splits = triton.cdiv(H, k_per_split)
    t_blocks = triton.cdiv(T, BLOCK_T)
    part = torch.empty((num_splits, T, e_pad), dtype=torch.float32, device=device)
    RK.route_kernel[(e_blocks * num_splits, t_blocks)](
        hidden, hidden.stride(0), weight, weight.stride(0), bias, part, _counters.get(device, t_blocks),
        logits, scores, ids, T, E, H, num_splits, k_per_split,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), SCORING=SCORING_IDS[scoring], RENORMALIZE=renormalize,
        HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E, E_PAD=e_pad, BLOCK_K=block_k,
        EVEN_K=H % block_k == 0, DOT_PRECISION="ieee" if hidden.dtype == torch.float32 else "tf32", num_warps=4,
    )
    return logits, scores, ids
