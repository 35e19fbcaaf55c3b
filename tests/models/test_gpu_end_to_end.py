"""On CUDA: attached tiny models with ``use_ops=True`` (the Triton kernels) equal the reference path, and greedy
generation of a mixed-adapter batch is identical. Run on the H200 with ``pytest -m gpu``."""

import copy

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", [
    "qwen3_moe",  # concat layout, silu
    "gpt_oss",    # interleaved layout, expert biases, clamped swiglu
    "llama4",     # swapped block, routing weight on the input
    "qwen2_moe",  # shared expert through lora_linear
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_path_matches_reference_path(tmp_path, family, dtype):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family)).eval()
    randomize_lora_(peft_model)
    peft_model.save_pretrained(tmp_path)
    models = {}
    for use_ops in (False, True):
        mm = attach(copy.deepcopy(base).to("cuda", dtype), max_loras=3, max_rank=16, use_ops=use_ops)
        mm.load_adapter("a", tmp_path)
        models[use_ops] = mm
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(1)).cuda()
    adapters = ["a", None, "a"]
    with torch.no_grad():
        ref = models[False](ids, adapters=adapters).logits.float()
        out = models[True](ids, adapters=adapters).logits.float()
    rel = (out - ref).norm() / ref.norm()
    assert rel < (1e-4 if dtype == torch.float32 else 2e-2), f"relative error {rel:.2e}"
    if dtype == torch.float32:
        with torch.no_grad():
            gen_ref = models[False].generate(ids, adapters=adapters, max_new_tokens=5, do_sample=False)
            gen_out = models[True].generate(ids, adapters=adapters, max_new_tokens=5, do_sample=False)
        assert torch.equal(gen_ref, gen_out)
