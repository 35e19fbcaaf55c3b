"""Slots: load/unload/replace in place, hot swap changes exactly the sequences that use the adapter, and every bad
input raises a clear error while all loaded slots stay intact."""

import copy
import json
import os
import shutil

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.dense import LoRALinear
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

FAMILY = "qwen3_moe"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Base model, PEFT models and saved folders: x, y (experts + attention), attn_only (no expert targets),
    big (rank 16), other_geometry (made for a base with 8 experts)."""
    root = tmp_path_factory.mktemp("adapters")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(FAMILY)).eval()
    specs = {
        "x": (base, dict(r=4)),
        "y": (base, dict(r=2, lora_alpha=2)),
        "attn_only": (base, dict(r=4, target_parameters=None)),
        "big": (base, dict(r=16)),
        "other_geometry": (AutoModelForCausalLM.from_config(tiny_config(FAMILY, num_experts=8)).eval(), dict(r=4)),
        # experts of half the intermediate size, gate_up only: its pair [H, 2 * I/2] has the shape of our down_proj
        "half_width_gate_up": (AutoModelForCausalLM.from_config(tiny_config(FAMILY, moe_intermediate_size=12)).eval(),
                               dict(r=4, target_parameters=["mlp.experts.gate_up_proj"])),
        "lm_head": (base, dict(r=4, target_modules=["q_proj", "lm_head"], target_parameters=None)),
    }
    peft_models, paths = {}, {}
    for i, (name, (model, overrides)) in enumerate(specs.items()):
        peft_model = get_peft_model(copy.deepcopy(model), tiny_lora_config(FAMILY, **overrides)).eval()
        randomize_lora_(peft_model, seed=i)
        paths[name] = root / name
        peft_model.save_pretrained(paths[name])
        peft_models[name] = peft_model
    return dict(base=base, peft=peft_models, paths=paths, root=root)


@pytest.fixture
def mm(adapters):
    """A fresh attached model with x in slot 0 and y in slot 1 (2 free slots)."""
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=4, max_rank=8)
    mm.load_adapter("x", adapters["paths"]["x"])
    mm.load_adapter("y", adapters["paths"]["y"])
    return mm


def _all_buffers(mm):
    """Snapshot of every slot buffer (clones) plus the buffer objects themselves (identity must not change)."""
    modules = list(mm.slots.experts_modules.items()) + list(mm.slots.linear_modules.items())
    tensors = {f"{n}.{b}": getattr(m, b) for n, m in modules for b, _ in m.named_buffers(recurse=False)}
    return {k: v.clone() for k, v in tensors.items()}, {k: id(v) for k, v in tensors.items()}


def _copy_with(src, dst, tensors_fn=None, config_updates=None):
    shutil.copytree(src, dst)
    if tensors_fn is not None:
        path = os.path.join(dst, "adapter_model.safetensors")
        save_file({k: v.clone().contiguous() for k, v in tensors_fn(load_file(path)).items()}, path)
    if config_updates:
        path = os.path.join(dst, "adapter_config.json")
        config = json.loads(open(path).read())
        config.update(config_updates)
        open(path, "w").write(json.dumps(config))
    return dst


def _first_key(tensors, needle):
    return next(k for k in tensors if needle in k)


def _poison(needle, value):
    def fn(t):
        key = _first_key(t, needle)
        t[key] = t[key].clone()
        t[key].view(-1)[0] = value
        return t
    return fn


def _rename(needle, new):
    def fn(t):
        return {k.replace(needle, new): v for k, v in t.items()}
    return fn


def _reshape_q_b(t):
    key = _first_key(t, "q_proj.lora_B")
    t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1])
    return t


def _drop(needle):
    def fn(t):
        del t[_first_key(t, needle)]
        return t
    return fn


BAD_FOLDERS = [
    # (id, how to build the folder from x's, error type, message fragment)
    ("missing_folder", lambda a, d: d, FileNotFoundError, "adapter folder .* does not exist"),
    ("empty_folder", lambda a, d: (d.mkdir(), d)[1], FileNotFoundError, "no adapter_config.json"),
    ("config_file_given", lambda a, d: _copy_with(a["paths"]["x"], d) / "adapter_config.json", FileNotFoundError,
     "is a file, not an adapter folder"),  # the config file's path instead of its folder
    ("missing_weights", lambda a, d: (_copy_with(a["paths"]["x"], d),
                                      os.remove(d / "adapter_model.safetensors"))[0],
     FileNotFoundError, "no adapter_model.safetensors"),
    ("unknown_target", lambda a, d: _copy_with(a["paths"]["x"], d, _rename("self_attn.q_proj", "self_attn.qq_proj")),
     ValueError, "not a LoRA target of this model"),
    ("shape_mismatch", lambda a, d: _copy_with(a["paths"]["x"], d, _reshape_q_b), ValueError, "another base model"),
    ("lora_A_without_B", lambda a, d: _copy_with(a["paths"]["x"], d, _drop("q_proj.lora_B")),
     ValueError, "no partner"),
    ("rank_above_max", lambda a, d: a["paths"]["big"], ValueError, "exceeds max_rank=8"),
    ("dora", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"use_dora": True}), ValueError, "use_dora"),
    ("lora_bias", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"lora_bias": True}),
     ValueError, "lora_bias"),
    ("modules_to_save", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"modules_to_save": ["lm_head"]}),
     ValueError, "modules_to_save"),
    # LoRA variants with another forward: activated LoRA (delta only from the invocation tokens on), block-diagonal
    ("alora", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"alora_invocation_tokens": [5, 6]}),
     ValueError, "alora_invocation_tokens"),
    ("bdlora", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"use_bdlora": {"nblocks": 2}}),
     ValueError, "use_bdlora"),
    # initializations that change the base weights: valid only on that modified base (PEFT redoes the SVD/QR on load)
    ("pissa", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"init_lora_weights": "pissa_niter_4"}),
     ValueError, "changes the base model's weights"),
    ("olora", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"init_lora_weights": "olora"}),
     ValueError, "path_initial_model_for_weight_conversion"),
    # PEFT reads OLoRA in any case (init.lower() == "olora") and CorDA by prefix: "OLoRA" loaded, wrong by 0.25
    ("olora_mixed_case", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"init_lora_weights": "OLoRA"}),
     ValueError, "changes the base model's weights"),
    ("corda_prefixed", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"init_lora_weights": "corda_x"}),
     ValueError, "changes the base model's weights"),
    ("loftq", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"loftq_config": {"loftq_bits": 4}}),
     ValueError, "loftq_config"),
    ("nan_weight", lambda a, d: _copy_with(a["paths"]["x"], d, _poison("experts.lora_B", float("nan"))),
     ValueError, "NaN or Inf"),
    ("inf_weight", lambda a, d: _copy_with(a["paths"]["x"], d, _poison("v_proj.lora_A", float("inf"))),
     ValueError, "NaN or Inf"),
    ("other_base_geometry", lambda a, d: a["paths"]["other_geometry"], ValueError, "another base model"),
    ("rank_differs_from_config", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"r": 3}),
     ValueError, "adapter_config.json gives rank 3"),
    # shapes alone would read its gate_up LoRA as our down_proj's: the config's target_parameters say which it is
    ("other_geometry_same_shapes", lambda a, d: a["paths"]["half_width_gate_up"], ValueError,
     r"the shapes of down_proj of this base .* target_parameters adapt only \['gate_up_proj'\]"),
    ("lm_head_lora", lambda a, d: a["paths"]["lm_head"], ValueError,                  # PEFT saves lm_head's weight
     r"LoRA on lm_head \(embeddings, output layer\) is not supported"),
    # save_embedding_layers=True saves the full lm_head weight beside the factors (was "unsupported adapter weight")
    ("saved_embedding_layer", lambda a, d: _copy_with(
        a["paths"]["x"], d, lambda t: {**t, "base_model.model.lm_head.weight": torch.zeros(128, 64)}),
     ValueError, r"full lm_head weight, saved by PEFT with save_embedding_layers=True"),
]




def _raw_config(text):
    """Replace adapter_config.json by ``text`` verbatim (malformed JSON, a list, NaN, ...)."""
    def build(a, d):
        _copy_with(a["paths"]["x"], d)
        open(os.path.join(d, "adapter_config.json"), "w").write(text)
        return d
    return build


def _config_without(field):
    def build(a, d):
        _copy_with(a["paths"]["x"], d)
        path = os.path.join(d, "adapter_config.json")
        config = json.loads(open(path).read())
        del config[field]
        open(path, "w").write(json.dumps(config))
        return d
    return build


def _truncated(a, d):
    _copy_with(a["paths"]["x"], d)
    path = os.path.join(d, "adapter_model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    return d


def _garbage_header(a, d):
    _copy_with(a["paths"]["x"], d)
    path = os.path.join(d, "adapter_model.safetensors")
    data = bytearray(open(path, "rb").read())
    data[8:40] = b"#" * 32  # the JSON header right after the 8-byte length
    open(path, "wb").write(bytes(data))
    return d


def _retyped(needle, dtype):
    def fn(t):
        key = _first_key(t, needle)
        t[key] = (t[key] * 10).to(dtype)
        return t
    return fn


def _scaled(factor, dtype=None):
    def fn(t):
        return {k: (v.to(dtype) if dtype else v) * (factor if "lora_B" in k else 1) for k, v in t.items()}
    return fn


def _auto_mapping(model_type, cls):
    return {"auto_mapping": {"base_model_class": cls,
                             "parent_library": f"transformers.models.{model_type}.modeling_{model_type}"}}


# Issue 11 items 3, 7 and 8: every malformed, overflowing or foreign folder is a ValueError naming the folder, the
# file and the problem, and leaves every slot bit-identical.
BAD_FOLDERS += [
    # item 3: values that are finite in the file but not after the scaling / the cast to the slot dtype
    ("alpha_nan", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"lora_alpha": float("nan")}),
     ValueError, r"adapter_config.json: lora_alpha must be a finite number, got nan"),
    ("alpha_inf", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"lora_alpha": float("inf")}),
     ValueError, r"lora_alpha must be a finite number"),
    ("alpha_1e308", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"lora_alpha": 1e308}),
     ValueError, r"adapter_model.safetensors: .* is not finite after the scaling .* slot dtype torch.float32"),
    ("fp64_weights_x1e300", lambda a, d: _copy_with(a["paths"]["x"], d, _scaled(1e300, torch.float64)),
     ValueError, r"not finite after the scaling .* slot dtype torch.float32"),
    ("alpha_pattern_nan", lambda a, d: _copy_with(a["paths"]["x"], d,
                                                  config_updates={"alpha_pattern": {"q_proj": float("nan")}}),
     ValueError, r"alpha_pattern\['q_proj'\] must be a finite number"),
    # item 7: malformed adapter_config.json
    ("config_not_json", _raw_config("{not json"), ValueError, r"adapter_config.json: cannot be read as JSON"),
    ("config_a_list", _raw_config("[1, 2]"), ValueError, r"adapter_config.json: must hold a JSON object, got list"),
    ("config_missing_r", _config_without("r"), ValueError, r"adapter_config.json: has no 'r'"),
    ("r_zero", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"r": 0}),
     ValueError, r"adapter_config.json: r must be a positive int, got 0"),
    ("r_a_string", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"r": "4"}),
     ValueError, r"r must be a positive int, got '4'"),
    ("alpha_a_string", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"lora_alpha": "8"}),
     ValueError, r"lora_alpha must be a finite number, got '8'"),
    ("rank_pattern_not_dict", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"rank_pattern": [4]}),
     ValueError, r"rank_pattern must be an object"),
    ("rank_pattern_zero", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"rank_pattern": {"q_proj": 0}}),
     ValueError, r"rank_pattern\['q_proj'\] must be a positive int"),
    ("bad_regex", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"rank_pattern": {"q_proj(": 4}}),
     ValueError, r"rank_pattern key 'q_proj\(' is not a valid regular expression"),
    ("use_rslora_a_string", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates={"use_rslora": "no"}),
     ValueError, r"use_rslora must be true or false"),
    # item 7: corrupt / truncated safetensors, integer and bool tensors
    ("truncated_safetensors", _truncated, ValueError, r"adapter_model.safetensors: cannot be read"),
    ("garbage_safetensors_header", _garbage_header, ValueError, r"adapter_model.safetensors: cannot be read"),
    ("int_tensor", lambda a, d: _copy_with(a["paths"]["x"], d, _retyped("q_proj.lora_A", torch.int32)),
     ValueError, r"adapter_model.safetensors: adapter weight .*q_proj.lora_A.* is torch.int32"),
    ("bool_tensor", lambda a, d: _copy_with(a["paths"]["x"], d, _retyped("experts.lora_B", torch.bool)),
     ValueError, r"is torch.bool; LoRA weights must be floating"),
    # item 8: made for GPT-OSS (interleaved gate/up), same names and shapes, loaded into Qwen3-MoE (concatenated)
    ("gpt_oss_experts_into_qwen3", lambda a, d: _copy_with(a["paths"]["x"], d, config_updates=_auto_mapping(
        "gpt_oss", "GptOssForCausalLM")), ValueError,
     r"adapter_config.json: adapter made for a 'gpt_oss' base .* gate and up mixed up"),
]


@pytest.mark.parametrize("case, build, error, message", BAD_FOLDERS, ids=[c[0] for c in BAD_FOLDERS])
def test_bad_adapter_folder_leaves_slots_intact(mm, adapters, tmp_path, case, build, error, message):
    path = build(adapters, tmp_path / case)
    before, ids_before = _all_buffers(mm)
    with pytest.raises(error, match=message) as excinfo:
        mm.load_adapter("new", path)
    assert os.fspath(path) in str(excinfo.value)  # names the folder
    after, ids_after = _all_buffers(mm)
    assert mm.adapters == {"x": 0, "y": 1}
    assert ids_after == ids_before
    for key in before:
        assert torch.equal(before[key], after[key]), key


def test_bad_hot_swap_keeps_the_old_adapter(mm, adapters, tmp_path):
    before, _ = _all_buffers(mm)
    with pytest.raises(ValueError, match="exceeds max_rank"):
        mm.load_adapter("x", adapters["paths"]["big"], replace=True)
    after, _ = _all_buffers(mm)
    assert mm.adapters == {"x": 0, "y": 1} and all(torch.equal(before[k], after[k]) for k in before)


def test_rank_above_max_names_the_projection(adapters, tmp_path):
    """An expert projection's rank past max_rank (rank_pattern on down_proj only) is refused naming which projection
    of the experts module it is (the message named only the module)."""
    peft_model = get_peft_model(copy.deepcopy(adapters["base"]), tiny_lora_config(FAMILY, r=4,
                                                                                  rank_pattern={"down_proj": 16}))
    peft_model.save_pretrained(tmp_path / "deep_down")
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=1, max_rank=8)
    with pytest.raises(ValueError, match=r"rank 16 of 'model.layers.0.mlp.experts' \(its down projection\) exceeds"):
        mm.load_adapter("z", tmp_path / "deep_down")
    assert mm.adapters == {}


def test_slots_full(mm, adapters):
    mm.load_adapter("z", adapters["paths"]["attn_only"])
    mm.load_adapter("w", adapters["paths"]["attn_only"])
    before, _ = _all_buffers(mm)
    with pytest.raises(ValueError, match="all 4 adapter slots are in use"):
        mm.load_adapter("v", adapters["paths"]["x"])
    after, _ = _all_buffers(mm)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("call, error, message", [
    (lambda mm, ids: mm(ids, adapters=["x", "nope"]), KeyError, "unknown adapter 'nope'"),  # unknown name
    (lambda mm, ids: mm(ids, adapters=["x"]), ValueError, "one adapter name"),             # wrong length
    (lambda mm, ids: mm(ids, adapters="x"), ValueError, "one adapter name"),               # a str, not a list
    (lambda mm, ids: mm.unload_adapter("nope"), KeyError, "unknown adapter 'nope'"),        # unload unknown
    (lambda mm, ids: mm.load_adapter("x", "/nonexistent"), ValueError, "replace=True"),     # name taken
    (lambda mm, ids: mm.load_adapter("", "/nonexistent"), TypeError, "non-empty str"),      # empty name
    (lambda mm, ids: mm.load_adapter("z", None), TypeError, "PEFT adapter folder"),         # no path
    (lambda mm, ids: mm.load_adapter_weights("z", {}), ValueError, "no LoRA factors"),      # nothing to serve
    (lambda mm, ids: mm(ids[0]), ValueError, r"\[batch, seq_len\] integer"),               # 1-D ids
    (lambda mm, ids: mm(ids[0], adapters=["x"]), ValueError, r"\[batch, seq_len\] integer"),  # 1-D, with adapters
    (lambda mm, ids: mm(ids[:, None]), ValueError, r"\[batch, seq_len\] integer"),         # 3-D ids
    (lambda mm, ids: mm(ids[:0]), ValueError, "batch, seq_len >= 1"),                       # empty batch
    (lambda mm, ids: mm(ids[:, :0]), ValueError, "batch, seq_len >= 1"),                    # empty sequences
    (lambda mm, ids: mm(ids.float()), ValueError, "integer token ids"),                     # float ids
    (lambda mm, ids: mm(ids.tolist()), TypeError, "must be a torch.Tensor"),                # a list
    (lambda mm, ids: mm.generate(ids + 1000, max_new_tokens=1), ValueError, r"outside the vocabulary \[0, 128\)"),
])
def test_bad_calls(mm, call, error, message):
    ids = torch.randint(3, 128, (2, 4))
    with pytest.raises(error, match=message):
        call(mm, ids)
    assert mm.adapters == {"x": 0, "y": 1}


def test_direct_call_after_a_call_with_adapters_runs_the_base_model(mm, adapters):
    """The adapters of a ``mm(...)`` call end with it: a later direct call of the wrapped model (which bypasses
    the adapter selection) runs every row without LoRA, never repeating the last caller's adapters."""
    ids = torch.randint(3, 128, (4, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        with_lora = mm(ids[:2], adapters=["x", "y"]).logits
        direct = mm.model(input_ids=ids).logits
        base = adapters["base"](ids).logits
        assert mm(ids[:2], adapters=None).logits.shape == with_lora.shape
    torch.testing.assert_close(direct, base, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(with_lora, base[:2], atol=1e-3)  # the adapters did change the first call


def test_unsupported_model_lists_families():
    from transformers import GPT2Config
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'.*qwen3_moe.*gpt_oss.*llama4"):
        attach(model)


def test_models_whose_names_differ_from_the_adapters_are_explained(adapters):
    """Models whose module names do not match PEFT's keys: a torch.compile'd model ('_orig_mod.' names) is refused
    at attach; an adapter of the causal LM loaded into its inner model names the prefix; a multimodal Llama-4 points
    to its text model. Before, attach took the first two and every load failed with "not a LoRA target", naming the
    very leaf names the adapter used."""
    import transformers

    base = adapters["base"]
    with pytest.raises(ValueError, match=r"torch.compile'd module.*attach\(model._orig_mod\)"):
        attach(torch.compile(copy.deepcopy(base)))
    inner = attach(copy.deepcopy(base).model, max_loras=1, max_rank=8)
    with pytest.raises(ValueError, match=r"not a LoRA target .* this model has 'layers\.0\..*': the adapter was "
                                         r"trained on a model with the extra prefix 'model\.'"):
        inner.load_adapter("x", adapters["paths"]["x"])
    assert inner.adapters == {}
    vision = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, image_size=16,
                  patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    config = transformers.Llama4Config(text_config=tiny_config("llama4").to_dict(), vision_config=vision)
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama4' \(a multimodal model whose text model "
                                         r"is 'llama4_text': attach the text model, e\.g\. "
                                         r"attach\(model\.language_model\)"):
        attach(transformers.Llama4ForConditionalGeneration(config))


def test_hot_swap_changes_exactly_the_sequences_using_it(mm, adapters):
    """Replace x by an adapter without expert targets: rows using x now match that adapter on PEFT (so its expert
    slots were zeroed), every other row is bit-identical, and all buffers are the same tensor objects."""
    ids = torch.randint(3, 128, (4, 5), generator=torch.Generator().manual_seed(3))
    batch = ["x", "y", None, "x"]
    _, buffer_ids = _all_buffers(mm)
    with torch.no_grad():
        before = mm(ids, adapters=batch).logits
        slot = mm.load_adapter("x", adapters["paths"]["attn_only"], replace=True)
        after = mm(ids, adapters=batch).logits
        expected = adapters["peft"]["attn_only"](ids[[0, 3]]).logits
    assert slot == 0 and mm.adapters == {"x": 0, "y": 1}
    assert _all_buffers(mm)[1] == buffer_ids
    for name, module in mm.slots.experts_modules.items():
        assert not module.lora_a13[0].any() and not module.lora_b2[0].any(), name
    torch.testing.assert_close(after[[0, 3]], expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before[0], after[0], atol=1e-3)
    assert torch.equal(before[[1, 2]], after[[1, 2]])


def test_unload_zeroes_the_slot_and_frees_it(mm, adapters):
    ids = torch.randint(3, 128, (1, 5))
    mm.unload_adapter("x")
    assert mm.adapters == {"y": 1}
    for module in list(mm.slots.experts_modules.values()) + list(mm.slots.linear_modules.values()):
        # slot buffers are slot-major ([L, ...]); the ranks put the slot last ([L], [2, L], fused [n, L])
        assert all(not (buf[..., 0] if name.startswith("lora_ranks") else buf[0]).any()
                   for name, buf in module.named_buffers(recurse=False)
                   if name not in ("token_lora_ids", "sequence_lora_ids"))
    with pytest.raises(KeyError, match="unknown adapter 'x'"):
        mm(ids, adapters=["x"])
    assert mm.load_adapter("z", adapters["paths"]["x"]) == 0
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, adapters=["z"]).logits, adapters["peft"]["x"](ids).logits,
                                   rtol=1e-4, atol=1e-4)


def test_attach_target_modules_narrows_dense_targets(adapters):
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=1, max_rank=8, target_modules=["q_proj", "o_proj"])
    assert {name.rpartition(".")[2] for name in mm.slots.linear_modules} == {"q_proj", "o_proj"}
    with pytest.raises(ValueError, match=r"v_proj.*not a LoRA target of this model"):
        mm.load_adapter("x", adapters["paths"]["x"])  # x also targets v_proj
    assert mm.adapters == {}


@pytest.mark.parametrize("kwargs, message", [
    (dict(target_modules=["qkv_proj"]), "not dense LoRA targets of qwen3_moe"),  # unknown leaf name
    (dict(max_loras=0), "max_loras must be a positive int"),                     # no slots
    (dict(max_rank=2.5), "max_rank must be a positive int"),                     # not an int
])
def test_bad_attach_arguments(adapters, kwargs, message):
    with pytest.raises(ValueError, match=message):
        attach(copy.deepcopy(adapters["base"]), **kwargs)


@pytest.mark.parametrize("kwargs,message", [
    (dict(target_modules="q_proj"), "target_modules must be a list of leaf names"),  # a bare string (was read as
                                                                                    # its letters)
    (dict(target_modules=[1]), "target_modules must be a list of leaf names"),       # not names
    (dict(use_ops="yes"), "use_ops must be a bool"),                                 # a truthy non-bool
])
def test_bad_attach_argument_types(adapters, kwargs, message):
    with pytest.raises(TypeError, match=message):
        attach(copy.deepcopy(adapters["base"]), **kwargs)


def test_refused_attach_leaves_the_model_as_it_was(adapters):
    """An unknown target is refused before the model is touched: its parameters stay trainable and its experts on
    transformers' implementation (before, both were changed by the failed call)."""
    model = copy.deepcopy(adapters["base"])
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    experts_impl = getattr(model.config, "_experts_implementation", None)
    with pytest.raises(ValueError, match="not dense LoRA targets"):
        attach(model, target_modules=["nope_proj"])
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before
    assert getattr(model.config, "_experts_implementation", None) == experts_impl


def test_attach_refuses_a_peft_model_and_leaves_it_as_it_was(adapters):
    """A PeftModel (or its inner model) holds PEFT's LoRA layers: attach refuses it, naming the way to the base
    model, and its trainable LoRA stays trainable. It attached with no dense target found (PEFT's layers are no
    nn.Linear), ran the PEFT adapter for adapters=None and froze its parameters."""
    peft_model = copy.deepcopy(adapters["peft"]["x"])
    for model, where in ((peft_model, "is a PeftModel"), (peft_model.base_model.model, "holds PEFT layers")):
        before = {n: p.requires_grad for n, p in model.named_parameters()}
        assert any(before.values())
        with pytest.raises(ValueError, match=rf"{where}.*peft_model.unload\(\)"):
            attach(model)
        assert {n: p.requires_grad for n, p in model.named_parameters()} == before


def test_attach_refused_after_the_checks_of_the_experts_leaves_the_model_trainable():
    """hidden_act gelu is refused inside the experts' attach: the model's parameters stay as trainable as they
    were (attach froze them first)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(FAMILY, hidden_act="gelu"))
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        attach(model)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before and all(before.values())


def test_gradient_checkpointing_in_training_is_refused(mm, adapters):
    """With checkpointing on, a layer recomputed in backward() after another forward read that forward's adapter
    ids: input gradients 100 % off (a reference pass with adapters=None in between, as DPO does), no error. Now
    such a forward raises; in eval mode or under no_grad (checkpointing then inactive) it runs as before."""
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    mm.model.gradient_checkpointing_enable()
    mm.train()
    with pytest.raises(RuntimeError, match="gradient checkpointing is on"):
        mm(ids, adapters=["x", None])
    with mm.manual_token_lora_ids():  # ids written by the caller are rewritten in place as well (was not refused)
        mm.set_token_lora_ids(["x", None], seq_len=5)
        with pytest.raises(RuntimeError, match="gradient checkpointing is on"):
            mm.model(ids)
    with torch.no_grad():
        train_no_grad = mm(ids, adapters=["x", None]).logits
    mm.eval()
    eval_grad = mm(ids, adapters=["x", None]).logits
    with torch.no_grad():
        want = adapters["peft"]["x"](ids).logits[0]
    torch.testing.assert_close(train_no_grad[0], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eval_grad[0].detach(), want, rtol=1e-5, atol=1e-5)


def test_a_target_under_a_path_this_base_lacks_warns_of_nothing(tmp_path):
    """A config shared across families names DeepSeek's ``shared_experts.gate_proj / up_proj`` beside Qwen2-MoE's
    own ``shared_expert.*``: PEFT skips the path this base lacks, and so does the load (it warned of an incomplete
    file, because ``gate_proj`` / ``up_proj`` are also per-expert projection names: PEFT 0.21 keeps them in
    target_modules; 0.22 moves them to target_parameters as ``shared_experts.gate_up_proj``, and warns itself);
    the logits equal PEFT's."""

    from peft import LoraConfig

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen2_moe")).eval()
    config = LoraConfig(r=4, init_lora_weights=False,
                        target_modules=["q_proj", "shared_expert.gate_proj", "shared_expert.up_proj",
                                        "shared_experts.gate_proj", "shared_experts.up_proj"])
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    randomize_lora_(peft_model, seed=6)
    peft_model.save_pretrained(tmp_path / "shared")
    _loads_silently_and_equals_peft(base, peft_model, tmp_path / "shared")


def _loads_silently_and_equals_peft(base, peft_model, folder):
    import warnings

    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm.load_adapter("z", folder)
    x = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(mm(x, adapters=["z", "z"]).logits, peft_model(x).logits, rtol=1e-5, atol=1e-5)


def test_a_second_forward_before_backward_keeps_the_first_ones_gradients(mm):
    """Training through the ops: the slot buffers as leaves. A reference forward (no grad, adapters=None, as DPO
    does) between a forward and its backward, or two forwards whose losses are summed, give the gradients of each
    forward alone (the ops saved a view of the shared id buffer, which the next forward rewrote: autograd refused
    the backward with "modified by an inplace operation")."""
    leaves = [t for m in mm.slots.experts_modules.values() for t in (m.lora_a13, m.lora_b13, m.lora_a2, m.lora_b2)]
    leaves += [t for m in mm.slots.linear_modules.values() for t in (m.lora_a, m.lora_b)]
    for t in leaves:
        t.requires_grad_(True)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    weights = torch.randn(2, 5, 128, generator=torch.Generator().manual_seed(2))
    try:
        mm.train()

        def loss(adapters):
            return (mm(ids, adapters=adapters).logits * weights).sum()

        def grads(value):
            return torch.autograd.grad(value, leaves, allow_unused=True, materialize_grads=True)

        want_xy, want_y = grads(loss(["x", "y"])), grads(loss(["y", None]))
        first = loss(["x", "y"])
        with torch.no_grad():
            mm(ids, adapters=[None, None])
        for got, want in zip(grads(first), want_xy):
            torch.testing.assert_close(got, want)
        for got, a, b in zip(grads(loss(["x", "y"]) + loss(["y", None])), want_xy, want_y):
            torch.testing.assert_close(got, a + b)
        assert any(g.abs().sum() > 0 for g in want_xy)
    finally:
        mm.eval()
        for t in leaves:
            t.requires_grad_(False)


@pytest.mark.parametrize("fused_router, fuse", [
    (False, False),
    (True, False),
    (True, True),  # fused siblings: a copy's member weights / LoRA views were copies of their own, not views of
                   # the copied fused buffers, and the copy refused every load / unload ("no longer alias")
])
def test_copies_and_pickles_of_an_attached_model_serve_alike(adapters, fused_router, fuse):
    """copy.deepcopy(mm), pickle and torch.save / torch.load give models that serve the same logits, with their
    own lock and id buffers (they raised: a threading lock, and the fused routers' classes made at run time), and
    that load and unload adapters."""
    import io
    import pickle

    from moe_lora_compile.models.dense import fused_views_intact

    mm = attach(copy.deepcopy(adapters["base"]), max_loras=4, max_rank=8, use_ops=fused_router,
                fused_router=fused_router, fuse=fuse)
    assert bool(mm.fused_groups) == fuse
    mm.load_adapter("x", adapters["paths"]["x"])
    assert bool(mm.fused_routers) == fused_router
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mm(ids, adapters=["x", None]).logits
    buffer = io.BytesIO()
    torch.save(mm, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(mm), pickle.loads(pickle.dumps(mm)), torch.load(buffer, weights_only=False)):
        assert copied.lock is not mm.lock and copied.token_lora_ids.data_ptr() != mm.token_lora_ids.data_ptr()
        assert all(fused_views_intact(leader) for leader in copied._fused_leaders)
        with torch.no_grad():
            torch.testing.assert_close(copied(ids, adapters=["x", None]).logits, want, rtol=0, atol=0)
        copied.unload_adapter("x")  # the copy's slots are its own
        copied.load_adapter("x2", adapters["paths"]["x"])
        with torch.no_grad():
            torch.testing.assert_close(copied(ids, adapters=["x2", None]).logits, want, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, adapters=["x", None]).logits, want, rtol=0, atol=0)


@pytest.mark.parametrize("fuse", [False, True])
def test_attach_under_inference_mode_loads_and_serves_outside_it(adapters, fuse):
    """attach inside torch.inference_mode() made its slot buffers inference tensors: every later load_adapter
    outside it failed ("Inplace update to inference tensor outside InferenceMode")."""
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    want = attach(copy.deepcopy(adapters["base"]), max_loras=2, max_rank=8, fuse=fuse)
    want.load_adapter("x", adapters["paths"]["x"])
    with torch.inference_mode():
        mm = attach(copy.deepcopy(adapters["base"]), max_loras=2, max_rank=8, fuse=fuse)
    mm.load_adapter("x", adapters["paths"]["x"])
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, adapters=["x", None]).logits, want(ids, adapters=["x", None]).logits,
                                   rtol=0, atol=0)
    with torch.inference_mode():
        mm.load_adapter("x", adapters["paths"]["x"], replace=True)
        torch.testing.assert_close(mm(ids, adapters=["x", None]).logits, want(ids, adapters=["x", None]).logits,
                                   rtol=0, atol=0)


def test_attach_twice_is_an_error(mm):
    with pytest.raises(ValueError, match="already attached"):
        attach(mm.model)


def test_fp16_model_refuses_weights_that_overflow_fp16(adapters, tmp_path):
    """~1e6 weights are fine in fp32 slots but overflow fp16 ones: the check is on the cast tensors."""
    path = _copy_with(adapters["paths"]["x"], tmp_path / "big_values", _scaled(2e5))
    fp32 = attach(copy.deepcopy(adapters["base"]), max_loras=2, max_rank=8)
    fp32.load_adapter("big", path)
    fp16 = attach(copy.deepcopy(adapters["base"]).half(), max_loras=2, max_rank=8)
    fp16.load_adapter("x", adapters["paths"]["x"])
    before, _ = _all_buffers(fp16)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: .* slot dtype torch.float16 \(max 6.55e\+04\)"):
        fp16.load_adapter("big", path)
    after, _ = _all_buffers(fp16)
    assert fp16.adapters == {"x": 0} and all(torch.equal(before[k], after[k]) for k in before)
    module = next(iter(fp16.slots.experts_modules.values()))
    assert module.lora_b13.dtype == torch.float16 and torch.isfinite(module.lora_b13).all()


@pytest.mark.parametrize("how", ["auto_mapping", "local_base_config"])
def test_other_family_with_fitting_names_warns(adapters, tmp_path, how):
    """Item 8: the folder says it was made for another family whose experts share this layout (OLMoE), or has no
    expert weights: load, but warn with the reason."""
    if how == "auto_mapping":
        updates = _auto_mapping("olmoe", "OlmoeForCausalLM")
    else:
        base_dir = tmp_path / "local_base"
        base_dir.mkdir()
        (base_dir / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
        updates = {"auto_mapping": None, "base_model_name_or_path": os.fspath(base_dir)}
    src = adapters["paths"]["x" if how == "auto_mapping" else "attn_only"]
    path = _copy_with(src, tmp_path / how, config_updates=updates)
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=1, max_rank=8)
    with pytest.warns(UserWarning, match=r"adapter made for a '(olmoe|gpt_oss)' base .* into a 'qwen3_moe' model"):
        mm.load_adapter("z", path)
    assert mm.adapters == {"z": 0}


def test_weights_missing_a_configured_target_warn(adapters, tmp_path):
    """A file without the expert pairs its config targets loads (the rest is a valid adapter) but warns, as PEFT
    does ("missing adapter keys"): those modules would run without the adapter's delta."""
    path = _copy_with(adapters["paths"]["x"], tmp_path / "no_experts",
                      lambda t: {k: v for k, v in t.items() if ".experts." not in k})
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=1, max_rank=8)
    with pytest.warns(UserWarning, match=r"adapts 4 module\(s\) of this base model that "
                                         r"adapter_model.safetensors holds no LoRA weights for") as caught:
        mm.load_adapter("z", path)
    message = str(caught[0].message)
    for layer in (0, 1):
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in message
        assert f"model.layers.{layer}.mlp.experts.down_proj" in message
    assert "q_proj" not in message
    assert mm.adapters == {"z": 0}


def _lora_module_names(peft_model) -> set:
    """The base-model names of the modules / parameters PEFT put a LoRA on (3-D expert parameters as
    ``<experts>.<parameter>``)."""
    names = set()
    for key in peft_model.state_dict():
        if ".lora_A." in key:
            name = key.split(".lora_A.")[0].removeprefix("base_model.model.")
            if name.endswith(".experts.base_layer"):  # gate_up: the inner ParamWrapper
                names.add(name.removesuffix(".base_layer") + ".gate_up_proj")
            elif name.endswith(".experts"):
                names.add(name + ".down_proj")
            else:
                names.add(name)
    return names


def test_adapter_of_a_shallower_model_warns_naming_every_module_it_misses(adapters, tmp_path):
    """An adapter saved from a 1-layer model loads into the 2-layer base (its layer 0 is valid), but warns naming
    exactly the modules of layer 1 that PEFT adapts and the file lacks (before: silent, layer 1 ran without the
    adapter). PEFT itself warns of the same missing keys; the reference names are those PEFT adapts on the base."""
    import warnings

    shallow = AutoModelForCausalLM.from_config(tiny_config(FAMILY, num_hidden_layers=1)).eval()
    peft_model = get_peft_model(shallow, tiny_lora_config(FAMILY)).eval()
    randomize_lora_(peft_model, seed=3)
    peft_model.save_pretrained(tmp_path / "shallow")
    want = {n for n in _lora_module_names(adapters["peft"]["x"]) if ".layers.1." in n}
    assert want and all(".layers.1." in n for n in want)
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=1, max_rank=8)
    with pytest.warns(UserWarning, match=rf"adapts {len(want)} module\(s\) .* holds no LoRA weights") as caught:
        mm.load_adapter("z", tmp_path / "shallow")
    message = str(next(w.message for w in caught if "holds no LoRA" in str(w.message)))
    named = set(message.split("(", 2)[2].split(")")[0].split(", "))
    assert named == want
    from peft import PeftModel
    with warnings.catch_warnings(record=True) as peft_caught:
        warnings.simplefilter("always")
        PeftModel.from_pretrained(copy.deepcopy(adapters["base"]), tmp_path / "shallow")
    assert any("missing adapter keys" in str(w.message) and ".layers.1." in str(w.message) for w in peft_caught)


@pytest.mark.parametrize("limits", [
    dict(layers_to_transform=[1]),  # one layer of the attention (PEFT keeps the experts of every layer)
    dict(layers_to_transform=0, layers_pattern="layers"),  # an int, with the name before the index
    dict(exclude_modules=["o_proj"]),  # excluded by suffix
    dict(exclude_modules=r".*layers\.0\.self_attn\.v_proj"),  # excluded by a regex
], ids=["layers_to_transform", "layers_pattern", "exclude_list", "exclude_regex"])
def test_peft_target_limits_warn_of_nothing_and_equal_peft(adapters, tmp_path, limits):
    """Adapters that PEFT limits to some modules (layers_to_transform / layers_pattern / exclude_modules) have
    weights for exactly those: they load without a warning (exclude_list used to warn of an incomplete file), and
    their logits equal PEFT's."""

    peft_model = get_peft_model(copy.deepcopy(adapters["base"]), tiny_lora_config(FAMILY, **limits)).eval()
    randomize_lora_(peft_model, seed=4)
    peft_model.save_pretrained(tmp_path / "limited")
    assert len(_lora_module_names(peft_model)) < len(_lora_module_names(adapters["peft"]["x"]))
    _loads_silently_and_equals_peft(adapters["base"], peft_model, tmp_path / "limited")


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text"])
def test_per_expert_names_that_peft_finds_nowhere_warn_of_nothing(tmp_path, family):
    """GPT-OSS and Llama-4 always had fused experts: PEFT adapts none of them for target_modules gate_proj /
    up_proj / down_proj (only dense modules of those names, Llama-4's shared expert), so an adapter naming them loads
    without the "incomplete file" warning (GPT-OSS warned that 3 modules run without the adapter's delta) and
    equals PEFT."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    config = tiny_lora_config(family, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"],
                              target_parameters=None)
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    randomize_lora_(peft_model, seed=5)
    assert not any(".experts" in n for n in _lora_module_names(peft_model))
    peft_model.save_pretrained(tmp_path / "named")
    _loads_silently_and_equals_peft(base, peft_model, tmp_path / "named")


def test_own_family_does_not_warn(adapters):
    import warnings
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=1, max_rank=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm.load_adapter("x", adapters["paths"]["x"])


def test_slots_hold_each_adapters_rank(adapters, tmp_path):
    """Loading writes each module's real rank per slot (experts: w13 and w2; dense; rank_pattern per module, 0
    where the adapter has no weights), unloading writes 0; the padding past a slot's rank is never read: NaN there
    leaves the model's output on PEFT's."""
    torch.manual_seed(5)
    peft_model = get_peft_model(copy.deepcopy(adapters["base"]),
                                tiny_lora_config(FAMILY, r=4, rank_pattern={"o_proj": 2})).eval()
    randomize_lora_(peft_model, seed=9)
    peft_model.save_pretrained(tmp_path / "patterned")
    mm = attach(copy.deepcopy(adapters["base"]), max_loras=3, max_rank=8)
    mm.load_adapter("y", adapters["paths"]["y"])  # rank 2, slot 0
    mm.load_adapter("p", tmp_path / "patterned")  # rank 4, o_proj 2, slot 1
    for name, module in mm.slots.experts_modules.items():
        assert module.lora_ranks[:, :2].tolist() == [[2, 4], [2, 4]], name
    targeted = 0
    for name, module in mm.slots.linear_modules.items():
        leaf = name.rpartition(".")[2]
        want = [2, 2 if leaf == "o_proj" else 4] if leaf in ("q_proj", "v_proj", "o_proj") else [0, 0]
        targeted += leaf in ("q_proj", "v_proj", "o_proj")
        assert module.lora_ranks[:2].tolist() == want, name
    assert targeted
    for module in list(mm.slots.experts_modules.values()) + list(mm.slots.linear_modules.values()):
        with torch.no_grad():
            for buf, rank_dim in (("lora_a13", 1), ("lora_b13", 2), ("lora_a2", 1), ("lora_b2", 2), ("lora_a", 0),
                                  ("lora_b", 1)):
                if hasattr(module, buf):
                    slot = getattr(module, buf)[1]
                    rank = int(module.lora_ranks[..., 1].max())
                    slot.narrow(rank_dim, rank, slot.shape[rank_dim] - rank).fill_(float("nan"))
    ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, adapters=["p"]).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)
    mm.unload_adapter("p")
    for module in list(mm.slots.experts_modules.values()) + list(mm.slots.linear_modules.values()):
        assert not module.lora_ranks[..., 1].any()


def _dict_of(parsed):
    """Parsed factors as a plain dict (not AdapterWeights): what a caller's own factors look like."""
    return {name: type(lora)(**{f: None if t is None else t.clone() for f, t in vars(lora).items()})
            for name, lora in parsed.items()}


# (parsed from, then the model's cast, lora_B scale, error expected): weights parsed for the slots of one dtype and
# written after the model was cast to another.
PARSED_THEN_CAST = [
    # a folder whose B overflows fp16 (2e5): parsed for fp32 slots, loaded after mm.half() (was written as Inf)
    pytest.param("folder", torch.float16, 2e5, True, id="folder-overflows-fp16"),
    # the caller's own factors, validated for fp32 slots, loaded after mm.half()
    pytest.param("dict", torch.float16, 2e5, True, id="dict-overflows-fp16"),
    # fits fp16: parsed for fp32 slots, loaded after mm.half(): the slots hold what a fresh fp16 load gives
    pytest.param("folder", torch.float16, 1.0, False, id="folder-fits-fp16"),
    # parsed for fp16 slots, loaded after mm.float(): written in fp32 (the parse's fp16 values, cast up)
    pytest.param("folder-fp16", torch.float32, 1.0, False, id="fp16-parse-into-fp32-slots"),
]


@pytest.mark.parametrize("source,cast,scale,fails", PARSED_THEN_CAST)
def test_parsed_weights_are_checked_again_after_the_model_is_cast(adapters, tmp_path, source, cast, scale, fails):
    """parse_adapter's result is trusted for its own slots only while their dtype is the one it was parsed in: after
    ``mm.half()`` the factors are cast and checked again, with the error a fresh load gives, before any slot is
    written (they were written as they were: Inf in fp16 slots)."""
    path = _copy_with(adapters["paths"]["x"], tmp_path / "scaled", _scaled(scale))
    base = copy.deepcopy(adapters["base"])
    mm = attach(base.half() if source == "folder-fp16" else base, max_loras=2, max_rank=8)
    parsed = mm.parse_adapter(path)
    if source == "dict":
        parsed = mm.parse_adapter(_dict_of(parsed))
    mm.to(cast)
    fresh = attach(copy.deepcopy(adapters["base"]).to(cast), max_loras=2, max_rank=8)
    if fails:
        with pytest.raises(ValueError) as want:  # a fresh load of the same factors in the new dtype
            fresh.load_adapter_weights("x", _dict_of(parsed)) if source == "dict" else fresh.load_adapter("x", path)
        before, _ = _all_buffers(mm)
        with pytest.raises(ValueError) as got:
            mm.load_adapter_weights("x", parsed)
        assert str(got.value) == str(want.value)
        after, _ = _all_buffers(mm)
        assert mm.adapters == {} and all(torch.equal(before[k], after[k]) for k in before)
        return
    slot = mm.load_adapter_weights("x", parsed)
    if source == "folder-fp16":  # the independent expectation: the fp16 parse's values, in fp32
        fresh.load_adapter_weights("x", {name: type(lora)(**{f: None if t is None else t.float()
                                                             for f, t in vars(lora).items()})
                                         for name, lora in parsed.items()})
    else:
        fresh.load_adapter("x", path)
    got, _ = _all_buffers(mm)
    want, _ = _all_buffers(fresh)
    for key, value in want.items():
        assert torch.equal(got[key], value), key
        if got[key].is_floating_point():  # (the ranks are int32)
            assert got[key].dtype == cast and torch.isfinite(got[key]).all(), key
    assert slot == 0


def _with_a_float16_overflowing_adapter(adapters, tmp_path):
    """A float32 model with adapters "big" (B = 100 at lora_alpha / r = 1024: beyond float16 once scaled) and "x",
    and a [2, 5] batch of ids."""
    base = adapters["base"]
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(FAMILY, r=4, lora_alpha=4096)).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.fill_(100.0 if ".lora_B." in name else 1e-6)
    peft_model.save_pretrained(tmp_path)
    mm = attach(copy.deepcopy(base), max_loras=3, max_rank=8)
    mm.load_adapter("big", tmp_path)
    mm.load_adapter("x", adapters["paths"]["x"])
    return mm, torch.randint(3, base.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))


def test_a_cast_that_would_overflow_a_loaded_adapter_is_refused(adapters, tmp_path):
    """lora_alpha / r is folded into B: B = 100 at scaling 1024 fits float32 (and float16 as PEFT stores it) but
    not float16 once scaled. A float16 load refuses it; mm.half() after a float32 load made its slots Inf and its
    rows' logits NaN, silently. The cast is now refused before anything converts; without the adapter it runs."""
    mm, x = _with_a_float16_overflowing_adapter(adapters, tmp_path)
    with torch.no_grad():
        before = mm(x, adapters=["big", "x"]).logits
        snapshot, ids = _all_buffers(mm)
        with pytest.raises(ValueError, match=r"cast would make LoRA factors infinite: adapter 'big'.*float16"):
            mm.half()
        after, ids_after = _all_buffers(mm)
        assert ids_after == ids and all(torch.equal(after[k], snapshot[k]) for k in snapshot)
        assert mm.model.lm_head.weight.dtype == torch.float32
        assert torch.equal(mm(x, adapters=["big", "x"]).logits, before)
        mm.to(torch.bfloat16)  # within bfloat16's range: cast
        assert mm.slots.linear_modules[next(iter(mm.slots.linear_modules))].lora_b.dtype == torch.bfloat16
        mm.unload_adapter("big")
        mm.half()
        assert torch.isfinite(mm(x, adapters=[None, "x"]).logits).all()


def test_a_cast_outside_mm_that_overflowed_an_adapter_is_refused_at_use(adapters, tmp_path):
    """mm.model.half() (or the user's own `model` after attach) casts without mm's check: the adapter whose scaled
    factors overflow float16 became Inf there and its rows' logits NaN, silently. Its next use is now a ValueError
    naming it; the other adapters and base rows run; a reload of the slot in range clears it."""
    mm, x = _with_a_float16_overflowing_adapter(adapters, tmp_path)
    with torch.no_grad():
        mm.model.half()  # bypasses mm._apply
        with pytest.raises(ValueError, match=r"adapter 'big' holds infinite factors.*cast outside mm"):
            mm(x, adapters=["big", "x"])
        with pytest.raises(ValueError, match="adapter 'big'"):
            mm.generate(x, adapters=["x", "big"], max_new_tokens=2, do_sample=False)
        logits = mm(x, adapters=[None, "x"]).logits
        assert logits.dtype == torch.float16 and torch.isfinite(logits).all()
        mm.load_adapter("big", adapters["paths"]["x"], replace=True)  # the slot rewritten with finite factors
        assert torch.isfinite(mm(x, adapters=["big", "x"]).logits).all()


@pytest.mark.parametrize("adapters_arg, error", [
    ({"x", "y"}, TypeError),          # a set has no row order: rows got arbitrary adapters (by hash seed)
    ({"x": 0, "y": 1}, TypeError),    # a dict was read by its keys
    (b"ab", TypeError),               # bytes are ints
    ((n for n in ("x", "y")), TypeError),  # forward had no len() for it; DecodeGraphs took it
    ([0, 1], TypeError),              # slot ids are no names (it was "unknown adapter 0")
    (["x"], ValueError),              # one entry for two sequences
])
def test_adapters_must_be_an_ordered_list_of_names(mm, adapters_arg, error):
    ids = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(0))
    with pytest.raises(error, match="adapters"):
        mm(ids, adapters=adapters_arg)


def test_adapters_as_a_tuple_or_numpy_array_of_names(mm, adapters):
    import numpy as np

    ids = torch.randint(3, 128, (2, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = mm(ids, adapters=["x", None]).logits
        assert torch.equal(mm(ids, adapters=("x", None)).logits, want)
        assert torch.equal(mm(ids, adapters=np.array(["x", None], dtype=object)).logits, want)
        assert torch.equal(mm(ids, adapters=np.array(["x", "y"])).logits, mm(ids, adapters=["x", "y"]).logits)


@pytest.mark.parametrize("kwargs", [
    dict(max_rank=10**8),     # a rank typo: 4.5 TiB of zeroed slots (on the CPU the process was killed, no error)
    dict(max_loras=10**7),    # slots for ten million adapters
    dict(max_tokens=10**12),  # id buffers of 7 TiB
])
def test_attach_refuses_slots_larger_than_the_memory_before_allocating(adapters, kwargs):
    model = copy.deepcopy(adapters["base"])
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=rf"{name}={kwargs[name]}.*would take [0-9.]+ GiB, over the"):
        attach(model, **kwargs)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == before  # refused before touching it
    assert not any(isinstance(m, LoRALinear) for m in model.modules())


@pytest.mark.parametrize("keyword", ["adapter_names", "adapter", "adapter_name"])
def test_adapter_keywords_of_other_apis_are_refused_not_dropped(mm, keyword):
    """PEFT's adapter_names= (and near misses) went into transformers' forward, which drops unknown keywords: every
    row ran the base model, silently (generate refused it only through transformers' own kwargs check)."""
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    for call in (mm, mm.generate):
        with pytest.raises(TypeError, match=rf"{keyword}=: not a keyword of this model.*adapters=\["):
            call(ids, **{keyword: ["x", None]})


def test_generate_checks_the_attention_mask_and_the_ids_dtype(mm):
    """mm.generate: a mask of another shape, or with a row of no token, is a ValueError naming it (a shape error deep
    in the model / a silent generation before); right padding stays allowed, as in transformers' generate. Token ids
    of a narrow integer dtype run as int64 ones (they failed inside F.embedding; DecodeGraphs took them already)."""
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"attention_mask must be \[2, 5\] like input_ids"):
        mm.generate(ids, adapters=["x", None], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=2)
    empty_row = torch.ones(2, 5, dtype=torch.long)
    empty_row[1] = 0
    with pytest.raises(ValueError, match="a row has no token"):
        mm.generate(ids, adapters=["x", None], attention_mask=empty_row, max_new_tokens=2)
    right = torch.ones(2, 5, dtype=torch.long)
    right[1, -1] = 0
    assert mm.generate(ids, adapters=["x", None], attention_mask=right, max_new_tokens=2).shape == (2, 7)
    with torch.no_grad():
        assert torch.equal(mm(ids.to(torch.int16), adapters=["x", None]).logits, mm(ids, adapters=["x", None]).logits)
    assert torch.equal(mm.generate(ids.to(torch.uint8), adapters=["x", None], max_new_tokens=2),
                       mm.generate(ids, adapters=["x", None], max_new_tokens=2))
