"""Greedy decoding WITH the KV cache equals PEFT's, for every family and every adapted target on its own.

The cacheless forward is not enough: transformers 5.x DeepSeek-V3 caches the compressed latent and applies
``kv_b_proj`` after the cache update to every cached position (``[B, 1, ctx, r]``), so a LoRA module can see more
rows than the forward has tokens. One PEFT adapter per target (each dense target alone, the experts alone) is loaded
into one attached model; a mixed batch (row i: adapter i, last row: no adapter) is generated with the cache and
compared with each PEFT model's own generation: tokens exactly, per-step logits to 1e-4. ``max_tokens`` is the
prompt's token count, so a module that reads more per-token ids than the forward has tokens cannot pass silently.
"""

import copy

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.families import FAMILIES as FAMILY_TABLE
from moe_lora_compile.models.tiny import _PEFT_DENSE_TARGETS, randomize_lora_, tiny_config, tiny_lora_config

FAMILIES = ["qwen3_moe", "qwen2_moe", "gpt_oss", "mixtral", "deepseek_v3", "olmoe", "llama4",
            "qwen3", "llama", "mistral", "qwen2"]
# targets PEFT reaches beyond the tiny default list (DeepSeek-V3's MLA: kv_b_proj runs on the cached latent)
EXTRA_TARGETS = {"deepseek_v3": ["q_a_proj", "kv_b_proj"]}
PROMPT, NEW = 5, 4


def _targets(family):
    dense = list(_PEFT_DENSE_TARGETS.get(family, ["q_proj", "v_proj", "o_proj"])) + EXTRA_TARGETS.get(family, [])
    model_type = {"llama4": "llama4_text"}.get(family, family)
    is_moe = next(f for f in FAMILY_TABLE if model_type in f.model_types).is_moe
    return dense + (["experts"] if is_moe else [])


def _lora_config(family, target):
    if target == "experts":
        return tiny_lora_config(family, target_modules=[])
    return tiny_lora_config(family, target_modules=[target], target_parameters=[])


def _generate(model, input_ids, **kwargs):
    out = model.generate(input_ids=input_ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                         output_logits=True, **kwargs)
    return out.sequences[:, PROMPT:], torch.stack(out.logits, 1)  # [b, NEW], [b, NEW, V]


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_decode_matches_peft_per_target(family, tmp_path):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    targets = _targets(family)
    peft_models = {}
    for i, target in enumerate(targets):
        peft_model = get_peft_model(copy.deepcopy(base), _lora_config(family, target)).eval()
        randomize_lora_(peft_model, std=0.5, seed=i)
        assert any(".lora_A." in n for n, _ in peft_model.named_parameters()), target
        peft_model.save_pretrained(tmp_path / target)
        peft_models[target] = peft_model
    adapters = targets + [None]
    input_ids = torch.randint(3, 128, (len(adapters), PROMPT), generator=torch.Generator().manual_seed(1))
    mm = attach(copy.deepcopy(base), max_loras=len(targets), max_rank=8, max_tokens=input_ids.numel())
    for target in targets:
        mm.load_adapter(target, tmp_path / target)
    with torch.no_grad():
        tokens, logits = _generate(mm, input_ids, adapters=adapters)
        for row, target in enumerate(adapters):
            ref = base if target is None else peft_models[target]
            want_tokens, want_logits = _generate(ref, input_ids[row: row + 1])
            n = want_tokens.shape[1]  # shorter when this row hit EOS alone
            torch.testing.assert_close(logits[row, :n], want_logits[0], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{family} row {row} ({target}): {m}")
            assert torch.equal(tokens[row, :n], want_tokens[0]), f"{family} row {row} ({target})"


def test_a_forward_under_inference_mode_leaves_no_inference_tensors(tmp_path):
    """A first forward under torch.inference_mode() with more tokens than max_tokens grows the id buffers: they were
    made inference tensors there, and every later forward outside inference_mode failed ("Inplace update to
    inference tensor outside InferenceMode"). Likewise DecodeGraphs' KV storage, allocated at its first prefill."""
    from moe_lora_compile.graphs import DecodeGraphs

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=4, max_tokens=4)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        first = mm(ids).logits
    assert mm.token_lora_ids.numel() >= ids.numel() and not mm.token_lora_ids.is_inference()
    with torch.no_grad():
        assert torch.equal(mm(ids).logits, first)
        assert torch.equal(mm(ids).logits, base(ids).logits)
    graphs = DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=16, capture=False, log=None)
    with torch.inference_mode():
        first = graphs.generate(ids, max_new_tokens=3)
    assert torch.equal(graphs.generate(ids, max_new_tokens=3), first)


def test_generate_refuses_paged_cache_and_takes_inputs(tmp_path):
    """cache_implementation="paged" makes transformers run continuous batching: its forwards (from a thread of its
    own) waited forever on the model's lock, held by the call, and would have packed every sequence into one row
    whatever its adapter. Now a NotImplementedError before anything runs (checked in a thread with a timeout, so a
    regression fails instead of hanging). ``inputs=``, transformers' name for the prompt, is taken as input_ids."""
    import threading

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config("qwen3_moe")).eval()
    randomize_lora_(peft_model, seed=1)
    peft_model.save_pretrained(tmp_path / "a")
    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=4)
    mm.load_adapter("a", tmp_path / "a")
    ids = torch.randint(3, 128, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    outcome = []

    def paged():
        try:
            mm.generate(ids, adapters=["a", None], max_new_tokens=2, cache_implementation="paged")
            outcome.append("ran")
        except NotImplementedError as error:
            outcome.append(str(error))

    worker = threading.Thread(target=paged, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "generate(cache_implementation='paged') hangs"
    assert "continuous batching" in outcome[0] and "ServingEngine" in outcome[0]
    got = mm.generate(inputs=ids, adapters=["a", None], max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got, mm.generate(ids, adapters=["a", None], max_new_tokens=NEW, do_sample=False))
    with torch.no_grad():
        want = peft_model.generate(input_ids=ids[:1], max_new_tokens=NEW, do_sample=False)
    assert torch.equal(got[:1], want)


@pytest.mark.parametrize("options", [
    dict(num_beams=3, num_return_sequences=2),  # beams: rows repeated per beam, each keeps its adapter
    dict(prompt_lookup_num_tokens=2),  # prompt-lookup drafts verified in multi-token steps
    dict(repetition_penalty=1.3, no_repeat_ngram_size=2),  # logits processors
], ids=["beams", "prompt_lookup", "processors"])
def test_generate_options_equal_peft_per_row(tmp_path, options):
    """transformers' generate options through mm.generate: each row equals PEFT's own generate of that row with its
    adapter alone (the base model for None)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config("qwen3_moe")).eval()
    randomize_lora_(peft_model, seed=2, std=0.5)
    peft_model.save_pretrained(tmp_path / "a")
    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=4)
    mm.load_adapter("a", tmp_path / "a")
    ids = torch.randint(3, 128, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=6, do_sample=False, **options)
    if "prompt_lookup_num_tokens" in options:  # transformers runs assisted decoding at batch 1 only
        got = [mm.generate(ids[i:i + 1], adapters=[name], **kwargs) for i, name in enumerate(["a", None])]
    else:
        both = mm.generate(ids, adapters=["a", None], **kwargs)
        got = both.chunk(2)
    with torch.no_grad():
        want = [peft_model.generate(input_ids=ids[:1], **kwargs), base.generate(input_ids=ids[1:], **kwargs)]
    for g, w in zip(got, want):
        assert torch.equal(g[:, :w.shape[1]], w) and (g[:, w.shape[1]:] == 0).all()  # (pad after an eos)
    assert not torch.equal(want[0][:, PROMPT:], want[1][:, PROMPT:])  # the adapter changes the tokens
