"""``attention="triton"`` in DecodeGraphs / RowGraphs: the decode steps' attention runs ``moe_lora.decode_attention``.

CPU (fp32, the kernel in Triton's interpreter): tiny GPT-OSS (eager attention folded, sinks, sliding window) and
Qwen3-MoE (SDPA) with three PEFT adapters: steps, greedy and speculative generation equal the default path; the
traced step calls the op once per layer and the prefill never; RowGraphs rows at different positions. GPU
(``-m gpu``): compiled and captured steps equal the eager model for every bucket, no recompiles.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_lora_compile.models.attention import (ATTENTION_MODES, DECODE_ATTENTION, FOLDED_GQA, attention_mode,
                                               decode_attention_steps)

MIXED = ["alpha", "beta", None]  # 3 sequences -> bucket 4 (one padding row)


def _setup(family, tmp_path_factory, device="cpu", dtype=torch.float32, use_ops=False):
    from moe_lora_compile.__main__ import build

    s = build(family, dtype=dtype, device=torch.device(device), batch=3, seq_len=6, use_ops=use_ops,
              workdir=str(tmp_path_factory.mktemp(f"adapters_{family}")))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in s.model.model.modules():  # GPT-OSS sinks start at zero: make them matter
            if hasattr(m, "sinks"):
                m.sinks.copy_(torch.randn(m.sinks.shape, generator=g).to(m.sinks))
    return s


@pytest.fixture(scope="module", params=["gpt_oss", "qwen3_moe"])
def setup(request, tmp_path_factory):
    return _setup(request.param, tmp_path_factory)


def _tokens(seed, shape, device="cpu"):
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def test_steps_equal_default_attention(setup):
    """Prefill (left-padded prompts), then 4 steps (GPT-OSS: cache slots pass its 16-token window): logits of the
    kernel's steps equal the default steps'; the model's implementation is unchanged outside the steps."""
    from moe_lora_compile.graphs import DecodeGraphs

    mm, prompt = setup.model, setup.input_ids
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding
    padded = prompt.masked_fill(mask == 0, 0)
    long_prompt = torch.cat([padded, padded, padded], 1)  # 18 tokens: beyond GPT-OSS's window of 16
    long_mask = torch.cat([mask, torch.ones_like(mask), torch.ones_like(mask)], 1)
    results = {}
    for attention in ATTENTION_MODES:
        graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=40, capture=False, log=None, attention=attention)
        state, first = graphs.prefill(long_prompt, adapters=MIXED, attention_mask=long_mask)
        logits = [first]
        for i in range(4):
            logits.append(graphs.step(state, _tokens(i, (3, 1)))[:, 0].clone())
        results[attention] = torch.stack(logits)
        assert mm.model.config._attn_implementation in ("sdpa", FOLDED_GQA)  # its own (GPT-OSS: folded for good)
    torch.testing.assert_close(results["triton"], results["default"], rtol=1e-4, atol=1e-4)


def test_generate_and_speculative_equal_default(setup):
    from moe_lora_compile.graphs import DecodeGraphs

    mm, prompt = setup.model, setup.input_ids
    plain = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=40, capture=False, log=None)
    want = plain.generate(prompt, adapters=MIXED, max_new_tokens=8)
    fast = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=40, capture=False, log=None, attention="triton")
    assert torch.equal(fast.generate(prompt, adapters=MIXED, max_new_tokens=8), want)
    garbage = lambda seqs: _tokens(len(seqs[0]), (len(seqs), 2))
    spec = {}
    for attention in ATTENTION_MODES:  # verify steps: S = 3 query tokens per row
        graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=40, num_speculative_tokens=2, capture=False,
                              log=None, attention=attention)
        with warnings.catch_warnings():  # GPT-OSS: the documented window caveat (greedy may differ; both paths alike)
            warnings.simplefilter("ignore")
            spec[attention] = graphs.generate(prompt, adapters=MIXED, max_new_tokens=8, draft=garbage)
    assert torch.equal(spec["triton"], spec["default"])
    if mm.model.config.model_type != "gpt_oss":
        assert torch.equal(spec["triton"], want)


class _Recorder:
    """A torch.compile backend that keeps Dynamo's FX graphs and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward


def _op_calls(gm) -> int:
    op = torch.ops.moe_lora.decode_attention
    return sum(n.target in (op, op.default) for n in gm.graph.nodes)


def test_traced_step_calls_the_op_prefill_does_not(setup):
    """The traced decode step calls moe_lora.decode_attention once per layer; the prefill (dynamic length) never;
    two prompts and adapter mixes recompile nothing."""
    from moe_lora_compile.graphs import DecodeGraphs

    mm, prompt = setup.model, setup.input_ids
    layers = mm.model.config.num_hidden_layers
    recorder = _Recorder()
    torch._dynamo.reset()
    try:
        graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=40, capture=False, log=None, attention="triton",
                              compile={"backend": recorder}).capture()
        (step,) = recorder.graphs
        assert _op_calls(step) == layers
        for adapters, tokens in ((MIXED, prompt), (["gamma", None], prompt[:2, :4])):
            state, _ = graphs.prefill(tokens, adapters=adapters)
            for i in range(2):
                graphs.step(state, _tokens(i, (len(adapters), 1)))
        assert all(_op_calls(g) == 0 for g in recorder.graphs[1:])
        assert graphs.compiled_graphs() == {"decode": 1, "prefill": 1}
    finally:
        torch._dynamo.reset()


def test_row_graphs_rows_at_different_positions(setup):
    """RowGraphs: three rows prefilled to lengths 3, 9 and 18 (GPT-OSS: past its window), one padding row; three
    steps with the kernel equal the default steps (Qwen3-MoE: SDPA's boolean masks, converted)."""
    from moe_lora_compile.graphs.rows import RowGraphs

    mm = setup.model
    results = {}
    for attention in ATTENTION_MODES:
        graphs = RowGraphs(mm, max_rows=4, max_cache_len=32, capture=False, log=None, attention=attention)
        lengths = {0: 3, 1: 9, 2: 18}
        for row, n in lengths.items():
            graphs.prefill(row, _tokens(row, (n,)), adapter_slot=row - 1)
            graphs.set_row(row, token=5 + row, position=n, adapter_slot=row - 1)
        out = []
        for _ in range(3):
            logits = graphs.step(4)
            out.append(logits[:3].clone())
            graphs.advance(list(lengths), logits[:3].argmax(-1).tolist())
        results[attention] = torch.stack(out)
    torch.testing.assert_close(results["triton"], results["default"], rtol=1e-4, atol=1e-4)


def test_switch_is_scoped_and_mode_checked(setup):
    model = setup.model.model
    impl = model.config._attn_implementation
    with decode_attention_steps(model) as switched:
        assert switched and model.config._attn_implementation == DECODE_ATTENTION
    with decode_attention_steps(model, enabled=False) as switched:
        assert not switched and model.config._attn_implementation == impl
    assert model.config._attn_implementation == impl
    assert attention_mode("triton") == "triton"
    for bad in ("flash", "Triton", None):  # unknown name, wrong case, None
        with pytest.raises(ValueError, match="attention must be one of"):
            attention_mode(bad)


# --- GPU: compiled and captured ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_captured_compiled_steps_equal_eager(tmp_path_factory, family, dtype):
    """attention="triton", compiled (Inductor) and captured, buckets 1/2/4: every step's logits equal the eager
    model's (the op's kernel inside the graph), nothing recompiles; fp32 greedy tokens equal mm.generate."""
    from moe_lora_compile.graphs import DecodeGraphs

    s = _setup(family, tmp_path_factory, device="cuda", dtype=dtype, use_ops=True)
    mm, prompt = s.model, s.input_ids
    torch._dynamo.reset()
    graphs = DecodeGraphs(mm, batch_sizes=(1, 2, 4), max_cache_len=64, log=None, compile=True, attention="triton")
    graphs.capture()
    tol = dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    with torch.no_grad():
        for adapters, tokens in ((MIXED, prompt), ([None], prompt[:1]), (["gamma", "alpha"], prompt[:2])):
            state, _ = graphs.prefill(tokens, adapters=adapters)
            seq = tokens
            for i in range(3):
                token = _tokens(i, (len(adapters), 1), "cuda")
                logits = graphs.step(state, token).float()
                seq = torch.cat([seq, token], 1)
                want = mm(seq, adapters=adapters, use_cache=False).logits[:, -1].float()
                torch.testing.assert_close(logits[:, 0], want, **tol)
    assert graphs.compiled_graphs()["decode"] == 3
    if dtype == torch.float32:
        out = graphs.generate(prompt, adapters=MIXED, max_new_tokens=8)
        assert torch.equal(out, mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False))
    torch._dynamo.reset()


def test_row_prefill_of_a_view_compiles_nothing_new():
    """RowGraphs(compile=...).prefill of a prompt given as a view (``prompts_2d[1]``, ``long[4:10]``) after
    capture() warmed the prefill: no new graph (the view's base was a guard: another prefill graph)."""
    from torch._dynamo.testing import CompileCounter
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.graphs import RowGraphs
    from moe_lora_compile.models import attach
    from moe_lora_compile.models.tiny import tiny_config

    torch.manual_seed(0)
    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval(), max_loras=2, max_rank=4)
    counter = CompileCounter()
    torch._dynamo.reset()
    try:
        graphs = RowGraphs(mm, max_rows=2, max_cache_len=32, compile={"backend": counter}, log=None).capture()
        graphs.prefill(0, torch.randint(3, 128, (6,)))
        warmed = counter.frame_count
        for view in (torch.randint(3, 128, (1, 6))[0], torch.randint(3, 128, (3, 8))[1],
                     torch.randint(3, 128, (20,))[4:10]):
            graphs.prefill(0, view)
        assert counter.frame_count == warmed
    finally:
        torch._dynamo.reset()
