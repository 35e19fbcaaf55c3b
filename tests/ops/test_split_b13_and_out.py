"""Two forms of ``fused_moe_lora`` that vLLM's MoE LoRA needs (issue 12):

- the split gate/up B13 (``lora_b13_split=True``: ``lora_b13 [L,E,2I,R/2]``, gate rows on rank entries
  ``[0, R/2)``, up rows on ``[R/2, R)``), with a w2 rank ``R2`` of its own. Checked against the float64 oracle
  given the equivalent block-diagonal ``[L,E,2I,R]`` B13 (built here from the layout's gate/up rows), for the
  reference (CPU op, gradients) and the Triton kernels (interpreter on CPU, float32, tiny shapes; GPU bf16);
- the ``out=`` form ``torch.ops.moe_lora.fused_moe_lora_out(out, ...)``: ``out`` receives ``y`` in place (on the
  Triton path the kernel's own final write, no copy).

Plus the contract errors of both, and opcheck.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from support.cases import MoECase
from support.oracle import INTERLEAVED, moe_lora_oracle

import moe_lora_compile as mlc

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def block_diagonal(b_split: torch.Tensor, layout: str) -> torch.Tensor:
    """Split B13 ``[L,E,2I,r]`` -> the full ``[L,E,2I,2r]`` it stands for: gate rows (``0::2`` interleaved, else the
    first I) on rank columns ``[0, r)``, up rows on ``[r, 2r)``, zeros elsewhere."""
    L, E, two_i, r = b_split.shape
    full = b_split.new_zeros(L, E, two_i, 2 * r)
    if INTERLEAVED[layout]:
        full[:, :, 0::2, :r], full[:, :, 1::2, r:] = b_split[:, :, 0::2], b_split[:, :, 1::2]
    else:
        i = two_i // 2
        full[:, :, :i, :r], full[:, :, i:, r:] = b_split[:, :, :i], b_split[:, :, i:]
    return full


def split_problem(case: MoECase, R2: int, device: str = "cpu", dtype=None):
    """``case``'s arguments with a split B13 ``[L,E,2I,R/2]`` (R = case.R) and w2 stacks of rank ``R2`` ->
    ``(args, kwargs)`` of the split form and ``full_args``: the same problem with the block-diagonal B13."""
    args, kwargs = case.make(device, dtype=dtype)
    g = torch.Generator().manual_seed(case.T * 131 + R2)
    L, E, H, I, r = case.L, case.E, case.H, case.I, case.R // 2
    like = dict(dtype=args[0].dtype)
    b13 = (torch.randn(L, E, 2 * I, r, generator=g) * r ** -0.5).to(**like).to(device)
    a2 = (torch.randn(L, E, R2, I, generator=g) * I ** -0.5).to(**like).to(device)
    b2 = (torch.randn(L, E, H, R2, generator=g) * R2 ** -0.5).to(**like).to(device)
    split = (*args[:7], b13, a2, b2)
    full = (*args[:7], block_diagonal(b13, case.layout), a2, b2)
    return split, dict(kwargs, lora_b13_split=True), full, kwargs


def oracle(full_args, kwargs):
    return moe_lora_oracle(*full_args, **kwargs).cpu()


SPLIT_CASES = [
    # concat (Qwen3-MoE), -1 rows and every slot mixed, w2 rank smaller than w13's
    pytest.param(MoECase(T=6, H=32, I=16, L=3, R=8, lora="mixed", topk_dtype=torch.int32), 4, id="concat-R8-R2=4"),
    # vLLM's GPT-OSS rows interleaved, biases, clamp; w2 rank larger than w13's
    pytest.param(MoECase(T=5, H=32, I=16, L=2, R=4, layout="interleaved", activation="gptoss_swiglu", bias=True,
                         limit=0.5, lora="alternate", topk_dtype=torch.int32), 6, id="interleaved-R4-R2=6"),
    # transposed layouts read B13 the same way (their w13 strides differ); R=2: one rank each
    pytest.param(MoECase(T=4, H=32, I=16, L=2, R=2, layout="transposed_interleaved", lora="mixed",
                         topk_dtype=torch.int32), 2, id="transposed-interleaved-R2"),
    pytest.param(MoECase(T=4, H=32, I=16, L=2, R=6, layout="transposed_concat", lora="all",
                         topk_dtype=torch.int32), 3, id="transposed-concat-R6"),
]


@pytest.mark.parametrize("case, R2", SPLIT_CASES)
def test_split_reference_matches_block_diagonal_oracle(case, R2):
    split, kwargs, full, full_kwargs = split_problem(case, R2)
    y = mlc.fused_moe_lora(*split, **kwargs)
    torch.testing.assert_close(y.double(), oracle(full, full_kwargs), rtol=1e-5, atol=1e-5)
    base = mlc.fused_moe_lora(*split[:3], torch.full_like(split[3], -1), *split[4:], **kwargs)
    assert (y - base).abs().max() > 1e-2  # the LoRA terms count at this tolerance
    no_lora = split[3] < 0
    assert torch.equal(y[no_lora], base[no_lora])  # -1 rows: exactly the base result


def test_split_gradients_are_the_block_diagonal_ones():
    """Autograd through the split form = the full form's gradients, B13's restricted to its non-zero blocks."""
    case = MoECase(T=5, H=16, I=8, L=2, R=4, layout="interleaved", lora="mixed")
    split, kwargs, full, full_kwargs = split_problem(case, 3)
    grads = {}
    for name, args, kw in (("split", split, kwargs), ("full", full, full_kwargs)):
        args = [t.clone().requires_grad_(i in (0, 2, 6, 7, 8, 9)) for i, t in enumerate(args)]
        mlc.fused_moe_lora(*args, **kw).square().sum().backward()
        grads[name] = [args[i].grad for i in (0, 2, 6, 7, 8, 9)]
    for i, (g_split, g_full) in enumerate(zip(*grads.values())):
        if i == 3:  # B13: the full form's gradient on the blocks the split form has
            blocks = block_diagonal(torch.ones_like(g_split), case.layout) != 0
            g_split, g_full = block_diagonal(g_split, case.layout), torch.where(blocks, g_full, 0.0)
        torch.testing.assert_close(g_split, g_full, rtol=1e-5, atol=1e-6)


def tiny_config(per_pair, fuse_shrink2=False, fuse_topk_sum=True, split13=1, split2=1):
    from moe_lora_compile.ops.triton.configs import GemmConfig, MoEKernelConfig, ShrinkConfig
    gemm = GemmConfig(BLOCK_N=16, BLOCK_K=16, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
    return MoEKernelConfig(per_pair=per_pair, fuse_shrink2=fuse_shrink2, fuse_topk_sum=fuse_topk_sum, BLOCK_M=16,
                           w13=replace(gemm, SPLIT_K=split13), w2=replace(gemm, SPLIT_K=split2),
                           shrink=ShrinkConfig(BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=1))


KERNEL_PATHS = [
    pytest.param((False, False), id="sorted"),                    # routed blocks, separate w2 shrink (rank R2)
    pytest.param((True, True, True, 2, 2), id="per-pair-fused-split-k"),  # w2 shrink fused into w13 (rank R2),
                                                                  # split-K, top-k sum in the w2 kernel
]


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("case, R2", SPLIT_CASES[:2])
def test_split_kernel_matches_block_diagonal_oracle(case, R2, path):
    """The w13 expand's masked B13 tile (gate columns on rank rows [0, R/2), up on [R/2, R)) for concat
    (two tiles) and interleaved (one tile, alternating columns); -1 rows and mixed slots; R2 != R."""
    from moe_lora_compile.ops.triton.launch import fused_moe_lora_triton
    split, kwargs, full, full_kwargs = split_problem(case, R2, DEVICE)
    y = fused_moe_lora_triton(*split, **kwargs, config=tiny_config(*path))
    torch.testing.assert_close(y.cpu().double(), oracle(full, full_kwargs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path, k, columns", [
    pytest.param((True, True), 2, False, id="per-pair-topk-sum"),   # the w2 kernel's top-k sum writes out's rows
    pytest.param((False, False), 1, False, id="sorted-k1"),         # k = 1: the w2 kernel's rows are out's rows
    pytest.param((False, False), 2, False, id="sorted-torch-sum"),  # the sorted path's torch sum writes into out
    pytest.param((True, True), 2, True, id="column-major-out"),     # out.stride(-1) != 1: computed, then copied
])
def test_kernel_writes_into_out(path, k, columns):
    from moe_lora_compile.ops.triton.launch import fused_moe_lora_triton
    case = MoECase(T=5, H=32, I=16, k=k, L=2, R=8, lora="mixed", topk_dtype=torch.int32)
    split, kwargs, full, full_kwargs = split_problem(case, 8, DEVICE)
    if columns:
        storage = torch.full((40, 5), float("nan"), device=DEVICE)
        out = storage[4:36].t()
    else:
        storage = torch.full((5, 40), float("nan"), device=DEVICE)
        out = storage[:, 4:36]  # rows of stride 40: a view, as vLLM's workspace hands over
    got = fused_moe_lora_triton(*split, **kwargs, out=out, config=tiny_config(*path))
    assert got is out
    torch.testing.assert_close(out.cpu().double(), oracle(full, full_kwargs), rtol=1e-4, atol=1e-4)
    assert storage.isnan().sum() == storage.numel() - out.numel()  # nothing outside out written


@pytest.mark.parametrize("case", [
    MoECase(T=5),  # concat, mixed adapters
    MoECase(T=4, layout="interleaved", activation="gptoss_swiglu", bias=True),  # vLLM's GPT-OSS, biases
    MoECase(T=0),  # empty batch: out stays as it was
], ids=MoECase.label)
def test_out_op_writes_the_ops_result(case):
    args, kwargs = case.make(DEVICE)
    want = torch.ops.moe_lora.fused_moe_lora(*args, **kwargs)
    out = torch.full_like(want, float("nan"))
    assert mlc.fused_moe_lora(*args, **kwargs, out=out) is out
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case, R2", SPLIT_CASES[:2])
def test_opcheck_split_form(case, R2):
    split, kwargs, _, _ = split_problem(case, R2)
    split = tuple(t.clone().requires_grad_(i in (0, 2, 6, 7, 8, 9)) for i, t in enumerate(split))
    torch.library.opcheck(torch.ops.moe_lora.fused_moe_lora.default, split, kwargs, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("form", ["full", "split"])
def test_opcheck_out_op(form):
    case = MoECase(T=5, layout="interleaved", activation="gptoss_swiglu", bias=True)
    if form == "split":
        args, kwargs, _, _ = split_problem(replace(case, R=4), 2, DEVICE)
    else:
        args, kwargs = case.make(DEVICE)
    out = torch.empty(case.T, case.H, device=DEVICE)
    torch.library.opcheck(torch.ops.moe_lora.fused_moe_lora_out.default, (out, *args), kwargs,
                          test_utils=OPCHECK_TESTS)


def test_out_op_under_compile():
    """torch.compile(fullgraph) of the out= form: functionalized, no graph break, same values."""
    args, kwargs = MoECase(T=5).make()
    want = mlc.fused_moe_lora(*args, **kwargs)

    def step(out, *args):
        mlc.fused_moe_lora(*args, **kwargs, out=out)
        return out

    out = torch.zeros_like(want)
    torch.compile(step, fullgraph=True, backend="aot_eager")(out, *args)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def _escaped(message):
    return message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")


def _b13_error_case(kind):
    """-> (args, kwargs) of one contract error of the split form."""
    case = MoECase(T=4, R=4)
    split, kwargs, full, full_kwargs = split_problem(case, 4)
    if kind == "odd-rank":  # R = 3 cannot be cut into gate / up halves
        a13 = split[6][:, :, :3]
        return (*split[:6], a13, split[7][..., :1], *split[8:]), kwargs
    if kind == "full-B13-flagged-split":  # a [.., 2I, R] B13 with the flag: not guessed, refused
        return full, kwargs
    return split, full_kwargs  # "split-B13-not-flagged": a [.., 2I, R/2] B13 without the flag


@pytest.mark.parametrize("kind, message", [
    ("odd-rank", "lora_b13_split=True needs an even lora_a13 rank R"),
    ("full-B13-flagged-split", "lora_b13 must have shape [L, E, 2I, R/2] = [3, 4, 24, 2] matching lora_a13 (R = 4) "
                               "with lora_b13_split=True"),
    ("split-B13-not-flagged", "gate and up rows apart, is the split form: pass lora_b13_split=True"),
])
def test_split_form_contract_errors(kind, message):
    args, kwargs = _b13_error_case(kind)
    with pytest.raises(ValueError, match=_escaped(message)):
        mlc.fused_moe_lora(*args, **kwargs)


def test_out_form_refuses_inputs_that_require_grad():
    args, kwargs = MoECase(T=4).make()
    x = args[0].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"out=\) is inference only"):
        mlc.fused_moe_lora(x, *args[1:], **kwargs, out=torch.empty(4, 16))
    with torch.no_grad():  # serving: fine
        mlc.fused_moe_lora(x, *args[1:], **kwargs, out=torch.empty(4, 16))


@pytest.mark.parametrize("make_out, error, message", [
    (lambda y: y[:-1], ValueError, "out must have shape [T, H] = [4, 16] like x"),  # a row short
    (lambda y: y.t(), ValueError, "out must have shape [T, H] = [4, 16] like x"),    # transposed
    (lambda y: y.double(), TypeError, "out must have x's dtype torch.float32, got torch.float64"),
    (lambda y: y[None], ValueError, "out must be 2-D"),
    # every token's row in one place (an expanded [1, H]): the kernels would write them all there
    (lambda y: y[:1].expand(4, 16), ValueError, "out must not overlap itself"),
    (lambda y: y.requires_grad_(True), ValueError, "out requires grad"),  # autograd cannot see the write
])
def test_out_contract_errors(make_out, error, message):
    args, kwargs = MoECase(T=4).make()
    out = make_out(torch.empty(4, 16))
    with pytest.raises(error, match=_escaped(message)):
        mlc.fused_moe_lora(*args, **kwargs, out=out)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("T", [1, 8, 256])  # decode (per-pair path, fused top-k sum), small batch, sorted path
def test_gpu_bf16_split_form_and_out_at_qwen3_shape(layout, T):
    """Qwen3-30B-A3B's MoE shape in bf16: the split form written into ``out`` against the oracle of the
    block-diagonal problem, and against the op on that full-rank problem."""
    from moe_lora_compile.shapes import QWEN3_30B_A3B
    case = replace(MoECase.of_geometry(QWEN3_30B_A3B, T, L=4, R=32, lora="alternate"), layout=layout)
    split, kwargs, full, full_kwargs = split_problem(case, 16, "cuda", dtype=torch.bfloat16)
    out = torch.empty(T, case.H, device="cuda", dtype=torch.bfloat16)
    mlc.fused_moe_lora(*split, **kwargs, out=out)
    ref = moe_lora_oracle(*full, **full_kwargs)
    assert (out.double() - ref).norm() / ref.norm() < 1e-2
    y_full = mlc.fused_moe_lora(*full, **full_kwargs)
    torch.testing.assert_close(out, y_full, rtol=2e-2, atol=2e-2)
