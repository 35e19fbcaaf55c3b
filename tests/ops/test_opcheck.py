"""torch.library.opcheck for every op: schema, autograd registration, fake tensors, AOT dispatch (dynamic)."""

import pytest
import torch
from support.cases import MoECase, make_linear

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _requires_grad(args, positions):
    return tuple(t.clone().requires_grad_(True) if i in positions else t for i, t in enumerate(args))


@pytest.mark.parametrize("case", [
    MoECase(T=5),  # concat layout, mixed adapters
    MoECase(T=4, layout="transposed_interleaved", activation="gptoss_swiglu", bias=True),  # GPT-OSS with biases
    MoECase(T=4, layout="interleaved", activation="gptoss_swiglu", bias=True),  # vLLM's GPT-OSS: [E, 2I, H]
    MoECase(T=4, layout="transposed_concat", routing_weight_on_input=True, k=1),  # Llama-4
    MoECase(T=0),  # empty batch
], ids=MoECase.label)
def test_fused_moe_lora_opcheck(case):
    args, kwargs = case.make()
    args = _requires_grad(args, {0, 2, 6, 7, 8, 9})  # x, topk_weights and the LoRA stacks are differentiable
    torch.library.opcheck(torch.ops.moe_lora.fused_moe_lora.default, args, kwargs, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("bias", [False, True])
def test_lora_linear_opcheck(bias):
    args, b = make_linear(6, 10, 12, 3, 4, bias=bias)
    args = _requires_grad(args, {0, 2, 3})
    torch.library.opcheck(torch.ops.moe_lora.lora_linear.default, args, {"bias": b}, test_utils=OPCHECK_TESTS)


def test_fake_impl_shapes_and_strides():
    from torch._subclasses.fake_tensor import FakeTensorMode

    args, kwargs = MoECase(T=5, layout="transposed_interleaved", bias=True).make()
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(t) for t in args]
        fake_kwargs = {k: mode.from_tensor(v) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        y = torch.ops.moe_lora.fused_moe_lora(*fake_args, **fake_kwargs)
        lin_args, _ = make_linear(7, 10, 12, 3, 4)
        z = torch.ops.moe_lora.lora_linear(*[mode.from_tensor(t) for t in lin_args])
    assert y.shape == (5, 16) and y.stride() == (16, 1) and y.dtype == torch.float32
    assert z.shape == (7, 12) and z.stride() == (12, 1)
