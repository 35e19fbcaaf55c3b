"""The attached model traces as one graph (fullgraph) and changing the adapter mix never recompiles (ids are
buffer data); both paths, ``use_ops=True`` (the default: ``torch.ops.moe_lora.*``) and ``use_ops=False`` (the
plain-PyTorch reference), give PEFT's result."""

import copy

import pytest
import torch
from peft import get_peft_model
from torch import nn
from torch._dynamo.testing import CompileCounter
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config


def _setup(family, tmp_path, **attach_kwargs):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family)).eval()
    randomize_lora_(peft_model)
    peft_model.save_pretrained(tmp_path)
    mm = attach(copy.deepcopy(base), max_loras=2, max_rank=8, **attach_kwargs)
    mm.load_adapter("a", tmp_path)
    return base, peft_model, mm


@pytest.mark.parametrize("family", [
    "qwen3_moe",  # decorated experts through ExpertsInterface
    "llama4",     # swapped MoE block
])
def test_fullgraph_and_no_recompile_when_adapters_change(tmp_path, family):
    base, peft_model, mm = _setup(family, tmp_path)
    counter = CompileCounter()
    mm.model.forward = torch.compile(mm.model.forward, fullgraph=True, backend=counter)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    for adapters in (["a", None], [None, "a"], ["a", "a"], [None, None]):
        with torch.no_grad():
            logits = mm(ids, adapters=adapters, use_cache=False).logits
            for row, name in enumerate(adapters):
                expected = (peft_model if name else base)(ids[row: row + 1]).logits[0]
                torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
    assert counter.frame_count == 1


@pytest.mark.parametrize("use_ops", [True, False], ids=["ops", "reference"])
@pytest.mark.parametrize("family", [
    "gpt_oss",  # expert biases and the interleaved layout through the op schema
    "qwen3",    # dense only: lora_linear op
])
def test_ops_and_reference_paths_match_peft(tmp_path, family, use_ops):
    _, peft_model, mm = _setup(family, tmp_path, use_ops=use_ops)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = mm(ids, adapters=["a", None]).logits
        torch.testing.assert_close(logits[0], peft_model(ids[:1]).logits[0], rtol=1e-4, atol=1e-4)
        with peft_model.disable_adapter():
            torch.testing.assert_close(logits[1], peft_model(ids[1:]).logits[0], rtol=1e-4, atol=1e-4)


def test_token_id_buffer_grows_past_max_tokens(tmp_path):
    """A batch larger than max_tokens reallocates the shared buffer (documented: invalidates captured graphs)."""
    _, peft_model, mm = _setup("qwen3_moe", tmp_path, max_tokens=4)
    ids = torch.randint(3, 128, (2, 5))
    with torch.no_grad():
        logits = mm(ids, adapters=["a", "a"]).logits
        expected = peft_model(ids).logits
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    assert mm.token_lora_ids.numel() >= 10
    assert all(m.token_lora_ids is mm.token_lora_ids for m in mm.slots.linear_modules.values())


def test_moving_the_model_keeps_one_shared_token_id_buffer(tmp_path):
    """nn.Module.to() converts each module's buffer separately; the wrapper re-shares its own afterwards."""
    _, peft_model, mm = _setup("qwen2_moe", tmp_path)
    mm.to(torch.float64)
    modules = list(mm.slots.experts_modules.values()) + list(mm.slots.linear_modules.values())
    assert all(m.token_lora_ids is mm.token_lora_ids for m in modules)
    assert mm.slots.experts_modules["model.layers.0.mlp.experts"].lora_a13.dtype == torch.float64
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, adapters=["a"]).logits, peft_model(ids).logits.double(),
                                   rtol=1e-4, atol=1e-4)


def test_attach_freezes_base_weights_so_a_plain_forward_works():
    """A model fresh from ``from_config``/``from_pretrained`` has trainable weights; the ops refuse gradients for
    base weights, so attach freezes them and ``mm(...)`` works outside ``torch.no_grad()`` with ``use_ops=True``."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    assert all(p.requires_grad for p in model.parameters())
    mm = attach(model, max_loras=2, max_rank=4)  # use_ops=True, the default
    assert not any(p.requires_grad for p in mm.parameters())
    logits = mm(torch.randint(3, 128, (2, 5)), adapters=[None, None]).logits
    assert logits.shape == (2, 5, 128) and torch.isfinite(logits).all()


@pytest.mark.parametrize("act, supported", [
    ("swish", True),   # transformers' other name of SiLU (ACT2FN["swish"] is SiLU): the same experts
    ("gelu", False),   # another activation: refused, never computed as SiLU
])
def test_hidden_act_names(act, supported):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", hidden_act=act)).eval()
    if not supported:
        with pytest.raises(ValueError, match=f"hidden_act '{act}' is not supported"):
            attach(copy.deepcopy(base))
        return
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(attach(copy.deepcopy(base))(ids).logits, base(ids).logits)


def test_moe_family_config_without_moe_layers(tmp_path):
    """A Qwen3-MoE config whose every layer is dense (``mlp_only_layers``) attaches with a warning, its dense
    targets only, and serves PEFT's adapter (PEFT adapts what such a model has: here q_proj); experts in a layout
    the library does not read stay an error."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe", mlp_only_layers=[0, 1])).eval()
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config("qwen3_moe", target_parameters=None)).eval()
    randomize_lora_(peft_model)
    peft_model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="this qwen3_moe model has no MoE layer .* only its dense LoRA targets"):
        mm = attach(copy.deepcopy(base), max_loras=2, max_rank=8)
    mm.load_adapter("a", tmp_path)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = mm(ids, adapters=["a", None]).logits
        torch.testing.assert_close(logits[:1], peft_model(ids[:1]).logits)
        torch.testing.assert_close(logits[1:], base(ids[1:]).logits)
    other = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    for layer in other.model.layers:  # experts whose weights are no 3-D parameters
        layer.mlp.experts.gate_up_proj = nn.Parameter(layer.mlp.experts.gate_up_proj.detach()[0])
    with pytest.raises(ValueError, match="in no layout this library reads"):
        attach(other)
