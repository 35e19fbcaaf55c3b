"""``attach(..., fuse=...)``: sibling LoRA linears on one input (q/k/v, gate/up of dense MLPs and shared experts,
DeepSeek MLA's q_a/kv_a) in one ``lora_linear`` call over fused buffers.

Every family with a gate/up group, fused (``fuse=True``: every group) against unfused, with PEFT adapters on every
dense target (those PEFT's API cannot reach on transformers 5, e.g. DeepSeek's MLPs, are written into the saved
file in PEFT's key format): equal logits and greedy tokens for a mixed batch (one row without adapter), after a hot
swap, after a load into a free slot and after ``mm.to(...)``; every peer takes its leader's stash (one call per
group, nothing left behind); the fused model compiles to one graph with no break and no recompile across adapter
mixes. Which groups fuse, and why the others do not, per family and target list.
"""

import copy

import pytest
import torch
from peft import get_peft_model
from safetensors.torch import load_file, save_file
from test_fused_qkv import _compile_and_check, _logits, _stashes
from transformers import AutoModelForCausalLM

from moe_lora_compile.adapters.peft_loader import LinearLoRA
from moe_lora_compile.models import attach
from moe_lora_compile.models.dense import LoRALinear, fused_members, fused_views_intact
from moe_lora_compile.models.families import family_for, find_dense_targets
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

QKV, GATE_UP, MLA = "q_proj,k_proj,v_proj", "gate_proj,up_proj", "q_a_proj,kv_a_proj_with_mqa"
# family, config overrides, the fused groups ("layer.parent:leaves") of fuse=True with the default targets
CASES = {
    "qwen2_moe": ({}, ["0.self_attn:" + QKV, "0.mlp.shared_expert:" + GATE_UP,        # shared expert on [T, H]
                       "1.self_attn:" + QKV, "1.mlp.shared_expert:" + GATE_UP]),
    "deepseek_v3": ({}, ["0.self_attn:" + MLA, "0.mlp:" + GATE_UP,                    # first dense layer, [B, S, H]
                         "1.self_attn:" + MLA, "1.mlp.shared_experts:" + GATE_UP]),   # shared experts, no q/k/v
    "llama4": ({}, ["0.self_attn:" + QKV, "0.feed_forward.shared_expert:" + GATE_UP,  # swapped MoE block
                    "1.self_attn:" + QKV, "1.feed_forward.shared_expert:" + GATE_UP]),
    "qwen3_moe": ({"mlp_only_layers": [0]}, ["0.self_attn:" + QKV, "0.mlp:" + GATE_UP,  # one dense MLP layer
                                             "1.self_attn:" + QKV]),
    "llama": ({}, ["0.self_attn:" + QKV, "0.mlp:" + GATE_UP, "1.self_attn:" + QKV, "1.mlp:" + GATE_UP]),
}
BATCH = ["a", None, "b"]
MAX_RANK = 8


def _short(names):
    """``("model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj")`` -> ``"0.mlp:gate_proj,up_proj"``."""
    parent = names[0].rpartition(".")[0].split(".layers.", 1)[1]
    return parent + ":" + ",".join(n.rpartition(".")[2] for n in names)


def save_adapter(base, path, seed: int, r: int) -> None:
    """A PEFT adapter folder of rank ``r`` (alpha 2r) on ``base``'s experts and on every dense target of its family;
    the dense targets PEFT's API does not reach are added to the saved file in PEFT's own key format."""
    config = tiny_lora_config(base.config.model_type, r=r, lora_alpha=2 * r)
    peft_model = get_peft_model(copy.deepcopy(base), config).eval()
    randomize_lora_(peft_model, seed=seed)
    peft_model.save_pretrained(path)
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(1000 + seed)
    for name, linear in find_dense_targets(base, family_for(base)).items():
        key = f"base_model.model.{name}.lora_"
        if key + "A.weight" not in tensors:
            tensors[key + "A.weight"] = torch.randn(r, linear.in_features, generator=g) * 0.2
            tensors[key + "B.weight"] = torch.randn(linear.out_features, r, generator=g) * 0.2
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(unfused, fused) attached copies of one tiny model with adapters a (r=4) and b (r=8) loaded; c (r=2) saved."""
    family = request.param
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family, **CASES[family][0])).eval()
    root = tmp_path_factory.mktemp(f"siblings_{family}")
    for seed, (name, r) in enumerate((("a", 4), ("b", 8), ("c", 2))):
        save_adapter(base, root / name, seed, r)
    models = []
    for fuse in (False, True):
        mm = attach(copy.deepcopy(base), max_loras=3, max_rank=MAX_RANK, fuse=fuse)
        mm.load_adapter("a", root / "a")
        mm.load_adapter("b", root / "b")
        models.append(mm)
    ids = torch.randint(3, 128, (len(BATCH), 6), generator=torch.Generator().manual_seed(1))
    return dict(family=family, base=base, root=root, plain=models[0], fused=models[1], ids=ids)


def _count_dense_calls(mm, ids, adapters=BATCH) -> int:
    """How many ``lora_linear`` computations (fused or not) one forward of ``mm`` runs."""
    calls = []
    original = LoRALinear._lora_linear
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LoRALinear, "_lora_linear", lambda self, *a: calls.append(1) or original(self, *a))
        _logits(mm, ids, adapters)
    return len(calls)


def _assert_equal(fused, plain, ids, adapters=BATCH, atol=1e-5):
    torch.testing.assert_close(_logits(fused, ids, adapters).float(), _logits(plain, ids, adapters), rtol=0,
                               atol=atol)
    assert _stashes(fused) == []


def test_fused_groups_and_views(pair):
    plain, fused = pair["plain"], pair["fused"]
    assert sorted(map(_short, fused.fused_groups)) == sorted(CASES[pair["family"]][1])
    assert fused.unfused_groups == {} and plain.fused_groups == [] and plain._fused_leaders == []
    for names, leader in zip(fused.fused_groups, fused._fused_leaders):
        members = fused_members(leader)
        assert [fused.model.get_submodule(n) for n in names] == list(members) and fused_views_intact(leader)
        n, k = sum(m.out_features for m in members), len(members)
        assert leader.weight_fused.shape == (n, leader.in_features)
        assert leader.lora_a_fused.shape == (3, k * MAX_RANK, leader.in_features)
        assert leader.lora_b_fused.shape == (3, n, k * MAX_RANK)
        row = 0
        for i, m in enumerate(members):  # B block-diagonal: zero outside each member's own rank block
            off = torch.ones(k * MAX_RANK, dtype=torch.bool)
            off[i * MAX_RANK:(i + 1) * MAX_RANK] = False
            assert (leader.lora_b_fused[:, row:row + m.out_features, off] == 0).all()
            assert (m.lora_b != 0).any()  # every member carries a real adapter
            row += m.out_features
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())
    plain_state, fused_state = plain.state_dict(), fused.state_dict()
    assert list(plain_state) == list(fused_state)
    assert all(torch.equal(plain_state[k], fused_state[k]) for k in plain_state)


def test_logits_generate_swap_and_load_equal(pair):
    plain, fused, ids, root = pair["plain"], pair["fused"], pair["ids"], pair["root"]
    _assert_equal(fused, plain, ids)
    # every peer took its leader's stash: one computation per group instead of one per member
    saved = sum(len(names) - 1 for names in fused.fused_groups)
    assert _count_dense_calls(plain, ids) - _count_dense_calls(fused, ids) == saved > 0
    base = _logits(plain, ids, [None] * len(BATCH))
    expected = _logits(plain, ids)
    assert [not torch.allclose(expected[i], base[i], atol=1e-3) for i in range(len(BATCH))] == [True, False, True]
    out = fused.generate(ids, adapters=BATCH, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain.generate(ids, adapters=BATCH, max_new_tokens=4, do_sample=False))
    assert _stashes(fused) == []
    slot_a = fused.adapters["a"]
    try:
        for mm in (plain, fused):  # hot swap a <- c (rank 2), then c into the free slot
            mm.load_adapter("a", root / "c", replace=True)
            assert mm.load_adapter("c", root / "c") == 2
        _assert_equal(fused, plain, ids, ["c", "a", None])
        _assert_equal(fused, plain, ids, ["b", "c", "a"])
    finally:
        for mm in (plain, fused):
            mm.unload_adapter("c")
            mm.load_adapter("a", root / "a", replace=True)
    assert fused.adapters["a"] == slot_a
    _assert_equal(fused, plain, ids)


def test_move_keeps_fusion(pair):
    mm = attach(copy.deepcopy(pair["base"]), max_loras=3, max_rank=MAX_RANK, fuse=True, max_tokens=4)
    mm.load_adapter("a", pair["root"] / "a")
    mm.to(torch.float64)
    assert all(fused_views_intact(m) and m.weight_fused.dtype == torch.float64 for m in mm._fused_leaders)
    mm.load_adapter("b", pair["root"] / "b")  # written after the move: must reach the fused buffers
    # 18 tokens > max_tokens: the id buffers grow and are re-shared with the fused leaders
    _assert_equal(mm, pair["plain"], pair["ids"])
    assert mm.token_lora_ids.numel() >= 18 and all(m.token_lora_ids is mm.token_lora_ids for m in mm._fused_leaders)


def test_training_a_fused_group_is_refused_and_a_reload_clears_its_zero_blocks(pair):
    """A forward with grad while a fused group's LoRA buffers (the fused ones, or a member's view, as one sets them
    unfused) require grad is a RuntimeError: the members' views got no gradient (None: an optimizer skipped them,
    silently) and the fused B's off-diagonal blocks got some. Values written there anyway (here by hand) are zeroed
    by the next write of the slot: a reload serves the adapter as loaded (it stayed 0.5 off)."""
    plain, ids = pair["plain"], pair["ids"]
    fused = attach(copy.deepcopy(pair["base"]), max_loras=3, max_rank=MAX_RANK, fuse=True)
    fused.load_adapter("a", pair["root"] / "a")
    fused.load_adapter("b", pair["root"] / "b")
    leader = fused._fused_leaders[0]
    member = fused_members(leader)[1]
    for tensor in (leader.lora_b_fused, member.lora_a):
        tensor.requires_grad_(True)
        with pytest.raises(RuntimeError, match="fused LoRA linears .* cannot be trained"):
            fused(ids, adapters=BATCH)
        with torch.no_grad():
            _assert_equal(fused, plain, ids)
        tensor.requires_grad_(False)
    slot = fused.adapters["a"]
    with torch.no_grad():
        leader.lora_b_fused[slot, :leader.out_features, MAX_RANK:] = 1.0  # off-diagonal blocks of slot a
    assert not torch.allclose(_logits(fused, ids, BATCH), _logits(plain, ids, BATCH), atol=1e-3)
    fused.load_adapter("a", pair["root"] / "a", replace=True)
    _assert_equal(fused, plain, ids)
    with torch.no_grad():
        leader.lora_b_fused[slot, :leader.out_features, MAX_RANK:] = 1.0
    fused.unload_adapter("a")
    assert (leader.lora_b_fused[slot] == 0).all()


@pytest.mark.parametrize("assign", [False, True])
def test_loading_a_state_dict_reaches_the_fused_buffers(pair, assign):
    """mm.model.load_state_dict of other base weights: the fused model computes with them, as the unfused one does.
    With assign=True the members' weights became new tensors and the fused buffers kept the old ones (logits off
    by 0.6), silently."""
    torch.manual_seed(5)
    other = AutoModelForCausalLM.from_config(tiny_config(pair["family"], **CASES[pair["family"]][0])).eval()
    models = []
    for fuse in (False, True):
        mm = attach(copy.deepcopy(pair["base"]), max_loras=3, max_rank=MAX_RANK, fuse=fuse)
        mm.load_adapter("a", pair["root"] / "a")
        mm.model.load_state_dict(copy.deepcopy(other.state_dict()), assign=assign)
        models.append(mm)
    plain, fused = models
    assert all(fused_views_intact(leader) for leader in fused._fused_leaders)
    _assert_equal(fused, plain, pair["ids"], ["a", None, "a"])
    fused.load_adapter("b", pair["root"] / "b")  # the fused model still takes adapters
    plain.load_adapter("b", pair["root"] / "b")
    _assert_equal(fused, plain, pair["ids"])


def test_compile_fullgraph_ops_path(pair):
    """use_ops=True: one graph (aot_eager), no break, no recompile for a second adapter mix, equal logits; one
    ``moe_lora.lora_linear`` per fused group."""
    mm = attach(copy.deepcopy(pair["base"]), max_loras=3, max_rank=MAX_RANK, fuse=True, use_ops=True)
    mm.load_adapter("a", pair["root"] / "a")
    mm.load_adapter("b", pair["root"] / "b")
    graph = _compile_and_check(mm, pair)
    calls = sum("lora_linear" in str(node.target) for node in graph.graph.nodes)
    assert calls == len(mm.slots.linear_modules) - sum(len(names) - 1 for names in mm.fused_groups)


def _both_layers(*groups):
    return [f"{layer}.{group}" for layer in range(2) for group in groups]


# family, config overrides, attach kwargs, the fused groups, the unfused groups -> why
STRUCTURE = [
    ("deepseek_v3", {"q_lora_rank": None}, {"fuse": True},  # MLA without q_a: q_proj + kv_a_proj_with_mqa
     ["0.mlp:" + GATE_UP, "1.mlp.shared_experts:" + GATE_UP] + _both_layers("self_attn:q_proj,kv_a_proj_with_mqa"),
     {}),
    ("deepseek_v3", {}, {"fuse": "mla", "target_modules": ["q_a_proj", "q_b_proj", "o_proj"]},  # kv_a not wrapped
     [], dict.fromkeys(_both_layers("self_attn:" + MLA), "kv_a_proj_with_mqa not a LoRA target (not wrapped)")),
    ("gpt_oss", {}, {"fuse": True}, _both_layers("self_attn:" + QKV), {}),  # no dense MLP: q/k/v only
    ("mixtral", {}, {"fuse": ["gate_up", "qkv"]}, _both_layers("self_attn:" + QKV), {}),
    ("olmoe", {}, {"fuse": True}, _both_layers("self_attn:" + QKV), {}),
    ("qwen2_moe", {}, {"fuse": "gate_up"}, _both_layers("mlp.shared_expert:" + GATE_UP), {}),  # one group by name
    ("qwen3", {}, {"fuse": ["gate_up"], "fuse_qkv": True}, _both_layers("self_attn:" + QKV, "mlp:" + GATE_UP), {}),
    ("llama", {}, {"fuse": True, "target_modules": ["q_proj", "v_proj", "gate_proj", "up_proj"]},  # k not wrapped
     _both_layers("mlp:" + GATE_UP), dict.fromkeys(_both_layers("self_attn:" + QKV), "k_proj not a LoRA target "
                                                                                      "(not wrapped)")),
    ("llama", {}, {"fuse": True, "target_modules": ["gate_proj", "down_proj"]},  # up not wrapped; no q/k/v at all
     [], dict.fromkeys(_both_layers("mlp:" + GATE_UP), "up_proj not a LoRA target (not wrapped)")),
]


@pytest.mark.parametrize("family,overrides,kwargs,fused,unfused", STRUCTURE)
def test_which_groups_fuse_and_why_not(family, overrides, kwargs, fused, unfused):
    """Fused groups and reasons; with random slots on every dense target, the fused model equals the unfused one
    and runs one computation per group."""
    base = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    models = [attach(copy.deepcopy(base), max_loras=2, max_rank=4, **{**kwargs, **no_fusion})
              for no_fusion in ({"fuse": False, "fuse_qkv": False}, {})]
    assert sorted(map(_short, models[1].fused_groups)) == sorted(fused)
    assert {_short(names): why for names, why in models[1].unfused_groups.items()} == unfused
    g = torch.Generator().manual_seed(0)
    weights = {name: LinearLoRA(torch.randn(3, m.in_features, generator=g) * 0.3,
                                torch.randn(m.out_features, 3, generator=g) * 0.3)
               for name, m in models[0].slots.linear_modules.items()}
    for mm in models:
        mm.load_adapter_weights("x", weights)
    ids = torch.randint(3, 128, (2, 5), generator=g)
    _assert_equal(models[1], models[0], ids, ["x", None])
    saved = sum(len(names) - 1 for names in models[1].fused_groups)
    assert _count_dense_calls(models[0], ids, ["x", None]) - _count_dense_calls(models[1], ids, ["x", None]) == saved


@pytest.mark.parametrize("fuse,error", [
    ("bogus", ValueError),         # unknown group name
    (["qkv", "up"], ValueError),   # one unknown among known
    (1, TypeError),                # neither a bool nor names
    (["qkv", 3], TypeError),       # a non-str entry
])
def test_bad_fuse_argument(fuse, error):
    with pytest.raises(error, match="fuse"):
        attach(AutoModelForCausalLM.from_config(tiny_config("llama")), fuse=fuse)


# --- GPU (the H200: `pytest -m gpu tests/models/test_fused_siblings.py`); written on a CPU-only machine ---
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_step", "compiled_step"])
def test_gpu_fused_siblings_kernels_and_captured_graphs(tmp_path, family, dtype, compiled):
    """The Triton kernels on every fused group (q/k/v or MLA, gate/up of shared experts and dense MLPs) equal the
    unfused model; captured CUDA-graph decode of the fused model generates what its own generate does (fp32) and
    leaves no stash behind; every peer took its stash in eager mode."""
    from moe_lora_compile.graphs import DecodeGraphs

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    for seed, (name, r) in enumerate((("a", 4), ("b", 8))):
        save_adapter(base, tmp_path / name, seed, r)
    base = base.to("cuda", dtype)
    models = []
    for fuse in (False, True):
        mm = attach(copy.deepcopy(base), max_loras=4, max_rank=MAX_RANK, use_ops=True, fuse=fuse)
        for name in ("a", "b"):
            mm.load_adapter(name, tmp_path / name)
        models.append(mm)
    plain, fused = models
    assert len(fused.fused_groups) == 4
    ids = torch.randint(3, 128, (len(BATCH), 6), generator=torch.Generator().manual_seed(1)).cuda()
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(_logits(fused, ids), _logits(plain, ids), **tol)
    saved = sum(len(names) - 1 for names in fused.fused_groups)
    assert _count_dense_calls(plain, ids) - _count_dense_calls(fused, ids) == saved
    torch._dynamo.reset()
    try:
        graphs = DecodeGraphs(fused, batch_sizes=(1, 4), max_cache_len=32, log=None, compile=compiled).capture()
        ours = graphs.generate(ids, adapters=BATCH, max_new_tokens=6)
    finally:
        torch._dynamo.reset()
    assert _stashes(fused) == []
    if dtype == torch.float32:
        assert torch.equal(ours, fused.generate(ids, adapters=BATCH, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("use_ops", [False, True])
@pytest.mark.parametrize("family, overrides", [
    ("qwen2_moe", dict(shared_expert_intermediate_size=0)),  # the shared expert turned off: zero-width linears
    ("deepseek_v3", dict(n_shared_experts=0)),
])
def test_zero_width_shared_experts_are_no_targets(family, overrides, use_ops):
    """A config that turns the shared expert off leaves transformers zero-width linears, which add nothing: they
    are no LoRA targets, and the model serves as the base does. They were wrapped, and the first forward failed
    (an error naming neither the module nor the config field)."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    zero = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and 0 in m.weight.shape]
    assert zero and not set(zero) & set(find_dense_targets(base, family_for(base)))
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = base(ids).logits
        mm = attach(copy.deepcopy(base), max_loras=1, max_rank=4, use_ops=use_ops)
        torch.testing.assert_close(mm(ids, adapters=[None, None]).logits, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, overrides", [
    ("qwen2_moe", dict(shared_expert_intermediate_size=0)),  # PEFT adapts the zero-width shared-expert linears
])
def test_an_adapter_of_zero_width_linears_loads_and_equals_peft(tmp_path, family, overrides):
    """PEFT adapts the zero-width linears of a turned-off shared expert and serves the adapter (their delta is
    empty or zero): so do we, dropping those pairs; logits equal PEFT's per row. The folder was refused, naming an
    existing module "not a LoRA target"."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family, **overrides)).eval()
    config = tiny_lora_config(family, target_modules=["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(copy.deepcopy(base), config)
    randomize_lora_(peft_model, seed=3)
    peft_model.save_pretrained(tmp_path / "a")
    saved = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert any("shared_expert.up_proj.lora_B" in k and 0 in v.shape for k, v in saved.items())
    from peft import PeftModel

    reference = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path / "a").eval()
    mm = attach(copy.deepcopy(base), max_loras=1, max_rank=8)  # (PEFT 0.22 adapts the experts' gate and up apart
    mm.load_adapter("a", tmp_path / "a")                         # for these names: rank 4 + 4 there)
    parsed = mm.parse_adapter(tmp_path / "a")
    assert parsed and not any("shared_expert" in name for name in parsed)  # the zero-width pairs dropped
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = mm(ids, adapters=["a", None]).logits
        torch.testing.assert_close(ours[:1], reference(input_ids=ids[:1]).logits, rtol=1e-5, atol=1e-5)
        with reference.disable_adapter():
            torch.testing.assert_close(ours[1:], reference(input_ids=ids[1:]).logits, rtol=1e-5, atol=1e-5)
        assert (ours[0] - base(ids[:1]).logits[0]).abs().max() > 1e-2  # the adapter changes something
