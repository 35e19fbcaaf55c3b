"""The folded-GQA eager attention (:mod:`moe_lora_compile.models.attention`) against transformers' own eager
attention: same logits for every family, with left padding, a sliding window (GPT-OSS), GPT-OSS's sinks and a
cached decode; it replaces only ``"eager"``."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_lora_compile.models.attention import FOLDED_GQA, use_folded_gqa_attention
from moe_lora_compile.models.tiny import TINY_FAMILIES, tiny_config


def _eager_model(family: str, **overrides):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), attn_implementation="eager")
    model = model.float().eval()
    for m in model.modules():  # GPT-OSS sinks start at zero: make them matter
        if hasattr(m, "sinks"):
            torch.nn.init.normal_(m.sinks, std=1.0)
    return model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_logits_equal_transformers_eager(family):
    """Batch of 3 with left padding, 20 tokens (GPT-OSS's sliding window is 16), then 4 cached decode steps."""
    eager = _eager_model(family)
    folded = copy.deepcopy(eager)
    assert use_folded_gqa_attention(folded)
    assert folded.config._attn_implementation == FOLDED_GQA
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :11] = 0
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask).logits
        got = folded(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5)
        out_eager = eager.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        out_folded = folded.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(out_folded, out_eager)


def test_leaves_other_implementations_alone():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), attn_implementation="sdpa")
    assert not use_folded_gqa_attention(model)
    assert model.config._attn_implementation == "sdpa"
