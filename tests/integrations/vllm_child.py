"""Child process of test_vllm_plugin.py: builds one ``vllm.LLM`` (LoRA on) and runs greedy batches.

argv[1]: JSON {model, adapters: {name: path}, batches: [[name or null, ...]], prompts: [[ids]], max_tokens,
count_calls}. Prints one line ``RESULT {json}``: tokens per batch and row, and the op's calls per batch.
The parent sets the environment (MOE_LORA_VLLM or not, VLLM_ENABLE_V1_MULTIPROCESSING=0, cache dirs).
"""

import json
import sys

spec = json.loads(sys.argv[1])

calls = [0]
if spec["count_calls"]:
    from moe_lora_compile.integrations.vllm import _plugin

    _op = _plugin.fused_moe_lora_op

    def _counting(*args, **kwargs):
        calls[0] += 1
        return _op(*args, **kwargs)

    _plugin.fused_moe_lora_op = _counting

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402

llm = LLM(model=spec["model"], enable_lora=True, enable_mixed_moe_lora_format=True, max_loras=spec["max_loras"],
          max_lora_rank=8, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64,
          max_num_seqs=4, seed=0)
ids = {name: i + 1 for i, name in enumerate(sorted(spec["adapters"]))}
requests = {name: LoRARequest(name, ids[name], path, is_3d_lora_weight=True)
            for name, path in spec["adapters"].items()}
params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
out = {"tokens": [], "calls": []}
for batch in spec["batches"]:
    prompts = [TokensPrompt(prompt_token_ids=spec["prompts"][i]) for i in range(len(batch))]
    before = calls[0]
    results = llm.generate(prompts, params, lora_request=[requests[n] if n else None for n in batch])
    out["calls"].append(calls[0] - before)
    out["tokens"].append([list(r.outputs[0].token_ids) for r in results])
print("RESULT " + json.dumps(out), flush=True)
