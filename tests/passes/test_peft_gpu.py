"""On the H200 (``pytest -m gpu``): PEFT models compiled with the pass, the fused ops running the Triton kernels."""

from __future__ import annotations

import pytest
import torch

from moe_lora_compile.peft_compat import functional_expert_lora

from pass_helpers import RecordingPass, pass_always_runs
from test_peft_models import FORMS, _first, _peft_block

pytestmark = pytest.mark.gpu

# (family, experts implementation): each row names what it covers
CASES = [
    ("qwen3_moe", "grouped_mm"),  # aten._grouped_mm on CUDA (bf16) / the fallback op (fp32)
    ("gpt_oss", "batched_mm"),  # transposed interleaved + biases, per-pair bmm
    ("llama4", None),  # dense experts form
]


@pytest.mark.parametrize("family, implementation", CASES, ids=[c[0] for c in CASES])
def test_peft_expert_lora_on_cuda(family, implementation):
    """fp32 (routing cannot flip between eager and compiled): one graph, the fused op, PEFT eager's values (the
    Triton kernels' tolerance, as the other GPU pass tests)."""
    peft_model, block, _ = _peft_block(family, implementation)
    peft_model.cuda()
    inputs = [torch.randn(2, T, 32, device="cuda") for T in (5, 9)]
    with torch.no_grad():
        want = [_first(block(x)) for x in inputs]
    functional_expert_lora(peft_model)
    recorder = RecordingPass()
    compiled = torch.compile(block, fullgraph=True, options={"post_grad_custom_post_pass": recorder,
                                                             "shape_padding": False})
    with pass_always_runs(recorder):
        for x, w in zip(inputs, want):
            torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(_first(compiled(x)), w, atol=3e-2, rtol=3e-2)
    assert len(recorder.graphs) == 1
    assert dict(recorder.counts) == {f"fused_moe_lora[{FORMS[implementation]}]": 1}
