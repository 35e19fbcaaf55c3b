"""@triton.jit kernel of ``moe_lora.decode_attention``: attention of a few query tokens over a static KV cache
("flash decoding"), grouped query heads folded, GPT-OSS sinks, one launch.

A decode step has ``S`` query tokens per sequence (1, or ``1 + k`` for a speculative verify step) and a static cache
of ``L`` slots of which most are masked (beyond the current position, or outside a sliding window). Program
``(b * Hkv + g, split)`` takes the ``n_rep * S`` query rows that read key/value head ``g`` (query head
``h = g * n_rep + j``, row ``j * S + s``; padded to ``BLOCK_M >= 16`` rows for ``tl.dot``) over its chunk of the
slots, ``BLOCK_N`` at a time, with an online softmax in fp32 (base 2). A block whose mask is masked for every row
(entries ``<= masked_below``) is skipped before its K/V are loaded: the empty part of the cache is never read.

The splits of one ``(b, g)`` write fp32 partials (running max, sum, unnormalized output); the last to arrive at its
int32 counter (acq_rel atomic, as :mod:`.router_kernels`) combines them in split order (deterministic), folds the
per-head sink logit into the denominator (GPT-OSS: ``softmax([scores, sink])`` without the sink column), writes
``out [B, S, H, D]`` and resets its counter to zero. A row whose every slot is masked gets zeros (transformers'
eager attention would average the values uniformly there; a decode step never has such a row).

Measured and not kept (H100, 2026-12-05, ``benchmarks/bench_decode_kernels.py``): loading the partial outputs of
several splits at once in the combine (``[chunk, BLOCK_M, BLOCK_D]``, summed over the chunk) instead of one split a
load: GPT-OSS-20B at batch 1 12.7 -> 11.2 us, but batch 8 9.6 -> 12.7 us and Qwen3-30B-A3B at batch 1 13.6 ->
20.6 us (the 3-D tile's reduction converts layouts every chunk). This kernel in the whole step of GPT-OSS-20B
(same H100, ``bench_decode.py --attention triton`` against ``default``, no adapters): batch 1 3.89 against 3.85 ms,
batch 8 10.81 against 10.98 ms, so ``DecodeGraphs`` keeps the model's own attention by default.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _finish(acc, m_i, l_i, sinks_ptr, head, row_ok, HAS_SINKS: tl.constexpr):
    """Normalized output [BLOCK_M, BLOCK_D] fp32 from the running max ``m_i`` (base 2, -inf: nothing seen), sum
    ``l_i`` and unnormalized ``acc``; with sinks, the head's sink logit joins the denominator."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * LOG2E
        m_fin = tl.maximum(m_i, sink)
        seen = tl.exp2(m_i - m_fin)
        denom = l_i * seen + tl.exp2(sink - m_fin)
        return acc * (seen / denom)[:, None]
    denom = tl.where(l_i > 0.0, l_i, 1.0)
    return acc / denom[:, None]


@triton.jit(do_not_specialize=["Hkv", "L", "num_splits", "chunk_len", "scale_log2", "masked_below"])
def decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, sinks_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_mb, stride_ms, stride_ml,
    stride_ob, stride_os, stride_oh,
    Hkv, L, num_splits, chunk_len, scale_log2, masked_below,
    D: tl.constexpr, S: tl.constexpr, N_REP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid ``(B * Hkv, num_splits)``.

    q [B, H, S, D], k / v [B, Hkv, L, D], mask [B, *, S, L] additive (any float dtype; stride 0 allowed) or None,
    sinks [H] or None, out [B, S, H, D] (head dim contiguous everywhere); part_acc [B * Hkv, num_splits, BLOCK_M,
    BLOCK_D] and part_ml [B * Hkv, num_splits, 2, BLOCK_M] fp32 scratch; counter [>= B * Hkv] int32, zero on entry
    and on exit. Split ``i`` covers slots ``[i * chunk_len, (i + 1) * chunk_len)`` (a multiple of BLOCK_N)."""
    pid_bg = tl.program_id(0)
    pid_split = tl.program_id(1)
    b = pid_bg // Hkv
    g = pid_bg % Hkv
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < N_REP * S
    rows_c = tl.where(row_ok, rows, 0)
    head = g * N_REP + rows_c // S
    pos = rows_c % S
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    b64 = b.to(tl.int64)

    q = tl.load(q_ptr + b64 * stride_qb + head[:, None] * stride_qh + pos[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b64 * stride_kb + g * stride_kh
    v_base = v_ptr + b64 * stride_vb + g * stride_vh

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    start = pid_split * chunk_len
    end = tl.minimum(start + chunk_len, L)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        if HAS_MASK:
            mask_ptrs = mask_ptr + b64 * stride_mb + pos[:, None] * stride_ms + offs_n[None, :] * stride_ml
            bias = tl.load(mask_ptrs, mask=row_ok[:, None] & n_ok[None, :], other=float("-inf")).to(tl.float32)
            keep = bias > masked_below
        else:
            bias = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            keep = row_ok[:, None] & n_ok[None, :]
        if tl.max(keep.to(tl.int32)) > 0:  # some row sees a slot of this block: load its keys and values
            kt = tl.load(k_base + offs_n[None, :].to(tl.int64) * stride_kl + offs_d[:, None],
                         mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION)
            logits = tl.where(keep, qk * scale_log2 + tl.where(keep, bias, 0.0) * LOG2E, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logits, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(logits - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # a slot no row sees reads as 0 (p is 0 there, and 0 * NaN would be NaN): what the cache holds past the
            # mask never reaches a result
            seen = tl.max(keep.to(tl.int32), axis=0) > 0
            v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vl + offs_d[None, :],
                        mask=(n_ok & seen)[:, None] & d_ok[None, :], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

    out_ptrs = (out_ptr + b64 * stride_ob + pos[:, None] * stride_os + head[:, None] * stride_oh + offs_d[None, :])
    out_mask = row_ok[:, None] & d_ok[None, :]
    if num_splits == 1:
        out = _finish(acc, m_i, l_i, sinks_ptr, head, row_ok, HAS_SINKS)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        part = pid_bg.to(tl.int64) * num_splits
        acc_ptrs = part_acc_ptr + (rows[:, None] * BLOCK_D + offs_d[None, :])
        ml_ptrs = part_ml_ptr + rows
        tl.store(acc_ptrs + (part + pid_split) * (BLOCK_M * BLOCK_D), acc)
        tl.store(ml_ptrs + (part + pid_split) * (2 * BLOCK_M), m_i)
        tl.store(ml_ptrs + (part + pid_split) * (2 * BLOCK_M) + BLOCK_M, l_i)
        # Arrive: all threads' partial stores happen before one thread's acq_rel atomic (release side).
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + pid_bg, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:  # every split of this (b, g) is written and visible
            tl.atomic_xchg(counter_ptr + pid_bg, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            splits = tl.arange(0, SPLITS_PAD)
            split_ok = splits < num_splits
            ml_tile = part_ml_ptr + (part + splits)[:, None] * (2 * BLOCK_M) + rows[None, :]
            m_s = tl.load(ml_tile, mask=split_ok[:, None], other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(ml_tile + BLOCK_M, mask=split_ok[:, None], other=0.0, cache_modifier=".cg")
            m_tot = tl.max(m_s, axis=0)
            m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
            w = tl.exp2(m_s - m_safe[None, :])  # [SPLITS_PAD, BLOCK_M]: each split's weight per row
            l_tot = tl.sum(l_s * w, axis=0)
            total = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
            for sp in range(0, num_splits):
                w_sp = tl.sum(tl.where(splits[:, None] == sp, w, 0.0), axis=0)
                part_sp = tl.load(acc_ptrs + (part + sp) * (BLOCK_M * BLOCK_D), cache_modifier=".cg")
                total += part_sp * w_sp[:, None]
            out = _finish(total, m_tot, l_tot, sinks_ptr, head, row_ok, HAS_SINKS)
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
