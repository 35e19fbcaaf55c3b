"""The op contract in one place: activations, "no adapter", and the argument checks every impl shares.

Notation: T tokens, H hidden, I expert intermediate, E experts, k top-k, L adapter slots, R slot rank.

Base expert weights keep the model's own layout (``concat``, ``interleaved``, ``transposed_concat``,
``transposed_interleaved``: shapes and gate/up order in :mod:`.layout`).

LoRA stacks always use vLLM's 3-D layout, the 2I axis in the base weight's own gate/up order and the scaling
already folded into B: ``lora_a13 [L,E,R,H]``, ``lora_b13 [L,E,2I,R]``, ``lora_a2 [L,E,R2,I]``, ``lora_b2 [L,E,H,R2]``
(w2's rank ``R2`` is its own). ``token_lora_ids [T]`` int32 picks the slot per token; ``-1`` means no adapter.

Split gate/up form (``lora_b13_split=True``, vLLM's 2-D MoE LoRA with gate and up factors apart): ``lora_b13`` is
``[L,E,2I,R/2]`` (R even); its gate rows multiply rank entries ``[0, R/2)`` of ``A13 x`` and its up rows entries
``[R/2, R)``, i.e. ``A13 = [A_gate; A_up]`` and the block-diagonal ``[L,E,2I,R]`` B13 without its zero half. The form
is chosen by that flag alone, never guessed from shapes: a B13 whose rank does not fit the flag is a ValueError.
An ``out=`` form (:func:`check_out_arg`) writes ``y`` into a caller's ``[T, H]`` tensor.

Per-slot rank (``lora_ranks``, optional, int; data, never a guard): the slot buffers are padded to the rank ``R`` of
the stacks, and slot ``l`` uses only its first ``rank`` entries of the rank axis: the others are never read (the
kernels mask them off, so their bytes are not moved; the reference drops them, whatever they hold). ``fused_moe_lora``
takes ``[2, L]``: row 0 the w13 rank of each slot (in the split gate/up form the rank of each half: gate entries
``[0, rank)``, up entries ``[R/2, R/2 + rank)``), row 1 the w2 rank; values in ``[0, R]`` (split form:
``[0, R/2]``) / ``[0, R2]``.
``lora_linear`` takes ``[L]``, or ``[n, L]`` for a rank axis made of ``n`` equal blocks of ``R/n`` (fused sibling
linears, block ``j`` = member ``j``), block ``j`` of slot ``l`` using its first ``lora_ranks[j, l]`` entries.
``None`` (the default): every slot at the full padded rank. Rank 0 = the slot adds nothing.

The checks below look only at shapes, dtypes and devices, so they run unchanged in the fake (meta) impl under
symbolic shapes; value checks (ids in range) need data and live in :func:`check_index_values`.
"""

from __future__ import annotations

import torch

from .layout import check_layout, is_transposed

NO_ADAPTER = -1  # token_lora_ids value of a token without adapter (data, never a Python branch)
ACTIVATIONS = ("silu", "gptoss_swiglu")
# GPT-OSS clamped swiglu constants (transformers' GptOssExperts).
GPTOSS_ALPHA = 1.702
GPTOSS_LIMIT = 7.0

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _expect_rank(name: str, t: torch.Tensor, rank: int, what: str) -> None:
    if not callable(getattr(t, "dim", None)):  # (a tensor, or the MXFP4 op's shape stand-in for its dense weights)
        raise TypeError(f"{name} must be a tensor {what}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {what}, got shape {_shape(t)}")


def _expect_dim(name: str, t: torch.Tensor, dim: int, size, what: str) -> None:
    torch._check_value(
        t.shape[dim] == size,
        lambda: f"{name} must have shape {what}; got {_shape(t)} (dim {dim} should be {size})",
    )


def _expect_positive(name: str, t: torch.Tensor, dim: int, letter: str, what: str) -> None:
    """Size ``t.shape[dim]`` (``letter`` in ``what``) must be >= 1: zero experts, slots, rank or features make no
    layer (T = 0, an empty batch, is fine and never checked here)."""
    torch._check_value(
        t.shape[dim] >= 1,
        lambda: f"{name} must have shape {what} with {letter} >= 1; got {_shape(t)} ({letter} = 0)",
    )


def _expect_dtype(name: str, t: torch.Tensor, allowed, what: str) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name} must be {what}, got {t.dtype}")


def _expect_device(name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but x is on {ref.device}; all tensors must share one device")


def check_fused_moe_lora_args(
    x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2, lora_b2,
    w13_bias, w2_bias, layout: str, activation: str, lora_b13_split: bool = False,
) -> None:
    """Shape/dtype/device checks of ``fused_moe_lora``; raises ValueError/TypeError naming the argument."""
    check_layout(layout)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _expect_rank("x", x, 2, "[T, H]")
    _expect_dtype("x", x, _FLOAT_DTYPES, "a floating tensor")
    _expect_positive("x", x, 1, "H", "[T, H]")
    T, H = x.shape
    _expect_rank("topk_ids", topk_ids, 2, "[T, k]")
    _expect_dtype("topk_ids", topk_ids, _INDEX_DTYPES, "int32 or int64")
    _expect_positive("topk_ids", topk_ids, 1, "k", "[T, k]")
    k = topk_ids.shape[1]
    _expect_dim("topk_ids", topk_ids, 0, T, "[T, k] with T = x.shape[0]")
    _expect_rank("topk_weights", topk_weights, 2, "[T, k]")
    _expect_dtype("topk_weights", topk_weights, _FLOAT_DTYPES, "a floating tensor")
    _expect_dim("topk_weights", topk_weights, 0, T, "[T, k] like topk_ids")
    _expect_dim("topk_weights", topk_weights, 1, k, "[T, k] like topk_ids")
    _expect_rank("token_lora_ids", token_lora_ids, 1, "[T]")
    _expect_dtype("token_lora_ids", token_lora_ids, _INDEX_DTYPES, "int32 or int64 (-1 = no adapter)")
    _expect_dim("token_lora_ids", token_lora_ids, 0, T, "[T] with T = x.shape[0]")

    _expect_rank("w13", w13, 3, "[E, 2I, H] or [E, H, 2I]")
    _expect_rank("w2", w2, 3, "[E, H, I] or [E, I, H]")
    for name, t in (("w13", w13), ("w2", w2)):
        _expect_dtype(name, t, _FLOAT_DTYPES, "a floating tensor")
    _expect_positive("w13", w13, 0, "E", "[E, 2I, H] or [E, H, 2I]")
    E = w13.shape[0]
    hidden = (w13.shape[1], w2.shape[2]) if is_transposed(layout) else (w13.shape[2], w2.shape[1])
    torch._check_value(  # both experts' weights agree on H, x does not: name x (H is read from x below)
        hidden[0] != hidden[1] or hidden[0] == H,
        lambda: f"x must have shape [T, H] with H = {hidden[0]} (the hidden size of w13 and w2); got {_shape(x)}",
    )
    if is_transposed(layout):
        _expect_dim("w13", w13, 1, H, f"[E, H, 2I] for layout {layout!r}")
        two_i = w13.shape[2]
        _expect_dim("w2", w2, 0, E, f"[E, I, H] for layout {layout!r}")
        _expect_dim("w2", w2, 2, H, f"[E, I, H] for layout {layout!r}")
        I = w2.shape[1]
    else:
        _expect_dim("w13", w13, 2, H, f"[E, 2I, H] for layout {layout!r}")
        two_i = w13.shape[1]
        _expect_dim("w2", w2, 0, E, f"[E, H, I] for layout {layout!r}")
        _expect_dim("w2", w2, 1, H, f"[E, H, I] for layout {layout!r}")
        I = w2.shape[2]
    torch._check_value(
        two_i == 2 * I,
        lambda: f"w13's gate/up axis ({two_i}) must be twice w2's intermediate axis ({I}) for layout {layout!r}",
    )
    _expect_positive("w2", w2, 1 if is_transposed(layout) else 2, "I", "[E, I, H]" if is_transposed(layout)
                     else "[E, H, I]")

    _expect_rank("lora_a13", lora_a13, 4, "[L, E, R, H]")
    _expect_positive("lora_a13", lora_a13, 0, "L", "[L, E, R, H]")
    _expect_positive("lora_a13", lora_a13, 2, "R", "[L, E, R, H]")
    L, R = lora_a13.shape[0], lora_a13.shape[2]
    _expect_dim("lora_a13", lora_a13, 1, E, "[L, E, R, H]")
    _expect_dim("lora_a13", lora_a13, 3, H, "[L, E, R, H]")
    _check_lora_b13(lora_b13, L, E, I, R, lora_b13_split)
    _expect_rank("lora_a2", lora_a2, 4, "[L, E, R2, I]")
    _expect_positive("lora_a2", lora_a2, 2, "R2", "[L, E, R2, I]")
    R2 = lora_a2.shape[2]
    for dim, size in ((0, L), (1, E), (3, I)):
        _expect_dim("lora_a2", lora_a2, dim, size, f"[L, E, R2, I] = [{L}, {E}, R2, {I}] matching lora_a13 and w2")
    _expect_rank("lora_b2", lora_b2, 4, "[L, E, H, R2]")
    for dim, size in ((0, L), (1, E), (2, H), (3, R2)):
        _expect_dim("lora_b2", lora_b2, dim, size, f"[L, E, H, R2] = [{L}, {E}, {H}, {R2}] matching lora_a2")
    for name, t in (("lora_a13", lora_a13), ("lora_b13", lora_b13), ("lora_a2", lora_a2), ("lora_b2", lora_b2)):
        _expect_dtype(name, t, _FLOAT_DTYPES, "a floating tensor")

    if w13_bias is not None:
        _expect_rank("w13_bias", w13_bias, 2, "[E, 2I]")
        _expect_dtype("w13_bias", w13_bias, _FLOAT_DTYPES, "a floating tensor")
        _expect_dim("w13_bias", w13_bias, 0, E, f"[E, 2I] = [{E}, {2 * I}]")
        _expect_dim("w13_bias", w13_bias, 1, 2 * I, f"[E, 2I] = [{E}, {2 * I}]")
    if w2_bias is not None:
        _expect_rank("w2_bias", w2_bias, 2, "[E, H]")
        _expect_dtype("w2_bias", w2_bias, _FLOAT_DTYPES, "a floating tensor")
        _expect_dim("w2_bias", w2_bias, 0, E, f"[E, H] = [{E}, {H}]")
        _expect_dim("w2_bias", w2_bias, 1, H, f"[E, H] = [{E}, {H}]")

    named = [("topk_ids", topk_ids), ("topk_weights", topk_weights), ("token_lora_ids", token_lora_ids),
             ("w13", w13), ("w2", w2), ("lora_a13", lora_a13), ("lora_b13", lora_b13), ("lora_a2", lora_a2),
             ("lora_b2", lora_b2), ("w13_bias", w13_bias), ("w2_bias", w2_bias)]
    for name, t in named:
        if t is not None:
            _expect_device(name, t, x)


def check_lora_ranks(lora_ranks, rows: int, L, R, x, *, what: str) -> None:
    """``lora_ranks`` (or None): int32/int64 ``[rows, L]`` (``rows`` 0: ``[L]``; -1: ``[L]`` or ``[n, L]`` with n
    dividing ``R``), on x's device; ``what`` names the shape in the message. Values are data: see
    :func:`check_rank_values`."""
    if lora_ranks is None:
        return
    _expect_dtype("lora_ranks", lora_ranks, _INDEX_DTYPES, "int32 or int64 (each slot's LoRA rank)")
    if rows == -1:
        if lora_ranks.dim() not in (1, 2):
            raise ValueError(f"lora_ranks must be {what}, got shape {_shape(lora_ranks)}")
        if lora_ranks.dim() == 2:
            n = lora_ranks.shape[0]
            torch._check_value(n >= 1 and R % n == 0, lambda: f"lora_ranks must be {what}: its {n} rank blocks "
                               f"must split the rank axis R = {R} evenly; got {_shape(lora_ranks)}")
    else:
        _expect_rank("lora_ranks", lora_ranks, 2 if rows else 1, what)
        if rows:
            _expect_dim("lora_ranks", lora_ranks, 0, rows, what)
    _expect_dim("lora_ranks", lora_ranks, lora_ranks.dim() - 1, L, f"{what} with L = {L} slots")
    _expect_device("lora_ranks", lora_ranks, x)


def check_rank_values(lora_ranks, highs) -> None:
    """Data check of ``lora_ranks`` (or None): row ``i`` (a 1-D tensor: the only row) in ``[0, highs[i]]``, the
    entries of one rank block (CPU: ValueError; CUDA: a device assert, as :func:`check_index_values`)."""
    if lora_ranks is None:
        return
    rows = lora_ranks if lora_ranks.dim() == 2 else lora_ranks.unsqueeze(0)
    for i, row in enumerate(rows):
        high = highs[min(i, len(highs) - 1)]
        if row.numel() and row.device.type == "cpu":
            lo, hi = int(row.min()), int(row.max())
            if lo < 0 or hi > high:
                raise ValueError(f"lora_ranks row {i} must lie in [0, {high}] (a slot's rank, at most the padded rank "
                                 f"of its block); got min {lo}, max {hi}")
        else:
            check_index_values(f"lora_ranks row {i} (in [0, {high}])", row, 0, high + 1)


def _check_lora_b13(lora_b13, L, E, I, R, split: bool) -> None:
    """B13 ``[L, E, 2I, R]``, or ``[L, E, 2I, R/2]`` in the split gate/up form (``split``, R even)."""
    if split:
        torch._check_value(
            R % 2 == 0,
            lambda: f"lora_b13_split=True needs an even lora_a13 rank R (gate ranks [0, R/2), up ranks [R/2, R)); "
                    f"got R = {R}",
        )
        want, what = R // 2, "[L, E, 2I, R/2]"
    else:
        want, what = R, "[L, E, 2I, R]"
    _expect_rank("lora_b13", lora_b13, 4, what)

    def message(dim, size):
        hint = (" (a B13 of rank R/2, gate and up rows apart, is the split form: pass lora_b13_split=True)"
                if not split and dim == 3 and 2 * lora_b13.shape[3] == R else "")
        return (f"lora_b13 must have shape {what} = [{L}, {E}, {2 * I}, {want}] matching lora_a13 (R = {R}) with "
                f"lora_b13_split={split}; got {_shape(lora_b13)} (dim {dim} should be {size}){hint}")

    for dim, size in ((0, L), (1, E), (2, 2 * I), (3, want)):
        torch._check_value(lora_b13.shape[dim] == size, lambda dim=dim, size=size: message(dim, size))


def check_out_arg(out, x) -> None:
    """``out`` of the ``out=`` form: ``[T, H]`` like ``x``, same dtype and device."""
    _expect_rank("out", out, 2, "[T, H] like x")
    _expect_dim("out", out, 0, x.shape[0], f"[T, H] = {_shape(x)} like x")
    _expect_dim("out", out, 1, x.shape[1], f"[T, H] = {_shape(x)} like x")
    if out.dtype != x.dtype:
        raise TypeError(f"out must have x's dtype {x.dtype}, got {out.dtype}")
    _expect_device("out", out, x)


def check_out_writable(out) -> None:
    """``out`` of the ``out=`` form, on real tensors (not in fake impls): no two of its elements share memory (an
    expanded or stride-0 tensor would take every token's row in one place), and not a tensor autograd tracks."""
    if torch._debug_has_internal_overlap(out) == 1:
        raise ValueError(f"out must not overlap itself (strides {tuple(out.stride())} for shape {_shape(out)}: an "
                         f"expanded tensor?); pass a tensor with one element per [T, H] entry, e.g. torch.empty")
    if out.requires_grad:
        raise ValueError("out requires grad, but fused_moe_lora(..., out=) is inference only: pass a tensor that "
                         "does not require grad (or call it without out=)")


def check_lora_linear_args(x, weight, lora_a, lora_b, token_lora_ids, bias) -> None:
    """Shape/dtype/device checks of ``lora_linear``; raises ValueError/TypeError naming the argument."""
    _expect_rank("x", x, 2, "[T, in]")
    _expect_dtype("x", x, _FLOAT_DTYPES, "a floating tensor")
    _expect_positive("x", x, 1, "in", "[T, in]")
    T, n_in = x.shape
    _expect_rank("weight", weight, 2, "[out, in]")
    _expect_dtype("weight", weight, _FLOAT_DTYPES, "a floating tensor")
    _expect_dim("weight", weight, 1, n_in, f"[out, in] with in = x.shape[1] = {n_in}")
    _expect_positive("weight", weight, 0, "out", "[out, in]")
    n_out = weight.shape[0]
    _expect_rank("lora_a", lora_a, 3, "[L, R, in]")
    _expect_positive("lora_a", lora_a, 0, "L", "[L, R, in]")
    _expect_positive("lora_a", lora_a, 1, "R", "[L, R, in]")
    L, R = lora_a.shape[0], lora_a.shape[1]
    _expect_dim("lora_a", lora_a, 2, n_in, f"[L, R, in] with in = {n_in}")
    _expect_rank("lora_b", lora_b, 3, "[L, out, R]")
    for dim, size in ((0, L), (1, n_out), (2, R)):
        _expect_dim("lora_b", lora_b, dim, size, f"[L, out, R] = [{L}, {n_out}, {R}] matching lora_a and weight")
    for name, t in (("lora_a", lora_a), ("lora_b", lora_b)):
        _expect_dtype(name, t, _FLOAT_DTYPES, "a floating tensor")
    _expect_rank("token_lora_ids", token_lora_ids, 1, "[T]")
    _expect_dtype("token_lora_ids", token_lora_ids, _INDEX_DTYPES, "int32 or int64 (-1 = no adapter)")
    _expect_dim("token_lora_ids", token_lora_ids, 0, T, "[T] with T = x.shape[0]")
    if bias is not None:
        _expect_rank("bias", bias, 1, "[out]")
        _expect_dtype("bias", bias, _FLOAT_DTYPES, "a floating tensor")
        _expect_dim("bias", bias, 0, n_out, f"[out] = [{n_out}]")
    for name, t in (("weight", weight), ("lora_a", lora_a), ("lora_b", lora_b),
                    ("token_lora_ids", token_lora_ids), ("bias", bias)):
        if t is not None:
            _expect_device(name, t, x)


def check_index_values(name: str, ids: torch.Tensor, low: int, high: int) -> None:
    """Data check ``low <= ids < high``. CPU: raises ValueError. CUDA: a device assert in one Triton launch
    (:mod:`.triton.checks`; no host sync), which fails the launch like ``torch._assert_async``."""
    if ids.numel() == 0:
        return
    if ids.device.type == "cpu":
        lo, hi = int(ids.min()), int(ids.max())
        if lo < low or hi >= high:
            raise ValueError(f"{name} values must lie in [{low}, {high}); got min {lo}, max {hi}")
    else:
        message = f"{name} values must lie in [{low}, {high})"
        try:
            from .triton.checks import check_index_range_kernel
        except ImportError:  # a CUDA torch without Triton: five aten launches instead of one
            torch._assert_async(((ids >= low) & (ids < high)).all(), message)
            return
        ids = ids.contiguous()
        block = 1024
        check_index_range_kernel[(-(-ids.numel() // block),)](ids, ids.numel(), low, high, MESSAGE=message,
                                                               BLOCK=block)


# moe_lora.route: how the router turns logits into (weights, ids); see moe_lora_compile.ops.router.
SCORINGS = ("topk_softmax", "softmax_topk", "topk_sigmoid")


def check_route_args(hidden, weight, bias, top_k, scoring: str, renormalize: bool, scores_dtype) -> None:
    """Shape/dtype/device checks of ``route``; raises ValueError/TypeError naming the argument."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if renormalize and scoring != "softmax_topk":
        raise ValueError(f"renormalize=True applies to scoring 'softmax_topk' only (the k weights of {scoring!r} "
                         f"are what transformers returns as is), got scoring {scoring!r}")
    _expect_rank("hidden", hidden, 2, "[T, H]")
    _expect_dtype("hidden", hidden, _FLOAT_DTYPES, "a floating tensor")
    _expect_positive("hidden", hidden, 1, "H", "[T, H]")
    _expect_rank("weight", weight, 2, "[E, H]")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype} (as F.linear needs), got {weight.dtype}")
    _expect_positive("weight", weight, 0, "E", "[E, H]")
    _expect_dim("weight", weight, 1, hidden.shape[1], f"[E, H] with H = hidden.shape[1] = {hidden.shape[1]}")
    E = weight.shape[0]
    if bias is not None:
        _expect_rank("bias", bias, 1, "[E]")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias must have hidden's dtype {hidden.dtype}, got {bias.dtype}")
        _expect_dim("bias", bias, 0, E, f"[E] = [{E}]")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}; all tensors must share one "
                             f"device")
    if not isinstance(top_k, (int, torch.SymInt)) or isinstance(top_k, bool):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    torch._check_value(top_k >= 1, lambda: f"top_k must lie in [1, E = {E}], got {top_k}")
    torch._check_value(top_k <= E, lambda: f"top_k must lie in [1, E = {E}], got {top_k}")
    if scores_dtype is not None and scores_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"scores_dtype must be a floating dtype or None, got {scores_dtype}")


# --- MXFP4 experts (``fused_moe_lora_mxfp4``; format: :mod:`.mxfp4`) --------------------------------------------

MXFP4_GROUP_SIZE = 32  # inputs sharing one E8M0 scale byte (.mxfp4 and the kernels read it from here)


class _DenseWeightSpec:
    """Shape, dtype and device of the dense weight an MXFP4 one dequantizes to, for the dense checks (no tensor)."""

    def __init__(self, shape, dtype, device):
        self.shape, self.dtype, self.device = tuple(shape), dtype, device

    def dim(self) -> int:
        return len(self.shape)


def _check_mxfp4_pair(name: str, blocks, scales, x) -> _DenseWeightSpec:
    """``{name}_blocks`` uint8 ``[E, N, K/32, 16]`` and ``{name}_scales`` uint8 ``[E, N, K/32]`` -> the spec of
    the dense ``[E, K, N]`` weight (x's dtype and device) they stand for."""
    b, s = f"{name}_blocks", f"{name}_scales"
    _expect_rank(b, blocks, 4, "[E, N, K/32, 16] (uint8 MXFP4 blocks)")
    _expect_rank(s, scales, 3, "[E, N, K/32] (uint8 E8M0 scales)")
    _expect_dtype(b, blocks, (torch.uint8,), "uint8 (two E2M1 codes per byte)")
    _expect_dtype(s, scales, (torch.uint8,), "uint8 (E8M0 exponents)")
    _expect_dim(b, blocks, 3, 16, "[E, N, K/32, 16]")
    expected = "[" + ", ".join(str(size) for size in blocks.shape[:3]) + "]"
    for dim in range(3):
        _expect_dim(s, scales, dim, blocks.shape[dim], f"[E, N, K/32] = {expected} like {b}")
    for dim, letter in ((1, "N"), (2, "K/32")):
        _expect_positive(b, blocks, dim, letter, "[E, N, K/32, 16]")
    _expect_device(b, blocks, x)
    _expect_device(s, scales, x)
    E, N, groups = blocks.shape[0], blocks.shape[1], blocks.shape[2]
    return _DenseWeightSpec((E, groups * MXFP4_GROUP_SIZE, N), x.dtype, x.device)


def check_fused_moe_lora_mxfp4_args(
    x, topk_ids, topk_weights, token_lora_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, lora_a13, lora_b13,
    lora_a2, lora_b2, w13_bias, w2_bias, layout: str, activation: str,
) -> None:
    """Checks of ``fused_moe_lora_mxfp4``: the MXFP4 tensors (w13 ``[E, 2I, H/32, 16]`` + ``[E, 2I, H/32]``, w2
    ``[E, H, I/32, 16]`` + ``[E, H, I/32]``, uint8), a transposed ``layout`` (they dequantize to ``[E, in, out]``),
    then :func:`check_fused_moe_lora_args` on the dense weights they stand for. ValueError/TypeError naming the
    argument."""
    check_layout(layout)
    if not is_transposed(layout):
        raise ValueError(f"layout must be a transposed layout for MXFP4 experts (they dequantize to [E, in, out]), "
                         f"got {layout!r}")
    _expect_rank("x", x, 2, "[T, H]")
    w13 = _check_mxfp4_pair("w13", w13_blocks, w13_scales, x)
    w2 = _check_mxfp4_pair("w2", w2_blocks, w2_scales, x)
    H = x.shape[1]
    torch._check_value(w13.shape[1] == H, lambda: f"w13_blocks must have shape [E, 2I, H/32, 16] with H = "
                       f"x.shape[1] = {H}; got {_shape(w13_blocks)} (H = {w13.shape[1]})")
    torch._check_value(w2.shape[2] == H, lambda: f"w2_blocks must have shape [E, H, I/32, 16] with H = "
                       f"x.shape[1] = {H}; got {_shape(w2_blocks)}")
    torch._check_value(w2.shape[0] == w13.shape[0], lambda: f"w2_blocks must have as many experts as w13_blocks "
                       f"({w13.shape[0]}); got {_shape(w2_blocks)} and {_shape(w13_blocks)}")
    torch._check_value(2 * w2.shape[1] == w13.shape[2], lambda: f"w2_blocks must have shape [E, H, I/32, 16] with "
                       f"2I = w13_blocks.shape[1] = {w13.shape[2]}; got {_shape(w2_blocks)} (I = {w2.shape[1]})")
    check_fused_moe_lora_args(x, topk_ids, topk_weights, token_lora_ids, w13, w2, lora_a13, lora_b13, lora_a2,
                              lora_b2, w13_bias, w2_bias, layout, activation)
