"""The folded-GQA attention (:mod:`moe_lora_compile.models.attention`) against transformers' own eager and SDPA
attention: same logits for every family, with left padding, a sliding window (GPT-OSS), GPT-OSS's sinks and a
cached decode; it replaces ``"eager"`` for good and ``"sdpa"`` only inside ``folded_gqa_decode``; and
``DecodeGraphs(fold_gqa="all")`` on an SDPA model: no repeat_kv copies in the step, tokens equal ``mm.generate``.
``@pytest.mark.gpu`` rows capture the compiled folded step on CUDA (``pytest -m gpu``)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from moe_lora_compile.models.attention import (FOLDED_GQA, fold_gqa_mode, folded_gqa_decode,
                                               use_folded_gqa_attention)
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


# --- SDPA models: folded only inside folded_gqa_decode (DecodeGraphs(fold_gqa="all")'s decode steps) ------------------
def _sdpa_model(family: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).float().eval()
    if model.config._attn_implementation != "sdpa":
        pytest.skip(f"{family} runs {model.config._attn_implementation!r} attention, not sdpa")
    return model


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_folded_decode_equals_transformers_sdpa(family):
    """Inside folded_gqa_decode an SDPA model runs the folded attention (eager's float mask) and gives SDPA's logits
    (left padding, 20 tokens) and greedy tokens (4 cached decode steps); outside and afterwards it is SDPA again."""
    model = _sdpa_model(family)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (3, 20), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    mask[2, :11] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
        out_sdpa = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        with folded_gqa_decode(model) as switched:
            assert switched and model.config._attn_implementation == FOLDED_GQA
            got = model(input_ids=ids, attention_mask=mask).logits
            out_folded = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5)
    assert torch.equal(out_folded, out_sdpa)


def test_folded_decode_switch_is_scoped():
    eager = _eager_model("qwen3_moe")
    with folded_gqa_decode(eager) as switched:  # eager models: use_folded_gqa_attention's business
        assert not switched and eager.config._attn_implementation == "eager"
    model = _sdpa_model("qwen3_moe")
    with folded_gqa_decode(model, enabled=False) as switched:
        assert not switched and model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="inside"):
        with folded_gqa_decode(model):
            raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa"  # restored after an error too


@pytest.mark.parametrize("value, mode", [(True, "eager"), (False, "off"), ("eager", "eager"), ("all", "all"),
                                         ("off", "off")])
def test_fold_gqa_mode(value, mode):
    assert fold_gqa_mode(value) == mode


@pytest.mark.parametrize("value", ["sdpa", "ALL", 1, None])  # a wrong name, wrong case, an int, None
def test_fold_gqa_mode_refuses(value):
    with pytest.raises(ValueError, match="fold_gqa must be"):
        fold_gqa_mode(value)


# --- DecodeGraphs(fold_gqa="all") on an SDPA model (tiny Qwen3-MoE with three PEFT adapters, fp32) ---------------------
MIXED = ["alpha", "beta", None]  # 3 sequences -> bucket 4 (one padding row)


@pytest.fixture(scope="module")
def sdpa_setup(tmp_path_factory):
    from moe_lora_compile.__main__ import build

    s = build("qwen3_moe", dtype=torch.float32, device=torch.device("cpu"), batch=3, seq_len=6,
              workdir=str(tmp_path_factory.mktemp("adapters")))
    assert s.model.model.config._attn_implementation == "sdpa"
    return s


def _eager_logits(mm, tokens, adapters):
    with torch.no_grad():
        return mm(tokens, adapters=adapters, use_cache=False).logits


class _Recorder:
    """A torch.compile backend that keeps Dynamo's FX graphs and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _cache_sized(gm, batch: int, heads: int, length: int, head_dim: int) -> int:
    """Ops of ``gm`` whose result is a [batch, heads, length, head_dim] tensor: K/V expanded to every query head."""
    shape = (batch, heads, length, head_dim)
    return sum(tuple(getattr(n.meta.get("example_value"), "shape", ())) == shape for n in gm.graph.nodes
               if n.op.startswith("call"))


def _sdpa_calls(gm) -> int:
    return sum(n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)


@pytest.mark.parametrize("mode", ["eager", "all"])
def test_decode_step_without_repeat_kv_copies(sdpa_setup, mode):
    """The traced decode step of the SDPA model: with "eager" (the default) every layer calls SDPA on K and V
    expanded to all query heads (repeat_kv: [B, H, L, D] copies of the cache); with "all" no SDPA call and no tensor
    of that shape. The prefill (dynamic length) is traced with SDPA in both modes; steps equal the eager model; two
    prompt lengths and adapter mixes recompile neither; the model is SDPA again afterwards."""
    from moe_lora_compile.graphs import DecodeGraphs

    mm, prompt = sdpa_setup.model, sdpa_setup.input_ids
    config = mm.model.config
    recorder = _Recorder()
    torch._dynamo.reset()
    try:
        graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=40, capture=False, log=None, fold_gqa=mode,
                              compile={"backend": recorder}).capture()
        assert graphs.fold_gqa == mode and config._attn_implementation == "sdpa"
        (step,) = recorder.graphs
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        copies = _cache_sized(step, 4, heads, 40, config.head_dim)
        if mode == "all":
            assert copies == 0 and _sdpa_calls(step) == 0
        else:
            assert copies >= 2 * layers and _sdpa_calls(step) == layers
        longer = torch.cat([prompt[:2], prompt[:2, :3]], 1)
        for adapters, tokens in ((MIXED, prompt), (["gamma", None], longer)):
            state, last = graphs.prefill(tokens, adapters=adapters)
            torch.testing.assert_close(last, _eager_logits(mm, tokens, adapters)[:, -1], atol=2e-5, rtol=0)
            seq = tokens
            for i in range(2):
                token = torch.randint(3, 128, (len(adapters), 1), generator=torch.Generator().manual_seed(i))
                logits = graphs.step(state, token)
                seq = torch.cat([seq, token], 1)
                torch.testing.assert_close(logits[:, 0], _eager_logits(mm, seq, adapters)[:, -1], atol=2e-5, rtol=0)
        prefills = recorder.graphs[1:]
        assert prefills and all(_sdpa_calls(g) == layers for g in prefills)  # the prefill keeps SDPA
        assert graphs.compiled_graphs() == {"decode": 1, "prefill": 1}
        assert config._attn_implementation == "sdpa"
    finally:
        torch._dynamo.reset()


def test_fold_all_generate_and_speculative_equal_greedy(sdpa_setup):
    """fold_gqa="all", eager steps: greedy tokens equal mm.generate (transformers' SDPA), with left padding and
    with speculative verify steps (q = 3); mm.generate itself still runs SDPA."""
    from moe_lora_compile.graphs import DecodeGraphs

    mm, prompt = sdpa_setup.model, sdpa_setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(2, 4), max_cache_len=32, capture=False, log=None, fold_gqa="all")
    theirs = mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False)
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=8), theirs)
    mask = torch.ones_like(prompt)
    mask[1, :2] = mask[2, :4] = 0
    padded = prompt.masked_fill(mask == 0, 0)
    assert torch.equal(graphs.generate(padded, adapters=MIXED, max_new_tokens=6, attention_mask=mask),
                       mm.generate(padded, adapters=MIXED, max_new_tokens=6, do_sample=False, attention_mask=mask))
    assert mm.model.config._attn_implementation == "sdpa"
    spec = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=40, num_speculative_tokens=2, capture=False, log=None,
                        fold_gqa="all")
    garbage = lambda seqs: torch.randint(3, 128, (len(seqs), 2), generator=torch.Generator().manual_seed(len(seqs[0])))
    assert torch.equal(spec.generate(prompt, adapters=MIXED, max_new_tokens=8, draft=garbage), theirs)


def test_fold_all_inductor_step_equals_eager(sdpa_setup):
    """Inductor compiles the folded decode step (compile=True, eager prefill): logits equal the eager model's, one
    graph for the bucket."""
    from moe_lora_compile.graphs import DecodeGraphs

    mm, prompt = sdpa_setup.model, sdpa_setup.input_ids
    torch._dynamo.reset()
    try:
        graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, log=None, fold_gqa="all",
                              compile=True, compile_prefill=False).capture()
        state, _ = graphs.prefill(prompt, adapters=MIXED)
        seq = prompt
        for i in range(2):
            token = torch.randint(3, 128, (3, 1), generator=torch.Generator().manual_seed(i))
            logits = graphs.step(state, token)
            seq = torch.cat([seq, token], 1)
            torch.testing.assert_close(logits[:, 0], _eager_logits(mm, seq, MIXED)[:, -1], atol=2e-5, rtol=0)
        assert graphs.compiled_graphs()["decode"] == 1
    finally:
        torch._dynamo.reset()


# --- GPU: the captured folded step of an SDPA model ---------------------------------------------------------------
def _gpu_sdpa_setup(tmp_path, dtype):
    """build()'s tiny Qwen3-MoE (SDPA) and adapters on CUDA, attached again with use_ops=True (the Triton kernels)."""
    from moe_lora_compile.__main__ import ADAPTERS, build
    from moe_lora_compile.models import attach

    s = build("qwen3_moe", dtype=dtype, device=torch.device("cuda"), batch=3, seq_len=6, workdir=str(tmp_path))
    mm = attach(copy.deepcopy(s.base), max_loras=4, max_rank=8, use_ops=True)
    for name in ADAPTERS:
        mm.load_adapter(name, tmp_path / name)
    assert mm.model.config._attn_implementation == "sdpa"
    return s, mm


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_step", "compiled_step"])
def test_gpu_fold_all_replay_equals_eager(tmp_path, dtype, compiled):
    """fold_gqa="all" on an SDPA model, captured (compiled: Inductor's code has no SDPA kernel and no
    [B, H, L, D] buffer): every bucket's replay equals the eager (SDPA) model, nothing recompiles, fp32 greedy
    tokens equal mm.generate."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from moe_lora_compile.graphs import DecodeGraphs

    s, mm = _gpu_sdpa_setup(tmp_path, dtype)
    config, prompt = mm.model.config, s.input_ids
    torch._dynamo.reset()
    graphs = DecodeGraphs(mm, batch_sizes=(1, 2, 4), max_cache_len=64, log=None, compile=compiled, fold_gqa="all")
    assert graphs.use_graphs
    if compiled:
        with inductor_config.patch(fx_graph_cache=False):  # generate the code, do not load it
            _, codes = run_and_get_code(graphs.capture)
        code = "\n".join(codes)
        assert "scaled_dot_product" not in code
        for b in graphs.batch_sizes:  # no repeat_kv copy of the cache
            assert f"({b}, {config.num_attention_heads}, 64, {config.head_dim})" not in code
        assert graphs.compiled_graphs()["decode"] == 3
    else:
        graphs.capture()
    assert config._attn_implementation == "sdpa"
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    for adapters, tokens in ((MIXED, prompt), ([None], prompt[:1]), (["gamma", "alpha"], prompt[:2])):
        state, _ = graphs.prefill(tokens, adapters=adapters)
        seq = tokens
        for i in range(3):
            token = torch.randint(3, 128, (len(adapters), 1), generator=torch.Generator().manual_seed(i)).cuda()
            logits = graphs.step(state, token).float()
            seq = torch.cat([seq, token], 1)
            torch.testing.assert_close(logits[:, 0], _eager_logits(mm, seq, adapters)[:, -1].float(), **tol)
    assert graphs.num_captures == 3
    if compiled:
        assert graphs.compiled_graphs()["decode"] == 3  # nothing recompiled
    if dtype == torch.float32:
        out = graphs.generate(prompt, adapters=MIXED, max_new_tokens=8)
        assert torch.equal(out, mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False))


@pytest.mark.gpu
def test_gpu_fold_all_speculative_replay_equals_eager(tmp_path):
    """fold_gqa="all", compiled and captured verify steps (q = 3, fp32): logits equal the eager model's for each
    row's kept tokens; generate with garbage drafts equals greedy."""
    from moe_lora_compile.graphs import DecodeGraphs

    s, mm = _gpu_sdpa_setup(tmp_path, torch.float32)
    prompt = s.input_ids
    torch._dynamo.reset()
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=64, num_speculative_tokens=2, log=None, compile=True,
                          fold_gqa="all").capture()
    state, _ = graphs.prefill(prompt, adapters=MIXED)
    tokens = lambda seed: torch.randint(3, 128, (3, 3), generator=torch.Generator().manual_seed(seed)).cuda()
    first = tokens(1)
    tol = dict(atol=2e-4, rtol=1e-4)
    logits = graphs.step(state, first).clone()
    torch.testing.assert_close(logits, _eager_logits(mm, torch.cat([prompt, first], 1), MIXED)[:, -3:], **tol)
    keep = [1, 2, 3]
    graphs.accept(state, torch.tensor(keep, device="cuda"))
    second = tokens(2)
    logits = graphs.step(state, second)
    for row, k in enumerate(keep):
        seq = torch.cat([prompt[row], first[row, :k], second[row]])[None]
        torch.testing.assert_close(logits[row], _eager_logits(mm, seq, [MIXED[row]])[0, -3:], **tol)
    reference = mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False)
    garbage = lambda seqs: torch.randint(3, 128, (len(seqs), 2),
                                         generator=torch.Generator().manual_seed(len(seqs[0]))).cuda()
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=8, draft=garbage), reference)
    torch._dynamo.reset()
