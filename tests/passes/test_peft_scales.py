"""PEFT's dense LoRA scale when it is not a constant of the graph: after ``set_scale`` / ``scale_layer`` on a
compiled model Dynamo makes the changed float a symbolic input, and ``prepare_model_for_compiled_hotswap`` makes it a
0-d tensor. The pass folds either into B like a constant (it used to leave such linears unfused, silently)."""

import pytest
import torch
from torch import nn

from moe_lora_compile.passes import MoELoRAPass

from pass_helpers import pass_always_runs

H, R = 16, 4


class ScaledLoRALinear(nn.Module):
    """``base(x) + lora_B(lora_A(x)) * scaling``, the scaling a Python float attribute or a 0-d tensor buffer."""

    def __init__(self, scaling):
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(H, H)
        self.lora_A = nn.Linear(H, R, bias=False)
        self.lora_B = nn.Linear(R, H, bias=False)
        if isinstance(scaling, torch.Tensor):
            self.register_buffer("scaling", scaling)
        else:
            self.scaling = scaling
        self.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


@pytest.mark.parametrize("scaling, rescale, graphs", [
    (0.5, lambda m: setattr(m, "scaling", 0.25), 2),   # a float changed after the first compile: a symbolic input
    (torch.tensor(0.5), lambda m: m.scaling.fill_(0.25), 1),  # a 0-d tensor changed in place: the same graph
])
def test_non_constant_peft_scale_is_fused(scaling, rescale, graphs):
    model = ScaledLoRALinear(scaling)
    recorder = MoELoRAPass()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(5, H)
    with pass_always_runs(recorder):
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        rescale(model)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    assert recorder.counts["lora_linear[peft]"] == graphs, recorder.counts  # every graph has its lora_linear
