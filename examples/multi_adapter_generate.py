"""Serve two LoRA adapters and the base model in one batch, on CPU, in seconds.

Builds a tiny random model of the chosen family, makes two adapters with PEFT's own API (different ranks), saves them
as real adapter folders, loads them back through ``MultiLoRAModel.load_adapter`` and greedily generates for a mixed
batch (adapter "sql", adapter "chat", no adapter). Each row is checked against PEFT run on that row alone.

    python examples/multi_adapter_generate.py --family gpt_oss
"""

import argparse
import copy
import tempfile
import warnings

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from moe_lora_compile.__main__ import positive_int
from moe_lora_compile.models import attach
from moe_lora_compile.family_names import describe_choices, family_arg
from moe_lora_compile.models.tiny import randomize_lora_, tiny_config, tiny_lora_config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="qwen3_moe", type=family_arg, metavar="F",
                        help=f"model family (default qwen3_moe): {describe_choices()}")
    parser.add_argument("--max-new-tokens", type=positive_int, default=8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(args.family)).eval()
    settings = {"sql": dict(r=4, lora_alpha=8), "chat": dict(r=8, lora_alpha=16, use_rslora=True)}
    batch_adapters = ["sql", "chat", None]
    prompts = torch.randint(3, 128, (len(batch_adapters), 6), generator=torch.Generator().manual_seed(1))

    # PEFT 0.21 calls a property transformers 5.x deprecated (a FutureWarning per adapter); not ours
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    with tempfile.TemporaryDirectory() as folder:
        peft_models = {}
        for seed, (name, lora) in enumerate(settings.items()):
            peft_model = get_peft_model(copy.deepcopy(base), tiny_lora_config(args.family, **lora)).eval()
            randomize_lora_(peft_model, seed=seed)  # a trained adapter stand-in: non-zero A and B
            peft_model.save_pretrained(f"{folder}/{name}")
            peft_models[name] = peft_model

        mm = attach(copy.deepcopy(base), max_loras=4, max_rank=16)
        for name in settings:
            slot = mm.load_adapter(name, f"{folder}/{name}")
            print(f"loaded adapter {name!r} into slot {slot}")

    out = mm.generate(prompts, adapters=batch_adapters, max_new_tokens=args.max_new_tokens, do_sample=False)
    all_match = True
    for row, name in enumerate(batch_adapters):
        reference = peft_models[name] if name else base
        expected = reference.generate(input_ids=prompts[row: row + 1], max_new_tokens=args.max_new_tokens,
                                      do_sample=False)[0]
        match = torch.equal(out[row], expected)
        all_match &= match
        print(f"row {row} adapter={name!s:5} new tokens={out[row, prompts.shape[1]:].tolist()} matches PEFT: {match}")
    print(f"{args.family}: {'all rows match PEFT' if all_match else 'MISMATCH'}")
    return 0 if all_match else 1


if __name__ == "__main__":
    raise SystemExit(main())
