"""On the H200 (``pytest -m gpu``): the pass in CUDA graphs, where the fused ops run the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from pass_helpers import RecordingPass, pass_always_runs
from test_hf_experts import CASES, ExpertsZoo
from test_reference_patterns import H, K, MOE_VARIANTS, N_LINEAR, Zoo

pytestmark = pytest.mark.gpu

# bf16: tokens whose K-th and (K+1)-th router probabilities (fp32) are closer than this may be routed to different
# experts by the eager graph and the compiled one (logits rounded to bf16 or not before the softmax; exact bf16
# ties at the top-k boundary occur for about 1 token in 15 at these sizes), so their MoE outputs are not compared.
ROUTING_MARGIN = {torch.bfloat16: 2e-2, torch.float32: 0.0}


def clear_routing(layer, x, margin: float):
    """[T] bool: the token's top-K experts do not depend on how the router's products round."""
    p = (x.float() @ layer.router.float()).softmax(-1).sort(-1, descending=True).values
    return p[:, K - 1] - p[:, K] > margin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_variants_on_cuda(dtype):
    torch.manual_seed(0)
    model = Zoo(dtype).cuda()
    recorder = RecordingPass()
    # shape_padding off (as mlc.compile does): Inductor's pad_mm otherwise guards the dynamic T on the GPU
    # ("4 <= x.size()[0] <= 15", is_mm_compute_bound) and T=29 recompiles (seen on the H200, bf16)
    compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": recorder,
                                                             "shape_padding": False})
    with pass_always_runs(recorder):
        for T in (5, 29):  # T <= len(TOKEN_IDS) (32): the Zoo slices its id buffer
            x = torch.randn(T, H, dtype=dtype, device="cuda")
            torch._dynamo.mark_dynamic(x, 0)
            for i, (got, want) in enumerate(zip(compiled(x), model(x))):
                if i < len(MOE_VARIANTS):  # MoE outputs: rows with an unambiguous routing
                    rows = clear_routing(model.moe[i], x, ROUTING_MARGIN[dtype])
                    assert rows.sum() >= T // 2, f"output {i}: too few tokens with a clear routing to compare"
                    got, want = got[rows], want[rows]
                torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=lambda m: f"output {i}: {m}")
    assert len(recorder.graphs) == 1
    assert recorder.graphs[0]["fused_moe_lora"] == len(MOE_VARIANTS)
    assert recorder.graphs[0]["lora_linear"] == N_LINEAR


def test_hf_experts_on_cuda():
    torch.manual_seed(0)
    model = ExpertsZoo().cuda()
    recorder = RecordingPass()
    compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": recorder})
    with pass_always_runs(recorder):
        x = torch.randn(9, 32, dtype=torch.bfloat16, device="cuda")
        for got, want in zip(compiled(x), model(x)):
            torch.testing.assert_close(got, want, atol=5e-2, rtol=5e-2)
    assert recorder.graphs[0]["fused_moe_lora"] == len(CASES)


def test_demo_on_cuda(capsys):
    from moe_lora_compile.__main__ import main

    assert main(["demo", "--device", "cuda", "--dtype", "bfloat16"]) == 0
    assert "ops run Triton kernels" in capsys.readouterr().out
