"""A mixed batch on one attached model equals PEFT run separately per adapter (and the base model for None).

For every supported family: a tiny random model, three adapters made with PEFT's own API and saved as real
safetensors folders (different ranks; one with use_rslora; one with rank_pattern + alpha_pattern), loaded through
``MultiLoRAModel.load_adapter``; logits compared in fp32 and greedy tokens compared exactly.
"""

import copy

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

ADAPTER_SETTINGS = {
    "plain": dict(r=4, lora_alpha=8),
    "rslora": dict(r=8, lora_alpha=16, use_rslora=True),
    # rank_pattern / alpha_pattern (regular expressions, PEFT's suffix match): the output projections (experts'
    # down_proj, dense down_proj where targeted, attention o_proj) get rank 6 and alpha 3, the value projection
    # alpha 12. Every key names a targeted module (PEFT checks keys against modules only, so a key that matched
    # only the experts' down_proj parameter would be reported as ignored although PEFT applies it).
    "patterns": dict(r=2, lora_alpha=4, rank_pattern={"(down|o)_proj": 6},
                     alpha_pattern={"(down|o)_proj": 3, "(v|kv_a)_proj(_with_mqa)?": 12}),
}
BATCH_ADAPTERS = ["plain", "rslora", None, "patterns"]

FAMILIES = [
    "qwen3_moe",    # concat experts, softmax routing
    "qwen2_moe",    # + shared expert (dense LoRA on shared_expert.up_proj), sigmoid shared gate, qkv biases
    "gpt_oss",      # transposed interleaved experts with biases, clamped swiglu
    "mixtral",      # concat, softmax -> top-k -> renormalise
    "deepseek_v3",  # sigmoid group routing, shared experts, first layer dense, MLA attention targets
    "olmoe",        # concat, softmax routing
    "llama4",       # not decorated: block swap, routing weight on the input, PEFT's A on the output side
    "qwen3",        # dense model: lora_linear path only (attention + MLP)
    "llama",        # dense model
    "mistral",      # dense model
    "qwen2",        # dense model with q/k/v biases
]


@pytest.fixture(scope="module", params=FAMILIES)
def family_setup(request, tmp_path_factory):
    family = request.param
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    peft_models, paths = {}, {}
    for i, (name, settings) in enumerate(ADAPTER_SETTINGS.items()):
        peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family, **settings)).eval()
        randomize_lora_(peft_model, seed=i)
        paths[name] = tmp_path_factory.mktemp(f"{family}_{name}")
        peft_model.save_pretrained(paths[name])
        peft_models[name] = peft_model
    mm = attach(copy.deepcopy(base), max_loras=4, max_rank=8)
    for name, path in paths.items():
        mm.load_adapter(name, path)
    input_ids = torch.randint(3, 128, (len(BATCH_ADAPTERS), 6), generator=torch.Generator().manual_seed(1))
    return dict(family=family, base=base, peft=peft_models, paths=paths, mm=mm, input_ids=input_ids)


def _reference(setup, name):
    return setup["base"] if name is None else setup["peft"][name]


def test_mixed_batch_logits_match_peft(family_setup):
    mm, input_ids = family_setup["mm"], family_setup["input_ids"]
    with torch.no_grad():
        logits = mm(input_ids, adapters=BATCH_ADAPTERS).logits
        for row, name in enumerate(BATCH_ADAPTERS):
            expected = _reference(family_setup, name)(input_ids[row: row + 1]).logits[0]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4, msg=f"row {row} ({name})")
        # the adapters really change the output (else the comparison above proves little)
        base = family_setup["base"](input_ids).logits
    for row, name in enumerate(BATCH_ADAPTERS):
        assert (name is None) == torch.allclose(logits[row], base[row], atol=1e-3), f"row {row} ({name})"


def test_mixed_batch_greedy_generate_matches_peft(family_setup):
    mm, input_ids = family_setup["mm"], family_setup["input_ids"]
    out = mm.generate(input_ids, adapters=BATCH_ADAPTERS, max_new_tokens=4, do_sample=False)
    assert out.shape == (len(BATCH_ADAPTERS), input_ids.shape[1] + 4)
    for row, name in enumerate(BATCH_ADAPTERS):
        expected = _reference(family_setup, name).generate(
            input_ids=input_ids[row: row + 1], max_new_tokens=4, do_sample=False)
        assert torch.equal(out[row], expected[0]), f"row {row} ({name})"


def test_all_lora_modules_share_one_token_id_buffer(family_setup):
    mm = family_setup["mm"]
    modules = list(mm.slots.experts_modules.values()) + list(mm.slots.linear_modules.values())
    assert modules and all(m.token_lora_ids is mm.token_lora_ids for m in modules)
    assert mm.token_lora_ids.dtype == torch.int32


def test_deepseek_dense_layers_and_shared_experts(tmp_path, monkeypatch):
    """DeepSeek-V3's first dense MLP layer and its shared experts get dense LoRA. PEFT rewrites `gate_proj`-style
    targets to the routed experts on transformers 5 models, so its v4->v5 config conversion is switched off here
    to make PEFT target those nn.Linear modules themselves."""
    import peft.utils.transformers_weight_conversion as conversion

    monkeypatch.setattr(conversion, "convert_peft_config_for_transformers", lambda *args, **kwargs: None)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("deepseek_v3")).eval()
    lora = tiny_lora_config("deepseek_v3", r=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(copy.deepcopy(base), lora).eval()
    randomize_lora_(peft_model)
    peft_model.save_pretrained(tmp_path)
    targeted = {n.rpartition(".lora_A")[0] for n, _ in peft_model.named_parameters() if ".lora_A." in n}
    assert any("layers.0.mlp.gate_proj" in n for n in targeted)
    assert any("shared_experts.down_proj" in n for n in targeted)

    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=4)
    mm.load_adapter("a", tmp_path)
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = mm(ids, adapters=["a", None]).logits
        torch.testing.assert_close(logits[0], peft_model(ids[:1]).logits[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits[1], base(ids[1:]).logits[0], rtol=1e-4, atol=1e-4)


def test_left_padded_mixed_batch_generates_like_unpadded_peft():
    """Prompts of different lengths, left-padded with an attention mask: each row's new tokens equal PEFT's on the
    unpadded prompt (pad positions carry the row's adapter id, which the mask makes harmless)."""
    family = "qwen3_moe"
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family)).eval()
        randomize_lora_(peft_model)
        peft_model.save_pretrained(folder)
        mm = attach(copy.deepcopy(base), max_loras=1, max_rank=8)
        mm.load_adapter("a", folder)
    g = torch.Generator().manual_seed(5)
    short, long = torch.randint(3, 128, (1, 3), generator=g), torch.randint(3, 128, (1, 6), generator=g)
    pad = torch.zeros(1, 3, dtype=torch.long)  # pad_token_id 0
    input_ids = torch.cat([torch.cat([pad, short], 1), long])
    attention_mask = torch.cat([torch.cat([pad, torch.ones_like(short)], 1), torch.ones_like(long)])
    out = mm.generate(input_ids, attention_mask=attention_mask, adapters=["a", None], max_new_tokens=4,
                      do_sample=False)
    expected_short = peft_model.generate(input_ids=short, max_new_tokens=4, do_sample=False)[0, 3:]
    expected_long = base.generate(input_ids=long, max_new_tokens=4, do_sample=False)[0, 6:]
    assert torch.equal(out[0, 6:], expected_short) and torch.equal(out[1, 6:], expected_long)
