"""@triton.jit kernel of ``moe_lora.route`` at decode: router logits, top-k and the routing weights in one launch.

At batch 1 the router GEMV reads ``W [E, H]`` (GPT-OSS-20B: 32 x 2880 bf16 = 184 KB; Qwen3-30B-A3B: 128 x 2048 =
512 KB) for one token: too little work for one program, so the grid splits W into ``(E blocks) x (H slices)``
tiles, each program streams one tile (a few KB, one round of loads) and writes its fp32 partial logits to a scratch
buffer. The last of a token block's programs to arrive at its int32 counter sums the partials in slice order
(deterministic), adds the bias, rounds the logits to the input dtype (what ``F.linear`` returns), picks the top k
(k rounds of max + lowest-index argmax) and writes logits, weights and ids. That program then resets its counter to
zero, so the counters (a persistent per-device buffer, zeroed once) need no memset launch.

Scorings (``SCORING``): ``TOPK_SOFTMAX`` (GPT-OSS) top-k of the logits, softmax over the k values;
``SOFTMAX_TOPK`` (Qwen2/3-MoE, OLMoE, Mixtral) softmax over all E in fp32, top-k of the probabilities, optionally
renormalised to sum 1; ``TOPK_SIGMOID`` (Llama-4) top-k of the logits, sigmoid of the k values.

Measured and not kept (H100, 2026-12-05, ``benchmarks/bench_decode_kernels.py``): summing the slices' partials a
chunk of slices a load (``[chunk, BLOCK_T, E_PAD]``, summed over the chunk) instead of one slice a load: GPT-OSS-20B
5.8 -> 8.4 us a call at T=1, Qwen3-30B-A3B 9.6 -> 13.1 us; with a chunk of 16 and int64 offsets the whole step of
GPT-OSS-20B got 1.2 ms slower at batch 1.
"""

from __future__ import annotations

import triton
import triton.language as tl

TOPK_SOFTMAX = tl.constexpr(0)
SOFTMAX_TOPK = tl.constexpr(1)
TOPK_SIGMOID = tl.constexpr(2)


@triton.jit
def _top_k(vals, valid_e, offs_e, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
           BLOCK_T: tl.constexpr):
    """The k largest of ``vals [BLOCK_T, E_PAD]`` (fp32; columns with ``valid_e`` false never chosen) per row,
    descending, equal values in index order -> (values [BLOCK_T, K_PAD] fp32, ids [BLOCK_T, K_PAD] int32; columns
    >= TOP_K are 0). A -inf value is still chosen before no value: ``taken`` marks chosen columns, not the value.
    NaN ranks above every number, +inf included (``torch.topk``'s order), NaNs among themselves in index order: a
    round picks the lowest open NaN column if the row has one, else the lowest column holding the max of the rest,
    so every id is a valid column whatever the values (``tl.max`` never sees a NaN: its NaN rule differs between
    the GPU and the interpreter)."""
    offs_k = tl.arange(0, K_PAD)
    taken = offs_e[None, :] < 0  # all False, [1, E_PAD]
    is_nan = vals != vals
    top_vals = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    top_ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        open_ = valid_e[None, :] & ~taken
        open_nan = open_ & is_nan
        open_num = open_ & ~is_nan
        has_nan = tl.max(open_nan.to(tl.int32), axis=1) > 0
        cand = tl.where(open_num, vals, float("-inf"))
        best = tl.max(cand, axis=1)
        at_best = tl.where(has_nan[:, None], open_nan, open_num & (cand == best[:, None]))
        idx = tl.min(tl.where(at_best, offs_e[None, :], E_PAD), axis=1)
        best = tl.where(has_nan, float("nan"), best)
        taken = taken | (offs_e[None, :] == idx[:, None])
        top_vals = tl.where(offs_k[None, :] == j, best[:, None], top_vals)
        top_ids = tl.where(offs_k[None, :] == j, idx[:, None], top_ids)
    return top_vals, top_ids


@triton.jit(do_not_specialize=["T", "num_splits", "k_per_split"])
def route_kernel(
    x_ptr, stride_x, w_ptr, stride_w, bias_ptr, part_ptr, counter_ptr, logits_ptr, scores_ptr, ids_ptr,
    T, E, H, num_splits, k_per_split,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, SCORING: tl.constexpr, RENORMALIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid ``(E_PAD // BLOCK_E * num_splits, cdiv(T, BLOCK_T))``.

    x [T, H] (H contiguous, row stride ``stride_x``); W [E, H] (H contiguous); bias [E] or None; part [num_splits,
    T, E_PAD] fp32 scratch; counter [>= cdiv(T, BLOCK_T)] int32, zero on entry and on exit; outputs: logits [T, E]
    in x's dtype, scores [T, TOP_K] in their own dtype, ids [T, TOP_K] int64. Program (e block, slice s) reduces H
    range ``[s * k_per_split, (s + 1) * k_per_split)`` (a whole number of BLOCK_K steps)."""
    pid = tl.program_id(0)
    pid_t = tl.program_id(1)
    pid_e = pid // num_splits
    pid_k = pid % num_splits
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, H)
    x_ptrs = x_ptr + tl.where(row_ok, rows, 0).to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + tl.where(e_ok, offs_e, 0).to(tl.int64)[None, :] * stride_w + offs_k[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0)
            w = tl.load(w_ptrs + k0)
        else:
            k_ok = (k0 + offs_k) < k_end
            x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs + k0, mask=k_ok[:, None], other=0.0)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
    # rows >= T and columns >= E hold clamped copies (never stored) or zeros: only real rows are written
    part_ptrs = part_ptr + (pid_k * T + rows).to(tl.int64)[:, None] * E_PAD + offs_e[None, :]
    tl.store(part_ptrs, acc, mask=row_ok[:, None])
    # Arrive: all threads' partial stores happen before one thread's acq_rel atomic (release side).
    tl.debug_barrier()
    parts = (E_PAD // BLOCK_E) * num_splits
    arrived = tl.atomic_add(counter_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
    if arrived == parts - 1:  # every partial of this token block is written and visible
        tl.atomic_xchg(counter_ptr + pid_t, 0, sem="relaxed", scope="gpu")  # ready for the next launch
        all_e = tl.arange(0, E_PAD)
        valid_e = all_e < E
        mask = row_ok[:, None] & valid_e[None, :]
        sum_ptrs = part_ptr + rows.to(tl.int64)[:, None] * E_PAD + all_e[None, :]
        logits = tl.load(sum_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
        for sp in range(1, num_splits):
            logits += tl.load(sum_ptrs + sp * T * E_PAD, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            logits += tl.load(bias_ptr + all_e, mask=valid_e, other=0.0).to(tl.float32)[None, :]
        logits_out = logits.to(logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + rows.to(tl.int64)[:, None] * E + all_e[None, :], logits_out, mask=mask)
        logits = logits_out.to(tl.float32)  # what F.linear returns, as the scoring sees it

        if SCORING == SOFTMAX_TOPK:  # softmax over all E in fp32, then the top k of the probabilities
            row_max = tl.max(tl.where(valid_e[None, :], logits, float("-inf")), axis=1)
            num = tl.where(valid_e[None, :], tl.exp(logits - row_max[:, None]), 0.0)
            probs = num / tl.sum(num, axis=1)[:, None]
            weights, ids = _top_k(probs, valid_e, all_e, E_PAD, TOP_K, K_PAD, BLOCK_T)
            if RENORMALIZE:
                offs_kp = tl.arange(0, K_PAD)
                weights = weights / tl.sum(tl.where(offs_kp[None, :] < TOP_K, weights, 0.0), axis=1)[:, None]
        else:
            top, ids = _top_k(logits, valid_e, all_e, E_PAD, TOP_K, K_PAD, BLOCK_T)
            if SCORING == TOPK_SOFTMAX:  # softmax over the k values (their max is top[:, 0]), in logits' dtype
                offs_kp = tl.arange(0, K_PAD)
                first = tl.sum(tl.where(offs_kp[None, :] == 0, top, 0.0), axis=1)
                num = tl.where(offs_kp[None, :] < TOP_K, tl.exp(top - first[:, None]), 0.0)
                weights = (num / tl.sum(num, axis=1)[:, None]).to(logits_ptr.dtype.element_ty).to(tl.float32)
            else:  # TOPK_SIGMOID
                weights = tl.sigmoid(top)
        offs_kp = tl.arange(0, K_PAD)
        out_mask = row_ok[:, None] & (offs_kp[None, :] < TOP_K)
        out_offs = rows.to(tl.int64)[:, None] * TOP_K + offs_kp[None, :]
        tl.store(scores_ptr + out_offs, weights.to(scores_ptr.dtype.element_ty), mask=out_mask)
        tl.store(ids_ptr + out_offs, ids.to(tl.int64), mask=out_mask)
