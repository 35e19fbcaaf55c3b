"""Bad input gets a clear error that names the argument (and the op works under compile, so checks never graph-break)."""

import pytest
import torch
from support.cases import MoECase, make_linear

import moe_lora_compile as mlc

NAMES = ("x", "topk_ids", "topk_weights", "token_lora_ids", "w13", "w2", "lora_a13", "lora_b13", "lora_a2", "lora_b2")


def _moe_args(**case):
    args, kwargs = MoECase(**{"T": 4, **case}).make()
    return dict(zip(NAMES, args)), kwargs


def _replace(name, make_bad, **case):
    args, kwargs = _moe_args(**case)
    args[name] = make_bad(args[name])
    return args, kwargs


MOE_BAD = [
    # (argument, how it is made wrong, error type, text the message must contain)
    ("x", lambda t: t[None], ValueError, "x must be 2-D"),
    ("x", lambda t: t.to(torch.int64), TypeError, "x must be a floating tensor"),
    # x narrower than the experts' H: x is named (the message blamed w13, H being read from x)
    ("x", lambda t: t[:, :10], ValueError, r"x must have shape [T, H] with H = 16 (the hidden size of w13 and w2)"),
    ("topk_ids", lambda t: t[:3], ValueError, "topk_ids must have shape [T, k]"),
    ("topk_ids", lambda t: t.float(), TypeError, "topk_ids must be int32 or int64"),
    ("topk_ids", lambda t: t + 100, ValueError, "topk_ids values must lie in [0, 4)"),
    ("topk_weights", lambda t: t[:, :1], ValueError, "topk_weights must have shape [T, k]"),
    ("token_lora_ids", lambda t: t[:2], ValueError, "token_lora_ids must have shape [T]"),
    ("token_lora_ids", lambda t: torch.full_like(t, 3), ValueError, "token_lora_ids values must lie in [-1, 3)"),
    ("token_lora_ids", lambda t: torch.full_like(t, -2), ValueError, "token_lora_ids values must lie in [-1, 3)"),
    ("w13", lambda t: t[:, :, :-1], ValueError, "w13 must have shape [E, 2I, H]"),
    ("w13", lambda t: t[:, :-2], ValueError, "w13's gate/up axis (22) must be twice"),
    ("w2", lambda t: t[:-1], ValueError, "w2 must have shape [E, H, I]"),
    ("lora_a13", lambda t: t[..., :-1], ValueError, "lora_a13 must have shape [L, E, R, H]"),
    ("lora_b13", lambda t: t[..., :-1], ValueError, "lora_b13 must have shape [L, E, 2I, R]"),  # rank mismatch
    ("lora_b13", lambda t: t[:2], ValueError, "lora_b13 must have shape [L, E, 2I, R]"),  # slot-count mismatch
    ("lora_a2", lambda t: t[..., :-1], ValueError, "lora_a2 must have shape [L, E, R2, I]"),  # not w2's I
    # w2's rank R2 is its own (need not be lora_a13's R), but lora_b2 must match lora_a2's
    ("lora_a2", lambda t: t[:, :, :-1], ValueError, "lora_b2 must have shape [L, E, H, R2] = [3, 4, 16, 3] matching "
                                                    "lora_a2"),
    ("lora_b2", lambda t: t[0], ValueError, "lora_b2 must be 4-D"),
    # None where a tensor goes (an AttributeError from the checks before)
    ("token_lora_ids", lambda t: None, TypeError, "token_lora_ids must be a tensor [T], got NoneType"),
    ("x", lambda t: None, TypeError, "x must be a tensor"),
]


@pytest.mark.parametrize("name,make_bad,error,message", MOE_BAD, ids=[f"{r[0]}-{r[3][:30]}" for r in MOE_BAD])
def test_fused_moe_lora_bad_input(name, make_bad, error, message):
    args, kwargs = _replace(name, make_bad)
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        mlc.fused_moe_lora(*args.values(), **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(layout="rows"), "layout must be one of"),  # unknown layout
    (dict(activation="gelu"), "activation must be one of"),  # unknown activation
    (dict(layout="transposed_interleaved"), "w13 must have shape [E, H, 2I]"),  # layout does not fit the weights
    (dict(w13_bias=torch.zeros(4, 5)), "w13_bias must have shape [E, 2I]"),
    (dict(w2_bias=torch.zeros(3, 16)), "w2_bias must have shape [E, H]"),
])
def test_fused_moe_lora_bad_attributes(kwargs, message):
    args, base = _moe_args()
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        mlc.fused_moe_lora(*args.values(), **{**base, **kwargs})


def test_interleaved_layout_refuses_transposed_weights():
    """GPT-OSS weights as transformers stores them ([E, H, 2I]) passed as vLLM's ``interleaved`` ([E, 2I, H])."""
    args, kwargs = _moe_args(layout="transposed_interleaved", activation="gptoss_swiglu")
    with pytest.raises(ValueError, match=r"w13 must have shape \[E, 2I, H\] for layout 'interleaved'"):
        mlc.fused_moe_lora(*args.values(), **{**kwargs, "layout": "interleaved"})


def test_errors_under_compile_too():
    """Shape errors surface from the fake impl while tracing, still naming the argument."""
    args, kwargs = _replace("lora_b2", lambda t: t[..., :-1])
    fn = torch.compile(mlc.fused_moe_lora, fullgraph=True)
    with pytest.raises(Exception, match="lora_b2 must have shape"):
        fn(*args.values(), **kwargs)


LINEAR_BAD = [
    (0, lambda t: t[0], ValueError, "x must be 2-D"),
    (1, lambda t: t[:, :-1], ValueError, "weight must have shape [out, in]"),
    (2, lambda t: t[..., :-1], ValueError, "lora_a must have shape [L, R, in]"),
    (3, lambda t: t[..., :-1], ValueError, "lora_b must have shape [L, out, R]"),  # rank mismatch with lora_a
    (3, lambda t: t[:1], ValueError, "lora_b must have shape [L, out, R]"),  # slot-count mismatch
    (4, lambda t: t.float(), TypeError, "token_lora_ids must be int32 or int64"),
    (4, lambda t: torch.full_like(t, 7), ValueError, "token_lora_ids values must lie in [-1, 3)"),
    (0, lambda t: None, TypeError, "x must be a tensor [T, in], got NoneType"),  # (an AttributeError before)
    (2, lambda t: None, TypeError, "lora_a must be a tensor"),
]


@pytest.mark.parametrize("pos,make_bad,error,message", LINEAR_BAD, ids=[r[3][:30] for r in LINEAR_BAD])
def test_lora_linear_bad_input(pos, make_bad, error, message):
    args, _ = make_linear(5, 10, 12, 3, 4)
    args = list(args)
    args[pos] = make_bad(args[pos])
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        mlc.lora_linear(*args)


def test_lora_linear_bad_bias():
    args, _ = make_linear(5, 10, 12, 3, 4)
    with pytest.raises(ValueError, match=r"bias must have shape \[out\]"):
        mlc.lora_linear(*args, bias=torch.zeros(11))


# --- issue 11, item 3: a non-finite (or overflowing) value in one slot stays in the rows that use that slot --------

_POISONS = [float("inf"), float("nan"), 3e38]  # 3e38: finite, but x @ A overflows fp32


@pytest.mark.parametrize("pos,value", [(2, float("inf")), (2, float("nan")), (2, 3e38), (3, float("inf")),
                                       (3, float("nan"))], ids=["lora_a-inf", "lora_a-nan", "lora_a-overflow",
                                                                 "lora_b-inf", "lora_b-nan"])
def test_lora_linear_bad_slot_stays_in_its_rows(pos, value):
    """The issue's reproducer: ``B[1] = inf; lora_linear(x, W, A, B, ids=[0, -1])`` gave NaN in both rows."""
    (x, weight, a, b, _), bias = make_linear(6, 10, 12, 3, 4, bias=True)
    ids = torch.tensor([0, -1, 1, 2, -1, 1], dtype=torch.int32)
    clean = mlc.lora_linear(x, weight, a, b, ids, bias=bias)
    base = mlc.lora_linear(x, weight, a, b, torch.full_like(ids, -1), bias=bias)
    bad = [a, b]
    bad[pos - 2] = bad[pos - 2].clone()
    bad[pos - 2][1] = value
    y = mlc.lora_linear(x, weight, *bad, ids, bias=bias)
    others = ids != 1
    torch.testing.assert_close(y[others], clean[others], rtol=1e-6, atol=1e-6)
    assert torch.equal(y[ids == -1], base[ids == -1])  # -1 rows: exactly the base result
    assert not torch.isfinite(y[ids == 1]).all()  # the bad slot's own rows do show it


@pytest.mark.parametrize("value", _POISONS, ids=["inf", "nan", "overflow"])
@pytest.mark.parametrize("name", ["lora_a13", "lora_b13", "lora_a2", "lora_b2"])
def test_fused_moe_lora_bad_slot_stays_in_its_rows(name, value):
    args, kwargs = _moe_args(T=6, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True)
    ids = torch.tensor([0, -1, 2, 1, -1, 2], dtype=torch.int32)  # slot 0 is poisoned below
    args["token_lora_ids"] = ids
    clean = mlc.fused_moe_lora(*args.values(), **kwargs)
    base = mlc.fused_moe_lora(*{**args, "token_lora_ids": torch.full_like(ids, -1)}.values(), **kwargs)
    args[name] = args[name].clone()
    args[name][0] = value
    y = mlc.fused_moe_lora(*args.values(), **kwargs)
    others = ids != 0
    torch.testing.assert_close(y[others], clean[others], rtol=1e-6, atol=1e-6)
    assert torch.equal(y[ids == -1], base[ids == -1])


# --- issue 11, item 9: zero sizes that make no layer, and integer/bool biases -----------------------------------

_ZERO_DIMS = {
    # name: ({argument: how to cut it}, message) on the concat case's [T,H] x, [E,2I,H] w13, [E,H,I] w2
    "L=0": ({n: (lambda t: t[:0]) for n in ("lora_a13", "lora_b13", "lora_a2", "lora_b2")},
            "lora_a13 must have shape [L, E, R, H] with L >= 1"),
    "R=0": ({"lora_a13": lambda t: t[:, :, :0], "lora_b13": lambda t: t[..., :0], "lora_a2": lambda t: t[:, :, :0],
             "lora_b2": lambda t: t[..., :0]}, "lora_a13 must have shape [L, E, R, H] with R >= 1"),
    "H=0": ({"x": lambda t: t[:, :0], "w13": lambda t: t[..., :0], "w2": lambda t: t[:, :0],
             "lora_a13": lambda t: t[..., :0], "lora_b2": lambda t: t[:, :, :0]},
            "x must have shape [T, H] with H >= 1"),
    "I=0": ({"w13": lambda t: t[:, :0], "w2": lambda t: t[..., :0], "lora_b13": lambda t: t[:, :, :0],
             "lora_a2": lambda t: t[..., :0]}, "w2 must have shape [E, H, I] with I >= 1"),
    "k=0": ({"topk_ids": lambda t: t[:, :0], "topk_weights": lambda t: t[:, :0]},
            "topk_ids must have shape [T, k] with k >= 1"),
}


def _escaped(message):
    return message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("case", list(_ZERO_DIMS))
def test_fused_moe_lora_zero_sizes(case):
    cuts, message = _ZERO_DIMS[case]
    args, kwargs = _moe_args()
    for name, cut in cuts.items():
        args[name] = cut(args[name])
    with pytest.raises(ValueError, match=_escaped(message)):
        mlc.fused_moe_lora(*args.values(), **kwargs)


@pytest.mark.parametrize("bias", ["w13_bias", "w2_bias"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_fused_moe_lora_integer_bias(bias, dtype):
    args, kwargs = _moe_args(bias=True)
    kwargs[bias] = kwargs[bias].to(dtype)
    with pytest.raises(TypeError, match=f"{bias} must be a floating tensor, got {dtype}"):
        mlc.fused_moe_lora(*args.values(), **kwargs)


def test_empty_batch_still_works():
    """T = 0 is an empty batch, not a zero-size layer: both ops return an empty output."""
    args, kwargs = _moe_args(T=0, bias=True)
    assert mlc.fused_moe_lora(*args.values(), **kwargs).shape == (0, 16)
    (x, weight, a, b, ids), bias = make_linear(0, 10, 12, 3, 4, bias=True)
    assert mlc.lora_linear(x, weight, a, b, ids, bias=bias).shape == (0, 12)


@pytest.mark.parametrize("cuts,message", [
    ({2: lambda t: t[:0], 3: lambda t: t[:0]}, "lora_a must have shape [L, R, in] with L >= 1"),
    ({2: lambda t: t[:, :0], 3: lambda t: t[..., :0]}, "lora_a must have shape [L, R, in] with R >= 1"),
    ({0: lambda t: t[:, :0], 1: lambda t: t[:, :0], 2: lambda t: t[..., :0]}, "x must have shape [T, in] with in >= 1"),
    ({1: lambda t: t[:0], 3: lambda t: t[:, :0]}, "weight must have shape [out, in] with out >= 1"),
], ids=["L=0", "R=0", "in=0", "out=0"])
def test_lora_linear_zero_sizes(cuts, message):
    args, _ = make_linear(5, 10, 12, 3, 4)
    args = list(args)
    for pos, cut in cuts.items():
        args[pos] = cut(args[pos])
    with pytest.raises(ValueError, match=_escaped(message)):
        mlc.lora_linear(*args)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_lora_linear_integer_bias(dtype):
    args, _ = make_linear(5, 10, 12, 3, 4)
    with pytest.raises(TypeError, match=f"bias must be a floating tensor, got {dtype}"):
        mlc.lora_linear(*args, bias=torch.zeros(12, dtype=dtype))


def test_zero_size_error_under_compile():
    """The same check runs in the fake impl under symbolic shapes (T dynamic), still naming the argument."""
    args, _ = make_linear(5, 10, 12, 3, 4)
    args = list(args)
    args[2], args[3] = args[2][:, :0], args[3][..., :0]
    torch._dynamo.mark_dynamic(args[0], 0)
    fn = torch.compile(mlc.lora_linear, fullgraph=True)
    with pytest.raises(Exception, match=r"lora_a must have shape \[L, R, in\] with R >= 1"):
        fn(*args)


_DEVICE_CHECK = """
import torch, moe_lora_compile as mlc
x, w = torch.randn(5, 32, device="cuda"), torch.randn(16, 32, device="cuda")
a, b = torch.randn(3, 4, 32, device="cuda"), torch.randn(3, 16, 4, device="cuda")
ids = torch.tensor(IDS, dtype=torch.int32, device="cuda")
y = mlc.lora_linear(x, w, a, b, ids)
torch.cuda.synchronize()
print("finished", float(y.abs().sum()))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("ids,fails", [
    ([0, 1, 2, -1, 0], False),  # every id in [-1, L): runs
    ([0, 1, 3, -1, 0], True),   # slot L = 3: past the last slot
    ([0, -2, 1, 1, 0], True),   # -2: below "no adapter"
])
def test_cuda_id_check_fails_the_launch(ids, fails):
    """On CUDA the id check is a device assert (one Triton launch, no host sync): a bad id fails the launch with the
    check's message, as the CPU check raises. Run in a child: a device assert leaves the CUDA context unusable."""
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c", _DEVICE_CHECK.replace("IDS", repr(ids))], capture_output=True,
                           text=True, timeout=300)
    if fails:
        assert child.returncode != 0 and "finished" not in child.stdout
        assert "token_lora_ids values must lie in [-1, 3)" in child.stdout + child.stderr
    else:
        assert child.returncode == 0 and "finished" in child.stdout, child.stderr[-2000:]


def test_mixed_dtypes_on_cuda_run_the_reference_and_say_so():
    """The CUDA impls send dtypes the kernels do not take (x bf16, LoRA stacks fp32: what a PEFT model keeps) to the
    reference, with one RuntimeWarning per op and dtypes; the same dtypes all round need no warning. Called here
    on CPU tensors: the fallback itself is device-agnostic, and the result must equal the reference."""
    import warnings as w

    from moe_lora_compile.ops import cuda_impl
    from moe_lora_compile.ops.reference import lora_linear_reference

    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 8, generator=g).bfloat16(), torch.randn(6, 8, generator=g).bfloat16()
    a, b = torch.randn(2, 4, 8, generator=g), torch.randn(2, 6, 4, generator=g)
    ids = torch.tensor([0, -1, 1], dtype=torch.int32)
    cuda_impl._WARNED.clear()
    with pytest.warns(RuntimeWarning, match=r"lora_linear on CUDA: x is torch.bfloat16 but lora_a torch.float32, "
                                            r"lora_b torch.float32; .* runs the PyTorch reference"):
        y = cuda_impl.lora_linear_cuda(x, weight, a, b, ids)
    torch.testing.assert_close(y, lora_linear_reference(x, weight, a, b, ids), rtol=0, atol=0)
    with w.catch_warnings():
        w.simplefilter("error")
        cuda_impl.lora_linear_cuda(x, weight, a, b, ids)  # once per op and dtypes
        assert not cuda_impl._kernel_covers("lora_linear", x.double(), weight=weight.double())  # float64: no warning


def test_router_and_attention_name_a_missing_tensor():
    """None where a tensor goes: a TypeError naming it (an AttributeError from the checks before); the attention's
    default scaling of a head dim 0, and a scaling given as a string, are named too (ZeroDivisionError / silently
    parsed before)."""
    from moe_lora_compile.ops.decode_attention import decode_attention
    from moe_lora_compile.ops.router import route

    with pytest.raises(TypeError, match=r"hidden must be a tensor \[T, H\], got NoneType"):
        route(None, torch.randn(4, 8), top_k=2, scoring="topk_softmax")
    q, kv = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(TypeError, match=r"key must be a tensor \[B, heads, len, D\], got NoneType"):
        decode_attention(q, None, kv)
    with pytest.raises(TypeError, match="scaling must be a float, got '0.5'"):
        decode_attention(q, kv, kv, scaling="0.5")
    with pytest.raises(ValueError, match="head dim D must be >= 1 for the default scaling"):
        decode_attention(q[..., :0], kv[..., :0], kv[..., :0])
