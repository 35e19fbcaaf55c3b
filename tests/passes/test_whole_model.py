"""Whole tiny models (attach + three real PEFT adapters) compiled with ``moe_lora_compile.compile``: one fused op
per MoE layer and per adapted linear, logits equal eager, one graph, no breaks, no recompiles.

A whole-model compile costs ~45 s on 2 CPU cores, so the default run compiles one family here: GPT-OSS
(transposed interleaved layout, biases, clamped swiglu, attention sinks). Qwen3-MoE (concat, silu) is compiled
whole by ``tests/test_demo.py`` (same checks through the demo's report); Llama-4's routing-on-input and the other
layout/activation variants are covered at module level in ``test_reference_patterns.py``.
``MOE_LORA_ALL_FAMILIES=1`` adds Qwen3-MoE and the other MoE families here.
"""

from __future__ import annotations

import os

import pytest
import torch

from moe_lora_compile.__main__ import ADAPTERS, build
from moe_lora_compile.compile import compile as compile_model

from pass_helpers import RecordingPass, pass_always_runs

pytestmark = pytest.mark.slow

FAMILIES = ["gpt_oss"]
if os.environ.get("MOE_LORA_ALL_FAMILIES") == "1":
    FAMILIES += ["qwen3_moe", "llama4", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3"]

BATCH, SEQ = 3, 6
TOL = dict(atol=1e-4, rtol=1e-4)


def _logits(setup, input_ids, adapters):
    with torch.no_grad():
        return setup.model(input_ids, adapters=adapters, use_cache=False).logits


def _eager(setup, input_ids, adapters):
    with torch.compiler.set_stance("force_eager"):
        return _logits(setup, input_ids, adapters)


@pytest.fixture(scope="module", params=FAMILIES)
def compiled(request, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp(f"adapters_{request.param}"))
    setup = build(request.param, dtype=torch.float32, device=torch.device("cpu"), batch=BATCH, seq_len=SEQ,
                  workdir=workdir, use_ops=False)  # our reference modules, for the pass
    eager = _logits(setup, setup.input_ids, setup.adapters)
    recorder = RecordingPass()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_model(setup.model, fullgraph=True, options={"post_grad_custom_post_pass": recorder})
    torch._dynamo.mark_dynamic(setup.input_ids, 0)  # the batch (token) dimension
    with pass_always_runs(recorder):
        logits = _logits(setup, setup.input_ids, setup.adapters)
    counters = torch._dynamo.utils.counters
    stats = dict(graphs=counters["stats"]["unique_graphs"], breaks=sum(counters["graph_break"].values()))
    yield dict(setup=setup, eager=eager, logits=logits, recorder=recorder, stats=stats, workdir=workdir)
    torch._dynamo.reset()


def test_one_fused_op_per_moe_layer_and_adapted_linear(compiled):
    setup, recorder = compiled["setup"], compiled["recorder"]
    n_moe = sum(name.endswith(".experts") for name, _ in setup.base.named_modules())  # DeepSeek: layer 0 dense
    n_linear = len(setup.model.slots.linear_modules)
    assert n_moe == len(setup.model.slots.experts_modules) > 0 and n_linear > 0
    (graph,) = recorder.graphs
    assert graph["fused_moe_lora"] == n_moe
    assert graph["lora_linear"] == n_linear
    assert graph["leftover_matmuls"] == 0  # no unfused expert or LoRA matmul left


def test_compiled_logits_equal_eager(compiled):
    torch.testing.assert_close(compiled["logits"], compiled["eager"], **TOL)


def test_one_graph_no_breaks(compiled):
    assert compiled["stats"] == dict(graphs=1, breaks=0)


def test_no_recompile_on_adapter_mix_hot_swap_and_batch_size(compiled):
    setup = compiled["setup"]
    a, b, c = ADAPTERS
    ids = setup.input_ids

    def hot_swap():  # slot of `a` now holds adapter `b`'s weights, copied in place
        setup.model.load_adapter(a, os.path.join(compiled["workdir"], b), replace=True)

    scenarios = [
        ("other adapter mix", None, ids, [None, c, c]),
        ("hot-swapped adapter", hot_swap, ids, [a, None, b]),
        ("larger batch", None, torch.cat([ids, ids[:2]]), [a, None, b, c, None]),
        ("smaller batch", None, ids[:2], [b, a]),
    ]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for what, before, input_ids, adapters in scenarios:
            if before is not None:
                before()
            got = _logits(setup, input_ids, adapters)
            torch.testing.assert_close(got, _eager(setup, input_ids, adapters), **TOL, msg=lambda m: f"{what}: {m}")
        # the swap took effect: `a` now gives what `b` gives, and differs from the base model
        same_prompt = torch.cat([ids[:1], ids[:1], ids[:1]])
        swapped, original, base = _logits(setup, same_prompt, [a, b, None])
    torch.testing.assert_close(swapped, original, **TOL)
    assert (swapped - base).abs().max() > 1e-3
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_only_base_tokens_give_the_base_model(compiled):
    """All token ids -1: the same graph (no guard on 'no adapter active') computes the plain model's logits."""
    setup = compiled["setup"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = _logits(setup, setup.input_ids, [None] * BATCH)
    with torch.no_grad():
        want = setup.base(setup.input_ids, use_cache=False).logits
    torch.testing.assert_close(got, want, **TOL)
