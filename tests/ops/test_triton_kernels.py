"""The Triton kernels of ``fused_moe_lora`` and ``lora_linear`` against the float64 oracle (``tests/support``).

CPU: the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` from conftest) in float32 at tiny shapes with
16-wide blocks (the interpreter's bf16 is wrong: triton-lang/triton#11584). GPU (``-m gpu``): bf16 at the real shapes of
:mod:`moe_lora_compile.shapes`, the op through ``torch.ops``, opcheck, and no Triton recompile for a new T.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch

from support.cases import MoECase
from support.oracle import lora_linear_oracle, moe_lora_oracle

from moe_lora_compile.ops.reference import fused_moe_lora_reference
from moe_lora_compile.ops.triton.configs import GemmConfig, MoEKernelConfig, ShrinkConfig
from moe_lora_compile.ops.triton.launch import fused_moe_lora_triton, lora_linear_triton
from moe_lora_compile.ops.triton.routing import max_blocks, sort_pairs
from moe_lora_compile.shapes import GPT_OSS_20B, QWEN3_30B_A3B

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Tiny tiles for the interpreter (about 5 ms per tl.dot step there).
_GEMM = GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
_SHRINK = ShrinkConfig(BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=1)


def tiny_config(per_pair: bool, fuse_shrink2: bool = False, fuse_topk_sum: bool = True, split13: int = 1,
                split2: int = 1) -> MoEKernelConfig:
    """``fuse_topk_sum`` (per-pair mode, k > 1): the w2 kernel also sums the top-k, per 16-wide H tile (H=32/40:
    2/3 tiles, the last one masked at H=40). ``split13`` / ``split2``: split-K of the w13 / w2 GEMM (w2: per-pair
    top-k-sum path only), clamped to the number of 16-wide K steps."""
    return MoEKernelConfig(per_pair=per_pair, fuse_shrink2=fuse_shrink2, fuse_topk_sum=fuse_topk_sum, BLOCK_M=16,
                           w13=replace(_GEMM, SPLIT_K=split13), w2=replace(_GEMM, SPLIT_K=split2), shrink=_SHRINK)


PATHS = [
    pytest.param((False, False), id="sorted"),           # routed blocks per expert/slot, separate w2 shrink
    pytest.param((True, True), id="per-pair-fused"),     # one pair per block, w2 shrink fused into w13, w2 + top-k
                                                         # sum in one kernel
    pytest.param((False, True), id="sorted-fused"),      # routed blocks, w2 shrink fused into w13
    pytest.param((True, True, False), id="per-pair-w2-then-sum"),  # per-pair w2 (one row per pair), torch top-k sum
    pytest.param((True, False), id="per-pair-shrink2"),  # per-pair, separate w2 shrink, fused w2 + top-k sum
    pytest.param((True, True, True, 3, 2), id="per-pair-split-k"),  # w13 split-K (3 slices, or as many K steps
                                                         # as there are: H=32 -> 2), w2 split-K inside the top-k sum
    pytest.param((False, False, True, 2), id="sorted-split-k"),  # routed blocks, w13 split-K, separate w2 shrink
]


# Kernel test cases: tiles of 16, so H=32 / I=16 make two / one column tiles; R=16 one rank tile.
KERNEL_CASE = dict(H=32, I=16, L=2, R=16, lora="all", topk_dtype=torch.int32)


def kernel_case(**fields) -> MoECase:
    return MoECase(**{**KERNEL_CASE, **fields})


def oracle(args, kwargs) -> torch.Tensor:
    """The float64 oracle of the op's arguments, on the CPU."""
    return moe_lora_oracle(*args, **kwargs).cpu()


CASES = [
    # T=1 decode, one adapter slot, k=1
    pytest.param(kernel_case(T=1, k=1, L=1), id="T1-k1-L1"),
    # several tokens, k>1, L>1, random slots (every token has an adapter)
    pytest.param(kernel_case(T=6, k=2, L=3), id="k2-L3"),
    # experts 1 and 3 receive no pair (empty experts)
    pytest.param(kernel_case(T=5, E=6, experts=(0, 2, 4, 5)), id="empty-experts"),
    # every pair on expert 2 (k=1), 20 pairs > BLOCK_M: two blocks of one expert
    pytest.param(kernel_case(T=20, k=1, E=4, experts=(2,)), id="one-expert-two-blocks"),
    # no token has an adapter: all LoRA work skipped, base only
    pytest.param(kernel_case(T=5, lora="none"), id="all-minus-one"),
    # every other token without adapter
    pytest.param(kernel_case(T=7, L=3, lora="alternate"), id="mixed-minus-one"),
    # slot ranks 16 / 5 / 9 zero-padded to R=16
    pytest.param(kernel_case(T=6, L=3, ranks=(16, 5, 9)), id="mixed-ranks"),
    # R=8 < 16: rank axis masked inside a 16-wide tile
    pytest.param(kernel_case(T=4, R=8), id="rank8-masked"),
    # H and I not multiples of the 16-wide tiles: masked K and N paths
    pytest.param(kernel_case(T=4, H=40, I=24), id="uneven-K-N"),
    # Llama-4: transposed concat, routing weight on the input
    pytest.param(kernel_case(T=5, layout="transposed_concat", routing_weight_on_input=True, lora="alternate"),
                 id="llama4-on-input"),
    # GPT-OSS: transposed interleaved, clamped swiglu (limit low enough to clamp), biases
    pytest.param(kernel_case(T=5, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True, limit=0.5),
                 id="gptoss-bias-clamp"),
    # vLLM's GPT-OSS: [E, 2I, H] weights with interleaved rows (strides of concat, interleaved tiles), clamp, biases
    pytest.param(kernel_case(T=5, layout="interleaved", activation="gptoss_swiglu", bias=True, limit=0.5),
                 id="vllm-gptoss-interleaved"),
    # concat layout with biases and the GPT-OSS activation
    pytest.param(kernel_case(T=3, bias=True, activation="gptoss_swiglu", lora="alternate"), id="concat-bias-swiglu"),
    # k=5 of 8 experts (not a power of two: the top-k kernel's row tile is padded), uneven H, adapters on some
    pytest.param(kernel_case(T=2, H=40, E=8, k=5, L=2, lora="alternate"), id="k5-uneven-H"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_lora_kernel_matches_loop(case, path):
    """Both routing paths (sorted per expert/slot, one pair per block), w2 shrink fused or not, per-pair w2 with
    the top-k sum fused or not, vs the oracle."""
    args, kwargs = case.make(DEVICE)
    y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(*path))
    assert y.shape == (case.T, case.H) and y.dtype == torch.float32
    torch.testing.assert_close(y.cpu().double(), oracle(args, kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", [
    pytest.param((True, True), id="per-pair-fused"),      # slices: one per w13 column tile (I=48: 3)
    pytest.param((False, True), id="sorted-fused"),       # the same, routed blocks with several slots
    pytest.param((True, False), id="per-pair-shrink2"),   # the separate shrink2's K slices (_SHRINK's split)
    pytest.param((False, False), id="sorted-shrink2"),
])
@pytest.mark.parametrize("block_k2", [16, 32, 64], ids=["3-steps", "2-steps", "1-step"])  # I=48: slices vs K steps
@pytest.mark.parametrize("case", [
    pytest.param(kernel_case(T=6, k=2, L=3, I=48, lora="alternate"), id="I48-alternate"),
    pytest.param(kernel_case(T=5, L=3, I=48, ranks=(16, 5, 9)), id="I48-mixed-ranks"),
    pytest.param(kernel_case(T=4, I=40, H=40, layout="transposed_interleaved", activation="gptoss_swiglu",
                             bias=True, limit=0.5), id="I40-gptoss-bias"),  # a ragged last K step
    pytest.param(kernel_case(T=3, I=48, lora="none"), id="I48-no-lora"),
])
@pytest.mark.parametrize("sum_in_loop", [True, False], ids=["in-loop", "after-loop"])  # True: the default
def test_w2_sum_in_loop_matches_oracle(case, path, block_k2, sum_in_loop):
    """``w2_sum_in_loop``: the w2 kernel sums the rank vectors' slices one per K step in its main loop and the rest
    after it (more slices than steps: block_k2 32 / 64 with 3 fused slices), or has fewer slices than steps; off,
    it sums them all after its main loop."""
    args, kwargs = case.make(DEVICE)
    cfg = tiny_config(*path).replace(w2_sum_in_loop=sum_in_loop, **{"w2.BLOCK_K": block_k2})
    y = fused_moe_lora_triton(*args, **kwargs, config=cfg)
    torch.testing.assert_close(y.cpu().double(), oracle(args, kwargs), rtol=1e-4, atol=1e-4)


def test_w2_sum_in_loop_config():
    """``w2_sum_in_loop`` must be a bool, True by default; it round-trips through the dict form, which leaves it
    out when True (the tables written before it read as the default)."""
    with pytest.raises(ValueError, match="w2_sum_in_loop"):
        tiny_config(True).replace(w2_sum_in_loop="yes")
    off = tiny_config(True).replace(w2_sum_in_loop=False)
    assert MoEKernelConfig.of(off.to_dict()) == off and off.to_dict()["w2_sum_in_loop"] is False
    on = tiny_config(True)
    assert on.w2_sum_in_loop and "w2_sum_in_loop" not in on.to_dict()


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair"])
def test_int64_ids_and_empty_batch(per_pair):
    """int64 topk_ids / token_lora_ids give the int32 result; T=0 gives an empty [0, H] output."""
    c = kernel_case(T=4, lora="alternate")
    args, kwargs = c.make(DEVICE)
    y32 = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(per_pair))
    wide = list(args)
    wide[1], wide[3] = args[1].long(), args[3].long()
    y64 = fused_moe_lora_triton(*wide, **kwargs, config=tiny_config(per_pair))
    torch.testing.assert_close(y64, y32, rtol=0, atol=0)
    empty = [args[0][:0], args[1][:0], args[2][:0], args[3][:0], *args[4:]]
    assert fused_moe_lora_triton(*empty, **kwargs).shape == (0, c.H)


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair"])
def test_strided_biases_are_read_as_such(per_pair):
    """Biases whose last dim is not contiguous (a transposed [E, 2I] w13 bias, a column of a wider dense bias): the
    kernels index a bias row with stride 1, so the launchers copy such views; read as they lie they gave wrong rows."""
    c = kernel_case(T=5, lora="alternate", bias=True)
    args, kwargs = c.make(DEVICE)
    kwargs["w13_bias"] = kwargs["w13_bias"].t().contiguous().t()  # same values, strides (1, E)
    kwargs["w2_bias"] = torch.stack([kwargs["w2_bias"], -kwargs["w2_bias"]], dim=-1)[..., 0]  # strides (2H, 2)
    assert kwargs["w13_bias"].stride(-1) != 1 and kwargs["w2_bias"].stride(-1) != 1
    y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(per_pair))
    torch.testing.assert_close(y.cpu().double(), oracle(args, kwargs), rtol=1e-4, atol=1e-4)
    g = torch.Generator().manual_seed(0)
    x, w, a, b = (torch.randn(*shape, generator=g) for shape in ((3, 32), (24, 32), (2, 16, 32), (2, 24, 16)))
    bias = torch.randn(24, 2, generator=g)[:, 0]  # a column: stride (2,)
    ids = torch.tensor([0, -1, 1], dtype=torch.int32)
    for gemv in (True, False):
        y = lora_linear_triton(*(t.to(DEVICE) for t in (x, w, a, b, ids)), bias=bias.to(DEVICE),
                               config={"BLOCK_M": 16, "per_token": True, "gemv": gemv,
                                       "gemm": asdict(GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=2, num_warps=4,
                                                                 num_stages=1)),
                                       "shrink": asdict(ShrinkConfig(BLOCK_K=16, SPLIT_K=1, num_warps=4,
                                                                     num_stages=1))})
        torch.testing.assert_close(y.cpu().double(), lora_linear_oracle(x, w, a, b, ids, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair"])
@pytest.mark.parametrize("k", [1, 2])  # k=1: reshape(-1) of a [T, 1] column slice is a view that keeps stride 2
def test_strided_routing_ids_are_read_as_such(per_pair, k):
    """topk_ids / topk_weights / token_lora_ids that are column slices of wider tensors (strides (2k, 1), (2,)):
    the routing kernels index them as flat arrays, so the launchers copy such views (the sorted path once read a
    k=1 slice as if contiguous: other tokens' experts, no error)."""
    c = kernel_case(T=5, k=k, lora="alternate")
    args, kwargs = c.make(DEVICE)
    args = list(args)
    args[1] = torch.cat([args[1], args[1].flip(0)], dim=1)[:, :k]
    args[2] = torch.cat([args[2], -args[2]], dim=1)[:, :k]
    args[3] = torch.stack([args[3], args[3].flip(0)], dim=1)[:, 0]
    assert args[1].stride() == (2 * k, 1) and args[3].stride() == (2,)
    y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(per_pair))
    torch.testing.assert_close(y.cpu().double(), oracle(args, kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair"])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_out_of_range_slots_reaching_the_kernels_are_no_adapter(per_pair, ids_dtype):
    """Slot ids outside [-1, L) that skip the op's checks (checks off inside CUDA graphs, MOE_LORA_CHECK_IDS=0) are
    read as -1 by every kernel: before, L indexed past the stacks (sorted mode: an out-of-bounds atomic in the
    routing, a process abort) and -2 took another expert's segment. int64 ids are tested before any cast: 2**32 + 1
    and -2**32 + 1 would be slot 1 (another tenant's adapter) once truncated to int32."""
    wide = ids_dtype == torch.int64
    c = kernel_case(T=6, lora="all", L=2)
    args, kwargs = c.make(DEVICE)
    args = list(args)
    args[3] = torch.tensor([0, 2, 2**32 + 1 if wide else -2, 1, 7, -2**32 + 1 if wide else -9], dtype=ids_dtype,
                           device=DEVICE)
    y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(per_pair))
    args[3] = torch.tensor([0, -1, -1, 1, -1, -1], dtype=ids_dtype, device=DEVICE)
    torch.testing.assert_close(y.cpu().double(), oracle(args, kwargs), rtol=1e-4, atol=1e-4)
    g = torch.Generator().manual_seed(0)
    x, w, a, b = (torch.randn(*shape, generator=g) for shape in ((4, 32), (24, 32), (2, 16, 32), (2, 24, 16)))
    for gemv in (True, False):
        ids = torch.tensor([1, 2**32 + 1 if wide else 2, -3, 0], dtype=ids_dtype)
        dev = [t.to(DEVICE) for t in (x, w, a, b, ids)]
        y = lora_linear_triton(*dev, config={"BLOCK_M": 16, "per_token": gemv, "gemv": gemv,
                                             "gemm": asdict(GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=2,
                                                                       num_warps=4, num_stages=1)),
                                             "shrink": asdict(ShrinkConfig(BLOCK_K=16, SPLIT_K=1, num_warps=4,
                                                                           num_stages=1))})
        want = lora_linear_oracle(x, w, a, b, torch.tensor([1, -1, -1, 0]))
        torch.testing.assert_close(y.cpu().double(), want, rtol=1e-4, atol=1e-4)


def _with_a_zero_expert(args, kwargs, bad):
    """The independent expectation for pairs whose expert lies outside [0, E): the same problem with one more expert,
    E, all zero (base weights, biases, LoRA factors), and those pairs (``bad`` [T, k] bool) routed to it. Its h is
    0, so act(0) = 0 for silu and GPT-OSS's swiglu alike, and its pairs add exactly nothing."""
    args, kwargs = list(args), dict(kwargs)

    def pad(t, dim):
        shape = list(t.shape)
        shape[dim] = 1
        return torch.cat([t, t.new_zeros(shape)], dim=dim)

    E = args[4].shape[0]
    args[1] = torch.where(bad, E, args[1].long()).to(args[1].dtype)
    args[4], args[5] = pad(args[4], 0), pad(args[5], 0)
    args[6:10] = [pad(t, 1) for t in args[6:10]]
    for key in ("w13_bias", "w2_bias"):
        if key in kwargs:
            kwargs[key] = pad(kwargs[key], 0)
    return args, kwargs


# (case, config, bad ids {(token, j): id}); E = 4 unless the case says otherwise.
OUT_OF_RANGE_EXPERTS = [
    # sorted: one pair's id just past the end (E), another token's both pairs at 16 (the router's old E_PAD)
    pytest.param(kernel_case(T=5, k=2), tiny_config(False), {(1, 0): 4, (3, 0): 16, (3, 1): 16},
                 id="sorted-E-and-whole-token"),
    # sorted, k=1: the w2 rows are y itself; a -1 id leaves that token's y row exactly 0
    pytest.param(kernel_case(T=4, k=1), tiny_config(False), {(2, 0): -1}, id="sorted-k1-negative"),
    # sorted with the block shrink (not the per-pair one) and int64 ids: 2**32 + 1 would truncate to expert 1
    pytest.param(kernel_case(T=5, k=2, topk_dtype=torch.int64), tiny_config(False).replace(per_pair_shrink=False),
                 {(0, 1): 2 ** 32 + 1, (4, 0): -(2 ** 40)}, id="sorted-block-shrink-int64-wide"),
    # sorted, w13 split-K, fused shrink2; every pair out of range: no block at all, y all zero
    pytest.param(kernel_case(T=3, k=2), tiny_config(False, True, split13=2),
                 {(t, j): 7 for t in range(3) for j in range(2)}, id="sorted-split-k-all-out"),
    # per-pair, w2 shrink fused, top-k sum in the w2 kernel: the bad pair still arrives with a zero row
    pytest.param(kernel_case(T=4, k=2), tiny_config(True, True), {(1, 1): 4, (2, 0): -3}, id="per-pair-topk-sum"),
    # per-pair, w13 and w2 split-K: every K slice of the bad pair's row is zero; a whole token out of range
    pytest.param(kernel_case(T=3, k=3, E=6), tiny_config(True, True, split13=2, split2=2),
                 {(0, 2): 6, (2, 0): 99, (2, 1): 99, (2, 2): 99}, id="per-pair-split-k"),
    # per-pair w2 then a torch top-k sum (one x.dtype row per pair), separate w2 shrink
    pytest.param(kernel_case(T=4, k=2), tiny_config(True, False, fuse_topk_sum=False), {(3, 0): 4},
                 id="per-pair-w2-then-sum"),
    # per-pair, k=1: the w2 rows are y itself
    pytest.param(kernel_case(T=3, k=1), tiny_config(True, True), {(1, 0): 5}, id="per-pair-k1"),
    # GPT-OSS layout with biases: the bad pair's biases (read from expert 0) must not leak either
    pytest.param(kernel_case(T=4, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True),
                 tiny_config(True, True), {(0, 0): 4, (3, 1): -1}, id="per-pair-gptoss-bias"),
    pytest.param(kernel_case(T=4, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True),
                 tiny_config(False), {(0, 0): 4, (3, 1): -1}, id="sorted-gptoss-bias"),
    # Llama-4: routing weight on the input, w13 shrink scaled by it
    pytest.param(kernel_case(T=4, layout="transposed_concat", routing_weight_on_input=True),
                 tiny_config(True, True), {(2, 1): 4}, id="per-pair-weight-on-input"),
]


def _bad_experts(args, bad_ids: dict) -> tuple[list, torch.Tensor]:
    """``args`` with the expert ids ``{(token, j): id}`` written into topk_ids, and the [T, k] mask of those pairs."""
    args = list(args)
    ids = args[1].clone()
    bad = torch.zeros(ids.shape, dtype=torch.bool)
    for (t, j), e in bad_ids.items():
        ids[t, j] = e
        bad[t, j] = True
    args[1] = ids
    return args, bad


@pytest.mark.parametrize("case,config,bad_ids", OUT_OF_RANGE_EXPERTS)
def test_out_of_range_experts_reaching_the_kernels_add_nothing(case, config, bad_ids):
    """Expert ids outside [0, E) that skip the op's checks (off inside CUDA graphs, MOE_LORA_CHECK_IDS=0): such a
    pair adds nothing (no base GEMM, no LoRA, no bias), whatever path. Before, the kernels indexed the weights and
    stacks with the id (per-pair: reads past W13/W2; sorted: an out-of-bounds atomic into the routing's counters)
    and -1 read the last expert. (The op's CPU impl always refuses such ids: its checks run on the host.)"""
    args, kwargs = case.make(DEVICE)
    args, bad = _bad_experts(args, bad_ids)
    y = fused_moe_lora_triton(*args, **kwargs, config=config)
    want = oracle(*_with_a_zero_expert(args, kwargs, bad.to(args[1].device)))
    torch.testing.assert_close(y.cpu().double(), want, rtol=1e-4, atol=1e-4)
    whole = bad.all(dim=1)  # tokens with every pair out of range: exactly zero
    assert torch.equal(y.cpu()[whole], torch.zeros_like(y.cpu()[whole]))


@pytest.mark.parametrize("case,config,bad_ids", OUT_OF_RANGE_EXPERTS)
def test_out_of_range_ids_reaching_the_reference_read_as_the_kernels_read_them(case, config, bad_ids):
    """The PyTorch reference is also the CUDA impl's fallback (mixed dtypes, float64), where unchecked ids reach it as
    they reach the kernels: an expert outside [0, E) adds nothing, a slot outside [-1, L) is -1. Before, expert -1
    wrapped to expert E - 1 (added with its full routing weight) and E or slot L raised IndexError (on CUDA a
    device-side assert)."""
    args, kwargs = case.make("cpu")
    args, bad = _bad_experts(args, bad_ids)
    L = args[6].shape[0]
    slots = args[3].clone()
    slots[::2] = torch.tensor([L, -2, L + 5])[torch.arange(slots[::2].numel()) % 3].to(slots.dtype)  # unchecked
    args[3] = slots
    y = fused_moe_lora_reference(*args, **kwargs)
    want_args, want_kwargs = _with_a_zero_expert(args, kwargs, bad)
    want_args[3] = torch.where((slots >= 0) & (slots < L), slots, -1)
    torch.testing.assert_close(y.double(), oracle(want_args, want_kwargs), rtol=1e-5, atol=1e-5)
    whole = bad.all(dim=1)
    assert torch.equal(y[whole], torch.zeros_like(y[whole]))


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair-topk-sum"])
def test_lora_changes_the_output(per_pair):
    """Guard against a kernel that drops the LoRA delta: with vs without adapters must differ by the delta."""
    c = kernel_case(T=4, L=2)
    args, kwargs = c.make(DEVICE)
    no_lora = list(args)
    no_lora[3] = torch.full_like(args[3], -1)
    y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(per_pair, per_pair))
    y0 = fused_moe_lora_triton(*no_lora, **kwargs, config=tiny_config(per_pair, per_pair))
    delta_ref = oracle(args, kwargs) - oracle(no_lora, kwargs)
    assert delta_ref.abs().max() > 0.1
    torch.testing.assert_close((y - y0).cpu().double(), delta_ref, rtol=1e-4, atol=1e-4)


def _aten_ops(fn) -> set:
    """Names of the aten ops ``fn()`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        fn()
    return rec.names


def test_fused_topk_sum_has_no_separate_sum():
    """Per-pair mode with ``fuse_topk_sum``: the top-k sum happens in the w2 kernel (no torch sum, no memset);
    with it off, a torch sum follows. Same result both ways; the fused one repeats bit for bit."""
    args, kwargs = kernel_case(T=3, k=3, L=2, lora="alternate").make(DEVICE)
    old = tiny_config(True, True, fuse_topk_sum=False)
    assert "sum" in _aten_ops(lambda: fused_moe_lora_triton(*args, **kwargs, config=old))
    ops = _aten_ops(lambda: fused_moe_lora_triton(*args, **kwargs, config=tiny_config(True, True)))
    assert not ops & {"sum", "zero_", "fill_", "zeros"}, ops
    y_old = fused_moe_lora_triton(*args, **kwargs, config=old)
    y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(True, True))
    torch.testing.assert_close(y, y_old, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, fused_moe_lora_triton(*args, **kwargs, config=tiny_config(True, True)))


@pytest.mark.parametrize("k,split2", [
    (1, 3),  # k=1: the w2 split-K partials alone go through the fused sum (3 slices of I=48)
    (3, 2),  # k=3 and 2 slices: 6 partials per token and H tile
])
def test_split_k_is_deterministic_and_matches(k, split2):
    """Split-K of w13 (per tile, the last arriver sums in split order) and of w2 (inside the top-k sum): equal to
    the oracle, to the unsplit kernels up to fp32 summation order, and bit for bit the same on a repeat."""
    c = kernel_case(T=3, H=48, I=48, k=k, L=2, lora="alternate", bias=True, layout="transposed_interleaved",
                    activation="gptoss_swiglu", limit=0.5)
    args, kwargs = c.make(DEVICE)
    cfg = tiny_config(True, True, split13=3, split2=split2)
    y = fused_moe_lora_triton(*args, **kwargs, config=cfg)
    torch.testing.assert_close(y.cpu().double(), oracle(args, kwargs), rtol=1e-4, atol=1e-4)
    y1 = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(True, True))
    torch.testing.assert_close(y, y1, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, fused_moe_lora_triton(*args, **kwargs, config=cfg))
    assert not _aten_ops(lambda: fused_moe_lora_triton(*args, **kwargs, config=cfg)) & {"sum", "zero_", "fill_"}


def test_pdl_switches(set_switch):
    """PDL precedence: a config the caller passes, over MOE_LORA_PDL, over a tuned entry's key, over the default
    (late trigger); never on without a CUDA SM90+ device (here: never); the launch chain compiles every kernel with
    USE_PDL=mode and launches all but the first as dependents."""
    from moe_lora_compile import settings
    from moe_lora_compile.ops.triton import pdl
    from moe_lora_compile.ops.triton.configs import requested_pdl
    caller = lambda value: requested_pdl(value, passed_by_caller=True)  # noqa: E731
    tuned = lambda value: requested_pdl(value, passed_by_caller=False)  # noqa: E731
    set_switch(settings.PDL, None)
    assert caller(None) == tuned(None) == pdl.PDL_LATE
    assert caller(False) == pdl.PDL_OFF and caller("early") == pdl.PDL_EARLY
    set_switch(settings.PDL, "0")
    assert caller(None) == tuned(None) == pdl.PDL_OFF
    assert caller(True) == pdl.PDL_LATE  # the caller's config wins over the variable
    for value, mode in (("1", pdl.PDL_LATE), ("late", pdl.PDL_LATE), ("EARLY", pdl.PDL_EARLY), ("off", pdl.PDL_OFF)):
        set_switch(settings.PDL, value)
        assert caller(None) == mode
    # a tuned entry's "pdl" yields to the variable when it is set, not otherwise
    set_switch(settings.PDL, "0")
    assert tuned("early") == pdl.PDL_OFF
    set_switch(settings.PDL, None)
    assert tuned("early") == pdl.PDL_EARLY
    set_switch(settings.PDL, "sometimes")
    with pytest.raises(ValueError, match="MOE_LORA_PDL='sometimes'"):
        caller(None)
    with pytest.raises(ValueError, match="PDL setting"):  # a bad config value fails when the config is made
        tiny_config(True).replace(pdl="sometimes")
    set_switch(settings.PDL, None)
    assert not pdl.pdl_supported(torch.device("cpu"))
    assert pdl.supported_mode(torch.device("cpu"), pdl.PDL_LATE) == pdl.PDL_OFF
    if DEVICE == "cpu":  # the interpreter never uses PDL, whatever the device
        assert pdl.supported_mode(torch.device("cuda"), pdl.PDL_LATE) == pdl.PDL_OFF
    on = pdl.LaunchChain(pdl.PDL_LATE)
    assert [on.next(), on.next(), on.next()] == [{"USE_PDL": 2}] + [{"USE_PDL": 2, "launch_pdl": True}] * 2
    off = pdl.LaunchChain(pdl.PDL_OFF)
    assert [off.next(), off.next()] == [{"USE_PDL": 0}] * 2
    # MOE_LORA_EARLY_SHRINK (default on): a kernel whose successor overlaps it triggers early, in a late chain only
    for early in (None, "0", "1"):
        set_switch(settings.EARLY_SHRINK, early)
        trigger = pdl.PDL_LATE if early == "0" else pdl.PDL_EARLY
        late = pdl.LaunchChain(pdl.PDL_LATE)
        assert [late.next(next_overlaps=True), late.next(), late.next(next_overlaps=True)] == [
            {"USE_PDL": trigger}, {"USE_PDL": 2, "launch_pdl": True}, {"USE_PDL": trigger, "launch_pdl": True}]
        for mode in (pdl.PDL_OFF, pdl.PDL_EARLY):  # nothing to move in these
            assert pdl.LaunchChain(mode).next(next_overlaps=True) == {"USE_PDL": mode}
    set_switch(settings.EARLY_SHRINK, "sometimes")
    with pytest.raises(ValueError, match="MOE_LORA_EARLY_SHRINK"):
        pdl.LaunchChain(pdl.PDL_LATE).next(next_overlaps=True)


def test_hot_path_switches_are_read_once(set_switch, monkeypatch):
    """MOE_LORA_PDL is read at its first use and kept: changing the environment later changes nothing until
    settings.reload()."""
    from moe_lora_compile import settings
    from moe_lora_compile.ops.triton.configs import requested_pdl
    set_switch(settings.PDL, "early")
    assert requested_pdl(None, passed_by_caller=True) == 1
    monkeypatch.setenv(settings.PDL.name, "0")  # not re-read
    assert requested_pdl(None, passed_by_caller=True) == 1
    settings.reload()
    assert requested_pdl(None, passed_by_caller=True) == 0


def test_pdl_requested_without_support_is_ignored():
    """A config asking for PDL where it is unsupported (the interpreter) gives the same result as without."""
    args, kwargs = kernel_case(T=2, k=2, L=2, lora="alternate").make(DEVICE)
    for per_pair in (False, True):
        cfg = tiny_config(per_pair, per_pair)
        y = fused_moe_lora_triton(*args, **kwargs, config=cfg)
        y_pdl = fused_moe_lora_triton(*args, **kwargs, config=cfg.replace(pdl=True))
        torch.testing.assert_close(y_pdl, y, rtol=0, atol=0)


@pytest.mark.parametrize("T,k,E,L,block_m", [
    (1, 1, 4, 1, 16),    # one pair
    (9, 3, 5, 3, 16),    # several experts and slots, partial blocks
    (40, 1, 2, 2, 16),   # 40 pairs on 2 experts: several blocks per expert
])
def test_routing_groups_pairs_per_expert_and_slot(T, k, E, L, block_m):
    g = torch.Generator().manual_seed(T)
    topk_ids = torch.randint(0, E, (T, k), generator=g, dtype=torch.int32)
    lora_ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
    r = sort_pairs(topk_ids, lora_ids, E, L, block_m)
    num_blocks = int(r.num_blocks)
    assert r.grid_m == max_blocks(T * k, E, block_m) >= num_blocks
    rows = r.row_pair.view(r.grid_m, block_m)[:num_blocks]
    real = rows[rows >= 0]
    assert sorted(real.tolist()) == list(range(T * k))  # every pair exactly once
    assert (r.row_pair.view(r.grid_m, block_m)[num_blocks:] == -1).all()
    assert torch.equal(r.row_pair[r.pair_row.long()], torch.arange(T * k, dtype=torch.int32))  # the inverse map
    flat_experts = topk_ids.reshape(-1).long()
    flat_slots = lora_ids.long().repeat_interleave(k)
    expected_blocks = sum(-(-int((flat_experts == e).sum()) // block_m) for e in range(E))
    assert num_blocks == expected_blocks
    for b in range(num_blocks):
        pairs = rows[b][rows[b] >= 0].long()
        assert len(pairs) > 0
        assert (flat_experts[pairs] == int(r.block_expert[b])).all()  # one expert per block
    # inside an expert's rows, slots ascend (-1 first): few distinct slots per block
    for e in range(E):
        sel = r.block_expert[:num_blocks] == e
        pairs = rows[sel].reshape(-1)
        slots = flat_slots[pairs[pairs >= 0].long()]
        assert (slots[1:] >= slots[:-1]).all()


@pytest.mark.parametrize("per_token", [False, True], ids=["block_shrink", "token_shrink"])
@pytest.mark.parametrize("T,n_in,n_out,lora,bias,split_k", [
    (1, 32, 16, "random", False, 1),   # one token
    (19, 32, 48, "mixed", True, 1),    # two row blocks, every other token -1, bias
    (5, 40, 24, "random", False, 1),   # in/out not multiples of 16: masked K and N
    (6, 32, 16, "none", True, 1),      # all -1: base linear + bias only
    (7, 32, 16, "one_slot", False, 1),  # every token on one slot (L = 1)
    (9, 48, 32, "mixed_ranks", False, 1),  # slots of real rank 2, 5, 8 zero-padded to R = 8, one token per slot, -1s
    (1, 64, 16, "random", True, 4),    # decode split-K: 4 K slices summed by the last program, bias once
    (19, 48, 48, "mixed", True, 2),    # split-K over two row blocks and three column tiles (counter per tile)
    (5, 40, 24, "random", False, 3),   # split-K with a ragged last slice (40 = 16 + 16 + 8) and masked N
    (6, 32, 16, "none", False, 2),     # split-K, all -1: no LoRA in any slice
])
def test_lora_linear_kernel_matches_loop(T, n_in, n_out, lora, bias, split_k, per_token):
    g = torch.Generator().manual_seed(7)
    L, R = (1 if lora == "one_slot" else 3), 8
    x = torch.randn(T, n_in, generator=g)
    weight = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    a, b = torch.randn(L, R, n_in, generator=g) * n_in ** -0.5, torch.randn(L, n_out, R, generator=g)
    ids = torch.randint(0, L, (T,), generator=g, dtype=torch.int32)
    if lora == "none":
        ids[:] = -1
    elif lora == "mixed":
        ids[::2] = -1
    elif lora == "mixed_ranks":
        for slot, rank in enumerate((2, 5, 8)):
            a[slot, rank:] = 0
            b[slot, :, rank:] = 0
        ids = torch.tensor([0, 1, 2, -1, 2, 1, 0, -1, 1], dtype=torch.int32)
    b_vec = torch.randn(n_out, generator=g) if bias else None
    cfg = {"BLOCK_M": 16, "gemm": dict(asdict(_GEMM), SPLIT_K=split_k),
           "shrink": dict(asdict(_SHRINK), per_token=per_token)}
    y = lora_linear_triton(*(t.to(DEVICE) for t in (x, weight, a, b, ids)),
                           bias=None if b_vec is None else b_vec.to(DEVICE), config=cfg)
    ref = lora_linear_oracle(x, weight, a, b, ids, bias=b_vec)
    torch.testing.assert_close(y.cpu().double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,n_in,n_out,block_n", [
    (5, 2880, 4096, 64),  # GPT-OSS q just past the GEMV sizes: 64 column tiles, split-K to ~2 programs per SM
    (5, 2880, 512, 32),  # k/v: 16 narrow tiles; split-K capped by 2 K steps a slice
    (8, 2048, 5120, 64),  # a fused q/k/v output at batch 8
    (64, 2048, 2048, 64),  # the largest decode batch: 4 row blocks
    (65, 2048, 512, 64),  # past decode sizes: block shrink, 64-wide tiles, no split
])
def test_default_linear_config(T, n_in, n_out, block_n):
    """Decode-sized batches past the GEMV sizes (``test_lora_gemv.py``) get the per-token shrink (K split to fill the
    SMs about twice, in at most ROWS_SHRINK_MAX_SPLIT slices) and a split-K GEMM whose programs fill the SMs about
    twice (unless K runs out of 2-step slices); larger batches the block shrink and no split."""
    from moe_lora_compile.ops.triton.configs import ROWS_SHRINK_MAX_SPLIT
    from moe_lora_compile.ops.triton.launch import default_linear_config

    cfg = default_linear_config(T, n_in, n_out, num_sms=132)
    gemm = cfg.gemm
    assert not cfg.gemv
    assert gemm.BLOCK_N == block_n
    assert cfg.per_token == (T <= 64)
    if T <= 64:
        assert cfg.shrink.SPLIT_K == min(-(-2 * 132 // T), -(-n_in // 128), ROWS_SHRINK_MAX_SPLIT)
        programs = -(-T // cfg.BLOCK_M) * -(-n_out // block_n) * gemm.SPLIT_K
        assert programs >= 2 * 132 or gemm.SPLIT_K in (1, -(-n_in // (2 * gemm.BLOCK_K)))
    else:
        assert gemm.SPLIT_K == 1


# ----------------------------------------------------------------------------------------------------------------
# GPU: bf16 at real shapes, through the op
# ----------------------------------------------------------------------------------------------------------------

# Item 3 of issue 11: a non-finite value in one slot must not reach rows of other slots (nor -1 rows) that share
# a block with that slot's rows. T=8, E=2, k=1: every block holds rows of slots 0, 1 (poisoned), 2 and -1.
_POISON_IDS = [0, 1, -1, 2, 1, 0, -1, 1]


@pytest.mark.parametrize("path", [(False, False), (False, True)], ids=["sorted", "sorted-fused"])  # sorted blocks (several slots per block), w2 shrink fused
@pytest.mark.parametrize("name,value", [("b13", float("inf")), ("b2", float("nan")), ("a13", float("inf")),
                                        ("a2", -float("inf"))])
def test_nonfinite_slot_stays_in_its_rows(name, value, path):
    c = kernel_case(T=8, E=2, k=1, L=3, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True)
    args, kwargs = c.make(DEVICE)
    args = list(args)
    args[3] = torch.tensor(_POISON_IDS, dtype=torch.int32, device=DEVICE)
    ref = oracle(args, kwargs)
    pos = {"a13": 6, "b13": 7, "a2": 8, "b2": 9}[name]
    args[pos] = args[pos].clone()
    args[pos][1] = value
    y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(*path)).cpu().double()
    others = torch.tensor(_POISON_IDS) != 1
    torch.testing.assert_close(y[others], ref[others], rtol=1e-4, atol=1e-4)
    # the poisoned adapter's own rows: non-finite exactly where the float64 oracle's are (GPT-OSS's clamp keeps a
    # NaN a NaN, as torch.clamp does; it once made those rows finite and wrong)
    poisoned_ref = oracle(args, kwargs)
    assert not torch.isfinite(poisoned_ref[~others]).all()
    torch.testing.assert_close(torch.isfinite(y).all(dim=1), torch.isfinite(poisoned_ref).all(dim=1))


def test_lora_linear_nonfinite_slot_stays_in_its_rows():
    g = torch.Generator().manual_seed(3)
    n_in, n_out, L, R = 32, 16, 3, 8
    x, weight = torch.randn(8, n_in, generator=g), torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    a, b = torch.randn(L, R, n_in, generator=g), torch.randn(L, n_out, R, generator=g)
    ids = torch.tensor(_POISON_IDS, dtype=torch.int32)
    ref = lora_linear_oracle(x, weight, a, b, ids)  # on the clean weights
    b[1, 0, 0] = float("inf")
    cfg = {"BLOCK_M": 16, "gemm": asdict(_GEMM), "shrink": asdict(_SHRINK)}
    y = lora_linear_triton(*(t.to(DEVICE) for t in (x, weight, a, b, ids)), config=cfg).cpu().double()
    others = ids != 1
    torch.testing.assert_close(y[others], ref[others], rtol=1e-4, atol=1e-4)
    assert not torch.isfinite(y[ids == 1]).all()  # the poisoned adapter's own rows do see it


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", [GPT_OSS_20B, QWEN3_30B_A3B], ids=lambda g: g.name)
@pytest.mark.parametrize("T,L,R,lora", [
    (1, 4, 16, "all"),           # decode: per-pair path
    (8, 4, 64, "alternate"),     # small batch, half the tokens without adapter
    (128, 16, 64, "all"),        # sorted path, many slots per block
    (2048, 4, 16, "alternate"),  # prefill-sized: big blocks
])
def test_gpu_bf16_real_shapes(geometry, T, L, R, lora):
    c = MoECase.of_geometry(geometry, T, L, R, lora)
    args, kwargs = c.make("cuda", dtype=torch.bfloat16)
    y = torch.ops.moe_lora.fused_moe_lora(*args, **kwargs)
    ref = moe_lora_oracle(*args, **kwargs)
    assert y.dtype == torch.bfloat16 and y.shape == (T, c.H)
    assert _rel_err(y, ref) < 1e-2
    # the LoRA delta itself is right, not only drowned in the base output
    no_lora = list(args)
    no_lora[3] = torch.full_like(args[3], -1)
    y0 = torch.ops.moe_lora.fused_moe_lora(*no_lora, **kwargs)
    ref0 = moe_lora_oracle(*no_lora, **kwargs)
    assert _rel_err(y.float() - y0.float(), ref - ref0) < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", [GPT_OSS_20B, QWEN3_30B_A3B], ids=lambda g: g.name)
@pytest.mark.parametrize("T,L,R,lora", [
    (1, 4, 32, "all"),           # decode: per-pair path, fused shrink2 (45 slices for GPT-OSS at 64-wide tiles)
    (8, 8, 32, "alternate"),     # sorted path, several slots per block
])
def test_gpu_bf16_w2_sum_in_loop(geometry, T, L, R, lora):
    """``w2_sum_in_loop`` at real shapes: the same result as the default (the rank-vector slices summed after the
    main loop), both against the oracle."""
    from moe_lora_compile.ops.triton.configs import get_config

    c = MoECase.of_geometry(geometry, T, L, R, lora)
    args, kwargs = c.make("cuda", dtype=torch.bfloat16)
    cfg = get_config(args[0].device, c.E, c.H, c.I, R, T, c.k)
    ref = moe_lora_oracle(*args, **kwargs)
    for sum_in_loop in (False, True):
        y = fused_moe_lora_triton(*args, **kwargs, config=cfg.replace(w2_sum_in_loop=sum_in_loop))
        assert _rel_err(y, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 256])  # decode (per-pair path), a batch on the sorted path
def test_gpu_bf16_vllm_gptoss_layout(T):
    """GPT-OSS-20B's MoE as vLLM stores it (``interleaved``: w13 [E, 2I, H], gate/up rows alternating)."""
    c = replace(MoECase.of_geometry(GPT_OSS_20B, T, 4, 32, "alternate"), layout="interleaved")
    args, kwargs = c.make("cuda", dtype=torch.bfloat16)
    y = torch.ops.moe_lora.fused_moe_lora(*args, **kwargs)
    assert _rel_err(y, moe_lora_oracle(*args, **kwargs)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_fp32_edge_cases(case):
    """The CPU rows on the GPU, fp32 (ieee dots), all kernel paths of PATHS."""
    args, kwargs = case.make("cuda")
    for path in [p.values[0] for p in PATHS]:
        y = fused_moe_lora_triton(*args, **kwargs, config=tiny_config(*path))
        torch.testing.assert_close(y.cpu().double(), oracle(args, kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_pdl_available_on_sm90():
    """On SM90+ with this Triton, PDL is detected (not silently off)."""
    import triton

    from moe_lora_compile.ops.triton.pdl import pdl_supported, triton_has_pdl
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs SM90+")
    assert triton_has_pdl(), f"triton {triton.__version__} lacks gdc_wait / launch_pdl: PDL is off"
    assert pdl_supported(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", [GPT_OSS_20B, QWEN3_30B_A3B], ids=lambda g: g.name)
@pytest.mark.parametrize("T", [1, 3, 8, 32])
def test_gpu_pdl_and_topk_sum_variants_agree(geometry, T):
    """bf16, real shapes: PDL on == PDL off bit for bit; the per-pair path with the fused top-k sum and with w2 +
    torch sum, and the sorted path, all match the fp32 reference."""
    from moe_lora_compile.ops.triton.configs import get_config
    c = MoECase.of_geometry(geometry, T, L=4, R=16, lora="alternate")
    args, kwargs = c.make("cuda", dtype=torch.bfloat16)
    ref = moe_lora_oracle(*args, **kwargs)
    base = get_config(args[0].device, c.E, c.H, c.I, c.R, T, c.k)
    variants = [base.replace(per_pair=True, fuse_shrink2=True, fuse_topk_sum=fuse) for fuse in (True, False)]
    if T > 1:
        variants.append(base.replace(per_pair=False))
    for cfg in variants:
        y_off = fused_moe_lora_triton(*args, **kwargs, config=cfg.replace(pdl=False))
        y_on = fused_moe_lora_triton(*args, **kwargs, config=cfg.replace(pdl=True))
        torch.cuda.synchronize()
        assert torch.equal(y_on, y_off), cfg
        assert y_on.dtype == torch.bfloat16 and y_on.shape == (T, c.H)
        assert _rel_err(y_on, ref) < 1e-2, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("geometry", [GPT_OSS_20B, QWEN3_30B_A3B], ids=lambda g: g.name)
@pytest.mark.parametrize("T,per_pair", [(1, True), (3, True), (8, False)])
def test_gpu_split_k_variants_agree(geometry, T, per_pair):
    """bf16, real shapes: w13 split-K (and w2 split-K in the per-pair top-k sum) match the fp32 reference, repeat
    bit for bit, and give the same bits with PDL on and off."""
    from moe_lora_compile.ops.triton.configs import get_config
    c = MoECase.of_geometry(geometry, T, L=4, R=16, lora="alternate")
    args, kwargs = c.make("cuda", dtype=torch.bfloat16)
    ref = moe_lora_oracle(*args, **kwargs)
    base = get_config(args[0].device, c.E, c.H, c.I, c.R, T, c.k)
    base = base.replace(per_pair=per_pair, fuse_shrink2=per_pair, BLOCK_M=16)
    for split13, split2 in ((1, 1), (3, 1), (8, 2), (2, 4)):
        cfg = base.replace(**{"w13.SPLIT_K": split13, "w2.SPLIT_K": split2})
        y = fused_moe_lora_triton(*args, **kwargs, config=cfg.replace(pdl=False))
        y_again = fused_moe_lora_triton(*args, **kwargs, config=cfg.replace(pdl=False))
        y_pdl = fused_moe_lora_triton(*args, **kwargs, config=cfg.replace(pdl=True))
        torch.cuda.synchronize()
        assert torch.equal(y, y_again) and torch.equal(y, y_pdl), (split13, split2)
        assert _rel_err(y, ref) < 1e-2, (split13, split2)


def _kernel_cache_size(kernel) -> int:
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:
        return sum(len(v[0]) for v in caches.values())
    return sum(len(v) for v in kernel.cache.values())


@pytest.mark.gpu
def test_gpu_new_token_count_does_not_recompile():
    from moe_lora_compile.ops.triton import moe_kernels, routing
    kernels = (moe_kernels.moe_w13_kernel, moe_kernels.moe_w2_kernel, moe_kernels.lora_shrink_kernel,
               moe_kernels.lora_shrink_pairs_kernel, routing._count_kernel, routing._offsets_kernel,
               routing._scatter_kernel)
    c = MoECase.of_geometry(QWEN3_30B_A3B, 40, 4, 16, "alternate")
    cfg = None
    # sorted path at T=40..64, then the per-pair path (fused top-k sum) at T=1..5, same config each
    for T, per_pair in ((40, False), (41, False), (57, False), (64, False), (1, True), (2, True), (3, True),
                        (5, True)):
        args, kwargs = replace(c, T=T).make("cuda", dtype=torch.bfloat16)
        if cfg is None:
            from moe_lora_compile.ops.triton.configs import default_config
            cfg = default_config(c.E, c.H, c.I, c.R, T, c.k)
            cfg_pp = cfg.replace(per_pair=True, fuse_shrink2=True, fuse_topk_sum=True)
            fused_moe_lora_triton(*args, **kwargs, config=cfg)
            fused_moe_lora_triton(*(a[:4] for a in args[:4]), *args[4:], **kwargs, config=cfg_pp)
            before = [_kernel_cache_size(k) for k in kernels]
        fused_moe_lora_triton(*args, **kwargs, config=cfg_pp if per_pair else cfg)
    torch.cuda.synchronize()
    assert [_kernel_cache_size(k) for k in kernels] == before


@pytest.mark.gpu
@pytest.mark.parametrize("T,n_in,n_out,L,R", [
    (300, 2048, 4096, 4, 64),  # prefill-sized: block shrink, no split-K
    (1, 2880, 5120, 8, 32),    # GPT-OSS fused q/k/v at batch 1: per-token shrink, split-K GEMM
    (8, 4096, 2880, 8, 32),    # GPT-OSS o at batch 8: 8 adapters over 8 rows, split-K
    (64, 2880, 512, 8, 32),    # GPT-OSS k at the largest decode batch: narrow output, 4 row blocks
])
def test_gpu_lora_linear_bf16(T, n_in, n_out, L, R):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, n_in, generator=g)
    w = torch.randn(n_out, n_in, generator=g) * n_in ** -0.5
    a, b = torch.randn(L, R, n_in, generator=g) * n_in ** -0.5, torch.randn(L, n_out, R, generator=g) * R ** -0.5
    ids = torch.randint(-1, L, (T,), generator=g, dtype=torch.int32)
    bias = torch.randn(n_out, generator=g)
    y = torch.ops.moe_lora.lora_linear(*(t.cuda().bfloat16() for t in (x, w, a, b)), ids.cuda(),
                                       bias=bias.cuda().bfloat16())
    from moe_lora_compile.ops.reference import lora_linear_reference
    ref = lora_linear_reference(*(t.bfloat16().double() for t in (x, w, a, b)), ids,
                                bias=bias.bfloat16().double())
    assert _rel_err(y.cpu(), ref) < 1e-2
    none = torch.full_like(ids, -1)  # the LoRA delta alone (base-only run subtracted) is right too
    y0 = torch.ops.moe_lora.lora_linear(*(t.cuda().bfloat16() for t in (x, w, a, b)), none.cuda(),
                                        bias=bias.cuda().bfloat16())
    ref0 = lora_linear_reference(*(t.bfloat16().double() for t in (x, w, a, b)), none, bias=bias.bfloat16().double())
    assert _rel_err(y.cpu().double() - y0.cpu().double(), ref - ref0) < 5e-2


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # sorted path (default heuristic at T=24), GPT-OSS layout with biases
    kernel_case(T=24, H=64, I=32, E=8, k=2, L=2, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True),
    # per-pair path (T=1), concat, half -1
    kernel_case(T=1, H=64, I=32, E=8, k=2, L=2, lora="alternate"),
])
def test_gpu_opcheck(case):
    args, kwargs = case.make("cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.moe_lora.fused_moe_lora.default, args, kwargs,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))
    x, ids = args[0], args[3]
    w, a, b = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16), args[6][:, 0], args[9][:, 0, :48]
    torch.library.opcheck(torch.ops.moe_lora.lora_linear.default, (x, w, a.contiguous(), b.contiguous(), ids),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_tuner_coordinates():
    """The tuner's split-K and PDL coordinates: w2 split-K only on the per-pair path; every candidate differs
    from the config it varies in that coordinate alone."""
    from moe_lora_compile.ops.triton import tune
    from moe_lora_compile.ops.triton import configs
    g = QWEN3_30B_A3B
    per_pair = configs.default_config(g.E, g.H, g.I, 16, 1, g.k)
    sorted_cfg = configs.default_config(g.E, g.H, g.I, 16, 512, g.k)
    assert [c.w13.SPLIT_K for c in tune._candidates(per_pair, 1, g, "w13.SPLIT_K")] == [1, 2, 3, 4, 6, 8]
    assert [c.w2.SPLIT_K for c in tune._candidates(per_pair, 1, g, "w2.SPLIT_K")] == [1, 2, 3, 4, 6, 8]
    assert all(c.replace(**{"w13.SPLIT_K": 1}) == per_pair for c in tune._candidates(per_pair, 1, g, "w13.SPLIT_K"))
    assert list(tune._candidates(sorted_cfg, 512, g, "w2.SPLIT_K")) == []
    pdl = list(tune._candidates(per_pair, 1, g, "pdl"))
    assert [c.pdl for c in pdl] == [False, "late", "early"]
    assert all(c.replace(pdl=None) == per_pair for c in pdl)
    assert set(tune.GROUPS) >= {"w13.SPLIT_K", "w2.SPLIT_K", "pdl"}


def test_config_lookup_buckets_and_fallback(monkeypatch):
    """Tuned entry of the largest T bucket <= T (smallest below all), nearest tuned rank, heuristic otherwise: other
    shapes, and T from twice the largest bucket on (an entry tuned at T=32 ran MXFP4's
    T=512 layer 1.3x slower than the heuristic on an H100)."""
    from moe_lora_compile.ops.triton import configs
    heuristic = configs.default_config(8, 64, 32, 16, 1, 2)
    t1, t32 = heuristic.replace(BLOCK_M=32), heuristic.replace(BLOCK_M=64)  # two entries told apart by BLOCK_M
    tuned = {configs.shape_key(8, 64, 32, 16): {"1": t1, "32": t32}}
    monkeypatch.setattr(configs, "_load", lambda name: tuned)
    cpu = torch.device("cpu")
    assert configs.get_config(cpu, 8, 64, 32, 16, 1, 2) == t1
    assert configs.get_config(cpu, 8, 64, 32, 16, 31, 2) == t1
    assert configs.get_config(cpu, 8, 64, 32, 16, 63, 2) == t32
    for T in (64, 4096):  # twice the largest bucket or more: the heuristic of that T
        assert configs.get_config(cpu, 8, 64, 32, 16, T, 2) == configs.default_config(8, 64, 32, 16, T, 2)
    mx_tuned = {configs.shape_key(8, 64, 32, 16, mxfp4=True): {"1": t1, "32": t32}}
    monkeypatch.setattr(configs, "_load", lambda name: mx_tuned)
    assert configs.get_config(cpu, 8, 64, 32, 16, 512, 2, mxfp4=True) == configs.default_mxfp4_config(
        8, 64, 32, 16, 512, 2)
    assert configs.get_config(cpu, 8, 64, 32, 16, 33, 2, mxfp4=True) == t32
    monkeypatch.setattr(configs, "_load", lambda name: tuned)
    assert configs.get_config(cpu, 8, 64, 32, 64, 32, 2) == t32  # R=64 bucket missing: nearest rank
    fallback = configs.get_config(cpu, 8, 128, 32, 16, 1, 2)  # other layer shape: heuristic
    assert fallback == configs.default_config(8, 128, 32, 16, 1, 2) and fallback.per_pair


def test_shipped_configs_are_complete():
    """Every shipped JSON entry parses as its config (MoE tables: MoEKernelConfig; ``*_linear.json``, the
    lora_linear tables: LinearKernelConfig), with every key the launcher reads and none it does not know, and
    survives a round trip through its JSON form."""
    import json

    from moe_lora_compile.ops.triton.configs import CONFIG_DIR, LinearKernelConfig, read_linear_table, read_table
    files = sorted(CONFIG_DIR.glob("*.json"))
    assert files and any(p.name.endswith("_linear.json") for p in files)
    for path in files:
        linear = path.name.endswith("_linear.json")
        table = read_linear_table(path) if linear else read_table(path)
        assert sum(map(len, table.values())) == sum(map(len, json.loads(path.read_text()).values()))
        for buckets in table.values():
            for cfg in buckets.values():
                if linear:
                    assert LinearKernelConfig.of(cfg.to_dict()) == cfg
                else:
                    assert MoEKernelConfig.from_dict(cfg.to_dict()) == cfg


def test_config_from_dict_names_bad_keys():
    """The dict form: unknown or missing keys are a ValueError naming them; defaults fill the optional keys."""
    d = tiny_config(True).to_dict()
    assert MoEKernelConfig.from_dict(d) == tiny_config(True)
    with pytest.raises(ValueError, match=r"unknown keys \['BLOCK_Q'\]"):
        MoEKernelConfig.from_dict(dict(d, BLOCK_Q=4))
    with pytest.raises(ValueError, match=r"missing keys \['BLOCK_N'\]"):
        MoEKernelConfig.from_dict(dict(d, w13={k: v for k, v in d["w13"].items() if k != "BLOCK_N"}))
    minimal = {k: v for k, v in d.items() if k in ("per_pair", "BLOCK_M", "w13", "w2", "shrink")}
    assert MoEKernelConfig.from_dict(minimal).fuse_shrink2 is True  # default: per_pair
