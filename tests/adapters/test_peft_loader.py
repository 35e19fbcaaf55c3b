"""The loader: both expert key layouts, orientation from shapes (peft_version only as tie-break), per-expert gate/up
merging, and the dense stacks; checked against files rewritten from real PEFT saves and against PEFT's forward."""

import copy
import json
import warnings
import os

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moe_lora_compile.adapters.peft_loader import ExpertsTarget, load_peft_adapter
from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

PREFIX = "base_model.model."


def _make_adapter(family, path, config_overrides=None, lora_overrides=None, seed=0):
    """Base model + a saved PEFT adapter (random non-zero LoRA); returns (base, peft_model)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family, **(config_overrides or {}))).eval()
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family, **(lora_overrides or {}))).eval()
    randomize_lora_(peft_model, seed=seed)
    peft_model.save_pretrained(path)
    return base, peft_model


def _rewrite(src, dst, transform_tensors, config_updates=None):
    """Copy adapter folder ``src`` to ``dst`` with its tensors passed through ``transform_tensors(dict) -> dict``."""
    os.makedirs(dst, exist_ok=True)
    tensors = transform_tensors(load_file(os.path.join(src, "adapter_model.safetensors")))
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(config_updates or {})
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def _experts_keys(tensors):
    """{experts module key prefix: {"gate_up": (A, B), "down": (A, B)}} of a 3-D PEFT save (gate_up is the inner
    ParamWrapper, so its keys carry `.base_layer`)."""
    out = {}
    for key in tensors:
        if key.endswith(".experts.base_layer.lora_A.weight"):
            prefix = key.removesuffix(".base_layer.lora_A.weight")
            out[prefix] = {
                "gate_up": (tensors[f"{prefix}.base_layer.lora_A.weight"],
                            tensors[f"{prefix}.base_layer.lora_B.weight"]),
                "down": (tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]),
            }
    return out


def _to_per_expert(num_experts, names, interleaved=False, rename=None):
    """3-D keys -> per-expert keys ``<experts>.<e>.<gate|up|down>`` with the same A for gate and up."""
    gate_name, up_name, down_name = names

    def transform(tensors):
        out = {k: v for k, v in tensors.items() if ".experts." not in k}
        for prefix, pairs in _experts_keys(tensors).items():
            new_prefix = prefix if rename is None else prefix.replace(*rename)
            for proj, (a, b) in pairs.items():
                r = a.shape[0] // num_experts
                a_e = a.reshape(num_experts, r, -1)                       # expert-major rows
                b_e = b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)  # expert-minor columns
                for e in range(num_experts):
                    if proj == "down":
                        out[f"{new_prefix}.{e}.{down_name}.lora_A.weight"] = a_e[e]
                        out[f"{new_prefix}.{e}.{down_name}.lora_B.weight"] = b_e[e]
                        continue
                    gate_b, up_b = (b_e[e][0::2], b_e[e][1::2]) if interleaved else b_e[e].chunk(2)
                    out[f"{new_prefix}.{e}.{gate_name}.lora_A.weight"] = a_e[e]
                    out[f"{new_prefix}.{e}.{gate_name}.lora_B.weight"] = gate_b
                    out[f"{new_prefix}.{e}.{up_name}.lora_A.weight"] = a_e[e]
                    out[f"{new_prefix}.{e}.{up_name}.lora_B.weight"] = up_b
        return out

    return transform


def _slot_buffers(mm, slot):
    out = {}
    for name, m in mm.slots.experts_modules.items():
        for buf in ("lora_a13", "lora_b13", "lora_a2", "lora_b2"):
            out[f"{name}.{buf}"] = getattr(m, buf)[slot].clone()
    for name, m in mm.slots.linear_modules.items():
        out[f"{name}.lora_a"], out[f"{name}.lora_b"] = m.lora_a[slot].clone(), m.lora_b[slot].clone()
    return out


@pytest.mark.parametrize("family, names, interleaved, rename", [
    ("qwen3_moe", ("gate_proj", "up_proj", "down_proj"), False, None),  # concat gate/up
    ("gpt_oss", ("gate_proj", "up_proj", "down_proj"), True, None),     # interleaved gate/up rows
    ("mixtral", ("w1", "w3", "w2"), False, (".mlp.", ".block_sparse_moe.")),  # legacy names and module path
])
def test_per_expert_and_3d_layouts_load_identical_slots(tmp_path, family, names, interleaved, rename):
    _make_adapter(family, tmp_path / "3d")
    _rewrite(tmp_path / "3d", tmp_path / "per_expert", _to_per_expert(4, names, interleaved, rename))
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    mm = attach(base, max_loras=2, max_rank=8)
    mm.load_adapter("3d", tmp_path / "3d")
    mm.load_adapter("per_expert", tmp_path / "per_expert")
    a, b = _slot_buffers(mm, 0), _slot_buffers(mm, 1)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "experts" in k)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_per_expert_separate_gate_up_a_is_block_diagonal(tmp_path):
    """Distinct gate/up A's (real per-expert adapters): rank r_gate + r_up, each half of B13 sees only its own A."""
    E, H, I, r = 4, 32, 24, 3
    g = torch.Generator().manual_seed(0)
    tensors, prefix = {}, PREFIX + "model.layers.0.mlp.experts"
    for e in range(E):
        for leaf, (n_in, n_out) in (("gate_proj", (H, I)), ("up_proj", (H, I)), ("down_proj", (I, H))):
            tensors[f"{prefix}.{e}.{leaf}.lora_A.weight"] = torch.randn(r, n_in, generator=g)
            tensors[f"{prefix}.{e}.{leaf}.lora_B.weight"] = torch.randn(n_out, r, generator=g)
    os.makedirs(tmp_path / "ad")
    save_file(tensors, tmp_path / "ad" / "adapter_model.safetensors")
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": 6, "peft_type": "LORA"}))
    name = "model.layers.0.mlp.experts"
    for layout in ("concat", "transposed_interleaved"):  # the merged rows follow the base weight's gate/up order
        target = ExpertsTarget(E, H, I, layout)
        lora = load_peft_adapter(str(tmp_path / "ad"), {name: target}, {}, max_rank=8)[name]
        assert lora.a13.shape == (E, 2 * r, H) and lora.b13.shape == (E, 2 * I, 2 * r)
        delta = lora.b13 @ lora.a13  # [E, 2I, H]
        gate, up = (delta[:, 0::2], delta[:, 1::2]) if layout == "transposed_interleaved" else delta.chunk(2, dim=1)
        for e in range(E):
            for leaf, got in (("gate_proj", gate[e]), ("up_proj", up[e])):
                key = f"{prefix}.{e}.{leaf}"
                expected = 2.0 * tensors[f"{key}.lora_B.weight"] @ tensors[f"{key}.lora_A.weight"]  # alpha / r = 2
                torch.testing.assert_close(got, expected)


def _to_old_peft_orientation(num_experts):
    """Rewrite new-PEFT 3-D keys as PEFT < 0.19.1 saved them for [E, out, in] weights: A on the output side."""

    def transform(tensors):
        out = dict(tensors)
        for prefix, pairs in _experts_keys(tensors).items():
            for proj, (a, b) in pairs.items():
                r = a.shape[0] // num_experts
                a_e = a.reshape(num_experts, r, -1)
                b_e = b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)
                old_a = b_e.transpose(1, 2).reshape(num_experts * r, -1)                   # [E*r, out]
                old_b = a_e.permute(2, 1, 0).reshape(a_e.shape[2], r * num_experts)        # [in, r*E], expert-minor
                key = f"{prefix}.base_layer" if proj == "gate_up" else prefix
                out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = old_a, old_b
        return out

    return transform


@pytest.mark.parametrize("hidden, version_decides", [
    (32, False),  # H=32 != 2I=48: orientation follows from the shapes, whatever peft_version says
    (48, True),   # H == 2I: gate_up shapes are symmetric, only peft_version can tell the orientation
])
def test_old_peft_orientation(tmp_path, hidden, version_decides):
    overrides = dict(hidden_size=hidden)
    base, peft_model = _make_adapter("qwen3_moe", tmp_path / "new", config_overrides=overrides)
    _rewrite(tmp_path / "new", tmp_path / "old", _to_old_peft_orientation(4), {"peft_version": "0.17.1"})
    _rewrite(tmp_path / "new", tmp_path / "old_mislabelled", _to_old_peft_orientation(4), {"peft_version": "0.21.2"})
    mm = attach(copy.deepcopy(base), max_loras=3, max_rank=8)
    for name in ("new", "old", "old_mislabelled"):
        mm.load_adapter(name, tmp_path / name)
    new, old, mislabelled = (_slot_buffers(mm, s) for s in range(3))
    gate_up = "model.layers.0.mlp.experts.lora_b13"
    assert all(torch.equal(new[k], old[k]) for k in new)
    assert torch.equal(new[gate_up], mislabelled[gate_up]) == (not version_decides)
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, adapters=["old"]).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("version, swapped", [
    ("0.17.1", False),  # before 0.19.0: A on the weight's dim 1, the input of GPT-OSS's [E, in, out]: today's side
    ("0.19.0", True),   # 0.19.0 swapped in/out for `is_transposed` experts (GPT-OSS): A on the output side
    ("0.19.1", False),  # today's rule
])
def test_gpt_oss_square_experts_by_peft_version(tmp_path, version, swapped):
    """GPT-OSS-20B's down_proj is square (I == H == 2880): only peft_version tells which side A is on, and PEFT
    0.19.0 put it on the side opposite both its predecessors and its successors for GPT-OSS (read as today's, its
    adapters were served with the wrong delta, no error)."""
    base, peft_model = _make_adapter("gpt_oss", tmp_path / "new", config_overrides=dict(intermediate_size=32))
    assert base.config.hidden_size == base.config.intermediate_size
    num_experts = base.config.num_local_experts
    _rewrite(tmp_path / "new", tmp_path / "saved", _to_old_peft_orientation(num_experts) if swapped else (lambda t: t),
             {"peft_version": version})
    mm = attach(copy.deepcopy(base), max_loras=2, max_rank=8)
    mm.load_adapter("new", tmp_path / "new")
    mm.load_adapter("saved", tmp_path / "saved")
    new, saved = _slot_buffers(mm, 0), _slot_buffers(mm, 1)
    assert all(torch.equal(new[k], saved[k]) for k in new)
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(mm(ids, adapters=["saved"]).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)


def test_dense_stacks_and_scaling_from_patterns(tmp_path):
    """lora_linear stacks A [L,R,in], B [L,out,R]: rank padded with zeros, alpha_pattern scaling folded into B."""
    _, peft_model = _make_adapter("qwen3", tmp_path / "ad", lora_overrides=dict(
        r=2, lora_alpha=4, rank_pattern={"o_proj": 3}, alpha_pattern={"o_proj": 9}))
    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3")).eval(), max_loras=2, max_rank=8)
    slot = mm.load_adapter("ad", tmp_path / "ad")
    for name, scale, r in (("model.layers.1.self_attn.q_proj", 4 / 2, 2),    # r and lora_alpha
                           ("model.layers.1.self_attn.o_proj", 9 / 3, 3)):   # rank_pattern and alpha_pattern
        peft_layer = peft_model.base_model.model.get_submodule(name)
        ours = mm.slots.linear_modules[name]
        torch.testing.assert_close(ours.lora_a[slot, :r], peft_layer.lora_A["default"].weight)
        torch.testing.assert_close(ours.lora_b[slot, :, :r], peft_layer.lora_B["default"].weight * scale)
        assert not ours.lora_a[slot, r:].any() and not ours.lora_b[slot, :, r:].any()


def test_concat_family_adapter_refused_by_gpt_oss(tmp_path):
    """Issue 11 item 8, the other way round: a GPT-OSS-shaped adapter whose folder says it was made for Qwen3-MoE
    (concatenated gate/up) is refused by a GPT-OSS model (interleaved), which reads the same names and shapes."""
    base, _ = _make_adapter("gpt_oss", tmp_path / "own")
    _rewrite(tmp_path / "own", tmp_path / "foreign", lambda t: t, {"auto_mapping": {
        "base_model_class": "Qwen3MoeForCausalLM", "parent_library": "transformers.models.qwen3_moe.modeling_qwen3_moe"}})
    mm = attach(base, max_loras=2, max_rank=8)
    mm.load_adapter("own", tmp_path / "own")  # PEFT's own record says gpt_oss: fine
    with pytest.raises(ValueError, match=r"foreign'.*adapter_config.json: adapter made for a 'qwen3_moe' base "
                                         r"\(auto_mapping.parent_library .*\).*'gpt_oss' model.*'concat'.*"
                                         r"'transposed_interleaved'"):
        mm.load_adapter("foreign", tmp_path / "foreign")
    assert mm.adapters == {"own": 0}


def test_dense_adapter_of_another_model_type_warns(tmp_path):
    """The dense row of the family table spans distinct models (llama, mistral, qwen2, qwen3): a folder recorded
    for llama loaded into qwen2 warns like any other family mismatch (it used to load silently)."""
    base, _ = _make_adapter("qwen2", tmp_path / "own")
    _rewrite(tmp_path / "own", tmp_path / "llama", lambda t: t, {"auto_mapping": {
        "base_model_class": "LlamaForCausalLM", "parent_library": "transformers.models.llama.modeling_llama"}})
    mm = attach(base, max_loras=2, max_rank=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm.load_adapter("own", tmp_path / "own")
    with pytest.warns(UserWarning, match=r"adapter made for a 'llama' base .* into a 'qwen2' model"):
        mm.load_adapter("llama", tmp_path / "llama")
    assert mm.adapters == {"own": 0, "llama": 1}


def test_loader_returns_the_slot_dtype(tmp_path):
    """``dtype`` (one, or per module): the factors come back cast, so the slots copy them without a second cast."""
    _make_adapter("qwen3_moe", tmp_path / "ad")
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))
    mm = attach(base, max_loras=1, max_rank=8)
    out = load_peft_adapter(str(tmp_path / "ad"), mm._experts_targets, mm._linear_targets, max_rank=8,
                            dtype=torch.bfloat16)
    assert {t.dtype for lora in out.values() for t in vars(lora).values() if t is not None} == {torch.bfloat16}


# (keys of one expert's w2 pair, as saved): the same module under a legacy name and under its current one.
DUPLICATE_AFTER_RENAME = [
    # Mixtral per-expert: block_sparse_moe.experts.0.w2 and mlp.experts.0.w2 (one used to replace the other)
    pytest.param(("model.layers.0.block_sparse_moe.experts.0.w2", "model.layers.0.mlp.experts.0.w2"),
                 id="per-expert-legacy-and-current"),
    # the same, on another expert and projection (w1): the error names whichever pair comes second
    pytest.param(("model.layers.0.block_sparse_moe.experts.3.w1", "model.layers.0.mlp.experts.3.w1"),
                 id="per-expert-gate"),
]


@pytest.mark.parametrize("modules", DUPLICATE_AFTER_RENAME)
def test_legacy_and_current_names_of_one_module_are_refused(tmp_path, modules):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for module in modules:
        n_in, n_out = (24, 32) if module.endswith("w2") else (32, 24)
        tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.randn(2, n_in, generator=g)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = torch.randn(n_out, 2, generator=g)
    os.makedirs(tmp_path / "ad")
    save_file(tensors, tmp_path / "ad" / "adapter_model.safetensors")
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "peft_type": "LORA"}))
    target = ExpertsTarget(4, 32, 24, "concat", per_expert_names=("w1", "w3", "w2"))
    message = (rf"adapter weights '{modules[0]}' and '{modules[1]}' are both LoRA pairs of module '{modules[1]}' "
               r"\(legacy names read as 'block_sparse_moe' -> 'mlp'\)")
    with pytest.raises(ValueError, match=message):
        load_peft_adapter(str(tmp_path / "ad"), {"model.layers.0.mlp.experts": target}, {}, max_rank=8,
                          aliases={"block_sparse_moe": "mlp"})


class _Expert(torch.nn.Module):
    """A Mixtral-style expert of nn.Linear projections (what PEFT's per-expert keys come from)."""

    def __init__(self, H, I):
        super().__init__()
        self.w1, self.w3 = torch.nn.Linear(H, I, bias=False), torch.nn.Linear(H, I, bias=False)
        self.w2 = torch.nn.Linear(I, H, bias=False)


class _PerExpertModel(torch.nn.Module):
    """``model.layers.0.block_sparse_moe.experts.{e}.{w1,w3,w2}``: nn.Linear experts under the legacy block name."""

    def __init__(self, E, H, I):
        super().__init__()
        moe = torch.nn.Module()
        moe.experts = torch.nn.ModuleList(_Expert(H, I) for _ in range(E))
        layer = torch.nn.Module()
        layer.block_sparse_moe = moe
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])


# LoraConfig overrides of r=2, lora_alpha=4 on nn.Linear experts: PEFT gives each matching module its own rank.
PER_EXPERT_PATTERNS = [
    # one expert's down projection at rank 4, the others at 2 (was refused: "different ranks")
    pytest.param(dict(rank_pattern={"experts.1.w2": 4}), id="one-expert-down-rank"),
    # one expert's gate at rank 3: its gate and up A's differ, stacked (2 + 3), zero-padded in the other experts
    pytest.param(dict(rank_pattern={"experts.0.w1": 3}), id="one-expert-gate-rank"),
    # a rank and an alpha of its own on one expert's up projection (its alpha / r folded into its B alone)
    pytest.param(dict(rank_pattern={"experts.2.w3": 4}, alpha_pattern={"experts.2.w3": 16}),
                 id="one-expert-up-rank-and-alpha"),
    # rsLoRA (alpha / sqrt(r)) with two experts of rank 4 on w2
    pytest.param(dict(rank_pattern={r"experts\.[13]\.w2": 4}, use_rslora=True), id="rslora-two-experts"),
    # no pattern: every expert alike (no warning)
    pytest.param(dict(), id="no-pattern"),
]


@pytest.mark.parametrize("overrides", PER_EXPERT_PATTERNS)
def test_per_expert_rank_pattern_matches_peft_forward(tmp_path, overrides):
    """Experts of one projection with ranks of their own load zero-padded to the largest; each expert's delta equals
    PEFT's own forward of that nn.Linear (float32). A warning says so when patterns single experts out: PEFT loads
    such a folder into its 3-D expert weights today and drops those keys (its outputs differ from ours there)."""
    from peft import LoraConfig

    E, H, I = 4, 32, 24
    torch.manual_seed(0)
    base = _PerExpertModel(E, H, I).eval()
    peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(target_modules=["w1", "w3", "w2"], r=2,
                                                                 lora_alpha=4, **overrides)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    peft_model.save_pretrained(tmp_path / "ad")
    name = "model.layers.0.mlp.experts"
    target = ExpertsTarget(E, H, I, "concat", per_expert_names=("w1", "w3", "w2"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lora = load_peft_adapter(str(tmp_path / "ad"), {name: target}, {}, max_rank=8,
                                 aliases={"block_sparse_moe": "mlp"})[name]
    told = [str(w.message) for w in caught if "give single experts their own rank" in str(w.message)]
    assert len(told) == (1 if overrides else 0), told
    experts = peft_model.base_model.model.model.layers[0].block_sparse_moe.experts
    base_experts = base.model.layers[0].block_sparse_moe.experts
    x, h = torch.randn(5, H, generator=g), torch.randn(5, I, generator=g)
    with torch.no_grad():
        for e in range(E):
            d13 = x @ lora.a13[e].T @ lora.b13[e].T  # [5, 2I]: gate rows, then up rows (concat)
            for leaf, got in (("w1", d13[:, :I]), ("w3", d13[:, I:])):
                want = getattr(experts[e], leaf)(x) - getattr(base_experts[e], leaf)(x)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            want = experts[e].w2(h) - base_experts[e].w2(h)
            torch.testing.assert_close(h @ lora.a2[e].T @ lora.b2[e].T, want, rtol=1e-5, atol=1e-5)
    ranks = {e: experts[e].w2.lora_A["default"].weight.shape[0] for e in range(E)}
    assert lora.a2.shape[1] == max(ranks.values())  # padded to the largest rank, no more


# (files in the folder besides a valid adapter_config.json listing targets, error type, message)
WEIGHTLESS_FOLDERS = [
    # an adapter_model.safetensors with no tensors at all (was served as the base model, silently)
    pytest.param("empty_safetensors", ValueError,
                 r"adapter folder '.*empty_safetensors', adapter_model.safetensors: holds no LoRA weights",
                 id="empty-safetensors"),
    # only PEFT's pickle checkpoint (save_pretrained(..., safe_serialization=False))
    pytest.param("bin_only", FileNotFoundError,
                 r"no adapter_model.safetensors in adapter folder '.*bin_only', only adapter_model.bin: pickle "
                 r"\(.bin\) checkpoints are not supported .* safe_serialization=True", id="bin-only"),
    # no weights file at all
    pytest.param("no_weights", FileNotFoundError, r"no adapter_model.safetensors in adapter folder '.*no_weights'$",
                 id="no-weights-file"),
]


@pytest.mark.parametrize("kind,error,message", WEIGHTLESS_FOLDERS)
def test_folder_without_lora_weights_is_refused(tmp_path, kind, error, message):
    folder = tmp_path / kind
    os.makedirs(folder)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "target_parameters": ["mlp.experts.gate_up_proj"]}))
    if kind == "empty_safetensors":
        save_file({}, folder / "adapter_model.safetensors")
    elif kind == "bin_only":
        torch.save({}, folder / "adapter_model.bin")
    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval(), max_loras=1, max_rank=8)
    with pytest.raises(error, match=message):
        mm.load_adapter("x", folder)
    assert mm.adapters == {}


# a dense projection adapted through target_parameters (PEFT saves plain lora_A / lora_B keys for it) with patterns:
# PEFT matches rank_pattern / alpha_pattern against the parameter's name "<module>.weight", not the module's
DENSE_TARGET_PARAMETER_PATTERNS = [
    # applied: alpha 32 on q_proj.weight (the loader took q_proj's default alpha: a delta 4x too small)
    pytest.param(dict(alpha_pattern={"q_proj.weight": 32}), id="alpha-on-weight-name"),
    # not applied by PEFT: "q_proj" does not end "…q_proj.weight" (the loader applied it: a delta 4x too large)
    pytest.param(dict(alpha_pattern={"q_proj": 32}), id="alpha-on-module-name"),
    # rank 2 for q_proj.weight (the loader refused it: "has rank 2 but adapter_config.json gives rank 4")
    pytest.param(dict(rank_pattern={"q_proj.weight": 2}), id="rank-on-weight-name"),
    # v_proj through target_modules takes the module pattern, q_proj.weight through target_parameters does not
    pytest.param(dict(target_modules=["v_proj"], alpha_pattern={r".*_proj": 32}), id="module-and-parameter"),
]


@pytest.mark.parametrize("overrides", DENSE_TARGET_PARAMETER_PATTERNS)
def test_dense_target_parameters_take_patterns_by_parameter_name(tmp_path, overrides):
    """Logits with the adapter equal PEFT's own forward (float32), the adapter's delta visible."""
    from peft import LoraConfig

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval()
    config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": [],
                           "target_parameters": ["self_attn.q_proj.weight"], **overrides})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    randomize_lora_(peft_model, std=0.2, seed=0)
    peft_model.save_pretrained(tmp_path / "ad")
    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=8)
    mm.load_adapter("a", str(tmp_path / "ad"))
    ids = torch.randint(3, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, plain = peft_model(ids).logits, base(ids).logits
        got = mm(ids, adapters=["a", "a"]).logits
    assert (want - plain).abs().max() > 0.05  # the adapter changes the logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, lora_overrides", [
    ("qwen3_moe", dict(r=8, lora_alpha=16, use_rslora=True)),  # scaling 16 / sqrt(8): not exact in float32
    ("mixtral", dict(r=4, lora_alpha=7)),                      # per-expert keys, scaling 7 / 4
])
def test_float64_model_gets_float64_factors(tmp_path, family, lora_overrides):
    """A float64 model and a float64 adapter (PEFT saves the parameters' dtype): the slots hold B * scaling
    computed in float64, as PEFT's float64 model does; parsed and scaled in float32 they were ~1e-7 off and the
    logits 4e-7 off PEFT's."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval().double()
    base.set_experts_implementation("eager")  # transformers' grouped_mm has no float64 kernel on the CPU
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family, **lora_overrides)).eval().double()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # float64 values that float32 cannot hold
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.2)
    peft_model.save_pretrained(tmp_path)
    assert {t.dtype for t in load_file(os.path.join(tmp_path, "adapter_model.safetensors")).values()} == {torch.float64}
    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=8)
    mm.load_adapter("a", tmp_path)
    q = mm.model.model.layers[0].self_attn.q_proj
    peft_q = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    want_b = peft_q.lora_B["default"].weight * peft_q.scaling["default"]
    assert q.lora_b.dtype == torch.float64
    assert torch.equal(q.lora_b[0, :, :want_b.shape[1]], want_b)
    x = torch.randint(3, base.config.vocab_size, (2, 6), generator=generator)
    with torch.no_grad():
        got = mm(x, adapters=["a", "a"]).logits
        want = peft_model(x).logits
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()
