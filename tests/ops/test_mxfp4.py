"""MXFP4 experts (moe_lora_compile.ops.mxfp4, models.mxfp4_gpt_oss) against transformers' own MXFP4 code, a brute-force
nearest-code search and the float64 loop reference."""

import pytest
import torch
import triton
import triton.language as tl
from support.cases import TOLERANCES, MoECase
from support.oracle import moe_lora_oracle

from transformers import AutoModelForCausalLM

import moe_lora_compile as mlc
from moe_lora_compile import ops
from moe_lora_compile.models.mxfp4_gpt_oss import GptOssMxfp4Experts, build_mxfp4_gpt_oss, load_mxfp4_gpt_oss
from moe_lora_compile.models.tiny import tiny_config
from moe_lora_compile.ops.mxfp4 import (FP4_E2M1_VALUES, Mxfp4Weight, dequantize_mxfp4, fused_moe_lora_mxfp4_reference,
                                        gpt_oss_mxfp4_expert_nbytes, mxfp4_nbytes, quantize_mxfp4)
from moe_lora_compile.ops.reference import fused_moe_lora_reference

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    """Bit pattern of a float tensor (so NaN == NaN and -0 != +0 in comparisons)."""
    return t.view(_INT_VIEW[t.element_size()])


def _random_mxfp4(shape, scale_range=(0, 256), seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(*scale_range, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


# ---------------------------------------------------------------------------------------------------------------
# dequantization


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [
    (2, 192, 2),  # gate_up of a tiny model: N = 2I = 192 rows, K = H = 64
    (2, 64, 3),  # down: N = H = 64, K = I = 96
    (1, 8, 90),  # GPT-OSS-20B's K = 2880 (90 groups), a few rows
], ids=["gate_up", "down", "k2880"])
def test_dequantize_bit_exact_vs_transformers(shape, dtype):
    """Every byte value and every scale byte (0..255, so also overflow to inf): same bits as transformers."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(shape)
    expected = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    out = dequantize_mxfp4(blocks, scales, dtype)
    E, N, G = shape
    assert out.shape == (E, G * 32, N) == expected.shape and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(_bits(out), _bits(expected))


def test_dequantize_layout_by_hand():
    """Independent of transformers: byte b of group g in row n holds inputs 32g+2b (low nibble) and 32g+2b+1
    (high nibble); the value lands at [e, k, n]; scale byte s multiplies by 2**(s-127)."""
    blocks = torch.zeros(1, 2, 2, 16, dtype=torch.uint8)
    scales = torch.full((1, 2, 2), 127, dtype=torch.uint8)
    blocks[0, 1, 1, 3] = 0x9F  # row 1, group 1, byte 3: low code 0xF (-6), high code 0x9 (-0.5)
    scales[0, 1, 1] = 129  # x4
    blocks[0, 0, 0, 0] = 0x07  # row 0, input 0: code 7 (6), input 1: code 0
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (1, 64, 2)
    assert out[0, 32 + 6, 1] == -24.0 and out[0, 32 + 7, 1] == -2.0 and out[0, 0, 0] == 6.0
    assert int((out != 0).sum()) == 3
    assert FP4_E2M1_VALUES[8] == 0.0 and str(FP4_E2M1_VALUES[8]) == "-0.0"


@pytest.mark.parametrize("blocks,scales,error", [
    (torch.zeros(2, 4, 1, 16, dtype=torch.int8), torch.zeros(2, 4, 1, dtype=torch.uint8), TypeError),  # int8 blocks
    (torch.zeros(2, 4, 1, 16, dtype=torch.uint8), torch.zeros(2, 4, 1), TypeError),  # float scales
    (torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), ValueError),  # 3-D blocks
    (torch.zeros(2, 4, 1, 15, dtype=torch.uint8), torch.zeros(2, 4, 1, dtype=torch.uint8), ValueError),  # 15 bytes
    (torch.zeros(2, 4, 2, 16, dtype=torch.uint8), torch.zeros(2, 4, 1, dtype=torch.uint8), ValueError),  # scales short
    (torch.zeros(0, 4, 1, 16, dtype=torch.uint8), torch.zeros(0, 4, 1, dtype=torch.uint8), ValueError),  # no experts
])
def test_bad_mxfp4_tensors_are_refused(blocks, scales, error):
    with pytest.raises(error):
        dequantize_mxfp4(blocks, scales)
    with pytest.raises(error):
        Mxfp4Weight(blocks, scales)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64, torch.uint8, torch.float8_e4m3fn, "bf16"],
                         ids=str)
def test_dequantize_refuses_non_float_dtypes(dtype):
    """int32 truncated 0.5 to 0, bool gave all True, complex64 complex values; uint8 / float8 failed inside torch."""
    blocks, scales = torch.zeros(1, 2, 1, 16, dtype=torch.uint8), torch.full((1, 2, 1), 127, dtype=torch.uint8)
    with pytest.raises(TypeError, match="floating dtype"):
        dequantize_mxfp4(blocks, scales, dtype)


# ---------------------------------------------------------------------------------------------------------------
# quantization (test weights)


def _groups(w):
    """[E, K, N] -> [E, N, K/32, 32] float64."""
    E, K, N = w.shape
    return w.double().transpose(1, 2).reshape(E, N, K // 32, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_quantize_nearest_code_minimal_scale(dtype):
    """Every value is a nearest E2M1 multiple of its group's scale (brute force over the 16 codes), the scale is the
    smallest power of two without clipping, and the documented error bound holds."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 64, 40, generator=g, dtype=torch.float64)
    w = w * torch.logspace(-30, 30, 40, dtype=torch.float64)  # columns (rows N) of very different magnitudes
    w[0, :32, 0] = 0.0  # an all-zero group
    w = w.to(dtype)
    if dtype == torch.float32:  # groups of fp32's two smallest subnormals (amax / 6 underflows: byte 126 before)
        w[1, :32, 1] = torch.tensor(2.0 ** -149, dtype=dtype)
        w[1, 32:, 1] = torch.tensor(-(2.0 ** -148), dtype=dtype)
    q = quantize_mxfp4(w)
    assert q.blocks.shape == (3, 40, 2, 16) and q.scales.shape == (3, 40, 2) and q.shape == w.shape
    s = torch.ldexp(torch.ones(q.scales.shape, dtype=torch.float64), q.scales.long() - 127).unsqueeze(-1)
    wg, dq = _groups(w), _groups(q.dequantize(torch.float64))
    amax = wg.abs().amax(-1, keepdim=True)
    assert (amax <= 6 * s).all(), "a value clips"
    assert ((amax > 3 * s) | (q.scales.unsqueeze(-1) == 1)).all(), "the scale is not the smallest power of two"
    grid = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float64)
    best = ((grid * s.unsqueeze(-1)) - wg.unsqueeze(-1)).abs().amin(-1)
    torch.testing.assert_close((dq - wg).abs(), best, atol=0, rtol=1e-12)
    mag = wg.abs() / s
    bound = torch.where(mag < 2, s / 4, torch.where(mag < 4, s / 2, s))
    assert ((dq - wg).abs() <= bound).all()


def test_quantize_relative_error_of_gaussian_weights():
    w = torch.randn(4, 256, 96, generator=torch.Generator().manual_seed(2))
    err = (quantize_mxfp4(w).dequantize(torch.float32) - w).norm() / w.norm()
    assert 0.05 < err < 0.13, f"relative error {err:.3f} outside what 4-bit codes with per-32 scales give"


def test_quantize_ties_round_to_even_code():
    """Midpoints between E2M1 values (scale 1: the group's max is 6) go to the even code, sign kept."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0], dtype=torch.float64)
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0], dtype=torch.float64)
    w = torch.cat([ties, -ties, ties / 2, -ties / 2]).reshape(1, 32, 1)  # one group, amax 6
    out = quantize_mxfp4(w).dequantize(torch.float64).flatten()
    assert torch.equal(out, torch.cat([expected, -expected, expected / 2, -expected / 2]))
    small = torch.zeros(1, 32, 1)
    small[0, 0, 0], small[0, 1, 0] = 6.0, -0.1  # rounds to zero: -0.0, the sign kept
    assert torch.equal(_bits(quantize_mxfp4(small).dequantize(torch.float32)[0, 1]), _bits(torch.tensor([-0.0])))


def test_quantize_dequantize_is_a_fixed_point():
    """Weights that are already MXFP4 values come back unchanged (bit for bit, -0 included)."""
    blocks, scales = _random_mxfp4((2, 24, 3), scale_range=(20, 230), seed=3)
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(_bits(quantize_mxfp4(w).dequantize(torch.float32)), _bits(w))


@pytest.mark.parametrize("w,error", [
    (torch.randn(2, 48, 8), ValueError),  # K = 48 not a multiple of 32
    (torch.randn(64, 8), ValueError),  # 2-D
    (torch.ones(1, 32, 2, dtype=torch.int32), ValueError),  # integer weights
    (torch.full((1, 32, 2), float("nan")), ValueError),  # non-finite
    (torch.full((1, 32, 2), 3e38), ValueError),  # beyond 6 * 2**125: its codes would dequantize to inf
])
def test_quantize_refuses_bad_weights(w, error):
    with pytest.raises(error):
        quantize_mxfp4(w)


def test_byte_counts():
    """The floor's byte count equals the tensors a quantized experts module actually holds."""
    experts = GptOssMxfp4Experts(4, 64, 96, dtype=torch.bfloat16)
    held = sum(t.numel() * t.element_size() for t in list(experts.buffers()) + list(experts.parameters()))
    assert held == 4 * gpt_oss_mxfp4_expert_nbytes(64, 96, bias_itemsize=2)
    assert experts.gate_up.expert_nbytes == mxfp4_nbytes(192, 64) == 192 * 64 // 2 + 192 * 2
    bf16 = 3 * 2880 * 2880 * 2 + (2 * 2880 + 2880) * 2
    assert gpt_oss_mxfp4_expert_nbytes(2880, 2880) == 13_236_480 and 3.7 < bf16 / 13_236_480 < 3.8


def test_experts_load_weights_checks_everything_before_copying():
    """A bias without the expert axis broadcast silently into every expert's row; a plain tuple raised an
    AttributeError; a bad part after a good one left the good one copied. Now: an error naming the part, and the
    module as it was."""
    experts = GptOssMxfp4Experts(4, 64, 96, dtype=torch.float32)
    torch.manual_seed(0)
    gate_up, down = quantize_mxfp4(torch.randn(4, 64, 192)), quantize_mxfp4(torch.randn(4, 96, 64))
    before = {k: v.clone() for k, v in experts.state_dict().items()}
    with pytest.raises(ValueError, match=r"gate_up_proj_bias: expected \[4, 192\], got \[192\]"):
        experts.load_weights(gate_up, down, torch.randn(192), torch.randn(4, 64))
    with pytest.raises(ValueError, match="down_proj_blocks"):
        experts.load_weights(gate_up, quantize_mxfp4(torch.randn(4, 64, 64)))
    with pytest.raises(TypeError, match="down_proj: an Mxfp4Weight"):
        experts.load_weights(gate_up, (down.blocks, down.scales))
    assert all(torch.equal(v, before[k]) for k, v in experts.state_dict().items())
    experts.load_weights(gate_up, down)
    assert torch.equal(experts.gate_up_proj_blocks, gate_up.blocks)


# ---------------------------------------------------------------------------------------------------------------
# the MoE + LoRA reference over MXFP4 experts

MXFP4_CASES = [
    MoECase(T=6, H=64, I=32, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True),  # GPT-OSS
    MoECase(T=6, H=64, I=96, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True,
            dtype=torch.bfloat16),  # bf16 activations and LoRA, several K groups
    MoECase(T=5, H=32, I=64, k=1, lora="none", layout="transposed_interleaved", activation="gptoss_swiglu"),  # base
    MoECase(T=4, H=32, I=32, L=4, R=8, ranks=(8, 2, 5, 1), layout="transposed_interleaved",
            activation="gptoss_swiglu", bias=True),  # per-slot ranks zero-padded
    MoECase(T=5, H=64, I=32, layout="transposed_concat", routing_weight_on_input=True, k=1),  # Llama-4-style layout
    MoECase(T=0, H=32, I=32, layout="transposed_interleaved", activation="gptoss_swiglu"),  # empty batch
]


def _quantized_case(case):
    args, kwargs = case.make()
    w13, w2 = quantize_mxfp4(args[4]), quantize_mxfp4(args[5])
    return args, kwargs, w13, w2


@pytest.mark.parametrize("case", MXFP4_CASES, ids=MoECase.label)
def test_mxfp4_reference_equals_reference_on_dequantized_weights(case):
    args, kwargs, w13, w2 = _quantized_case(case)
    y = fused_moe_lora_mxfp4_reference(*args[:4], w13, w2, *args[6:], **kwargs)
    assert y.shape == (case.T, case.H) and y.dtype == case.dtype
    # exactly the reference on weights dequantized to fp32: MXFP4 values are exact in bf16, so nothing is lost
    dense = (*args[:4], w13.dequantize(torch.float32), w2.dequantize(torch.float32), *args[6:])
    assert torch.equal(y, fused_moe_lora_reference(*dense, **kwargs))
    assert torch.equal(y, mlc.fused_moe_lora(*dense, **kwargs))
    torch.testing.assert_close(y.double(), moe_lora_oracle(*dense, **kwargs), **TOLERANCES[case.dtype])


def test_mxfp4_reference_is_not_the_float_weights():
    """The quantization error reaches the output (the test above would pass with float weights otherwise)."""
    case = MXFP4_CASES[0]
    args, kwargs, w13, w2 = _quantized_case(case)
    y = fused_moe_lora_mxfp4_reference(*args[:4], w13, w2, *args[6:], **kwargs)
    assert not torch.allclose(y, fused_moe_lora_reference(*args, **kwargs), atol=1e-3)


def test_mxfp4_reference_refuses_bad_arguments():
    args, kwargs, w13, w2 = _quantized_case(MXFP4_CASES[0])
    with pytest.raises(ValueError, match="transposed"):
        fused_moe_lora_mxfp4_reference(*args[:4], w13, w2, *args[6:], **{**kwargs, "layout": "concat"})
    with pytest.raises(TypeError, match="Mxfp4Weight"):
        fused_moe_lora_mxfp4_reference(*args[:4], args[4], w2, *args[6:], **kwargs)
    with pytest.raises(ValueError, match="w13"):  # w13 and w2 swapped: shapes disagree
        fused_moe_lora_mxfp4_reference(*args[:4], w2, w13, *args[6:], **kwargs)
    with pytest.raises(TypeError, match="w13: an Mxfp4Weight"):  # the op's wrapper: was an AttributeError
        ops.fused_moe_lora_mxfp4(*args[:4], (w13.blocks, w13.scales), w2, *args[6:], **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# a GPT-OSS model with MXFP4 experts, and transformers loading what it saves


def _mxfp4_config():
    from transformers import Mxfp4Config

    return tiny_config("gpt_oss", hidden_size=64, intermediate_size=96,
                       quantization_config=Mxfp4Config().to_dict())


def test_build_mxfp4_gpt_oss_holds_only_quantized_experts():
    model = build_mxfp4_gpt_oss(_mxfp4_config(), dtype=torch.bfloat16)
    experts = [m for m in model.modules() if isinstance(m, GptOssMxfp4Experts)]
    assert len(experts) == 2
    state = model.state_dict()
    assert state["model.layers.1.mlp.experts.gate_up_proj_blocks"].shape == (4, 192, 2, 16)
    assert state["model.layers.1.mlp.experts.gate_up_proj_scales"].shape == (4, 192, 2)
    assert state["model.layers.1.mlp.experts.down_proj_blocks"].shape == (4, 64, 3, 16)
    assert state["model.layers.1.mlp.experts.down_proj_scales"].dtype == torch.uint8
    assert not [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))], "a float copy"
    assert model.config.quantization_config["quant_method"] == "mxfp4"
    assert all(e.gate_up_proj_bias.abs().sum() > 0 for e in experts)  # random biases, not transformers' zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transformers_loads_the_saved_model_bit_exact(tmp_path, dtype):
    """save_pretrained writes an MXFP4 checkpoint (the real one's tensor names and quantization_config);
    transformers' from_pretrained (no `kernels` package: it dequantizes) gets the same weights bit for bit, and its
    experts and logits match ours."""
    from transformers import GptOssForCausalLM

    ours = build_mxfp4_gpt_oss(_mxfp4_config(), dtype=dtype)
    ours.save_pretrained(tmp_path)
    # transformers 5.17 leaves the dequantized experts bf16 whatever dtype is asked for (5.24 uses dtype): cast them,
    # the values are exact in both
    theirs = GptOssForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval().to(dtype)
    for layer_ours, layer_theirs in zip(ours.model.layers, theirs.model.layers):
        e_ours, e_theirs = layer_ours.mlp.experts, layer_theirs.mlp.experts
        assert not isinstance(e_theirs, GptOssMxfp4Experts)
        assert torch.equal(_bits(e_theirs.gate_up_proj.to(dtype)), _bits(e_ours.gate_up.dequantize(dtype)))
        assert torch.equal(_bits(e_theirs.down_proj.to(dtype)), _bits(e_ours.down.dequantize(dtype)))
        assert torch.equal(e_theirs.down_proj_bias.to(dtype), e_ours.down_proj_bias)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(9, 64, generator=g, dtype=torch.float32).to(dtype)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g).softmax(-1).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    with torch.no_grad():
        torch.testing.assert_close(ours.model.layers[0].mlp.experts(h, ids, weights),
                                   theirs.model.layers[0].mlp.experts(h, ids, weights), **tol)
        tokens = torch.randint(3, 128, (2, 7), generator=g)
        torch.testing.assert_close(ours(tokens).logits, theirs(tokens).logits, **tol)


@pytest.mark.parametrize("change,match", [
    (dict(hidden_size=48), "hidden_size"),  # not a multiple of 32
    (dict(intermediate_size=24), "intermediate_size"),  # the tiny default, not a multiple of 32
    (dict(quantization_config={"quant_method": "fp8"}), "mxfp4"),  # another quantization
])
def test_build_refuses_bad_configs(change, match):
    config = _mxfp4_config()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=match):
        build_mxfp4_gpt_oss(config)


def test_unfused_reference_model_compiles_to_one_graph():
    """attach(use_ops=False) runs the MXFP4 experts through the pure-PyTorch reference: its argument checks (message
    closures) broke the graph at every MoE layer (fullgraph failed; 42 graphs with dynamic=True). Now one graph for
    all shapes >= 2 with dynamic=True, equal to eager."""
    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    mm = mlc.attach(build_mxfp4_gpt_oss(_mxfp4_config(), dtype=torch.float32), max_loras=2, max_rank=4,
                    use_ops=False)
    batches = [torch.randint(3, 128, shape) for shape in [(2, 3), (3, 5)]]
    with torch.no_grad():
        eager = [mm(ids, adapters=None, use_cache=False).logits for ids in batches]
        counter = CompileCounter()
        mm.model.forward = torch.compile(mm.model.forward, backend=counter, fullgraph=True, dynamic=True)
        for ids, want in zip(batches, eager):
            torch.testing.assert_close(mm(ids, adapters=None, use_cache=False).logits, want,
                                       **TOLERANCES[torch.float32])
    assert counter.frame_count == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_load_mxfp4_checkpoint_keeps_the_experts_quantized(tmp_path, dtype):
    """A checkpoint folder (what save_pretrained writes: the real one's names and quantization_config) loads with
    its experts as GptOssMxfp4Experts holding the stored bytes (transformers' from_pretrained dequantizes them):
    every tensor bit-exact, the rotary buffers rebuilt, logits equal to the saved model's, also once attached."""
    saved = build_mxfp4_gpt_oss(_mxfp4_config(), dtype=torch.bfloat16)
    saved.save_pretrained(tmp_path)
    model = load_mxfp4_gpt_oss(str(tmp_path), dtype=dtype)
    experts = [m for m in model.modules() if isinstance(m, GptOssMxfp4Experts)]
    assert len(experts) == 2 and all(e.gate_up_proj_blocks.dtype == torch.uint8 for e in experts)
    assert not [n for n, t in model.state_dict().items() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    want = saved.to(dtype) if dtype != torch.bfloat16 else saved  # (.to casts the fp32 rotary buffers too)
    for key, tensor in want.state_dict().items():
        assert torch.equal(model.state_dict()[key], tensor), key
    assert torch.equal(model.model.rotary_emb.inv_freq, want.model.rotary_emb.inv_freq)
    tokens = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, want(tokens).logits)
        mm, mm_want = (mlc.attach(m, max_loras=2, max_rank=4) for m in (model, want))
        assert torch.equal(mm(tokens, adapters=None).logits, mm_want(tokens, adapters=None).logits)


def test_load_mxfp4_checkpoint_refuses_what_it_cannot_place(tmp_path):
    from safetensors.torch import load_file, save_file

    plain = tmp_path / "plain"
    AutoModelForCausalLM.from_config(tiny_config("gpt_oss", hidden_size=64, intermediate_size=96)).save_pretrained(plain)
    with pytest.raises(ValueError, match="no MXFP4 quantization_config"):
        load_mxfp4_gpt_oss(str(plain))
    with pytest.raises(ValueError, match="model_type 'gpt_oss'"):
        load_mxfp4_gpt_oss(str(_saved(tmp_path / "qwen", tiny_config("qwen3_moe"))))
    folder = tmp_path / "mxfp4"
    build_mxfp4_gpt_oss(_mxfp4_config()).save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    extra = dict(weights, **{"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 64, 192)})  # a dense copy
    save_file(extra, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.0.mlp.experts.gate_up_proj' has no place"):
        load_mxfp4_gpt_oss(str(folder))
    del weights["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks 1 of the model's tensors.*down_proj_scales"):
        load_mxfp4_gpt_oss(str(folder))


def test_load_mxfp4_checkpoint_reads_its_generation_config(tmp_path):
    """The real checkpoints' generation_config.json lists more stop tokens than config.json (<|call|>,
    <|endoftext|>) and do_sample: the loader ignored it, so generation ran past them (what from_pretrained reads)."""
    from transformers import GenerationConfig

    build_mxfp4_gpt_oss(_mxfp4_config()).save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=[2, 112], do_sample=True, temperature=0.7, bos_token_id=1).save_pretrained(tmp_path)
    model = load_mxfp4_gpt_oss(str(tmp_path), dtype=torch.float32)
    assert model.generation_config.eos_token_id == [2, 112] and model.generation_config.do_sample is True
    assert model.generation_config.temperature == 0.7


def test_load_mxfp4_checkpoint_takes_the_stored_bits_only(tmp_path):
    """Blocks / scales are bytes: E8M0 scales stored as float8_e8m0fnu, and blocks or scales stored as int8, load as
    their bits (a value copy turned 2**-7 into the byte 0); float or wide-int copies of them are refused (they were cast
    by value, logits off or NaN), and so are blocks stored as float8_e8m0fnu (E2M1 pairs are not exponents: they
    loaded)."""
    from safetensors.torch import load_file, save_file

    build_mxfp4_gpt_oss(_mxfp4_config()).save_pretrained(tmp_path)
    want = load_mxfp4_gpt_oss(str(tmp_path), dtype=torch.float32)
    weights = load_file(tmp_path / "model.safetensors")
    key = "model.layers.0.mlp.experts.gate_up_proj_scales"
    save_file(dict(weights, **{key: weights[key].view(torch.float8_e8m0fnu)}), tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    got = load_mxfp4_gpt_oss(str(tmp_path), dtype=torch.float32)
    assert torch.equal(got.state_dict()[key], want.state_dict()[key])
    blocks = "model.layers.0.mlp.experts.down_proj_blocks"
    save_file(dict(weights, **{k: weights[k].view(torch.int8) for k in (key, blocks)}), tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    got = load_mxfp4_gpt_oss(str(tmp_path), dtype=torch.float32)
    assert all(torch.equal(got.state_dict()[k], want.state_dict()[k]) for k in (key, blocks))
    for name, bad in ((key, torch.ldexp(torch.ones(weights[key].shape), weights[key].int() - 127)),
                      (key, weights[key].int() - 127), (blocks, weights[blocks].view(torch.float8_e8m0fnu))):
        save_file(dict(weights, **{name: bad.contiguous()}), tmp_path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ValueError, match=f"{name} is torch.(float32|int32|float8_e8m0fnu).*must be uint8"):
            load_mxfp4_gpt_oss(str(tmp_path))


@pytest.mark.parametrize("dtype, want", [("auto", torch.bfloat16), ("float32", torch.float32),
                                         (torch.float16, torch.float16)])
def test_dtype_by_name_or_auto(tmp_path, dtype, want):
    build_mxfp4_gpt_oss(_mxfp4_config(), dtype=torch.bfloat16).save_pretrained(tmp_path)
    assert load_mxfp4_gpt_oss(str(tmp_path), dtype=dtype).lm_head.weight.dtype == want
    assert build_mxfp4_gpt_oss(_mxfp4_config(), dtype=dtype).lm_head.weight.dtype == want
    with pytest.raises(TypeError, match="floating torch.dtype"):
        load_mxfp4_gpt_oss(str(tmp_path), dtype="int8")


def test_quantizing_an_attached_model_is_refused():
    """The slots point at the attached experts modules: swapping them for quantized ones ran every adapter's
    expert LoRA as nothing, silently."""
    from moe_lora_compile.models.mxfp4_gpt_oss import quantize_gpt_oss_experts_

    mm = mlc.attach(AutoModelForCausalLM.from_config(tiny_config("gpt_oss", hidden_size=64, intermediate_size=96)),
                    max_loras=2, max_rank=4)
    with pytest.raises(ValueError, match="quantize the experts before attach"):
        quantize_gpt_oss_experts_(mm.model)


def test_build_leaves_the_callers_config_alone():
    config = tiny_config("gpt_oss", hidden_size=64, intermediate_size=96)
    build_mxfp4_gpt_oss(config)
    assert getattr(config, "quantization_config", None) is None


def _saved(folder, config):
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def test_build_refuses_other_families():
    with pytest.raises(ValueError, match="gpt_oss"):
        build_mxfp4_gpt_oss(tiny_config("qwen3_moe"))


# ---------------------------------------------------------------------------------------------------------------
# a probe of the Triton primitives a kernel's MXFP4 load path would use, on the checkpoint's layout


@triton.jit
def _probe_mxfp4_matmul(a_ptr, blocks_ptr, scales_ptr, out_ptr, K, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_SCALED: tl.constexpr):
    """out [BLOCK_M, N] fp32 = a [BLOCK_M, K] @ W [K, N] for one expert's MXFP4 W as the checkpoint stores it:
    blocks uint8 [N, K/2] (K contiguous), scales uint8 [N, K/32]. DOT_SCALED: ``tl.dot_scaled`` (a bf16); else
    decode in registers (codes -> fp16 bits, times the scale built from the byte's bits) and ``tl.dot``."""
    offs_m, offs_n = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    offs_byte, offs_group = tl.arange(0, BLOCK_K // 2), tl.arange(0, BLOCK_K // 32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + offs_m[:, None] * K + k0 + tl.arange(0, BLOCK_K)[None, :])
        packed = tl.load(blocks_ptr + offs_n[:, None] * (K // 2) + (k0 // 2 + offs_byte)[None, :])  # [BN, BK/2]
        scale = tl.load(scales_ptr + offs_n[:, None] * (K // 32) + (k0 // 32 + offs_group)[None, :])  # [BN, BK/32]
        if DOT_SCALED:
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(packed), scale, "e2m1", acc)
        else:
            codes = tl.interleave(packed & 0xF, packed >> 4).to(tl.int16)  # [BN, BK]: input 2b low nibble
            # E2M1 bits -> fp16 bits: value * 2**-14 (code 1, 0.5, becomes the fp16 subnormal 2**-15)
            half = (((codes & 0x8) << 12) | ((codes & 0x7) << 9)).to(tl.float16, bitcast=True)
            factor = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0  # 2**(s-127) * 2**14
            w = tl.reshape(half.to(tl.float32), (BLOCK_N, BLOCK_K // 32, 32)) * factor[:, :, None]
            w = tl.trans(tl.reshape(w, (BLOCK_N, BLOCK_K)))
            acc += tl.dot(a, w.to(a.dtype), input_precision="ieee" if a.dtype == tl.float32 else "tf32")
    tl.store(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc)


def _probe(device, dot_scaled, dtype):
    g = torch.Generator().manual_seed(5)
    M, K, N = 16, 128, 32
    q = quantize_mxfp4(torch.randn(1, K, N, generator=g) * torch.logspace(-3, 1, N))  # several scale bytes
    a = torch.randn(M, K, generator=g).to(dtype)
    expected = a.float() @ q.dequantize(torch.float32)[0]
    blocks, scales = q.blocks[0].reshape(N, K // 2).to(device), q.scales[0].to(device)
    out = torch.empty(M, N, device=device)
    _probe_mxfp4_matmul[(1,)](a.to(device), blocks, scales, out, K, N, BLOCK_M=M, BLOCK_N=N, BLOCK_K=64,
                              DOT_SCALED=dot_scaled)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dot_scaled,dtype", [
    (False, torch.float32),  # in-register decode (the interpreter computes bf16 tl.dot wrong: fp32 only)
    (True, torch.bfloat16),  # tl.dot_scaled reads blocks [N, K/2] (transposed) and scales [N, K/32] as stored
], ids=["register_decode_fp32", "dot_scaled_bf16"])
def test_triton_primitives_read_the_checkpoint_layout(dot_scaled, dtype):
    _probe("cuda" if torch.cuda.is_available() else "cpu", dot_scaled, dtype)


@pytest.mark.gpu
def test_gpu_in_register_decode_with_bf16_dot():
    _probe("cuda", False, torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_dequantize_bit_exact_at_gpt_oss_20b_shape(dtype):
    """One GPT-OSS-20B layer's gate_up and down (E=32, H=I=2880) on CUDA: same bits as transformers."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    for shape in ((32, 5760, 90), (32, 2880, 90)):
        blocks, scales = (t.cuda() for t in _random_mxfp4(shape, scale_range=(100, 140)))
        expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        assert torch.equal(_bits(dequantize_mxfp4(blocks, scales, dtype)), _bits(expected))


@pytest.mark.gpu
def test_gpu_build_and_forward_match_cpu():
    config = _mxfp4_config()
    gpu = build_mxfp4_gpt_oss(config, dtype=torch.float32, device="cuda")
    cpu = build_mxfp4_gpt_oss(config, dtype=torch.float32, device="cpu")
    cpu.load_state_dict({k: v.cpu() for k, v in gpu.state_dict().items()})
    tokens = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(gpu(tokens.cuda()).logits.cpu(), cpu(tokens).logits, atol=1e-4, rtol=1e-4)
    assert gpu.model.layers[0].mlp.experts.gate_up.device.type == "cuda"


@pytest.mark.gpu
def test_gpu_load_mxfp4_checkpoint_onto_cuda(tmp_path):
    """load_mxfp4_gpt_oss(device="cuda"): every tensor read straight onto the GPU (the rotary buffers too), the
    experts still uint8; attached with the Triton ops, its logits match the CPU model's reference."""
    saved = build_mxfp4_gpt_oss(_mxfp4_config(), dtype=torch.float32)
    saved.save_pretrained(tmp_path)
    gpu = load_mxfp4_gpt_oss(str(tmp_path), dtype=torch.float32, device="cuda")
    assert {t.device.type for t in [*gpu.parameters(), *gpu.buffers()]} == {"cuda"}
    assert gpu.model.layers[0].mlp.experts.gate_up_proj_blocks.dtype == torch.uint8
    tokens = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        want = saved(tokens).logits
        got = mlc.attach(gpu, max_loras=2, max_rank=4)(tokens.cuda(), adapters=None).logits.cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
