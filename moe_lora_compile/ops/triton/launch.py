"""Host launchers of the Triton kernels: buffers, grids, config choice. No host sync; same results on any device
Triton runs on (CUDA, or CPU tensors under ``TRITON_INTERPRET=1``).

``fused_moe_lora_triton`` launches, for one MoE layer: routing (4 small launches; none in per-pair mode),
shrink13 (x A13^T), w13 (grouped GEMM + LoRA expand + bias + activation [+ shrink2 fused, config
``fuse_shrink2``, default in per-pair mode]), shrink2 (act A2^T, unless fused), w2 (grouped GEMM + LoRA expand +
bias, times routing weight, one row per pair), then the top-k sum:
- per-pair mode, k > 1 (config ``fuse_topk_sum``, default on): inside the w2 kernel. Each program writes its
  pair's fp32 row tile to a scratch buffer; the last of a token's k programs for that H tile (an int32 arrival
  counter, zeroed by the shrink13 kernel) sums the k rows in pair order and writes y. No sum launch, no memset,
  deterministic, the per-pair grid's parallelism kept (a token-major kernel, one program per (token, H tile)
  looping over the k experts, made the whole layer 1.4-2.8x slower on the H200 at T=1: k times fewer
  programs, each streaming k experts' weights, and its loop did not pipeline across experts);
- sorted mode: a torch sum over [T, k, H] (a token's pairs sit in blocks of different experts).
At decode (per-pair) that is 3 launches: shrink13, w13 (+ shrink2), w2 (+ top-k sum).

The shrinks (config ``per_pair_shrink``, default: sorted mode up to :data:`.configs.PAIR_SHRINK_MAX_PAIRS` pairs)
run one program per (token, expert) pair and K slice (:func:`.moe_kernels.lora_shrink_pairs_kernel`), or one per
row block (:func:`.moe_kernels.lora_shrink_kernel`). Both write each pair's rank vector at its row of the sorted
order (the routing's ``pair_row``), so the consumers (w13's and w2's expand, the fused shrink2) are the same.

Split-K of the base GEMMs (config ``w13.SPLIT_K``, ``w2.SPLIT_K``): at decode a layer has few (pair, column
tile) programs, fewer than two per SM, so the weights stream from a fraction of the SMs. w13 then splits K: each
slice writes an fp32 partial, the last slice to arrive at its tile's counter sums them in order and runs the
epilogue (LoRA expand, bias, activation, fused shrink2); w2 splits K inside the fused top-k sum (the last of a
token's k*SPLIT_K programs sums every partial). The counters are zeroed by the shrink13 kernel, the first of the
chain, so there is no memset launch; results are deterministic (fixed summation order, no float atomics).

Every kernel after the first of the chain is launched with programmatic dependent launch on SM90+ (see
:mod:`.pdl`; ``MOE_LORA_PDL=0`` or config ``"pdl": false`` turns it off, which wins:
:func:`.configs.requested_pdl`). Kernel arguments go by keyword; a pointer the launch's constexpr switches leave
unread is passed as None (Triton specializes on it), not as a placeholder tensor.
"""

from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import triton
from torch import Tensor

from ..contract import GPTOSS_ALPHA, GPTOSS_LIMIT
from ..layout import CONCAT, expert_geometry, in_out_strides, is_interleaved
from . import dense_kernels as DK
from . import moe_kernels as K
from . import mxfp4_kernels as MXK
from .configs import LinearKernelConfig, MoEKernelConfig, ShrinkConfig, get_config, requested_pdl
from .configs import GEMV_MAX_T, ROWS_SHRINK_MAX_T, default_linear_config, get_linear_config  # noqa: F401
from .pdl import LaunchChain, supported_mode
from .routing import sort_pairs

_ACTIVATION_IDS = {"silu": K.SILU, "gptoss_swiglu": K.GPTOSS_SWIGLU}
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _tile(block: int, dim: int, mxfp4_scales: Optional[Tensor] = None) -> int:
    """A block size no larger than the padded dim (tl.dot needs >= 16); a K block over MXFP4 weights (their
    ``mxfp4_scales`` given) spans whole 32-input scale groups."""
    return max(16 if mxfp4_scales is None else MXK.GROUP, min(block, triton.next_power_of_2(dim)))


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _k_split(K_dim: int, block_k: int, split_k: int) -> tuple[int, int, bool]:
    """Split K_dim into at most ``split_k`` slices of whole BLOCK_K steps -> (slices, k_per_split, EVEN_K)."""
    split_k = max(1, min(split_k, triton.cdiv(K_dim, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(K_dim, split_k), block_k) * block_k
    return triton.cdiv(K_dim, k_per_split), k_per_split, K_dim % k_per_split == 0


def _launch_shrink(inp, a, topk_weights, token_lora_ids, meta, *, K_dim, R, top_k, mode, block_m,
                   input_by_token, scale_by_weight, cfg, dtype, launch, counters=None, pair_row=None,
                   per_pair_shrink=False, ranks=None, rank_block=1, rank_stride=0, rank_blocks=0):
    """-> s [SPLIT_K, rows, R] fp32: per split-K slice, inp A[l, e]^T for the rows with LoRA (others unwritten).

    ``meta``: ``(row_pair, block_expert, topk_ids, num_blocks, num_pairs, grid_m)``; what ``mode`` does not read
    may be None. ``topk_weights``: read only with ``scale_by_weight``. ``cfg``: :class:`.configs.ShrinkConfig`
    (or its dict form). ``counters`` (int32): zeroed on the way (the arrival counters of the kernels after it).
    ``per_pair_shrink`` (SORTED with ``pair_row``, or PER_PAIR mode): one program per pair
    (:func:`.moe_kernels.lora_shrink_pairs_kernel`), same rows written; else one per row block. ``ranks``,
    ``rank_block``, ``rank_stride``, ``rank_blocks``: each slot's rank (:func:`.moe_kernels.rank_mask`; ranks None:
    all R)."""
    rank_args = dict(ranks_ptr=ranks, rank_block=rank_block, rank_stride=rank_stride, num_slots=a.shape[0],
                     num_experts=a.shape[1])
    row_pair, block_expert, topk_ids, num_blocks, num_pairs, grid_m = meta
    cfg = ShrinkConfig.of(cfg)
    zero_counters = counters is not None and counters.numel() > 0
    if per_pair_shrink:
        # no tl.dot: no 16-wide minimum on the K tile
        block_k = max(16, min(cfg.BLOCK_K, triton.next_power_of_2(K_dim)))
        split_k, k_per_split, even_k = _k_split(K_dim, block_k, cfg.SPLIT_K)
        s = torch.empty((split_k, grid_m * block_m, R), dtype=torch.float32, device=inp.device)
        K.lora_shrink_pairs_kernel[(num_pairs, split_k)](
            in_ptr=inp, stride_in=inp.stride(0), a_ptr=a, stride_al=a.stride(0), stride_ae=a.stride(1),
            stride_ar=a.stride(2), s_ptr=s, split_stride=s.stride(0),
            topk_weights_ptr=topk_weights if scale_by_weight else None, token_lora_ptr=token_lora_ids,
            pair_row_ptr=pair_row if mode == K.SORTED else None, topk_ids_ptr=topk_ids, num_pairs=num_pairs, K=K_dim,
            R=R, top_k=top_k, k_per_split=k_per_split, counter_ptr=counters if zero_counters else None,
            num_counters=counters.numel() if zero_counters else 0,
            BLOCK_M=block_m, BLOCK_R=_block_r(R), BLOCK_K=block_k, MODE=mode, INPUT_BY_TOKEN=input_by_token,
            SCALE_BY_WEIGHT=scale_by_weight, EVEN_K=even_k, ZERO_COUNTERS=zero_counters, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **rank_args, **launch)
        return s
    block_k = _tile(cfg.BLOCK_K, K_dim)
    split_k, k_per_split, even_k = _k_split(K_dim, block_k, cfg.SPLIT_K)
    s = torch.empty((split_k, grid_m * block_m, R), dtype=torch.float32, device=inp.device)
    K.lora_shrink_kernel[(grid_m, split_k)](
        in_ptr=inp, stride_in=inp.stride(0), a_ptr=a, stride_al=a.stride(0), stride_ae=a.stride(1),
        stride_ar=a.stride(2), s_ptr=s, topk_weights_ptr=topk_weights if scale_by_weight else None,
        token_lora_ptr=token_lora_ids, row_pair_ptr=row_pair, block_expert_ptr=block_expert, topk_ids_ptr=topk_ids,
        num_blocks_ptr=num_blocks, num_pairs=num_pairs, grid_m=grid_m, K=K_dim, R=R, top_k=top_k,
        k_per_split=k_per_split, counter_ptr=counters if zero_counters else None,
        num_counters=counters.numel() if zero_counters else 0,
        BLOCK_M=block_m, BLOCK_R=_block_r(R), BLOCK_K=block_k, MODE=mode, INPUT_BY_TOKEN=input_by_token,
        SCALE_BY_WEIGHT=scale_by_weight, EVEN_K=even_k, DOT_PRECISION=_dot_precision(dtype),
        ZERO_COUNTERS=zero_counters, num_warps=cfg.num_warps, num_stages=cfg.num_stages, RANK_BLOCKS=rank_blocks,
        **rank_args, **launch)
    return s


def fused_moe_lora_triton(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, token_lora_ids: Tensor, w13: Tensor, w2: Tensor,
    lora_a13: Tensor, lora_b13: Tensor, lora_a2: Tensor, lora_b2: Tensor, *,
    w13_bias: Optional[Tensor] = None, w2_bias: Optional[Tensor] = None, layout: str = CONCAT,
    activation: str = "silu", alpha: float = GPTOSS_ALPHA, limit: float = GPTOSS_LIMIT,
    routing_weight_on_input: bool = False, lora_b13_split: bool = False, out: Optional[Tensor] = None,
    config: Union[MoEKernelConfig, dict, None] = None, w13_scales: Optional[Tensor] = None,
    w2_scales: Optional[Tensor] = None, lora_ranks: Optional[Tensor] = None,
) -> Tensor:
    """Same contract as :func:`..reference.fused_moe_lora_reference` (arguments already checked); y [T, H] x.dtype.

    ``out`` ([T, H], x's dtype; checked by the op): y is written there, by the kernel that writes the final result
    (the w2 kernel's top-k sum, or its rows when k = 1; the sorted path's torch sum otherwise), and ``out`` is
    returned. ``lora_b13_split``: B13 is ``[L, E, 2I, R/2]`` (the contract's split gate/up form; the w13 expand reads
    gate columns on rank rows [0, R/2) and up columns on [R/2, R), nothing else). The w13 and w2 LoRA ranks
    (``R``, ``R2``) are independent. ``config`` (a :class:`.configs.MoEKernelConfig` or its dict form) replaces
    the tuned/heuristic config; its ``pdl`` then wins over ``MOE_LORA_PDL`` (:func:`.configs.requested_pdl`).
    ``w13_scales`` / ``w2_scales`` given: w13 / w2 are MXFP4 blocks (:func:`fused_moe_lora_mxfp4_triton`).
    ``lora_ranks`` [2, L] int: each slot's w13 / w2 rank (every kernel masks the factors' rank axis past it,
    :func:`.moe_kernels.rank_mask`); None: all R / R2."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E, _, I = expert_geometry(layout, _logical_shape(w13, w13_scales), _logical_shape(w2, w2_scales))
    L, R, R2 = lora_a13.shape[0], lora_a13.shape[2], lora_a2.shape[2]
    if out is not None and out.stride(-1) != 1:  # the kernels write rows of unit column stride
        return out.copy_(fused_moe_lora_triton(
            x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
            w13_bias=w13_bias, w2_bias=w2_bias, layout=layout, activation=activation, alpha=alpha, limit=limit,
            routing_weight_on_input=routing_weight_on_input, lora_b13_split=lora_b13_split, config=config,
            w13_scales=w13_scales, w2_scales=w2_scales, lora_ranks=lora_ranks))
    if T == 0:
        return x.new_empty((0, H)) if out is None else out
    cfg = (MoEKernelConfig.of(config) if config is not None
           else get_config(x.device, E, H, I, max(R, R2), T, top_k, mxfp4=w13_scales is not None))
    block_m = 16 if cfg.per_pair else cfg.BLOCK_M
    num_pairs = T * top_k
    x = x.contiguous()
    topk_flat = topk_ids.reshape(-1).contiguous()
    weights_flat = topk_weights.reshape(-1).contiguous()
    token_lora_ids = token_lora_ids.contiguous()
    a13, b13, a2, b2 = (_last_dim_contiguous(t) for t in (lora_a13, lora_b13, lora_a2, lora_b2))
    # the kernels index a bias row's entries with stride 1 (and rows with stride(0)): a transposed bias is copied
    w13_bias, w2_bias = (None if t is None else _last_dim_contiguous(t) for t in (w13_bias, w2_bias))
    ranks13 = ranks2 = None
    if lora_ranks is not None:
        lora_ranks = lora_ranks.contiguous()
        ranks13, ranks2 = lora_ranks[0], lora_ranks[1]
    rank_block13 = R // 2 if lora_b13_split else R  # split form: the gate and up halves share each slot's rank
    chain = LaunchChain(supported_mode(x.device, requested_pdl(cfg.pdl, passed_by_caller=config is not None)))
    # Expert ids outside [0, E) (unchecked: inside CUDA graphs, MOE_LORA_CHECK_IDS=0) add nothing: every kernel gets
    # E (per-pair mode: such a pair skips its GEMMs and its w2 row is zeros; sorted mode: the routing leaves it out
    # and zeroes its row of the w2 output).
    y = out if out is not None else torch.empty((T, H), dtype=x.dtype, device=x.device)
    c2 = cfg.w2
    topk_sum = cfg.per_pair and cfg.fuse_topk_sum and (top_k > 1 or c2.SPLIT_K > 1)
    block_n2, block_k2 = _tile(c2.BLOCK_N, H), _tile(c2.BLOCK_K, I, w2_scales)
    split2, k_per_split2, even_k2 = _k_split(I, block_k2, c2.SPLIT_K if topk_sum else 1)
    if topk_sum:  # fp32 partial rows per pair (and K slice), summed per token into y by the w2 kernel
        rows2 = torch.empty((split2 * num_pairs, H), dtype=torch.float32, device=x.device)
    elif top_k == 1:  # one row per pair = per token: straight into y
        rows2 = y
    else:  # one row per pair, in x.dtype, summed per token below
        rows2 = torch.empty((num_pairs, H), dtype=x.dtype, device=x.device)
    if cfg.per_pair:  # one pair per block: no routing, the kernels read the pair's expert from topk_ids
        mode, grid_m = K.PER_PAIR, num_pairs
        row_pair = block_expert = num_blocks = pair_row = None
    else:
        routing = sort_pairs(topk_ids, token_lora_ids, E, L, block_m, chain=chain, zero_rows=rows2)
        mode, grid_m = K.SORTED, routing.grid_m
        row_pair, block_expert, num_blocks = routing.row_pair, routing.block_expert, routing.num_blocks
        pair_row = routing.pair_row
    meta = (row_pair, block_expert, topk_flat, num_blocks, num_pairs, grid_m)
    # the shrinks per pair (decode-sized batches) or per row block; both write s by row for the consumers
    shrink_kind = dict(pair_row=pair_row, per_pair_shrink=cfg.uses_per_pair_shrink(num_pairs))
    rows = grid_m * block_m
    block_r, block_r2 = _block_r(R), _block_r(R2)
    # the activation in x's dtype, as transformers keeps it (w2's tensor-core dot reads that dtype): in fp16 a value
    # above 65504 is inf here, where the reference keeps fp32 (README, the op's arguments)
    act = torch.empty((rows, I), dtype=x.dtype, device=x.device)
    dot_precision = _dot_precision(x.dtype)

    c13 = cfg.w13
    block_n, block_k = _tile(c13.BLOCK_N, I), _tile(c13.BLOCK_K, H, w13_scales)
    split13, k_per_split13, even_k13 = _k_split(H, block_k, c13.SPLIT_K)
    # Top-k sum inside the w2 kernel (per-pair mode, ``topk_sum`` above): fp32 partial per pair (and K slice), the
    # last of a token's programs per H tile sums them. w2 split-K exists only on this path.
    # Arrival counters (int32), zeroed by the shrink13 kernel, the first of the chain: w13's per tile (split-K),
    # then w2's per (token, H tile) (top-k sum).
    n13 = grid_m * triton.cdiv(I, block_n) if split13 > 1 else 0
    n2 = T * triton.cdiv(H, block_n2) if topk_sum else 0
    counters = torch.empty(n13 + n2, dtype=torch.int32, device=x.device)

    s13 = _launch_shrink(x, a13, weights_flat, token_lora_ids, meta, K_dim=H, R=R, top_k=top_k, mode=mode,
                         block_m=block_m, input_by_token=True, scale_by_weight=routing_weight_on_input,
                         cfg=cfg.shrink, dtype=x.dtype, launch=chain.next(next_overlaps=cfg.w13_overlap),
                         counters=counters, ranks=ranks13, rank_block=rank_block13, **shrink_kind)

    fuse_shrink2 = cfg.fuse_shrink2
    # shrink2 in w13's epilogue: one rank-vector slice per I column tile
    s2 = torch.empty((triton.cdiv(I, block_n), rows, R2), dtype=torch.float32, device=x.device) \
        if fuse_shrink2 else None
    # w13 split-K: fp32 partial gate/up per K slice (valid rows only are written)
    part = torch.empty((split13, rows, 2 * I), dtype=torch.float32, device=x.device) if split13 > 1 else None
    K.moe_w13_kernel[(grid_m * triton.cdiv(I, block_n), split13)](
        x_ptr=x, stride_xt=x.stride(0), **_base_weight_args(w13, w13_scales, layout), bias_ptr=w13_bias, stride_bias_e=0 if w13_bias is None else w13_bias.stride(0),
        b_ptr=b13, stride_bl=b13.stride(0), stride_be=b13.stride(1), stride_bn=b13.stride(2),
        s_ptr=s13, num_splits=s13.shape[0], split_stride=s13.stride(0), act_ptr=act, topk_weights_ptr=weights_flat,
        token_lora_ptr=token_lora_ids, row_pair_ptr=row_pair, block_expert_ptr=block_expert, topk_ids_ptr=topk_flat,
        num_blocks_ptr=num_blocks, num_pairs=num_pairs, grid_m=grid_m, K=H, I=I, R=R, top_k=top_k,
        alpha=float(alpha), limit=float(limit),
        a2_ptr=a2 if fuse_shrink2 else None, stride_a2l=a2.stride(0), stride_a2e=a2.stride(1),
        stride_a2r=a2.stride(2), s2_ptr=s2, s2_split_stride=s2.stride(0) if fuse_shrink2 else 0,
        part_ptr=part, part_split_stride=part.stride(0) if split13 > 1 else 0,
        counter_ptr=counters[:n13] if n13 else None, k_per_split=k_per_split13,
        R2=R2, BLOCK_R2=block_r2, SPLIT_B13=lora_b13_split,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=block_r, GROUP_SIZE_M=c13.GROUP_SIZE_M,
        MODE=mode, INTERLEAVED=is_interleaved(layout), HAS_BIAS=w13_bias is not None,
        ACTIVATION=_ACTIVATION_IDS[activation], WEIGHT_ON_INPUT=routing_weight_on_input,
        EVEN_K=even_k13, EVEN_N=I % block_n == 0, DOT_PRECISION=dot_precision, FUSE_SHRINK2=fuse_shrink2,
        SPLIT_K=split13, WAIT_AFTER_MAIN_LOOP=cfg.w13_overlap, num_warps=c13.num_warps,
        num_stages=c13.num_stages, ranks_ptr=ranks13, rank_block=rank_block13, num_slots=L, num_experts=E,
        ranks2_ptr=ranks2 if fuse_shrink2 else None, **chain.next())

    if not fuse_shrink2:
        s2 = _launch_shrink(act, a2, weights_flat, token_lora_ids, meta, K_dim=I, R=R2, top_k=top_k, mode=mode,
                            block_m=block_m, input_by_token=False, scale_by_weight=False, cfg=cfg.shrink,
                            dtype=x.dtype, launch=chain.next(), ranks=ranks2, rank_block=R2, **shrink_kind)

    K.moe_w2_kernel[(grid_m * triton.cdiv(H, block_n2), split2)](
        in_ptr=act, stride_in=act.stride(0), **_base_weight_args(w2, w2_scales, layout), bias_ptr=w2_bias, stride_bias_e=0 if w2_bias is None else w2_bias.stride(0),
        b_ptr=b2, stride_bl=b2.stride(0), stride_be=b2.stride(1), stride_bn=b2.stride(2),
        s_ptr=s2, num_splits=s2.shape[0], split_stride=s2.stride(0), out_ptr=rows2, stride_out=rows2.stride(0),
        topk_weights_ptr=None if routing_weight_on_input else weights_flat, token_lora_ptr=token_lora_ids,
        row_pair_ptr=row_pair, block_expert_ptr=block_expert, topk_ids_ptr=topk_flat, num_blocks_ptr=num_blocks,
        num_pairs=num_pairs, grid_m=grid_m, K=I, N=H, R=R2, top_k=top_k,
        counter_ptr=counters[n13:] if n2 else None, y_ptr=y if topk_sum else None,
        stride_y=y.stride(0) if topk_sum else 0, k_per_split=k_per_split2,
        BLOCK_M=block_m, BLOCK_N=block_n2, BLOCK_K=block_k2, BLOCK_R=block_r2, GROUP_SIZE_M=c2.GROUP_SIZE_M,
        MODE=mode, HAS_BIAS=w2_bias is not None, WEIGHT_ON_OUTPUT=not routing_weight_on_input,
        EVEN_K=even_k2, EVEN_N=H % block_n2 == 0, DOT_PRECISION=dot_precision, TOPK_SUM=topk_sum,
        SPLIT_K=split2, num_warps=c2.num_warps, num_stages=c2.num_stages, ranks_ptr=ranks2, num_slots=L,
        num_experts=E, SUM_IN_LOOP=cfg.w2_sum_in_loop and split2 == 1 and w2_scales is None, **chain.next())
    if not topk_sum and top_k > 1:
        torch.sum(rows2.view(T, top_k, H), dim=1, out=y)
    return y


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: keep grids tiny
    return torch.cuda.get_device_properties(device).multi_processor_count


def _launch_shrink_rows(x, a, token_lora_ids, *, R, rows, cfg: ShrinkConfig, launch, counters, rank_args):
    """lora_linear's per-token shrink (:mod:`.dense_kernels`) -> s [SPLIT_K, rows, R] fp32 (rows >= T); zeroes
    ``counters`` (int32) on the way. ``rank_args``: :func:`_dense_rank_args`."""
    T, n_in = x.shape
    block_k = _tile(cfg.BLOCK_K, n_in)
    split_k, k_per_split, even_k = _k_split(n_in, block_k, cfg.SPLIT_K)
    s = torch.empty((split_k, rows, R), dtype=torch.float32, device=x.device)
    zero = counters.numel() > 0
    DK.lora_shrink_rows_kernel[(T, split_k)](
        x_ptr=x, stride_x=x.stride(0), a_ptr=a, stride_al=a.stride(0), stride_ar=a.stride(1), s_ptr=s,
        split_stride=s.stride(0), token_lora_ptr=token_lora_ids, T=T, K=n_in, R=R, k_per_split=k_per_split,
        counter_ptr=counters if zero else None, num_counters=counters.numel(),
        BLOCK_R=_block_r(R), BLOCK_K=block_k, EVEN_K=even_k, ZERO_COUNTERS=zero, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **rank_args, **launch)
    return s


def _dense_rank_args(lora_ranks: Optional[Tensor], R: int) -> dict:
    """lora_linear's ``lora_ranks`` ([L], [n, L] or None) as the kernels' ``ranks_ptr``, ``rank_block`` (R/n),
    ``rank_stride`` (L between the n rows), RANK_BLOCKS (n) (:func:`.moe_kernels.rank_mask`)."""
    if lora_ranks is None:
        return dict(ranks_ptr=None, rank_block=R, rank_stride=0, RANK_BLOCKS=1)
    ranks = lora_ranks.contiguous()
    if ranks.dim() == 1:
        return dict(ranks_ptr=ranks, rank_block=R, rank_stride=0, RANK_BLOCKS=1)
    return dict(ranks_ptr=ranks, rank_block=R // ranks.shape[0], rank_stride=ranks.shape[1],
                RANK_BLOCKS=ranks.shape[0])


def lora_linear_triton(x: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor, token_lora_ids: Tensor, *,
                       bias: Optional[Tensor] = None,
                       config: Union[LinearKernelConfig, dict, None] = None,
                       lora_ranks: Optional[Tensor] = None) -> Tensor:
    """``y = x W^T (+ bias) + B[l] A[l] x``: x [T, in], weight [out, in], lora_a [L, R, in], lora_b [L, out, R]
    -> y [T, out] in x.dtype. Two launches: the shrink (per token for decode-sized batches, config ``per_token``;
    else per block of BLOCK_M tokens, the DENSE mode of the MoE shrink), then the base product with the expand in its
    epilogue: the GEMV (:func:`.dense_kernels.lora_gemv_kernel`, config ``gemv``, T <= :data:`.configs.GEMV_MAX_T`)
    or the GEMM (:func:`.dense_kernels.lora_linear_kernel`); split-K ``gemm.SPLIT_K`` with an in-kernel sum, whose
    arrival counters the shrink zeroes. ``config``: a :class:`.configs.LinearKernelConfig` (or its dict form)
    instead of the tuned entry or heuristic (:func:`.configs.get_linear_config`); its ``pdl`` then wins over
    ``MOE_LORA_PDL``. ``lora_ranks`` ([L] or [n, L] int, or None): each slot's rank (see :mod:`..contract`)."""
    T, n_in = x.shape
    n_out = weight.shape[0]
    R = lora_a.shape[1]
    if T == 0:
        return x.new_empty((0, n_out))
    passed = config is not None
    cfg = (LinearKernelConfig.of(config) if passed
           else get_linear_config(x.device, T, n_in, n_out, R, _num_sms(x.device)))
    x = _last_dim_contiguous(x)
    token_lora_ids = token_lora_ids.contiguous()
    a, b = _last_dim_contiguous(lora_a), _last_dim_contiguous(lora_b)
    bias = None if bias is None else bias.contiguous()  # read with stride 1 (a strided view: copied)
    chain = LaunchChain(supported_mode(x.device, requested_pdl(cfg.pdl, passed_by_caller=passed)))
    rank_args = {**_dense_rank_args(lora_ranks, R), "num_slots": a.shape[0]}
    if cfg.gemv and T <= GEMV_MAX_T and weight.stride(1) == 1:  # (a transposed weight: the GEMM reads it as is)
        return _launch_gemv(x, weight, bias, a, b, token_lora_ids, cfg, chain, rank_args)
    c = cfg.gemm
    grid_m = triton.cdiv(T, cfg.BLOCK_M)
    block_n, block_k = _tile(c.BLOCK_N, n_out), _tile(c.BLOCK_K, n_in)
    tiles = grid_m * triton.cdiv(n_out, block_n)
    split_k, k_per_split, even_k = _k_split(n_in, block_k, c.SPLIT_K)
    counters = torch.empty(tiles if split_k > 1 else 0, dtype=torch.int32, device=x.device)
    rows = grid_m * cfg.BLOCK_M
    if cfg.per_token:
        s = _launch_shrink_rows(x, a, token_lora_ids, R=R, rows=rows, cfg=cfg.shrink,
                                launch=chain.next(next_overlaps=True), counters=counters, rank_args=rank_args)
    else:  # the block shrink: the MoE shrink's DENSE mode with one expert, A [L, 1, R, in] (zero expert stride)
        s = _launch_shrink(x, a.unsqueeze(1), None, token_lora_ids, (None, None, None, None, T, grid_m), K_dim=n_in,
                           R=R, top_k=1, mode=K.DENSE, block_m=cfg.BLOCK_M, input_by_token=True,
                           scale_by_weight=False, cfg=cfg.shrink, dtype=x.dtype,
                           launch=chain.next(next_overlaps=True), counters=counters, ranks=rank_args["ranks_ptr"],
                           rank_block=rank_args["rank_block"], rank_stride=rank_args["rank_stride"],
                           rank_blocks=rank_args["RANK_BLOCKS"])
    out = torch.empty((T, n_out), dtype=x.dtype, device=x.device)
    part = torch.empty((split_k, rows, n_out), dtype=torch.float32, device=x.device) if split_k > 1 else None
    DK.lora_linear_kernel[(tiles, split_k)](
        x_ptr=x, stride_x=x.stride(0), w_ptr=weight, stride_wn=weight.stride(0), stride_wk=weight.stride(1),
        bias_ptr=bias, b_ptr=b, stride_bl=b.stride(0), stride_bn=b.stride(1), s_ptr=s, num_splits=s.shape[0],
        split_stride=s.stride(0), token_lora_ptr=token_lora_ids, y_ptr=out, stride_y=out.stride(0), part_ptr=part,
        counter_ptr=counters if split_k > 1 else None, T=T, grid_m=grid_m, K=n_in, N=n_out, R=R,
        k_per_split=k_per_split,
        BLOCK_M=cfg.BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_R=_block_r(R), GROUP_SIZE_M=c.GROUP_SIZE_M,
        HAS_BIAS=bias is not None, EVEN_K=even_k, EVEN_N=n_out % block_n == 0,
        DOT_PRECISION=_dot_precision(x.dtype), SPLIT_K=split_k,
        EXPAND_SLOTS=_expand_slots(cfg, block_n, R, c.num_warps), SPREAD_EXPAND=cfg.spread_expand and split_k > 1,
        num_warps=c.num_warps, num_stages=c.num_stages,
        **rank_args, **chain.next())
    return out


EXPAND_ELEMS_PER_THREAD = 64  # the grouped expand's B tiles held a thread: 64 bf16 (+ the batched dot's result)


def _expand_slots(cfg: LinearKernelConfig, block_n: int, R: int, num_warps: int) -> int:
    """The GEMM's EXPAND_SLOTS: ``cfg.expand_slots`` capped by the rows of a block and by a register budget (the
    group's [slots, BLOCK_R, BLOCK_N] B tiles at most EXPAND_ELEMS_PER_THREAD a thread: sm_90 at BLOCK_N 64,
    rank 32: 80 registers one slot at a time, 143 at 4 slots, 192 at 8)."""
    budget = EXPAND_ELEMS_PER_THREAD * 32 * num_warps // (_block_r(R) * block_n)
    return max(1, min(cfg.expand_slots, cfg.BLOCK_M, 1 << max(0, budget.bit_length() - 1)))


def _launch_gemv(x, weight, bias, a, b, token_lora_ids, cfg: LinearKernelConfig, chain: LaunchChain,
                 rank_args: dict) -> Tensor:
    """lora_linear for a handful of tokens: the per-token shrink (zeroing the split-K counters), then the GEMV
    with the expand and bias in its epilogue (:func:`.dense_kernels.lora_gemv_kernel`) -> y [T, out]."""
    T, n_in = x.shape
    n_out, R = weight.shape[0], a.shape[1]
    c = cfg.gemm
    block_n = max(2, min(c.BLOCK_N, triton.next_power_of_2(n_out)))  # no tl.dot: no 16-wide minimum
    block_k = max(16, min(c.BLOCK_K, triton.next_power_of_2(n_in)))
    tiles = triton.cdiv(n_out, block_n)
    split_k, k_per_split, _ = _k_split(n_in, block_k, c.SPLIT_K)
    counters = torch.empty(tiles if split_k > 1 else 0, dtype=torch.int32, device=x.device)
    s = _launch_shrink_rows(x, a, token_lora_ids, R=R, rows=T, cfg=cfg.shrink,
                            launch=chain.next(next_overlaps=True),
                            counters=counters, rank_args=rank_args)
    out = torch.empty((T, n_out), dtype=x.dtype, device=x.device)
    part = torch.empty((split_k, T, n_out), dtype=torch.float32, device=x.device) if split_k > 1 else None
    DK.lora_gemv_kernel[(tiles, split_k)](
        x_ptr=x, stride_x=x.stride(0), w_ptr=weight, stride_wn=weight.stride(0), bias_ptr=bias, b_ptr=b,
        stride_bl=b.stride(0), stride_bn=b.stride(1), s_ptr=s, num_splits=s.shape[0], split_stride=s.stride(0),
        token_lora_ptr=token_lora_ids, y_ptr=out, stride_y=out.stride(0), part_ptr=part,
        counter_ptr=counters if split_k > 1 else None, T=T, K=n_in, N=n_out, R=R, split_k=split_k,
        k_per_split=k_per_split, BLOCK_T=triton.next_power_of_2(T), BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_R=_block_r(R), HAS_BIAS=bias is not None, EVEN_K=n_in % block_k == 0, EVEN_N=n_out % block_n == 0,
        USE_SPLIT_K=split_k > 1, PREFETCH=c.num_stages >= 2, num_warps=c.num_warps, num_stages=1, **rank_args,
        **chain.next())
    return out


# --- MXFP4 base weights (the kernels' W_FORMAT, :mod:`.mxfp4_kernels`) -------------------------------------------


def _logical_shape(w: Tensor, scales: Optional[Tensor]) -> tuple[int, int, int]:
    """The dense ``[E, in, out]`` shape of MXFP4 ``blocks [E, out, in/32, 16]`` (scales given), else ``w.shape``."""
    if scales is None:
        return tuple(w.shape)
    return w.shape[0], w.shape[2] * MXK.GROUP, w.shape[1]


def _base_weight_args(w: Tensor, scales: Optional[Tensor], layout: str) -> dict:
    """The GEMM kernels' base-weight arguments: dense ``w`` in ``layout`` (element (e, in, out) strides), or MXFP4
    blocks uint8 ``[E, out, in/32, 16]`` + ``scales [E, out, in/32]`` (contiguous past dim 1)."""
    if scales is None:
        stride_e, stride_k, stride_n = in_out_strides(w, layout)
        return dict(w_ptr=w, stride_we=stride_e, stride_wk=stride_k, stride_wn=stride_n)
    return dict(w_ptr=w, stride_we=w.stride(0), stride_wk=0, stride_wn=w.stride(1), w_scales_ptr=scales,
                stride_se=scales.stride(0), stride_sn=scales.stride(1), W_FORMAT=MXK.MXFP4)


def fused_moe_lora_mxfp4_triton(
    x: Tensor, topk_ids: Tensor, topk_weights: Tensor, token_lora_ids: Tensor, w13_blocks: Tensor,
    w13_scales: Tensor, w2_blocks: Tensor, w2_scales: Tensor, lora_a13: Tensor, lora_b13: Tensor, lora_a2: Tensor,
    lora_b2: Tensor, **kwargs,
) -> Tensor:
    """:func:`fused_moe_lora_triton` over MXFP4 experts (arguments already checked): ``w13_blocks`` uint8
    ``[E, 2I, H/32, 16]`` + ``w13_scales [E, 2I, H/32]``, ``w2_blocks [E, H, I/32, 16]`` + ``w2_scales [E, H, I/32]``
    (the checkpoint's layout, made contiguous past the expert dim), decoded to x.dtype in the GEMMs' load path.
    ``kwargs``: those of :func:`fused_moe_lora_triton` (``layout`` a transposed one). y [T, H] x.dtype."""
    w13_blocks, w13_scales, w2_blocks, w2_scales = (
        t if t[0].is_contiguous() else t.contiguous() for t in (w13_blocks, w13_scales, w2_blocks, w2_scales))
    return fused_moe_lora_triton(x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w2_blocks, lora_a13, lora_b13,
                                 lora_a2, lora_b2, w13_scales=w13_scales, w2_scales=w2_scales, **kwargs)
