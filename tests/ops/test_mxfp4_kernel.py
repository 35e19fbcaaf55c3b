"""``fused_moe_lora_mxfp4``: the Triton kernels' in-register MXFP4 decode and the op (contract, reference, fake,
opcheck, attach) against dequantize-then-oracle in float64.

CPU: the kernels in Triton's interpreter (float32 activations, tiny shapes, 32-wide K blocks: one scale group per
K step or two); GPU (``-m gpu``): bf16 at GPT-OSS-20B's shapes, CUDA-graph capture, an attached model.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from support.cases import TOLERANCES, MoECase
from support.oracle import moe_lora_oracle
from support.ranks import poison_moe

from moe_lora_compile.models.mxfp4_gpt_oss import GptOssMxfp4Experts, build_mxfp4_gpt_oss
from moe_lora_compile.models.tiny import tiny_config as tiny_model_config
from moe_lora_compile.ops import fused_moe_lora_mxfp4
from moe_lora_compile.ops.mxfp4 import dequantize_mxfp4, fused_moe_lora_mxfp4_reference, quantize_mxfp4
from moe_lora_compile.ops.triton.configs import GemmConfig, MoEKernelConfig, ShrinkConfig
from moe_lora_compile.ops.triton.launch import fused_moe_lora_mxfp4_triton
from moe_lora_compile.ops.triton.mxfp4_kernels import decode_mxfp4
from moe_lora_compile.shapes import GPT_OSS_20B

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


# ---------------------------------------------------------------------------------------------------------------
# the decode alone: every byte value under every scale byte


@triton.jit
def _decode_kernel(blocks_ptr, scales_ptr, out_ptr, BLOCK_N: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """blocks [BLOCK_N, 16] + scales [BLOCK_N] (one 32-input group per row) -> out [32, BLOCK_N] in OUT_DTYPE."""
    offs_n = tl.arange(0, BLOCK_N)
    packed = tl.load(blocks_ptr + offs_n[:, None] * 16 + tl.arange(0, 16)[None, :])
    scale = tl.load(scales_ptr + offs_n[:, None])
    w = decode_mxfp4(packed, scale, OUT_DTYPE, BLOCK_N, 32)
    tl.store(out_ptr + tl.arange(0, 32)[:, None] * BLOCK_N + offs_n[None, :], w)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _check_decode(dtype):
    """Rows: 16 rows of byte values 0..255 under each scale byte 0..255. Same bits as transformers'
    ``convert_moe_packed_tensors`` everywhere, fp32 subnormal results (scale bytes 0 and 1) and overflow to inf
    (scale bytes near 255) included."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    scales = torch.arange(256, dtype=torch.uint8).repeat_interleave(16)  # [4096]
    blocks = torch.arange(256, dtype=torch.uint8).reshape(16, 16).repeat(256, 1)  # [4096, 16]
    out = torch.empty(32, 4096, dtype=dtype, device=DEVICE)
    _decode_kernel[(1,)](blocks.to(DEVICE), scales.to(DEVICE), out, BLOCK_N=4096, OUT_DTYPE=_TL_DTYPES[dtype])
    expected = convert_moe_packed_tensors(blocks[None, :, None].clone(), scales[None, :, None].clone(),
                                          dtype=dtype)[0]  # [32, 4096]
    exact32 = dequantize_mxfp4(blocks[None, :, None], scales[None, :, None], torch.float32)[0]
    subnormal = (exact32 != 0) & (exact32.abs() < 2.0 ** -126)
    assert subnormal.any() and exact32.isinf().any()  # the edge cases are in the rows
    assert torch.equal(out.cpu().view(_INT_VIEW[dtype]), expected.view(_INT_VIEW[dtype]))


def test_decode_bit_exact_for_every_byte_and_scale():
    _check_decode(torch.float32)  # the interpreter: fp32 only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_decode_bit_exact_for_every_byte_and_scale(dtype):
    _check_decode(dtype)


# ---------------------------------------------------------------------------------------------------------------
# the kernels in the interpreter against dequantize-then-oracle

_GEMM = GemmConfig(BLOCK_N=16, BLOCK_K=32, GROUP_SIZE_M=2, num_warps=4, num_stages=1)
_SHRINK = ShrinkConfig(BLOCK_K=16, SPLIT_K=2, num_warps=4, num_stages=1)


def _config(per_pair: bool, split_k: int = 1, block_k: int = 32) -> MoEKernelConfig:
    gemm = GemmConfig(**{**_GEMM.__dict__, "SPLIT_K": split_k, "BLOCK_K": block_k})
    return MoEKernelConfig(per_pair=per_pair, fuse_shrink2=per_pair, fuse_topk_sum=True, BLOCK_M=16, w13=gemm,
                           w2=gemm, shrink=_SHRINK)


def _case(**fields) -> MoECase:
    base = dict(T=5, H=64, I=64, E=4, k=2, L=3, R=16, layout="transposed_interleaved", activation="gptoss_swiglu",
                bias=True, topk_dtype=torch.int32)
    return MoECase(**{**base, **fields})


def _quantized(case, device=DEVICE, dtype=None):
    """(args with w13/w2 replaced by None, kwargs, w13 Mxfp4Weight, w2 Mxfp4Weight, dense-args fn)."""
    args, kwargs = case.make(device, dtype=dtype)
    w13, w2 = quantize_mxfp4(args[4].float()), quantize_mxfp4(args[5].float())

    def dense(weight_dtype):
        return (*args[:4], w13.dequantize(weight_dtype), w2.dequantize(weight_dtype), *args[6:])

    return args, kwargs, w13, w2, dense


KERNEL_CASES = [
    # GPT-OSS (interleaved gate/up, biases, clamped swiglu), tokens with -1 and mixed slots
    pytest.param(_case(T=6, lora="mixed"), id="gptoss-mixed-minus-one"),
    # experts 1 and 3 get no pair
    pytest.param(_case(T=5, experts=(0, 2), lora="alternate"), id="empty-experts"),
    # every token on expert 0 (k=1): 17 pairs > BLOCK_M, two blocks of one expert
    pytest.param(_case(T=17, k=1, routing="one_expert", lora="all"), id="all-tokens-one-expert"),
    # H = 96 with 64-wide K blocks: a masked half-block (one scale group) at the end of w13's K; I = 32
    pytest.param(_case(T=4, H=96, I=32, limit=0.5), id="uneven-K-clamp"),
    # Llama-4-style transposed concat (gate and up rows apart), routing weight on the input, silu
    pytest.param(_case(T=5, layout="transposed_concat", activation="silu", bias=False, routing_weight_on_input=True,
                       k=1), id="transposed-concat"),
    # per-slot ranks zero-padded to R
    pytest.param(_case(T=6, ranks=(16, 3, 7)), id="mixed-ranks"),
]


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair"])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_matches_dequantized_oracle(case, per_pair):
    args, kwargs, w13, w2, dense = _quantized(case)
    block_k = 64 if case.H == 96 else 32
    y = fused_moe_lora_mxfp4_triton(*args[:4], w13.blocks, w13.scales, w2.blocks, w2.scales, *args[6:], **kwargs,
                                    config=_config(per_pair, block_k=block_k))
    assert y.shape == (case.T, case.H) and y.dtype == torch.float32
    expected = moe_lora_oracle(*dense(torch.float64), **kwargs).cpu()
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("per_pair", [False, True], ids=["sorted", "per-pair"])
def test_kernel_split_k(per_pair):
    """w13 split-K (and w2's inside the per-pair top-k sum): K slices of whole 32-input groups."""
    case = _case(T=3, H=96, I=64, lora="mixed")
    args, kwargs, w13, w2, dense = _quantized(case)
    y = fused_moe_lora_mxfp4_triton(*args[:4], w13.blocks, w13.scales, w2.blocks, w2.scales, *args[6:], **kwargs,
                                    config=_config(per_pair, split_k=3))
    torch.testing.assert_close(y.cpu().double(), moe_lora_oracle(*dense(torch.float64), **kwargs).cpu(),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["sorted", "per-pair", "op"])
def test_lora_ranks_stop_at_each_slots_rank(path):
    """``lora_ranks`` on the MXFP4 op and kernels: slots of w13 ranks 16/3/0 and w2 ranks 5/16/8 with NaN past
    each rank equal the oracle on zero-padded stacks (kernels in the interpreter, the op's CPU reference)."""
    case = _case(T=6, lora="mixed")
    args, kwargs, w13, w2, dense = _quantized(case, device=DEVICE if path != "op" else "cpu")
    ranks = torch.tensor([[16, 3, 0], [5, 16, 8]], dtype=torch.int32, device=args[0].device)
    clean, dirty = poison_moe(dense(torch.float32), ranks[0].tolist(), ranks[1].tolist())
    quantized = (*dirty[:4], w13.blocks, w13.scales, w2.blocks, w2.scales, *dirty[6:])
    if path == "op":
        y = torch.ops.moe_lora.fused_moe_lora_mxfp4(*quantized, **kwargs, lora_ranks=ranks)
    else:
        y = fused_moe_lora_mxfp4_triton(*quantized, **kwargs, lora_ranks=ranks, config=_config(path == "per-pair"))
    expected = moe_lora_oracle(*(t.double() if t.is_floating_point() else t for t in clean), **kwargs).cpu()
    torch.testing.assert_close(y.cpu().double(), expected, rtol=1e-4, atol=1e-4)


def test_kernel_is_not_reading_float_weights():
    """The quantization error shows: the kernel's output differs from the oracle on the unquantized weights."""
    args, kwargs, w13, w2, _ = _quantized(_case(T=4))
    y = fused_moe_lora_mxfp4_triton(*args[:4], w13.blocks, w13.scales, w2.blocks, w2.scales, *args[6:], **kwargs,
                                    config=_config(True))
    assert not torch.allclose(y.cpu().double(), moe_lora_oracle(*args, **kwargs).cpu(), atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# the op: reference, contract, fake impl, opcheck


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_op_equals_dequantize_then_oracle(dtype):
    args, kwargs, w13, w2, dense = _quantized(_case(T=6), device="cpu", dtype=dtype)
    y = fused_moe_lora_mxfp4(*args[:4], w13, w2, *args[6:], **kwargs)
    assert y.dtype == dtype and y.shape == (6, 64)
    torch.testing.assert_close(y, fused_moe_lora_mxfp4_reference(*args[:4], w13, w2, *args[6:], **kwargs),
                               rtol=0, atol=0)
    torch.testing.assert_close(y.double(), moe_lora_oracle(*dense(torch.float64), **kwargs), **TOLERANCES[dtype])


def _op_args(case):
    args, kwargs, w13, w2, _ = _quantized(case, device="cpu")
    return (*args[:4], w13.blocks, w13.scales, w2.blocks, w2.scales, *args[6:]), kwargs


@pytest.mark.parametrize("case", [
    _case(T=4),  # GPT-OSS with biases
    _case(T=4, layout="transposed_concat", activation="silu", bias=False, routing_weight_on_input=True, k=1),
    _case(T=0),  # empty batch
    _case(T=4, ranks=(16, 3, 7)),  # with lora_ranks (below)
], ids=MoECase.label)
def test_opcheck(case):
    args, kwargs = _op_args(case)
    if case.ranks is not None:
        kwargs = {**kwargs, "lora_ranks": torch.tensor([case.ranks, case.ranks[::-1]], dtype=torch.int32)}
    grads = {0, 2, 8, 9, 10, 11}  # x, topk_weights, the LoRA stacks
    args = tuple(t.clone().requires_grad_(True) if i in grads else t for i, t in enumerate(args))
    torch.library.opcheck(torch.ops.moe_lora.fused_moe_lora_mxfp4.default, args, kwargs, test_utils=OPCHECK_TESTS)


def test_gradients_equal_the_dense_ops():
    """Gradients (x, routing weights, LoRA) equal those of fused_moe_lora on the dequantized weights."""
    args, kwargs = _op_args(_case(T=4, H=32, I=32))
    dense_args = (*args[:4], dequantize_mxfp4(args[4], args[5], torch.float32),
                  dequantize_mxfp4(args[6], args[7], torch.float32), *args[8:])
    grads = []
    for op, a, positions in ((torch.ops.moe_lora.fused_moe_lora_mxfp4, args, (0, 2, 8, 9, 10, 11)),
                             (torch.ops.moe_lora.fused_moe_lora, dense_args, (0, 2, 6, 7, 8, 9))):
        a = [t.clone().requires_grad_(True) if i in positions else t for i, t in enumerate(a)]
        op(*a, **kwargs).square().sum().backward()
        grads.append([a[i].grad for i in positions])
    for g_mx, g_dense in zip(*grads):
        torch.testing.assert_close(g_mx, g_dense, rtol=1e-6, atol=1e-6)


def _bad(index, value):
    def change(args):
        args = list(args)
        args[index] = value(args[index])
        return args
    return change


@pytest.mark.parametrize("change,error,match", [
    (_bad(4, lambda b: b.view(torch.int8)), TypeError, "w13_blocks"),  # int8 blocks
    (_bad(7, lambda s: s.float()), TypeError, "w2_scales"),  # float scales
    (_bad(5, lambda s: s[:, :-1]), ValueError, "w13_scales"),  # scales of fewer rows than the blocks
    (_bad(4, lambda b: b[..., :8]), ValueError, "w13_blocks"),  # 8 bytes per group
    (_bad(6, lambda b: b[:, :, :1]), ValueError, "w2_blocks"),  # w2 K groups do not match (scales neither)
    (_bad(4, lambda b: b.flatten(2)), ValueError, "w13_blocks"),  # 3-D blocks (transformers 5.24's [E, N, K/2])
    (_bad(8, lambda a: a[:, :, :, :32]), ValueError, "lora_a13"),  # LoRA of another H
    # w13 of fewer experts than w2 (and its scales): the error names the blocks, not the dense shape behind them
    (lambda a: _bad(5, lambda s: s[:-1])(_bad(4, lambda b: b[:-1])(a)), ValueError, "w2_blocks must have as many experts"),
    # w2 of an I other than w13's 2I / 2
    (lambda a: _bad(7, lambda s: s[:, :, :-1])(_bad(6, lambda b: b[:, :, :-1])(a)), ValueError, "2I = w13_blocks"),
], ids=["int8-blocks", "float-scales", "scales-rows", "bytes-per-group", "w2-groups", "3d-blocks", "lora-H",
        "experts-differ", "w2-I"])
def test_bad_arguments_are_refused(change, error, match):
    args, kwargs = _op_args(_case(T=3))
    with pytest.raises(error, match=match):
        torch.ops.moe_lora.fused_moe_lora_mxfp4(*change(args), **kwargs)


def test_non_transposed_layout_is_refused():
    args, kwargs = _op_args(_case(T=3))
    with pytest.raises(ValueError, match="transposed"):
        torch.ops.moe_lora.fused_moe_lora_mxfp4(*args, **{**kwargs, "layout": "interleaved"})


def test_fake_impl_under_dynamic_compile():
    """torch.compile(dynamic=True) traces the op through its fake impl: one graph for two batch sizes."""
    args, kwargs = _op_args(_case(T=5))
    args7, _ = _op_args(_case(T=7))
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm

    fn = torch.compile(lambda *a: torch.ops.moe_lora.fused_moe_lora_mxfp4(*a, **kwargs), backend=backend,
                       dynamic=True, fullgraph=True)
    for a in (args, args7):
        torch.testing.assert_close(fn(*a), torch.ops.moe_lora.fused_moe_lora_mxfp4(*a, **kwargs))
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------------------------
# attach keeps a quantized GPT-OSS quantized


def _quantized_and_dense_models(device):
    """A tiny MXFP4 GPT-OSS and transformers' dense GPT-OSS holding the same weights dequantized (fp32)."""
    from transformers import GptOssForCausalLM, Mxfp4Config

    config = tiny_model_config("gpt_oss", hidden_size=64, intermediate_size=64,
                               quantization_config=Mxfp4Config().to_dict())
    quantized = build_mxfp4_gpt_oss(config, dtype=torch.float32, device=device)
    dense_config = tiny_model_config("gpt_oss", hidden_size=64, intermediate_size=64)
    dense = GptOssForCausalLM(dense_config).to(device).eval()
    state = {}
    for name, value in quantized.state_dict().items():
        if name.endswith("_blocks"):
            stem = name[: -len("_blocks")]
            state[stem] = dequantize_mxfp4(value, quantized.state_dict()[stem + "_scales"], torch.float32)
        elif not name.endswith("_scales"):
            state[name] = value
    dense.load_state_dict(state)
    return quantized, dense


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attach_quantized_gpt_oss_equals_dequantized_model(device):
    import moe_lora_compile as mlc
    from moe_lora_compile.adapters import ExpertsLoRA, LinearLoRA

    quantized, dense = _quantized_and_dense_models(device)
    mq = mlc.attach(quantized, max_loras=2, max_rank=8)
    md = mlc.attach(dense, max_loras=2, max_rank=8)
    experts = [m for m in mq.model.modules() if isinstance(m, GptOssMxfp4Experts)]
    assert len(experts) == 2 and len(mq.slots.experts_modules) == 2
    floats = [n for n, p in mq.model.named_parameters() if p.dim() == 3]
    assert not floats, f"dense copies of the experts: {floats}"
    g = torch.Generator().manual_seed(0)
    factors = {}
    for name, m in mq.slots.experts_modules.items():
        E, H, I, r = 4, 64, 64, 4
        factors[name] = ExpertsLoRA(*(torch.randn(*s, generator=g) * 0.3 for s in
                                      ((E, r, H), (E, 2 * I, r), (E, r, I), (E, H, r))))
    for name, m in mq.slots.linear_modules.items():
        factors[name] = LinearLoRA(torch.randn(4, m.in_features, generator=g) * 0.3,
                                   torch.randn(m.out_features, 4, generator=g) * 0.3)
    for mm in (mq, md):
        mm.load_adapter_weights("a", factors)
    tokens = torch.randint(3, 128, (2, 6), generator=g).to(device)
    with torch.no_grad():
        yq = mq(tokens, adapters=["a", None]).logits
        yd = md(tokens, adapters=["a", None]).logits
        y_base = md(tokens).logits
    torch.testing.assert_close(yq, yd, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(yd[0], y_base[0], atol=1e-3)  # the adapter changes sequence 0


# ---------------------------------------------------------------------------------------------------------------
# configs: MXFP4 entries apart from bf16 ones, the tuner's MXFP4 coordinates


def test_mxfp4_config_entries_are_apart_from_bf16_ones(monkeypatch):
    """An MXFP4 call reads only ``,W=mxfp4`` entries (nearest tuned rank among them), a bf16 call only the plain
    ones; either falls back to its own heuristic."""
    from moe_lora_compile.ops.triton import configs
    bf16_entry = configs.default_config(8, 64, 32, 16, 1, 2).replace(BLOCK_M=32)
    mx_entry = configs.default_mxfp4_config(8, 64, 32, 64, 1, 2).replace(BLOCK_M=64)
    tuned = {configs.shape_key(8, 64, 32, 16): {"1": bf16_entry},
             configs.shape_key(8, 64, 32, 64, mxfp4=True): {"1": mx_entry}}
    assert configs.shape_key(8, 64, 32, 64, mxfp4=True) == "E=8,H=64,I=32,R=64,W=mxfp4"
    monkeypatch.setattr(configs, "_load", lambda name: tuned)
    cpu = torch.device("cpu")
    assert configs.get_config(cpu, 8, 64, 32, 16, 1, 2) == bf16_entry
    assert configs.get_config(cpu, 8, 64, 32, 64, 1, 2) == bf16_entry  # bf16 R=64 missing: nearest bf16 rank
    assert configs.get_config(cpu, 8, 64, 32, 16, 1, 2, mxfp4=True) == mx_entry  # nearest MXFP4 rank
    del tuned[configs.shape_key(8, 64, 32, 16)]
    assert configs.get_config(cpu, 8, 64, 32, 16, 1, 2) == configs.default_config(8, 64, 32, 16, 1, 2)
    assert configs.get_config(cpu, 8, 96, 32, 16, 1, 2, mxfp4=True) == configs.default_mxfp4_config(
        8, 96, 32, 16, 1, 2)


@pytest.mark.parametrize("H,block_k", [(2880, 64), (4096, 128), (96, 32)])  # GPT-OSS; a multiple of 128; of 32 only
def test_default_mxfp4_config_tiles(H, block_k):
    from moe_lora_compile.ops.triton.configs import default_mxfp4_config
    cfg = default_mxfp4_config(32, H, H, 16, 1, 4)
    assert (cfg.w13.BLOCK_K, cfg.w2.BLOCK_K, cfg.w13.BLOCK_N) == (block_k, block_k, 32)
    assert H % cfg.w13.BLOCK_K == 0  # no K mask in the decode loop


def test_tuner_mxfp4_coordinates():
    """--mxfp4 searches K tiles up to 256 and puts the GEMM coordinates first; bf16 keeps its K choices."""
    from moe_lora_compile.ops.triton import tune
    from moe_lora_compile.ops.triton.configs import default_mxfp4_config
    g = GPT_OSS_20B
    cfg = default_mxfp4_config(g.E, g.H, g.I, 16, 1, g.k)
    assert [c.w13.BLOCK_K for c in tune._candidates(cfg, 1, g, "w13.BLOCK_K", mxfp4=True)] == [64, 128, 256]
    assert [c.w2.BLOCK_K for c in tune._candidates(cfg, 1, g, "w2.BLOCK_K")] == list(tune.GEMM_CHOICES["BLOCK_K"])
    assert set(tune.MXFP4_GROUPS) == set(tune.GROUPS) and tune.MXFP4_GROUPS[1].startswith("w13.")
    assert tune.main(["--model", "qwen3-30b-a3b", "--mxfp4"]) == 2  # CPU here; on a GPU: not a transposed layout


# ---------------------------------------------------------------------------------------------------------------
# GPU: GPT-OSS-20B's shapes in bf16, CUDA graphs


def _rel_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("T,L,R,lora", [
    (1, 4, 16, "all"),           # decode: per-pair path (w2 + top-k sum fused)
    (8, 4, 64, "alternate"),     # small batch, half the tokens without adapter
    (32, 16, 16, "mixed"),       # sorted path at decode size, many slots
    (128, 16, 64, "mixed"),      # sorted path, many slots per block
    (512, 4, 16, "alternate"),   # prefill-sized
])
def test_gpu_gpt_oss_20b_bf16(T, L, R, lora):
    case = MoECase.of_geometry(GPT_OSS_20B, T, L, R, lora)
    args, kwargs, w13, w2, dense = _quantized(case, device="cuda", dtype=torch.bfloat16)
    y = fused_moe_lora_mxfp4(*args[:4], w13, w2, *args[6:], **kwargs)
    assert y.dtype == torch.bfloat16 and y.shape == (T, case.H)
    ref = moe_lora_oracle(*dense(torch.float32), **kwargs)
    assert _rel_err(y, ref) < 1e-2
    no_lora = list(args)
    no_lora[3] = torch.full_like(args[3], -1)
    y0 = fused_moe_lora_mxfp4(*no_lora[:4], w13, w2, *args[6:], **kwargs)
    ref0 = moe_lora_oracle(*no_lora[:4], *dense(torch.float32)[4:6], *args[6:], **kwargs)
    assert _rel_err(y.float() - y0.float(), ref - ref0) < 5e-2  # the LoRA delta itself


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 8, 32, 512])  # per-pair decode path; sorted path at decode, small, prefill sizes
def test_gpu_cuda_graph_replay_equals_eager(T):
    case = MoECase.of_geometry(GPT_OSS_20B, T, 4, 16, "alternate")
    args, kwargs, w13, w2, _ = _quantized(case, device="cuda", dtype=torch.bfloat16)
    static = [a.clone() for a in args]
    call = lambda a: fused_moe_lora_mxfp4(*a[:4], w13, w2, *a[6:], **kwargs)  # noqa: E731
    graph, y_static = _capture(lambda: call(static))
    fresh, _ = MoECase.of_geometry(GPT_OSS_20B, T, 4, 16, "mixed").make("cuda", dtype=torch.bfloat16)
    for i in (0, 1, 2, 3):  # new tokens, routing, weights, adapter ids
        static[i].copy_(fresh[i])
    graph.replay()
    torch.testing.assert_close(y_static, call(static), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("T,per_pair,block_n,block_k,split_k", [
    (1, True, 16, 256, 1),    # the tuner's widest K tile (H = 2880: a masked last K step), narrow columns
    (1, True, 32, 128, 4),    # split-K over the decode (w13 partial sums, w2 inside the top-k sum); masked K
    (32, False, 64, 128, 1),  # sorted path, 128-wide K
    (32, False, 128, 64, 1),  # sorted path, wide column tiles
])
def test_gpu_mxfp4_tuner_tiles(T, per_pair, block_n, block_k, split_k):
    """The K tiles and splits ``tune --mxfp4`` may pick, at GPT-OSS-20B's shapes, against dequantize-then-oracle."""
    from moe_lora_compile.ops.triton.configs import default_mxfp4_config
    case = MoECase.of_geometry(GPT_OSS_20B, T, 4, 16, "mixed")
    args, kwargs, w13, w2, dense = _quantized(case, device="cuda", dtype=torch.bfloat16)
    g = GPT_OSS_20B
    cfg = default_mxfp4_config(g.E, g.H, g.I, 16, T, g.k).replace(
        per_pair=per_pair, fuse_shrink2=per_pair, **{f"{w}.{key}": value for w in ("w13", "w2") for key, value in
                                                     (("BLOCK_N", block_n), ("BLOCK_K", block_k),
                                                      ("SPLIT_K", split_k))})
    y = fused_moe_lora_mxfp4_triton(*args[:4], w13.blocks, w13.scales, w2.blocks, w2.scales, *args[6:], **kwargs,
                                    config=cfg)
    assert _rel_err(y, moe_lora_oracle(*dense(torch.float32), **kwargs)) < 1e-2
