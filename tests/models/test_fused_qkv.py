"""``attach(..., fuse_qkv=True)``: q/k/v of one attention in one ``lora_linear`` call over fused buffers.

Fused and unfused attach of the same tiny model with the same PEFT adapters (q/k/v/o targeted, so every block of
the fused buffers carries a real adapter) give equal logits and greedy tokens; hot swap and unload write exactly
their slot's diagonal blocks; state dicts are unchanged; the fused model compiles to one graph; moving it keeps the
fusion; the Triton kernels (interpreter, float32) compute one fused projection like the reference.
"""

import copy

import pytest
import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from moe_lora_compile.models import attach
from moe_lora_compile.models.dense import LoRALinear, fused_members, fused_views_intact, point_fused_views
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

FAMILIES = [
    "qwen3_moe",  # q_norm / k_norm on the projections' outputs
    "gpt_oss",    # q/k/v biases, sinks, sliding window
    "mixtral",
    "olmoe",      # q_norm / k_norm over the whole projection
    "qwen2_moe",  # q/k/v biases
    "llama4",     # k viewed without a transpose, swapped MoE block
    "llama",      # dense model
]
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
BATCH = ["a", None, "b"]
MAX_RANK = 8


def _adapter(family, base, path, seed, r):
    overrides = dict(r=r, lora_alpha=2 * r, target_modules=QKVO)
    peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(family, **overrides)).eval()
    randomize_lora_(peft_model, seed=seed)
    peft_model.save_pretrained(path)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(unfused, fused) attached copies of one tiny model with adapters a (r=4) and b (r=8) loaded; c saved. On the
    reference path (``use_ops=False``): the tests count its calls and compile it; the ops path has its own test."""
    family = request.param
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    root = tmp_path_factory.mktemp(f"qkv_{family}")
    for seed, (name, r) in enumerate((("a", 4), ("b", 8), ("c", 2))):
        _adapter(family, base, root / name, seed, r)
    models = []
    for fuse in (False, True):
        mm = attach(copy.deepcopy(base), max_loras=3, max_rank=MAX_RANK, fuse_qkv=fuse, use_ops=False)
        mm.load_adapter("a", root / "a")
        mm.load_adapter("b", root / "b")
        models.append(mm)
    ids = torch.randint(3, 128, (len(BATCH), 6), generator=torch.Generator().manual_seed(1))
    return dict(family=family, base=base, root=root, plain=models[0], fused=models[1], ids=ids)


def _logits(mm, ids, adapters=BATCH):
    with torch.no_grad():
        return mm(ids, adapters=adapters).logits


def _stashes(mm):
    return [m._fused_stash for m in mm.model.modules() if isinstance(m, LoRALinear) and m._fused_stash is not None]


def test_every_attention_fused_with_views(pair):
    plain, fused = pair["plain"], pair["fused"]
    layers = plain.model.config.num_hidden_layers
    assert len(fused._fused_leaders) == layers and plain._fused_leaders == []
    for q in fused._fused_leaders:
        assert fused_views_intact(q)
        k, v = q._fused_peers
        n = q.out_features + k.out_features + v.out_features
        assert q.weight_fused.shape == (n, q.in_features) and q.lora_a_fused.shape == (3, 3 * MAX_RANK, q.in_features)
        assert q.lora_b_fused.shape == (3, n, 3 * MAX_RANK)
        assert (q.bias_fused is None) == (q.bias is None)
        assert q.weight.data_ptr() == q.weight_fused.data_ptr()
        assert k.weight.data_ptr() == q.weight_fused[q.out_features].data_ptr()
    # no parameter added, none duplicated
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in plain.parameters())


def test_state_dict_unchanged(pair):
    plain, fused = pair["plain"].state_dict(), pair["fused"].state_dict()
    assert list(plain) == list(fused)
    for key in plain:
        assert torch.equal(plain[key], fused[key]), key
    # and a load_state_dict writes into the fused weight (in place, through the views)
    q = pair["fused"]._fused_leaders[0]
    k = q._fused_peers[0]
    before = q.weight_fused.clone()
    key = next(n for n, p in pair["fused"].named_parameters() if p is k.weight)
    try:
        pair["fused"].load_state_dict({key: torch.ones_like(k.weight)}, strict=False)
        rows = slice(q.out_features, q.out_features + k.out_features)
        assert (q.weight_fused[rows] == 1).all() and torch.equal(q.weight_fused[: q.out_features], before[: q.out_features])
    finally:
        pair["fused"].load_state_dict({key: before[rows]}, strict=False)
    assert torch.equal(q.weight_fused, before)


def test_mixed_batch_logits_and_generate_equal(pair):
    plain, fused, ids = pair["plain"], pair["fused"], pair["ids"]
    calls = []
    for q in fused._fused_leaders:  # count the fused calls: one per attention per forward
        original = q._forward_fused
        q._forward_fused = lambda x, _f=original: calls.append(1) or _f(x)
    try:
        expected = _logits(plain, ids)
        torch.testing.assert_close(_logits(fused, ids), expected, rtol=0, atol=1e-5)
    finally:
        for q in fused._fused_leaders:
            del q._forward_fused
    assert len(calls) == len(fused._fused_leaders) and _stashes(fused) == []
    # k and v took q's stash: per forward, 2 fewer dense calls per attention than unfused
    import moe_lora_compile.models.dense as dense

    counts = []
    for mm in (plain, fused):
        n = []
        with pytest.MonkeyPatch.context() as patch:
            reference = dense.lora_linear_reference
            patch.setattr(dense, "lora_linear_reference", lambda *a, **k: n.append(1) or reference(*a, **k))
            _logits(mm, ids)
        counts.append(len(n))
    assert counts[0] - counts[1] == 2 * len(fused._fused_leaders)
    base = _logits(plain, ids, [None] * len(BATCH))
    assert [not torch.allclose(expected[i], base[i], atol=1e-3) for i in range(len(BATCH))] == [True, False, True]
    out = fused.generate(ids, adapters=BATCH, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, plain.generate(ids, adapters=BATCH, max_new_tokens=4, do_sample=False))
    assert _stashes(fused) == []


def _fused_snapshot(mm):
    return [(q.lora_a_fused.clone(), q.lora_b_fused.clone()) for q in mm._fused_leaders]


def _assert_block_diagonal(q):
    R = q.lora_a_fused.shape[1] // 3
    row = 0
    for i, size in enumerate(q._fused_sizes):
        off = torch.ones(3 * R, dtype=torch.bool)
        off[i * R:(i + 1) * R] = False
        assert (q.lora_b_fused[:, row:row + size, off] == 0).all()
        row += size


def test_hot_swap_and_unload_touch_only_their_slot(pair):
    plain, fused, ids, root = pair["plain"], pair["fused"], pair["ids"], pair["root"]
    slot_a, slot_b = fused.adapters["a"], fused.adapters["b"]
    before = _fused_snapshot(fused)
    try:
        for mm in (plain, fused):
            mm.load_adapter("a", root / "c", replace=True)
        torch.testing.assert_close(_logits(fused, ids), _logits(plain, ids), rtol=0, atol=1e-5)
        after = _fused_snapshot(fused)
        for q, (a0, b0), (a1, b1) in zip(fused._fused_leaders, before, after):
            _assert_block_diagonal(q)
            assert torch.equal(a1[slot_b], a0[slot_b]) and torch.equal(b1[slot_b], b0[slot_b])
            assert not torch.equal(a1[slot_a], a0[slot_a]) and not torch.equal(b1[slot_a], b0[slot_a])
            # rank 2 of c: every projection's block is written up to rank 2 and zero-padded after
            R = MAX_RANK
            for i in range(3):
                assert (a1[slot_a, i * R + 2:(i + 1) * R] == 0).all() and (a1[slot_a, i * R:i * R + 2] != 0).any()
        for mm in (plain, fused):
            mm.unload_adapter("a")
        for q, (a0, b0) in zip(fused._fused_leaders, before):
            assert (q.lora_a_fused[slot_a] == 0).all() and (q.lora_b_fused[slot_a] == 0).all()
            assert torch.equal(q.lora_a_fused[slot_b], a0[slot_b]) and torch.equal(q.lora_b_fused[slot_b], b0[slot_b])
        torch.testing.assert_close(_logits(fused, ids, [None, "b", None]), _logits(plain, ids, [None, "b", None]),
                                   rtol=0, atol=1e-5)
    finally:
        for mm in (plain, fused):
            if "a" in mm.adapters:
                mm.unload_adapter("a")
            assert mm.load_adapter("a", root / "a") == slot_a
    for q, (a0, b0) in zip(fused._fused_leaders, before):
        assert torch.equal(q.lora_a_fused, a0) and torch.equal(q.lora_b_fused, b0)


def test_k_and_v_alone_or_with_another_input(pair):
    """Called without q (or after q ran on another tensor) k and v compute their own product; a stale stash is
    dropped, never returned for the wrong input."""
    plain, fused = pair["plain"], pair["fused"]
    name = next(n for n, m in fused.model.named_modules() if m is fused._fused_leaders[0]).rpartition(".")[0]
    attn_f, attn_p = fused.model.get_submodule(name), plain.model.get_submodule(name)
    h, other = torch.randn(2, 3, attn_f.q_proj.in_features), torch.randn(2, 3, attn_f.q_proj.in_features)
    fused.set_token_lora_ids(["a", "b"], 3)
    plain.set_token_lora_ids(["a", "b"], 3)
    with torch.no_grad():
        for leaf in ("k_proj", "v_proj", "q_proj"):
            torch.testing.assert_close(getattr(attn_f, leaf)(h), getattr(attn_p, leaf)(h), rtol=0, atol=1e-6)
        attn_f.q_proj(h)  # stashes k and v for h
        torch.testing.assert_close(attn_f.k_proj(other), attn_p.k_proj(other), rtol=0, atol=1e-6)
        torch.testing.assert_close(attn_f.v_proj(other), attn_p.v_proj(other), rtol=0, atol=1e-6)
    assert _stashes(fused) == []


def _compile_and_check(mm, pair, backend="aot_eager"):
    """Compile ``mm.model`` with fullgraph; two adapter mixes: equal to unfused, one graph, no break, no stash left.
    Returns the Dynamo graph."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    forward = mm.model.forward
    mm.model.forward = torch.compile(forward, fullgraph=True, backend=record)
    try:
        for adapters in (BATCH, ["b", "a", None]):
            torch.testing.assert_close(_logits(mm, pair["ids"], adapters), _logits(pair["plain"], pair["ids"], adapters),
                                       rtol=0, atol=1e-5)
            assert _stashes(mm) == []
    finally:
        mm.model.forward = forward
        torch._dynamo.reset()
    assert len(graphs) == 1 and sum(counters["graph_break"].values()) == 0
    return graphs[0]


def test_compile_fullgraph_ops_path_one_lora_linear_per_attention_qkv(pair):
    """use_ops=True (the GPU path): one graph through AOT, no break, no recompile for another adapter mix, equal
    logits; the graph holds one ``moe_lora.lora_linear`` per attention for q/k/v plus one per other dense target."""
    mm = attach(copy.deepcopy(pair["base"]), max_loras=3, max_rank=MAX_RANK, fuse_qkv=True, use_ops=True)
    mm.load_adapter("a", pair["root"] / "a")
    mm.load_adapter("b", pair["root"] / "b")
    graph = _compile_and_check(mm, pair)
    calls = sum("lora_linear" in str(node.target) for node in graph.graph.nodes)
    assert calls == len(mm.slots.linear_modules) - 2 * len(mm._fused_leaders)


def test_compile_fullgraph_reference_path(pair):
    if pair["family"] != "gpt_oss":
        pytest.skip("one family (biases) on the reference path; the ops path runs for all")
    _compile_and_check(pair["fused"], pair)


def test_decode_graphs_compiled_equal_generate(pair):
    """DecodeGraphs(compile=True, capture=False) over the fused model generates what the unfused model does."""
    if pair["family"] != "qwen3_moe":
        pytest.skip("one family (Inductor compile of the decode step and the prefill)")
    from moe_lora_compile.graphs import DecodeGraphs
    from torch._dynamo.utils import counters

    plain, fused, ids = pair["plain"], pair["fused"], pair["ids"]
    torch._dynamo.reset()
    counters.clear()
    try:
        graphs = DecodeGraphs(fused, batch_sizes=(4,), max_cache_len=16, capture=False, compile=True, log=None)
        ours = graphs.generate(ids, adapters=BATCH, max_new_tokens=3)
    finally:
        torch._dynamo.reset()
    assert sum(counters["graph_break"].values()) == 0 and _stashes(fused) == []
    assert torch.equal(ours, plain.generate(ids, adapters=BATCH, max_new_tokens=3, do_sample=False))


def test_move_keeps_fusion_and_moving_the_inner_model_refuses(pair):
    if pair["family"] != "qwen2_moe":
        pytest.skip("one family (biases)")
    mm = attach(copy.deepcopy(pair["base"]), max_loras=3, max_rank=MAX_RANK, fuse_qkv=True, max_tokens=4)
    mm.load_adapter("a", pair["root"] / "a")
    mm.to(torch.float64)
    assert all(fused_views_intact(q) and q.weight_fused.dtype == torch.float64 for q in mm._fused_leaders)
    assert all(m.token_lora_ids is mm.token_lora_ids for m in mm.slots.linear_modules.values())
    mm.load_adapter("b", pair["root"] / "b")  # written after the move: must reach the fused buffers
    expected = _logits(pair["plain"], pair["ids"])
    torch.testing.assert_close(_logits(mm, pair["ids"]).float(), expected, rtol=0, atol=1e-5)
    # 18 tokens > max_tokens: the id buffers grew and were re-shared, the fused q modules read the new ones
    assert mm.token_lora_ids.numel() >= 18 and all(q.token_lora_ids is mm.token_lora_ids for q in mm._fused_leaders)
    mm.model.to(torch.float32)  # the inner model alone: views broken
    assert not all(fused_views_intact(q) for q in mm._fused_leaders)
    with pytest.raises(RuntimeError, match="fuse_qkv"):
        mm.load_adapter("c", pair["root"] / "c")
    with pytest.raises(RuntimeError, match="mm.to"):
        mm.unload_adapter("a")


def test_member_weights_changed_in_place_or_rebound(pair):
    """In place (copy_) the fused forward reads the new weight; re-bound (a new Parameter, or .data =) it would
    not: the next forward refuses instead of computing with the old one."""
    if pair["family"] != "qwen2_moe":
        pytest.skip("one family (biases)")
    plain, fused = (attach(copy.deepcopy(pair["base"]), max_loras=3, max_rank=MAX_RANK, fuse_qkv=fuse)
                    for fuse in (False, True))
    for mm in (plain, fused):
        mm.load_adapter("a", pair["root"] / "a")
    attention = lambda mm: mm.model.model.layers[0].self_attn
    new_weight = torch.randn_like(attention(plain).k_proj.weight)
    new_bias = torch.randn_like(attention(plain).v_proj.bias)
    with torch.no_grad():
        for mm in (plain, fused):
            attention(mm).k_proj.weight.copy_(new_weight)
            attention(mm).v_proj.bias.copy_(new_bias)
    expected = _logits(plain, pair["ids"], ["a", None, "a"])
    assert (expected - _logits(pair["plain"], pair["ids"], ["a", None, "a"])).abs().max() > 1e-2  # it matters
    torch.testing.assert_close(_logits(fused, pair["ids"], ["a", None, "a"]), expected, rtol=0, atol=1e-5)
    k_proj = attention(fused).k_proj
    for rebind in (lambda: setattr(k_proj, "weight", torch.nn.Parameter(new_weight * 2)),
                   lambda: setattr(k_proj.weight, "data", new_weight * 2),
                   lambda: setattr(attention(fused).v_proj.bias, "data", new_bias * 2)):
        rebind()
        for call in (lambda: _logits(fused, pair["ids"], ["a", None, "a"]),
                     lambda: fused.model(pair["ids"])):  # the wrapped model called directly too
            with pytest.raises(RuntimeError, match="re-bound"):
                call()
        assert not fused.lock._is_owned()  # refused before the lock was taken
        point_fused_views(fused._fused_leaders[0])  # (restore for the next case)


@pytest.mark.parametrize("family,target_modules,fused", [
    ("deepseek_v3", None, 0),                          # MLA: no k/v projections
    ("llama", ["q_proj", "v_proj", "o_proj"], 0),      # k not a target
    ("llama", ["q_proj", "k_proj", "v_proj"], 2),
])
def test_what_is_left_unfused(family, target_modules, fused):
    base = AutoModelForCausalLM.from_config(tiny_config(family)).eval()
    mm = attach(base, max_loras=1, max_rank=4, fuse_qkv=True, target_modules=target_modules)
    assert len(mm._fused_leaders) == fused
    with pytest.raises(TypeError, match="fuse_qkv"):
        attach(AutoModelForCausalLM.from_config(tiny_config(family)), fuse_qkv=1)


def test_triton_kernel_on_one_fused_projection():
    """On CUDA the fused call is one lora_linear with n_out = q+k+v and rank 3R: the Triton kernels (interpreter,
    float32, tiny tiles) on a fused q/k/v equal the reference of the three projections called apart."""
    from moe_lora_compile.models.dense import fuse_siblings
    from moe_lora_compile.ops.reference import lora_linear_reference
    from moe_lora_compile.ops.triton.launch import lora_linear_triton

    g = torch.Generator().manual_seed(3)
    n_in, sizes, L, R, T = 32, (32, 16, 16), 3, 4, 5
    ids = torch.tensor([0, -1, 2, 1, 0], dtype=torch.int32)
    members = []
    for out in sizes:
        linear = torch.nn.Linear(n_in, out, bias=True)
        m = LoRALinear(linear, max_loras=L, max_rank=R, token_lora_ids=ids, sequence_lora_ids=ids, use_ops=False)
        m.lora_a.copy_(torch.randn(L, R, n_in, generator=g) * n_in ** -0.5)
        m.lora_b.copy_(torch.randn(L, out, R, generator=g))
        members.append(m)
    x = torch.randn(T, n_in, generator=g)
    with torch.no_grad():
        apart = torch.cat([lora_linear_reference(x, m.weight, m.lora_a, m.lora_b, ids, bias=m.bias)
                           for m in members], dim=1)
    q = members[0]
    fuse_siblings(members)
    assert [m for m in fused_members(q)] == members
    gemm = {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_SIZE_M": 2, "num_warps": 4, "num_stages": 1}
    shrink = {"BLOCK_K": 16, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}
    for per_token in (True, False):
        cfg = {"BLOCK_M": 16, "gemm": dict(gemm), "shrink": dict(shrink, per_token=per_token)}
        with torch.no_grad():
            y = lora_linear_triton(x, q.weight_fused, q.lora_a_fused, q.lora_b_fused, ids, bias=q.bias_fused, config=cfg)
        torch.testing.assert_close(y, apart, rtol=1e-4, atol=1e-4)


# --- GPU (the H200: `pytest -m gpu tests/models/test_fused_qkv.py`); written on a CPU-only machine, not yet run ---
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_step", "compiled_step"])
def test_gpu_fused_kernels_and_captured_graphs(tmp_path, family, dtype, compiled):
    """The Triton kernels on the fused q/k/v (n_out = q+k+v, rank 3R) equal the unfused model; captured CUDA-graph
    decode of the fused model generates what its own generate does (fp32) and leaves no stash behind."""
    from moe_lora_compile.__main__ import ADAPTERS, build
    from moe_lora_compile.graphs import DecodeGraphs

    s = build(family, dtype=dtype, device=torch.device("cuda"), batch=3, seq_len=6, workdir=str(tmp_path))
    models = []
    for fuse in (False, True):
        mm = attach(copy.deepcopy(s.base), max_loras=4, max_rank=8, use_ops=True, fuse_qkv=fuse)
        for name in ADAPTERS:
            mm.load_adapter(name, tmp_path / name)
        models.append(mm)
    plain, fused = models
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(_logits(fused, s.input_ids, s.adapters), _logits(plain, s.input_ids, s.adapters),
                               **tol)
    torch._dynamo.reset()
    try:
        graphs = DecodeGraphs(fused, batch_sizes=(1, 4), max_cache_len=32, log=None, compile=compiled).capture()
        ours = graphs.generate(s.input_ids, adapters=s.adapters, max_new_tokens=6)
    finally:
        torch._dynamo.reset()
    assert _stashes(fused) == []
    if dtype == torch.float32:
        assert torch.equal(ours, fused.generate(s.input_ids, adapters=s.adapters, max_new_tokens=6,
                                                do_sample=False))
