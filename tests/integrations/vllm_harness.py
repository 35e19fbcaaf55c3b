"""Helpers of the vLLM tests (no vLLM import): the runs, the adapters written to disk, the child process.
See conftest.py for the fixtures and the adapters; vllm_child.py for one engine run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

CHILD = os.path.join(os.path.dirname(__file__), "vllm_child.py")
MAX_TOKENS = 6
PROMPTS = [[5, 17, 33, 9, 60], [7, 8, 100, 42], [11, 3, 77, 19, 23, 90]]
# vLLM CPU's dense-LoRA bug: bgmv indexes lora_weights[-1] unmasked, so a base row (-1) reads the last slot once
# every slot holds an adapter. Each run keeps one slot more than it has adapters: the last slot stays empty (zeros)
# and base rows stay base.
RUNS = {
    # enable_mixed_moe_lora_format=True: vLLM's 2-D FusedMoEWithLoRA, PEFT 3-D and per-expert 2-D adapters mixed
    "mixed": dict(adapters=("A", "B", "C"), max_loras=4,
                  batches=[[None, "A"], ["A", "B"], ["B", "A", None], ["C", "A", None], ["B", "C"]]),
    # FusedMoE3DWithLoRA (vLLM's 3-D stacks, read by the op as they are); per-expert adapters need mixed format
    "3d": dict(adapters=("A", "B"), max_loras=3, batches=[[None, "A"], ["A", "B"], ["B", "A", None]]),
    # tiny GPT-OSS (vLLM's swigluoai: w13 [E, 2I, H] with gate/up rows interleaved, expert biases): vLLM's own
    # FusedMoE3DWithLoRA (GPT-OSS declares 3-D expert weights) ...
    "gptoss_3d": dict(adapters=("A", "B"), max_loras=3, batches=[[None, "A"], ["A", "B"], ["B", "A", None]]),
    # ... and, under mixed format, its 2-D stacks (vLLM's loader de-interleaves B into gate and up)
    "gptoss_mixed": dict(adapters=("A", "B"), max_loras=3, batches=[[None, "A"], ["A", "B"], ["B", "A", None]]),
}
EXPECTED_WRAPPER = {"mixed": "FusedMoEWithLoRA", "3d": "FusedMoE3DWithLoRA", "gptoss_3d": "FusedMoE3DWithLoRA",
                    "gptoss_mixed": "FusedMoEWithLoRA"}


def family_of(fmt: str) -> str:
    """The tiny model family a run serves: ``gpt_oss`` for the ``gptoss_*`` runs, else ``qwen3_moe``."""
    return "gpt_oss" if fmt.startswith("gptoss") else "qwen3_moe"


def is_mixed(fmt: str) -> bool:
    """Whether a run turns on ``enable_mixed_moe_lora_format`` (vLLM's 2-D stacks for every MoE model)."""
    return fmt.endswith("mixed")


def save_peft(model_dir, path, *, r, targets, seed, blocks_of=None, family="qwen3_moe"):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.models.tiny import randomize_lora_, tiny_lora_config

    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                tiny_lora_config(family, r=r, lora_alpha=2 * r, target_modules=targets))
    randomize_lora_(peft_model, std=0.2, seed=seed)
    if blocks_of is not None:
        _zero_outside_blocks_(peft_model, blocks_of)
    peft_model.save_pretrained(path)


@torch.no_grad()
def _zero_outside_blocks_(peft_model, r):
    """PEFT 3-D factors (A ``[E*2r, d_in]`` expert-major, B ``[d_out, 2r*E]`` expert-minor) of rank 2r made
    block-structured: gate_up B's gate rows use rank 0..r-1 only and its up rows rank r..2r-1; down_proj A keeps
    rank 0..r-1 only."""
    for name, param in peft_model.named_parameters():
        if ".experts.base_layer.lora_B." in name:  # gate_up_proj B [2I, 2r*E]
            b = param.view(param.shape[0], 2 * r, -1)
            half = param.shape[0] // 2
            b[:half, r:] = 0
            b[half:, :r] = 0
        elif ".experts.lora_A." in name:  # down_proj A [E*2r, I]
            param.view(-1, 2 * r, param.shape[1])[:, r:] = 0


def save_per_expert(d_path, path, r):
    """Per-expert 2-D adapter of rank ``r`` with the same delta as the block-structured rank-2r PEFT adapter at
    ``d_path`` (same unscaled factors, alpha / r kept at 2)."""
    from safetensors.torch import load_file, save_file

    tensors, out = load_file(os.path.join(d_path, "adapter_model.safetensors")), {}
    for key, value in tensors.items():
        experts = key.split(".experts.")[0] + ".experts"
        if ".experts.base_layer.lora_A." in key:  # gate_up A [E*2r, H]
            a = value.view(-1, 2 * r, value.shape[1])
            for e in range(a.shape[0]):
                out[f"{experts}.{e}.gate_proj.lora_A.weight"] = a[e, :r].clone()
                out[f"{experts}.{e}.up_proj.lora_A.weight"] = a[e, r:].clone()
        elif ".experts.base_layer.lora_B." in key:  # gate_up B [2I, 2r*E]
            b = value.view(value.shape[0], 2 * r, -1)
            half = value.shape[0] // 2
            for e in range(b.shape[2]):
                out[f"{experts}.{e}.gate_proj.lora_B.weight"] = b[:half, :r, e].clone()
                out[f"{experts}.{e}.up_proj.lora_B.weight"] = b[half:, r:, e].clone()
        elif ".experts.lora_A." in key:  # down A [E*2r, I]
            a = value.view(-1, 2 * r, value.shape[1])
            for e in range(a.shape[0]):
                out[f"{experts}.{e}.down_proj.lora_A.weight"] = a[e, :r].clone()
        elif ".experts.lora_B." in key:  # down B [H, 2r*E]
            b = value.view(value.shape[0], 2 * r, -1)
            for e in range(b.shape[2]):
                out[f"{experts}.{e}.down_proj.lora_B.weight"] = b[:, :r, e].clone()
        else:
            raise AssertionError(f"unexpected key {key}")
    os.makedirs(path, exist_ok=True)
    save_file(out, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(d_path, "adapter_config.json")) as f:
        config = json.load(f)
    config.update(r=r, lora_alpha=2 * r, target_modules=["gate_proj", "up_proj", "down_proj"],
                  target_parameters=None)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def run_child(setup, *, plugin: bool, fmt: str, adapters, batches, max_loras: int, count_calls: bool,
              dump: str | None = None, llm_kwargs: dict | None = None):
    """Run ``vllm_child.py`` once; returns (CompletedProcess, parsed RESULT or None). ``llm_kwargs``: more
    arguments of ``vllm.LLM``."""
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               XDG_CACHE_HOME=str(setup["root"] / "cache"), VLLM_CACHE_ROOT=str(setup["root"] / "cache" / "vllm"))
    env.pop("MOE_LORA_VLLM", None)
    env.pop("VLLM_PLUGINS", None)
    if plugin:
        env["MOE_LORA_VLLM"] = "1"
    spec = dict(model=setup["model"], adapters={n: setup["adapters"][n] for n in adapters}, batches=batches,
                prompts=PROMPTS, max_tokens=MAX_TOKENS, max_loras=max_loras, count_calls=count_calls, format=fmt,
                dump=dump, llm_kwargs=llm_kwargs or {})
    child = subprocess.run([sys.executable, CHILD, json.dumps(spec)], capture_output=True, text=True, env=env,
                           timeout=600)
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    return child, (json.loads(lines[-1][len("RESULT "):]) if lines else None)
