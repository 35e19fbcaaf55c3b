"""Child process of the vLLM tests (conftest.py): builds one ``vllm.LLM`` (LoRA on) and runs greedy batches.

argv[1]: JSON {model, adapters: {name: path}, batches: [[name or null, ...]], prompts: [[ids]], max_tokens,
max_loras, count_calls, format: "mixed" | "3d" | "gptoss_3d" | "gptoss_mixed", dump: path or null}.

- ``format="mixed"``: ``enable_mixed_moe_lora_format=True`` and ``is_3d_lora_weight`` per adapter (a PEFT 3-D
  experts adapter, or a per-expert 2-D one); vLLM 0.32 then wraps every MoE layer in its 2-D ``FusedMoEWithLoRA``.
- ``format="3d"``: vLLM gives ``FusedMoE3DWithLoRA`` only to models that declare ``is_3d_moe_weight`` (GPT-OSS,
  whose clamped activation the plugin leaves to vLLM, and multimodal / hybrid Qwen3 variants), so this registers
  vLLM's own ``Qwen3MoeForCausalLM`` under a second architecture name with that flag set, and serves the same
  checkpoint through it (``hf_overrides``); mixed format off.
- ``format="gptoss_3d"`` / ``"gptoss_mixed"``: a tiny GPT-OSS checkpoint served as it is (vLLM's own
  ``GptOssForCausalLM`` declares 3-D expert weights), mixed format off / on.

Prints one line ``RESULT {json}``: tokens per batch and row, the op's calls per batch and how many of those wrote
into the very output tensor vLLM handed to ``apply()`` (``direct``), and the LoRA wrapper classes of the MoE
layers. With ``dump``, saves per MoE layer vLLM's stacks, the plugin's op stacks (and whether B13 is in the split
gate/up form), and whether vLLM's tensors live in the op stacks' storage, plus vLLM's slot -> adapter id list
(``torch.save``).
The parent sets the environment (MOE_LORA_VLLM or not, VLLM_ENABLE_V1_MULTIPROCESSING=0, cache dirs).
"""

import json
import sys

import torch

spec = json.loads(sys.argv[1])
ARCH_3D = "Qwen3Moe3DLoRAForCausalLM"

calls, direct = [0], [0]
if spec["count_calls"]:
    from moe_lora_compile.integrations.vllm import _plugin

    _op, _apply, _outputs = _plugin.fused_moe_lora_op, _plugin.MoELoRAExperts.apply, []

    def _counting(out, *args, **kwargs):
        calls[0] += 1
        direct[0] += bool(_outputs) and out is _outputs[-1]  # the op's out is vLLM's own output tensor
        return _op(out, *args, **kwargs)

    def _recording_apply(self, output, *args, **kwargs):
        _outputs[:] = [output]
        return _apply(self, output, *args, **kwargs)

    _plugin.fused_moe_lora_op = _counting
    _plugin.MoELoRAExperts.apply = _recording_apply

from vllm import LLM, ModelRegistry, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

mixed = spec["format"].endswith("mixed")
extra = {}
if spec["format"] == "3d":
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    class Qwen3Moe3DLoRAForCausalLM(Qwen3MoeForCausalLM):
        is_3d_moe_weight = True  # the only difference: vLLM's MoE LoRA wrapper becomes FusedMoE3DWithLoRA

    ModelRegistry.register_model(ARCH_3D, Qwen3Moe3DLoRAForCausalLM)
    extra["hf_overrides"] = {"architectures": [ARCH_3D]}

llm = LLM(model=spec["model"], enable_lora=True, enable_mixed_moe_lora_format=mixed, max_loras=spec["max_loras"],
          max_lora_rank=8, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64,
          max_num_seqs=4, seed=0, **extra, **spec.get("llm_kwargs", {}))
ids = {name: i + 1 for i, name in enumerate(sorted(spec["adapters"]))}
requests = {name: LoRARequest(name, ids[name], info["path"], is_3d_lora_weight=info["is_3d"])
            for name, info in spec["adapters"].items()}
params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
out = {"tokens": [], "calls": [], "direct": [], "ids": ids}
for batch in spec["batches"]:
    prompts = [TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in range(len(batch))]
    before, direct_before = calls[0], direct[0]
    results = llm.generate(prompts, params, lora_request=[requests[n] if n else None for n in batch])
    out["calls"].append(calls[0] - before)
    out["direct"].append(direct[0] - direct_before)
    out["tokens"].append([list(r.outputs[0].token_ids) for r in results])


def _moe_layers(worker, dump_path):
    """On the worker: the MoE LoRA wrapper classes; with ``dump_path``, the stacks (see the module docstring)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    layers, kinds = {}, set()
    for name, module in manager.modules.items():
        if not hasattr(module, "w2_lora_a_stacked"):
            continue
        kinds.add(type(module).__name__)
        vllm_stacks = {key: [t.detach().clone() for t in getattr(module, key)]
                       for key in ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked",
                                   "w2_lora_b_stacked")}
        op_stacks = module._moe_kernel.fused_experts._stacks
        tensors = () if op_stacks is None else op_stacks.tensors
        storages = {s.untyped_storage().data_ptr() for s in tensors}
        in_place = all(t.untyped_storage().data_ptr() in storages
                       for key in vllm_stacks for t in getattr(module, key))
        layers[name] = {"vllm": vllm_stacks, "in_place": in_place,
                        "op": None if op_stacks is None else [t.detach().clone() for t in tensors],
                        "split": None if op_stacks is None else op_stacks.lora_b13_split}
    if dump_path:
        torch.save({"slots": list(manager.lora_index_to_id), "layers": layers}, dump_path)
    return sorted(kinds)


out["moe_lora_classes"] = llm.collective_rpc(_moe_layers, args=(spec.get("dump"),))[0]
print("RESULT " + json.dumps(out), flush=True)
