"""The ops under torch.compile(fullgraph=True, dynamic=True): equal to eager, and no recompiles when adapter ids or
the token count change (after the first dynamic compile)."""

import pytest
import torch
from torch._dynamo.utils import counters
from support.cases import MoECase, make_linear

import moe_lora_compile as mlc


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _moe_step(x, topk_ids, topk_weights, token_lora_ids, *weights):
    # A little traced code around the op, as inside a model: the op must not break the graph.
    y = mlc.fused_moe_lora(x * 1.0, topk_ids, topk_weights, token_lora_ids, *weights)
    return y + x


def _linear_step(x, weight, lora_a, lora_b, token_lora_ids):
    return torch.relu(mlc.lora_linear(x, weight, lora_a, lora_b, token_lora_ids))


def test_fused_moe_lora_compiles_without_recompiles():
    fn = torch.compile(_moe_step, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=False):
        for T in (5, 9):  # the first call compiles dynamically
            args, _ = MoECase(T=T).make()
            torch.testing.assert_close(fn(*args), _moe_step(*args))
    assert _graphs() == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        args, _ = MoECase(T=9).make()
        for new_ids in (torch.full_like(args[3], -1), torch.zeros_like(args[3]), torch.randint_like(args[3], -1, 3)):
            changed = (*args[:3], new_ids, *args[4:])  # a new adapter mix: data, not a guard
            torch.testing.assert_close(fn(*changed), _moe_step(*changed))
        for T in (3, 17, 2):  # new token counts
            args, _ = MoECase(T=T).make()
            torch.testing.assert_close(fn(*args), _moe_step(*args))
    assert _graphs() == 1


def test_lora_linear_compiles_without_recompiles():
    fn = torch.compile(_linear_step, fullgraph=True, dynamic=True)
    args, _ = make_linear(6, 10, 12, 3, 4)
    torch.testing.assert_close(fn(*args), _linear_step(*args))
    with torch._dynamo.config.patch(error_on_recompile=True):
        for T, seed in ((6, 1), (11, 2), (3, 3)):
            args, _ = make_linear(T, 10, 12, 3, 4, seed=seed)
            torch.testing.assert_close(fn(*args), _linear_step(*args))
    assert _graphs() == 1
