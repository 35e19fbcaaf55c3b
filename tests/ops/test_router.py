"""``moe_lora.route`` (logits, top-k ids and routing weights in one op) against a float64 oracle and transformers.

CPU: the Triton kernel in the interpreter (``TRITON_INTERPRET=1`` from conftest) in float32 at tiny shapes; the op
(its CPU impl is transformers' own aten sequence) through opcheck and in every attached tiny MoE family. GPU
(``-m gpu``): bf16 at GPT-OSS-20B / Qwen3-30B-A3B router shapes, tie order against CUDA ``torch.topk``, and replay
from a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from moe_lora_compile.ops.router import MAX_KERNEL_TOKENS, route_reference
from moe_lora_compile.ops.triton import router_launch
from moe_lora_compile.ops.triton.router_launch import route_triton

F64 = torch.float64


def route_oracle(hidden, weight, bias, top_k, scoring, renormalize=False):
    """float64 routing of the contract, ties to the lower expert index; logits rounded once to hidden's dtype (what
    ``F.linear`` returns) before scoring. -> (logits [T, E] float64, weights [T, k] float64, ids [T, k] int64)."""
    logits = hidden.to(F64) @ weight.to(F64).T
    if bias is not None:
        logits = logits + bias.to(F64)
    logits = logits.to(hidden.dtype).to(F64)
    ranked = torch.softmax(logits, dim=-1) if scoring == "softmax_topk" else logits
    top, ids = torch.sort(ranked, dim=-1, descending=True, stable=True)
    top, ids = top[:, :top_k], ids[:, :top_k]
    if scoring == "topk_softmax":
        weights = torch.softmax(top, dim=-1)
    elif scoring == "topk_sigmoid":
        weights = torch.sigmoid(top)
    else:
        weights = top / top.sum(dim=-1, keepdim=True) if renormalize else top
    return logits, weights, ids


def _integers(shape, low, high, scale, generator):
    """Small integers times a power of two: every product and sum below is exact in fp32 (ties stay ties)."""
    return torch.randint(low, high, shape, generator=generator).float() * scale


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel tests: the interpreter here, the GPU there


def on_device(*tensors):
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


def make_inputs(T, E, H, *, bias=False, ties=False, scale=1.0, offset=None, neg_inf_bias=(), seed=0):
    """hidden [T, H], weight [E, H], bias [E] or None (float32). ``ties``: integer data, weight rows 0/2 and 1/3
    equal (exactly tied logits) and hidden row 0 all zero (every logit tied at the bias, or 0). ``scale``: logits'
    spread; ``offset``: a bias of ``offset`` + N(0, 1) on every expert; ``neg_inf_bias``: experts with bias -inf."""
    g = torch.Generator().manual_seed(seed)
    if ties:
        hidden = _integers((T, H), -3, 4, 0.25, g)
        weight = _integers((E, H), -3, 4, 0.125, g)
        weight[2], weight[3] = weight[0], weight[1]
        hidden[0] = 0.0
    else:
        hidden = torch.randn(T, H, generator=g)
        weight = torch.randn(E, H, generator=g) * scale / H ** 0.5
    b = torch.randn(E, generator=g) if bias or neg_inf_bias or offset is not None else None
    if b is not None and ties:
        b = _integers((E,), -2, 3, 0.5, g)
    if offset is not None:
        b = b + offset
    for e in neg_inf_bias:
        b[e] = float("-inf")
    return hidden, weight, b


# (T, E, H, k, scoring, renormalize, options): options go to make_inputs, plus split_k/block_k for the kernel.
KERNEL_CASES = [
    # T=1 decode, GPT-OSS scoring with a bias, E=4 padded to a 16-wide tile, H split in 2 slices of 16
    pytest.param((1, 4, 32, 2, "topk_softmax", False, dict(bias=True, split_k=2)), id="T1-gptoss-bias"),
    # T=5 (not a multiple of the 16-token block), E=12 (not a power of two), H=40 (masked K steps), 3 slices
    pytest.param((5, 12, 40, 3, "softmax_topk", True, dict(split_k=3, block_k=16)), id="qwen-renorm-odd-shapes"),
    # T=17: two token blocks, the second with one row; no renormalisation (Qwen2-MoE's default)
    pytest.param((17, 16, 48, 4, "softmax_topk", False, dict(split_k=2, block_k=16)), id="T17-two-token-blocks"),
    # k=1, Llama-4 scoring, E=5
    pytest.param((3, 5, 32, 1, "topk_sigmoid", False, dict()), id="k1-llama4"),
    # k=E: every expert chosen, in score order
    pytest.param((4, 6, 32, 6, "softmax_topk", True, dict()), id="k-equals-E"),
    # k=E with the logits themselves
    pytest.param((2, 8, 16, 8, "topk_softmax", False, dict(bias=True)), id="k-equals-E-topk-softmax"),
    # exact ties (equal weight rows, an all-zero token): lower expert index first, in every scoring
    pytest.param((6, 8, 32, 4, "topk_softmax", False, dict(ties=True, bias=True)), id="ties-topk-softmax"),
    pytest.param((6, 8, 32, 4, "softmax_topk", True, dict(ties=True)), id="ties-softmax-topk"),
    pytest.param((6, 8, 32, 3, "topk_sigmoid", False, dict(ties=True)), id="ties-topk-sigmoid"),
    # -inf bias on experts 1 and 3 (masked experts): k = 5 of 6 takes one -inf logit, the lower index, weight 0
    pytest.param((3, 6, 32, 5, "topk_softmax", False, dict(neg_inf_bias=(1, 3))), id="neg-inf-bias"),
    # large logits (~1e3 + O(3)): exp of l - max never overflows (the chosen weights stay above fp32 underflow:
    # where several do underflow to 0, the kernel and the oracle may pick different zero-weight experts)
    pytest.param((4, 8, 32, 2, "softmax_topk", True, dict(scale=3.0, offset=1e3)), id="large-logits-softmax"),
    pytest.param((4, 8, 32, 2, "topk_softmax", False, dict(scale=3.0, offset=-1e3)), id="large-neg-logits-softmax"),
    # logits spread ~1e3: sigmoid saturates to exactly 0 / 1
    pytest.param((4, 8, 32, 3, "topk_sigmoid", False, dict(scale=1e3)), id="large-logits-sigmoid"),
    # Qwen2-MoE's E=60 (four 16-wide E blocks, the last one part padding)
    pytest.param((2, 60, 32, 4, "softmax_topk", False, dict()), id="E60"),
    # 11 H slices summed by the last program; T=18 spans two token blocks
    pytest.param((18, 12, 176, 3, "softmax_topk", True, dict(split_k=11, block_k=16)), id="11-slices-two-blocks"),
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_float64_oracle(case):
    T, E, H, k, scoring, renormalize, options = case
    launch = {key: options.pop(key) for key in ("split_k", "block_k") if key in options}
    hidden, weight, bias = make_inputs(T, E, H, **options)
    logits, scores, ids = (t.cpu() for t in route_triton(*on_device(hidden, weight, bias), top_k=k, scoring=scoring,
                                                          renormalize=renormalize, scores_dtype=torch.float32,
                                                          **launch))
    ref_logits, ref_weights, ref_ids = route_oracle(hidden, weight, bias, k, scoring, renormalize)
    assert logits.dtype == torch.float32 and scores.dtype == torch.float32 and ids.dtype == torch.int64
    assert logits.shape == (T, E) and scores.shape == ids.shape == (T, k)
    torch.testing.assert_close(logits.to(F64), ref_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores.to(F64), ref_weights, rtol=1e-5, atol=1e-6)
    assert router_launch._counters.all_clear(torch.empty(0, device=DEVICE).device), "arrival counters not reset"


NAN, INF = float("nan"), float("inf")


def _poke_hostile(hidden, bias, poke):
    """Non-finite routing inputs in place: ``nan_row`` hidden row 1 all NaN (an overflowed hidden state: every
    logit NaN); ``inf_entry`` hidden[2, 0] = +inf (every logit of row 2 is +-inf, several tied at +inf);
    ``neg_inf_entry`` hidden[0, 1] = -inf; ``nan_bias`` bias[3] = NaN (one NaN logit per row, mid-row);
    ``inf_bias`` bias[1] = +inf and bias[4] = NaN (a NaN outranks +inf)."""
    if poke == "nan_row":
        hidden[1] = NAN
    elif poke == "inf_entry":
        hidden[2, 0] = INF
    elif poke == "neg_inf_entry":
        hidden[0, 1] = -INF
    elif poke == "nan_bias":
        bias[3] = NAN
    elif poke == "inf_bias":
        bias[1], bias[4] = INF, NAN


# (T, E, H, k, scoring, renormalize, poke, bias): rows whose logits hold NaN or +-inf.
HOSTILE_CASES = [
    # an all-NaN row: k NaN picks, the lowest experts (the kernel returned id E_PAD = 16 here)
    pytest.param((3, 8, 32, 2, "softmax_topk", False, "nan_row", False), id="nan-row-softmax-topk"),
    pytest.param((3, 8, 32, 2, "softmax_topk", True, "nan_row", False), id="nan-row-softmax-topk-renorm"),
    pytest.param((3, 8, 32, 2, "topk_softmax", False, "nan_row", True), id="nan-row-topk-softmax"),
    pytest.param((3, 8, 32, 3, "topk_sigmoid", False, "nan_row", False), id="nan-row-topk-sigmoid"),
    # one +inf input: logits +-inf, several tied at +inf (softmax over them is NaN, sigmoid 1 / 0)
    pytest.param((3, 8, 32, 2, "softmax_topk", True, "inf_entry", False), id="inf-entry-softmax-topk"),
    pytest.param((3, 8, 32, 3, "topk_softmax", False, "inf_entry", False), id="inf-entry-topk-softmax"),
    pytest.param((3, 8, 32, 3, "topk_sigmoid", False, "inf_entry", False), id="inf-entry-topk-sigmoid"),
    # a -inf input: +-inf logits in row 0, two slices of H (the inf sits in the first partial sum)
    pytest.param((3, 6, 32, 2, "topk_softmax", False, "neg_inf_entry", False), id="neg-inf-entry-split"),
    # one NaN logit mid-row (bias): it ranks first, then the numbers in value order
    pytest.param((4, 8, 32, 3, "topk_sigmoid", False, "nan_bias", True), id="nan-logit-topk-sigmoid"),
    pytest.param((4, 8, 32, 2, "topk_softmax", False, "nan_bias", True), id="nan-logit-topk-softmax"),
    # NaN above +inf above the numbers; k = E: every column once, NaN first
    pytest.param((2, 6, 32, 6, "topk_sigmoid", False, "inf_bias", True), id="nan-over-inf-k-equals-E"),
    # E=20 (two E blocks, E_PAD 32, padding columns never picked) with an all-NaN row, k=4
    pytest.param((3, 20, 32, 4, "topk_sigmoid", False, "nan_row", False), id="nan-row-E20"),
]


@pytest.mark.parametrize("case", HOSTILE_CASES)
def test_kernel_non_finite_logits(case):
    """NaN ranks above every number (torch.topk's order) and equal values go to the lower index, so ids always lie
    in [0, E) and equal the stable-sort oracle's; the weights are the reference's, NaN where it gives NaN."""
    T, E, H, k, scoring, renormalize, poke, bias = case
    hidden, weight, b = make_inputs(T, E, H, bias=bias)
    _poke_hostile(hidden, b, poke)
    logits, scores, ids = (t.cpu() for t in route_triton(*on_device(hidden, weight, b), top_k=k, scoring=scoring,
                                                          renormalize=renormalize, scores_dtype=torch.float32,
                                                          split_k=2 if poke == "neg_inf_entry" else None))
    ref_logits, ref_weights, ref_ids = route_oracle(hidden, weight, b, k, scoring, renormalize)
    assert ((ids >= 0) & (ids < E)).all(), ids
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(logits.to(F64), ref_logits, rtol=1e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(scores.to(F64), ref_weights, rtol=1e-5, atol=1e-6, equal_nan=True)
    # the op's CPU impl (torch.topk: ties in an unspecified order) gives the same weights
    _, aten_scores, aten_ids = route_reference(hidden, weight, b, top_k=k, scoring=scoring, renormalize=renormalize)
    torch.testing.assert_close(scores, aten_scores, rtol=1e-5, atol=1e-6, equal_nan=True)
    assert ((aten_ids >= 0) & (aten_ids < E)).all()
    assert router_launch._counters.all_clear(torch.empty(0, device=DEVICE).device), "arrival counters not reset"


def test_kernel_empty_batch():
    hidden, weight, _ = make_inputs(1, 4, 16)
    logits, scores, ids = route_triton(hidden[:0], weight, None, top_k=2, scoring="softmax_topk", renormalize=False,
                                       scores_dtype=torch.float32)
    assert logits.shape == (0, 4) and scores.shape == ids.shape == (0, 2)


@pytest.mark.parametrize("scoring,renormalize,scores_dtype", [
    ("topk_softmax", False, None),           # GPT-OSS
    ("softmax_topk", True, None),            # Qwen3-MoE / OLMoE with norm_topk_prob
    ("softmax_topk", True, torch.float32),   # Mixtral: fp32 weights
    ("topk_sigmoid", False, None),           # Llama-4
])
def test_op_opcheck(scoring, renormalize, scores_dtype):
    hidden, weight, bias = make_inputs(5, 6, 16, bias=scoring == "topk_softmax")
    hidden = hidden.requires_grad_(True)
    torch.library.opcheck(torch.ops.moe_lora.route.default,
                          (hidden, weight, bias, 2, scoring, renormalize, scores_dtype),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_op_gradient_matches_reference():
    """d(logits, scores)/d(hidden) through route_backward equals autograd through the reference."""
    hidden, weight, _ = make_inputs(4, 6, 16)
    a = hidden.clone().requires_grad_(True)
    b = hidden.clone().requires_grad_(True)
    logits, scores, _ = torch.ops.moe_lora.route(a, weight, None, 3, "softmax_topk", True)
    ref_logits, ref_scores, _ = route_reference(b, weight, None, top_k=3, scoring="softmax_topk", renormalize=True)
    (logits.sum() + (scores * torch.arange(3.0)).sum()).backward()
    (ref_logits.sum() + (ref_scores * torch.arange(3.0)).sum()).backward()
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("change,error,match", [
    (dict(scoring="softmax"), ValueError, "scoring must be one of"),             # unknown scoring
    (dict(renormalize=True), ValueError, "renormalize=True applies"),             # renormalize with topk_softmax
    (dict(top_k=0), ValueError, r"top_k must lie in \[1, E = 6\]"),               # k below 1
    (dict(top_k=7), ValueError, r"top_k must lie in \[1, E = 6\]"),               # k above E
    (dict(weight=torch.zeros(6, 15)), ValueError, "weight must have shape"),       # H mismatch
    (dict(weight=torch.zeros(6, 16, dtype=torch.float64)), TypeError, "hidden's dtype"),  # dtype mismatch
    (dict(bias=torch.zeros(5)), ValueError, "bias must have shape"),               # bias length != E
    (dict(hidden=torch.zeros(2, 3, 16)), ValueError, "hidden must be 2-D"),        # 3-D hidden
    (dict(scores_dtype=torch.int32), TypeError, "scores_dtype must be a floating"),  # integer scores
])
def test_op_bad_inputs(change, error, match):
    args = dict(hidden=torch.zeros(2, 16), weight=torch.zeros(6, 16), bias=None, top_k=2, scoring="topk_softmax",
                renormalize=False, scores_dtype=None)
    args.update(change)
    with pytest.raises(error, match=match):
        torch.ops.moe_lora.route(*args.values())


def test_route_refuses_a_bool_top_k():
    """The op's int schema reads True as 1, so the Python entry point refuses bools before it (top_k=True routed
    every token to one expert, no error)."""
    from moe_lora_compile.ops import route
    with pytest.raises(TypeError, match="top_k must be an int, got True"):
        route(torch.zeros(2, 16), torch.zeros(6, 16), top_k=True, scoring="topk_softmax")
    with pytest.raises(TypeError, match="top_k must be an int, got 2.0"):  # was the schema's raw RuntimeError
        route(torch.zeros(2, 16), torch.zeros(6, 16), top_k=2.0, scoring="topk_softmax")
    import numpy as np

    ids = route(torch.randn(2, 16), torch.randn(6, 16), top_k=np.int64(2), scoring="topk_softmax")[2]
    assert ids.shape == (2, 2)


MOE_FAMILIES = ["qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "olmoe", "llama4"]


@pytest.mark.parametrize("family", MOE_FAMILIES + ["deepseek_v3"])
def test_attached_router_matches_transformers(family):
    """attach() routes the verified routers through the op (DeepSeek-V3's stays transformers'), the model output
    equals transformers' eager output, and the router outputs (router_logits, weights dtype) are unchanged."""
    import transformers

    from moe_lora_compile.models.attach import attach
    from moe_lora_compile.models.routers import FusedRouterMixin
    from moe_lora_compile.models.tiny import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    ids = torch.randint(3, 128, (2, 5))
    with torch.no_grad():
        ref = model(ids).logits
        routers = {n: m for n, m in model.named_modules() if type(m).__name__.endswith("Router")}
        x = torch.randn(10, model.config.hidden_size)
        ref_router = {n: m(x) for n, m in routers.items()}
        mm = attach(model)
        out = mm(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if family == "deepseek_v3":
        assert mm.fused_routers == []
        return
    assert len(mm.fused_routers) == model.config.num_hidden_layers
    if family == "llama4":
        return  # its router module is unchanged; the swapped block calls the op
    for name, router in routers.items():
        assert isinstance(router, FusedRouterMixin) and isinstance(router, type(router).__mro__[2])
        with torch.no_grad():
            got = router(x)
        for a, b in zip(got, ref_router[name]):
            assert a.dtype == b.dtype and a.shape == b.shape
            torch.testing.assert_close(a, b)


def test_attach_fused_router_off_keeps_transformers_routers():
    import transformers

    from moe_lora_compile.models.attach import attach
    from moe_lora_compile.models.tiny import tiny_config

    model = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    mm = attach(model, fused_router=False)
    assert mm.fused_routers == [] and type(model.model.layers[0].mlp.gate).__name__ == "Qwen3MoeTopKRouter"
    with pytest.raises(TypeError, match="fused_router must be a bool"):
        attach(transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")), fused_router=1)


@pytest.mark.parametrize("family, fused", [
    ("qwen3_moe", True),   # the router's class swapped to the op's forward
    ("llama4", True),      # the MoE block swapped whole: it must still call the router module (the hook's target)
    ("llama4", False),     # likewise with transformers' own routing math
])
def test_attached_router_logits_are_recorded(family, fused):
    """transformers records router_logits with hooks on the router class; the swapped class still matches."""
    import copy

    import transformers

    from moe_lora_compile.models.attach import attach
    from moe_lora_compile.models.tiny import tiny_config

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    ids = torch.randint(3, 128, (2, 6))
    with torch.no_grad():
        ref = model(ids, output_router_logits=True).router_logits
        out = attach(copy.deepcopy(model), fused_router=fused)(ids, output_router_logits=True).router_logits
    assert len(out) == len(ref) == 2
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)


# --- GPU --------------------------------------------------------------------------------------------------------
GEOMETRIES = [
    pytest.param((32, 2880, 4, "topk_softmax", False, True), id="gpt-oss-20b"),
    pytest.param((128, 2048, 8, "softmax_topk", True, False), id="qwen3-30b-a3b"),
]


def _gpu_inputs(T, E, H, bias, integers, seed=0):
    g = torch.Generator().manual_seed(seed)
    if integers:  # exact fp32 sums in any order: logits bit-equal to cuBLAS', ties exact
        hidden = _integers((T, H), -3, 4, 0.25, g)
        weight = _integers((E, H), -2, 3, 1 / 64, g)
        weight[E // 2] = weight[0]  # a tied pair of experts
        b = _integers((E,), -2, 3, 0.25, g) if bias else None
    else:
        hidden = torch.randn(T, H, generator=g)
        weight = torch.randn(E, H, generator=g) / H ** 0.5
        b = torch.randn(E, generator=g) if bias else None
    to = dict(device="cuda", dtype=torch.bfloat16)
    return hidden.to(**to), weight.to(**to), None if b is None else b.to(**to)


def _by_expert(ids, scores):
    """(ids, scores) of each row reordered by expert id: equal sets compare equal whatever the order of near-ties."""
    order = ids.argsort(dim=-1)
    return ids.gather(-1, order), scores.gather(-1, order)


def clear_rows(logits, k):
    """[T] bool: rows whose k-th and (k+1)-th largest logits are further apart than 4 bf16 roundings, so one rounding
    of the logits (kernel vs float64) cannot change the chosen set (k < E)."""
    top = logits.sort(-1, descending=True).values
    return (top[:, k - 1] - top[:, k]) > 4 * 2.0 ** -8 * top[:, k - 1].abs()


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("T", [1, 8, 64, MAX_KERNEL_TOKENS + 1])  # 65: past the kernel, the aten path
def test_gpu_bf16_real_shapes(geometry, T):
    """bf16 router at real shapes against float64: logits within one bf16 rounding, the same expert set and the
    same weight per expert (within bf16 rounding) in every row without a near-tie at the k-th place (the inputs
    are fixed; the test checks that there are such rows)."""
    E, H, k, scoring, renormalize, bias = geometry
    hidden, weight, b = _gpu_inputs(T, E, H, bias, integers=False)
    logits, scores, ids = torch.ops.moe_lora.route(hidden, weight, b, k, scoring, renormalize)
    ref_logits, ref_weights, ref_ids = route_oracle(hidden.cpu(), weight.cpu(), None if b is None else b.cpu(), k,
                                                    scoring, renormalize)
    assert logits.dtype == scores.dtype == torch.bfloat16 and ids.dtype == torch.int64
    torch.testing.assert_close(logits.cpu().to(F64), ref_logits, rtol=1e-2, atol=1e-2)
    clear = clear_rows(ref_logits, k)
    assert clear.any()
    got_ids, got_scores = _by_expert(ids.cpu()[clear], scores.cpu().to(F64)[clear])
    want_ids, want_scores = _by_expert(ref_ids[clear], ref_weights[clear])
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_scores, want_scores, rtol=2e-2, atol=1e-3)


def _expected_ids_lowest_index_on_ties(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k experts of each row by ``keys`` [T, E] (descending), equal keys taken lowest index first -> [T, k]
    sorted by expert index (the kernel's documented tie rule; a stable sort of the negated keys gives it)."""
    order = torch.sort(-keys, dim=-1, stable=True).indices[:, :k]
    return order.sort(dim=-1).values


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpu_exact_data_matches_torch_path(geometry, T):
    """Integer-valued bf16 data (fp32 sums exact in any order): the kernel's logits equal the aten path's (cuBLAS)
    bit for bit; its experts are the top k with equal logits taken lowest index first, and equal the aten path's
    (torch.topk) as sets wherever no tie crosses the k-th place (CUDA torch.topk's order among equal values is
    unspecified: on the H200 it is not index order); its weights equal the aten path's within one bf16 rounding
    on those rows."""
    E, H, k, scoring, renormalize, bias = geometry
    hidden, weight, b = _gpu_inputs(T, E, H, bias, integers=True)
    logits, scores, ids = torch.ops.moe_lora.route(hidden, weight, b, k, scoring, renormalize)
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False  # cuBLAS: fp32 sums throughout
    try:
        ref_logits, ref_scores, ref_ids = route_reference(hidden, weight, b, top_k=k, scoring=scoring,
                                                          renormalize=renormalize)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    assert torch.equal(logits, ref_logits)
    keys = ref_logits.float().cpu()
    got_ids, got_scores = _by_expert(ids.cpu(), scores.cpu().to(F64))
    assert torch.equal(got_ids, _expected_ids_lowest_index_on_ties(keys, k))
    top = keys.topk(min(k + 1, E), dim=-1).values
    clear = top[:, k - 1] > top[:, k] if k < E else torch.ones(T, dtype=torch.bool)
    want_ids, want_scores = _by_expert(ref_ids.cpu()[clear], ref_scores.cpu().to(F64)[clear])
    assert torch.equal(got_ids[clear], want_ids)
    torch.testing.assert_close(got_scores[clear], want_scores, rtol=1e-2, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", GEOMETRIES)
def test_gpu_cuda_graph_replay(geometry):
    """The op captured in a CUDA graph replays with new inputs exactly as it runs eagerly (the counters reset)."""
    E, H, k, scoring, renormalize, bias = geometry
    hidden, weight, b = _gpu_inputs(8, E, H, bias, integers=False)
    static = hidden.clone()
    torch.ops.moe_lora.route(static, weight, b, k, scoring, renormalize)  # warm-up: compile, counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.moe_lora.route(static, weight, b, k, scoring, renormalize)
    for seed in (1, 2, 3):
        static.copy_(_gpu_inputs(8, E, H, bias, integers=False, seed=seed)[0])
        graph.replay()
        eager = torch.ops.moe_lora.route(static, weight, b, k, scoring, renormalize)
        for a, e in zip(out, eager):
            assert torch.equal(a, e)
