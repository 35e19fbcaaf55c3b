"""Host launchers of the Triton kernels: buffers, grids, config choice. No host sync; same results on any device
Triton runs on (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

``fused_moe_lora_triton`` launches, for one MoE layer: routing (4 small launches; none in per-pair mode),
shrink13 (x A13^T), w13 (grouped GEMM + LoRA expand + bias + activation [+ shrink2 fused, config
``fuse_shrink2``, default in per-pair mode]), shrink2 (act A2^T, unless fused), w2 (grouped GEMM + LoRA expand +
bias, times routing weight, one row per pair), then the top-k sum:
- per-pair mode, k > 1 (config ``fuse_topk_sum``, default on): inside the w2 kernel. Each program writes its
  pair's fp32 row tile to a scratch buffer; the last of a token's k programs for that H tile (an int32 arrival
  counter, zeroed by the w13 kernel) sums the k rows in pair order and writes y. No sum launch, no memset,
  deterministic, the per-pair grid's parallelism kept (a token-major kernel, one program per (token, H tile)
  looping over the k experts, made the whole layer 1.4-2.8x slower on the H200 at T=1: k times fewer
  programs, each streaming k experts' weights, and its loop did not pipeline across experts);
- sorted mode: a torch sum over [T, k, H] (a token's pairs sit in blocks of different experts).
At decode (per-pair) that is 3 launches: shrink13, w13 (+ shrink2), w2 (+ top-k sum).

Split-K of the base GEMMs (config ``w13.SPLIT_K``, ``w2.SPLIT_K``): at decode a layer has few (pair, column
tile) programs, fewer than two per SM, so the weights stream from a fraction of the SMs. w13 then splits K: each
slice writes an fp32 partial, the last slice to arrive at its tile's counter sums them in order and runs the
epilogue (LoRA expand, bias, activation, fused shrink2); w2 splits K inside the fused top-k sum (the last of a
token's k*SPLIT_K programs sums every partial). The counters are zeroed by the shrink13 kernel, the first of the
chain, so there is no memset launch; results are deterministic (fixed summation order, no float atomics).

Every kernel after the first of the chain is launched with programmatic dependent launch on SM90+ (see
:mod:`.pdl`; ``MOE_LORA_PDL=0`` or config ``"pdl": false`` turns it off).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
from torch import Tensor

from ..contract import GPTOSS_ALPHA, GPTOSS_LIMIT
from ..layout import CONCAT, expert_geometry, in_out_strides, is_interleaved
from . import dense_kernels as DK
from . import moe_kernels as K
from .configs import get_config
from .pdl import LaunchChain, use_pdl
from .routing import sort_pairs

_ACTIVATION_IDS = {"silu": K.SILU, "gptoss_swiglu": K.GPTOSS_SWIGLU}
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tile(block: int, dim: int) -> int:
    """A block size no larger than the padded dim (tl.dot needs >= 16)."""
    return max(16, min(block, triton.next_power_of_2(dim)))


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _k_split(K_dim: int, block_k: int, split_k: int) -> tuple[int, int, bool]:
    """Split K_dim into at most ``split_k`` slices of whole BLOCK_K steps -> (slices, k_per_split, EVEN_K)."""
    split_k = max(1, min(split_k, triton.cdiv(K_dim, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K_dim, split_k), block_k) * block_k
    return triton.cdiv(K_dim, k_per_split), k_per_split, K_dim % k_per_split == 0


def _launch_shrink(inp, a, topk_weights, token_lora_ids, meta, *, K_dim, R, top_k, mode, block_m,
                   input_by_token, scale_by_weight, cfg, dtype, launch, counters=None):
    """-> s [SPLIT_K, rows, R] fp32: per split-K slice, inp A[l, e]^T for the rows with LoRA (others unwritten).
    ``counters`` (int32): zeroed on the way (the arrival counters of the kernels after it)."""
    row_pair, block_expert, topk_ids, num_blocks, num_pairs, grid_m = meta
    block_k = _tile(cfg["BLOCK_K"], K_dim)
    split_k, k_per_split, even_k = _k_split(K_dim, block_k, cfg["SPLIT_K"])
    s = torch.empty((split_k, grid_m * block_m, R), dtype=torch.float32, device=inp.device)
    zero = counters is not None and counters.numel() > 0
    counters = counters if zero else token_lora_ids
    K.lora_shrink_kernel[(grid_m, split_k)](
        inp, inp.stride(0), a, a.stride(0), a.stride(1), a.stride(2), s, topk_weights, token_lora_ids,
        row_pair, block_expert, topk_ids, num_blocks, num_pairs, grid_m, K_dim, R, top_k, k_per_split,
        counters, counters.numel(),
        BLOCK_M=block_m, BLOCK_R=_block_r(R), BLOCK_K=block_k, MODE=mode, INPUT_BY_TOKEN=input_by_token,
        SCALE_BY_WEIGHT=scale_by_weight, EVEN_K=even_k, DOT_PRECISION=_dot_precision(dtype), ZERO_COUNTERS=zero,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **launch)
    return s


def fused_moe_lora_triton(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, token_lora_ids: Tensor, w13: Tensor, w2: Tensor,
    lora_a13: Tensor, lora_b13: Tensor, lora_a2: Tensor, lora_b2: Tensor, *,
    w13_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None, layout: str = CONCAT,
    activation: str = "silu", alpha: float = GPTOSS_ALPHA, limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False, config: Optional[dict] = None,
) -> Tensor:
    """Same contract as :func:`..reference.fused_moe_lora_reference` (arguments already checked); y [T, H] x.dtype.

    ``config`` overrides the tuned/heuristic config (see :mod:`.configs`; its optional ``"pdl"`` and
    ``"fuse_topk_sum"`` keys switch PDL and the fused w2 + top-k sum kernel)."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E, _, I = expert_geometry(layout, w13.shape, w2.shape)
    L, R = lora_a13.shape[0], lora_a13.shape[2]
    if T == 0:
        return x.new_empty((0, H))
    cfg = config or get_config(x.device, E, H, I, R, T, top_k)
    block_m = 16 if cfg["per_pair"] else cfg["BLOCK_M"]
    num_pairs = T * top_k
    x = x.contiguous()
    topk_flat = topk_ids.reshape(-1).contiguous()
    weights_flat = topk_weights.reshape(-1).contiguous()
    token_lora_ids = token_lora_ids.contiguous()
    a13, b13, a2, b2 = (_last_dim_contiguous(t) for t in (lora_a13, lora_b13, lora_a2, lora_b2))
    chain = LaunchChain(use_pdl(x.device, cfg, env_first=config is None))
    if cfg["per_pair"]:
        mode, grid_m = K.PER_PAIR, num_pairs
        row_pair = block_expert = num_blocks = topk_flat  # unused in this mode
    else:
        routing = sort_pairs(topk_ids, token_lora_ids, E, L, block_m, chain=chain)
        mode, grid_m = K.SORTED, routing.grid_m
        row_pair, block_expert, num_blocks = routing.row_pair, routing.block_expert, routing.num_blocks
    meta = (row_pair, block_expert, topk_flat, num_blocks, num_pairs, grid_m)
    rows = grid_m * block_m
    block_r = _block_r(R)
    act = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    dot_precision = _dot_precision(x.dtype)

    c, c2 = cfg["w13"], cfg["w2"]
    block_n, block_k = _tile(c["BLOCK_N"], I), _tile(c["BLOCK_K"], H)
    block_n2, block_k2 = _tile(c2["BLOCK_N"], H), _tile(c2["BLOCK_K"], I)
    split13, k_per_split13, even_k13 = _k_split(H, block_k, c.get("SPLIT_K", 1))
    # Top-k sum inside the w2 kernel (per-pair mode): fp32 partial per pair (and K slice), the last of a token's
    # programs per H tile sums them. w2 split-K exists only on this path.
    topk_sum = cfg["per_pair"] and cfg.get("fuse_topk_sum", True) and (top_k > 1 or c2.get("SPLIT_K", 1) > 1)
    split2, k_per_split2, even_k2 = _k_split(I, block_k2, c2.get("SPLIT_K", 1) if topk_sum else 1)
    # Arrival counters (int32), zeroed by the shrink13 kernel, the first of the chain: w13's per tile (split-K),
    # then w2's per (token, H tile) (top-k sum).
    n13 = grid_m * triton.cdiv(I, block_n) if split13 > 1 else 0
    n2 = T * triton.cdiv(H, block_n2) if topk_sum else 0
    counters = torch.empty(n13 + n2, dtype=torch.int32, device=x.device)

    s13 = _launch_shrink(x, a13, weights_flat, token_lora_ids, meta, K_dim=H, R=R, top_k=top_k, mode=mode,
                         block_m=block_m, input_by_token=True, scale_by_weight=routing_weight_on_input,
                         cfg=cfg["shrink"], dtype=x.dtype, launch=chain.next(), counters=counters)

    w13_strides = in_out_strides(w13, layout)  # element (e, k, n): k over H, n over 2I
    bias13 = w13_bias if w13_bias is not None else x
    fuse_shrink2 = cfg.get("fuse_shrink2", cfg["per_pair"])
    if fuse_shrink2:  # shrink2 in w13's epilogue: one rank-vector slice per I column tile
        s2 = torch.empty((triton.cdiv(I, block_n), rows, R), dtype=torch.float32, device=x.device)
    else:
        s2 = s13  # placeholder; the shrink2 launch below makes the real one
    # w13 split-K: fp32 partial gate/up per K slice (valid rows only are written)
    part = torch.empty((split13, rows, 2 * I) if split13 > 1 else (1,), dtype=torch.float32, device=x.device)
    if topk_sum:
        out = torch.empty((split2 * num_pairs, H), dtype=torch.float32, device=x.device)
        y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((num_pairs, H), dtype=x.dtype, device=x.device)
        y = out
    counters13 = counters[:n13] if n13 else token_lora_ids  # (an unused placeholder when there are none)
    counters2 = counters[n13:] if n2 else token_lora_ids
    K.moe_w13_kernel[(grid_m * triton.cdiv(I, block_n), split13)](
        x, x.stride(0), w13, *w13_strides, bias13, bias13.stride(0),
        b13, b13.stride(0), b13.stride(1), b13.stride(2), s13, s13.shape[0], s13.stride(0), act, weights_flat,
        token_lora_ids,
        row_pair, block_expert, topk_flat, num_blocks, num_pairs, grid_m, H, I, R, top_k, float(alpha), float(limit),
        a2, a2.stride(0), a2.stride(1), a2.stride(2), s2, s2.stride(0), part, part.stride(0), counters13,
        k_per_split13,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, GROUP_SIZE_M=c["GROUP_SIZE_M"],
        MODE=mode, INTERLEAVED=is_interleaved(layout), HAS_BIAS=w13_bias is not None,
        ACTIVATION=_ACTIVATION_IDS[activation], WEIGHT_ON_INPUT=routing_weight_on_input,
        EVEN_K=even_k13, EVEN_N=I % block_n == 0, DOT_PRECISION=dot_precision, FUSE_SHRINK2=fuse_shrink2,
        SPLIT_K=split13, WAIT_AFTER_MAIN_LOOP=cfg.get("w13_overlap", True), num_warps=c["num_warps"],
        num_stages=c["num_stages"], **chain.next())

    if not fuse_shrink2:
        s2 = _launch_shrink(act, a2, weights_flat, token_lora_ids, meta, K_dim=I, R=R, top_k=top_k, mode=mode,
                            block_m=block_m, input_by_token=False, scale_by_weight=False, cfg=cfg["shrink"],
                            dtype=x.dtype, launch=chain.next())

    w2_strides = in_out_strides(w2, layout)  # element (e, k, n): k over I, n over H
    bias2 = w2_bias if w2_bias is not None else x
    K.moe_w2_kernel[(grid_m * triton.cdiv(H, block_n2), split2)](
        act, act.stride(0), w2, *w2_strides, bias2, bias2.stride(0),
        b2, b2.stride(0), b2.stride(1), b2.stride(2), s2, s2.shape[0], s2.stride(0), out, out.stride(0), weights_flat,
        token_lora_ids,
        row_pair, block_expert, topk_flat, num_blocks, num_pairs, grid_m, I, H, R, top_k, counters2, y, y.stride(0),
        k_per_split2,
        BLOCK_M=block_m, BLOCK_N=block_n2, BLOCK_K=block_k2, BLOCK_R=block_r, GROUP_SIZE_M=c2["GROUP_SIZE_M"],
        MODE=mode, HAS_BIAS=w2_bias is not None, WEIGHT_ON_OUTPUT=not routing_weight_on_input,
        EVEN_K=even_k2, EVEN_N=H % block_n2 == 0, DOT_PRECISION=dot_precision, TOPK_SUM=topk_sum,
        SPLIT_K=split2, num_warps=c2["num_warps"], num_stages=c2["num_stages"], **chain.next())
    if topk_sum or top_k == 1:
        return y
    return out.view(T, top_k, H).sum(dim=1)


ROWS_SHRINK_MAX_T = 64  # up to this many tokens lora_linear's shrink runs per token (dense_kernels), else per block


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: keep grids tiny
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_linear_config(T: int, n_in: int = 4096, n_out: int = 4096, num_sms: int = 132) -> dict:
    """Heuristic ``lora_linear`` config. Decode (T <= 64) is a skinny GEMM that streams the weight once: column
    tiles of 64 where that gives >= 40 programs, else narrower (32, 16), and K steps of 256; from a sweep on the
    H200 (2026-12-03, ``benchmarks/bench_lora_linear.py --configs``): q [4096, 2880] at T=1 19.4 us with 64-wide tiles
    against 22.7 us with 16-wide ones, k/v [512, 2880] best at 16. The per-token shrink splits K so that the batch's
    programs fill the SMs about twice."""
    small = T <= 64
    block_m = 16 if small else 64
    grid_m = triton.cdiv(T, block_m)
    block_n = 64
    if small:
        while block_n > 16 and grid_m * triton.cdiv(n_out, block_n) < 40:
            block_n //= 2
    rows_split = max(1, min(triton.cdiv(n_in, 128), triton.cdiv(2 * num_sms, max(T, 1))))
    return {"BLOCK_M": block_m,
            "gemm": {"BLOCK_N": block_n, "BLOCK_K": 256 if small else 64, "GROUP_SIZE_M": 8, "num_warps": 4,
                     "num_stages": 4 if small else 3},
            "shrink": {"BLOCK_K": 128 if small else 64, "SPLIT_K": rows_split if small else 1, "num_warps": 4,
                       "num_stages": 2, "per_token": small}}


def _launch_shrink_rows(x, a, token_lora_ids, *, R, rows, cfg, launch):
    """lora_linear's per-token shrink (:mod:`.dense_kernels`) -> s [SPLIT_K, rows, R] fp32 (rows >= T)."""
    T, n_in = x.shape
    block_k = _tile(cfg["BLOCK_K"], n_in)
    split_k, k_per_split, even_k = _k_split(n_in, block_k, cfg["SPLIT_K"])
    s = torch.empty((split_k, rows, R), dtype=torch.float32, device=x.device)
    DK.lora_shrink_rows_kernel[(T, split_k)](
        x, x.stride(0), a, a.stride(0), a.stride(1), s, s.stride(0), token_lora_ids, T, n_in, R, k_per_split,
        BLOCK_R=_block_r(R), BLOCK_K=block_k, EVEN_K=even_k, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **launch)
    return s


def lora_linear_triton(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, token_lora_ids: Tensor, *,
                       bias: Optional[Tensor] = None, config: Optional[dict] = None) -> Tensor:
    """``y = x W^T (+ bias) + B[l] A[l] x``: x [T, in], weight [out, in], lora_a [L, R, in], lora_b [L, out, R]
    -> y [T, out] in x.dtype. Two launches: shrink (per token for decode-sized batches, config
    ``shrink.per_token``; else per block of BLOCK_M tokens), then the GEMM with the expand in its epilogue."""
    T, n_in = x.shape
    n_out = weight.shape[0]
    R = lora_a.shape[1]
    if T == 0:
        return x.new_empty((0, n_out))
    cfg = config or default_linear_config(T, n_in, n_out, _num_sms(x.device))
    block_m = cfg["BLOCK_M"]
    grid_m = triton.cdiv(T, block_m)
    x = x.contiguous()
    token_lora_ids = token_lora_ids.contiguous()
    a, b = _last_dim_contiguous(lora_a), _last_dim_contiguous(lora_b)
    dummy = token_lora_ids
    chain = LaunchChain(use_pdl(x.device, cfg))
    if cfg["shrink"].get("per_token", False):
        s = _launch_shrink_rows(x, a, token_lora_ids, R=R, rows=grid_m * block_m, cfg=cfg["shrink"],
                                launch=chain.next())
    else:
        # lora_linear is the DENSE mode of the MoE kernels with one expert: A [L, 1, R, in] via a zero expert stride.
        meta = (dummy, dummy, dummy, dummy, T, grid_m)
        s = _launch_shrink(x, a.unsqueeze(1), x, token_lora_ids, meta, K_dim=n_in, R=R, top_k=1, mode=K.DENSE,
                           block_m=block_m, input_by_token=True, scale_by_weight=False, cfg=cfg["shrink"],
                           dtype=x.dtype, launch=chain.next())
    out = torch.empty((T, n_out), dtype=x.dtype, device=x.device)
    c = cfg["gemm"]
    block_n, block_k = _tile(c["BLOCK_N"], n_out), _tile(c["BLOCK_K"], n_in)
    bias_t = bias if bias is not None else x
    K.moe_w2_kernel[(grid_m * triton.cdiv(n_out, block_n),)](
        x, x.stride(0), weight, 0, weight.stride(1), weight.stride(0), bias_t, 0,
        b, b.stride(0), 0, b.stride(1), s, s.shape[0], s.stride(0), out, out.stride(0), x, token_lora_ids,
        dummy, dummy, dummy, dummy, T, grid_m, n_in, n_out, R, 1, dummy, out, out.stride(0),
        triton.cdiv(n_in, block_k) * block_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=_block_r(R), GROUP_SIZE_M=c["GROUP_SIZE_M"],
        MODE=K.DENSE, HAS_BIAS=bias is not None, WEIGHT_ON_OUTPUT=False,
        EVEN_K=n_in % block_k == 0, EVEN_N=n_out % block_n == 0, DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=c["num_warps"], num_stages=c["num_stages"], **chain.next())
    return out
