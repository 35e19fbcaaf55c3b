"""The plugin's conversion of vLLM's MoE LoRA stacks, checked against vLLM's own loader and against ours on the same
adapter folders: after the engine runs of ``test_vllm_plugin.py`` (conftest.py), the child dumps, per MoE layer,
vLLM's stacks as vLLM's loader filled them and the stacks the op reads. Skips without vLLM.

- The op's stacks are vLLM's stacks converted: 3-D, the very tensors; 2-D, the op's split gate/up form
  (``lora_b13_split``): ``A13 = [A_gate; A_up]``, ``B13 [L,E,2I,r]`` with B_gate's rows and B_up's where the base
  w13 keeps gate and up (GPT-OSS: gate rows even, up rows odd), w2 as it is (no zero padding); and vLLM's tensors
  live in the op stacks' storage (no copy per step).
- Per adapter slot and expert, the deltas the op applies (``B13 @ A13`` with gate rows on A13's first r rows and up
  rows on the rest in the split form; ``B2 @ A2``; scaling included) equal those of
  :meth:`MultiLoRAModel.parse_adapter` on the same folder (PEFT 3-D and per-expert 2-D layouts); free slots are
  zero.
"""

from __future__ import annotations

import pytest
import torch

from vllm_harness import RUNS, family_of, is_mixed

pytest.importorskip("vllm", reason="vLLM is not installed in this venv; see tests/integrations/conftest.py")


def _converted(vllm_stacks, interleaved=False):
    """The op's stacks built here from vLLM's (independently of the plugin's in-place re-seating) and whether B13 is
    in the split gate/up form; ``interleaved``: gate / up rows of B13 alternate (GPT-OSS)."""
    (a2,), (b2,) = vllm_stacks["w2_lora_a_stacked"], vllm_stacks["w2_lora_b_stacked"]
    if len(vllm_stacks["w13_lora_a_stacked"]) == 1:
        (a13,), (b13,) = vllm_stacks["w13_lora_a_stacked"], vllm_stacks["w13_lora_b_stacked"]
        return (a13, b13, a2, b2), False
    (a_g, a_u), (b_g, b_u) = vllm_stacks["w13_lora_a_stacked"], vllm_stacks["w13_lora_b_stacked"]
    L, E, I, r = b_g.shape
    b13 = torch.empty(L, E, 2 * I, r)
    if interleaved:
        b13[:, :, 0::2], b13[:, :, 1::2] = b_g, b_u
    else:
        b13[:, :, :I], b13[:, :, I:] = b_g, b_u
    return (torch.cat([a_g, a_u], dim=2), b13, a2, b2), True


def _delta13(a13, b13, split, interleaved):
    """``[E, 2I, H]`` w13 delta of one slot: ``B13 @ A13``, or in the split form gate rows times A13's first half of
    the rank and up rows times the second."""
    if not split:
        return b13 @ a13
    r = b13.shape[-1]
    gate, up = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, b13.shape[1] // 2),
                                                                           slice(b13.shape[1] // 2, None))
    delta = torch.empty(b13.shape[0], b13.shape[1], a13.shape[-1])
    delta[:, gate], delta[:, up] = b13[:, gate] @ a13[:, :r], b13[:, up] @ a13[:, r:]
    return delta


@pytest.mark.parametrize("fmt", [
    "mixed",  # vLLM's 2-D stacks (its loader split PEFT 3-D adapters into gate/up; C is per-expert on disk)
    "3d",     # vLLM's 3-D stacks
    "gptoss_3d",     # GPT-OSS's 3-D stacks (B13 rows interleaved like its base w13)
    "gptoss_mixed",  # GPT-OSS's 2-D stacks (vLLM's loader split gate / up; the op's B13 interleaves them again)
])
def test_op_stacks_are_vllms_stacks_converted_and_match_our_loader(served, setup_of, fmt):
    from transformers import AutoModelForCausalLM

    import moe_lora_compile as mlc

    vllm_setup = setup_of(fmt)
    _, result, dump = served(fmt)
    data = torch.load(dump)
    assert data["layers"], "no MoE LoRA layer dumped"
    mm = mlc.attach(AutoModelForCausalLM.from_pretrained(vllm_setup["model"]), max_loras=2, max_rank=8)
    ours = {name: mm.parse_adapter(vllm_setup["adapters"][name]["path"]) for name in RUNS[fmt]["adapters"]}
    slot_of = {name: data["slots"].index(result["ids"][name]) for name in ours}
    free = [slot for slot, lora_id in enumerate(data["slots"]) if lora_id is None]
    assert free, "every slot holds an adapter (vLLM CPU's dense-LoRA bug needs one free, see vllm_harness.RUNS)"
    for layer_name, layer in data["layers"].items():
        assert layer["in_place"], f"{layer_name}: vLLM's stacks are not views of the op's"
        op, interleaved = layer["op"], family_of(fmt) == "gpt_oss"
        converted, split = _converted(layer["vllm"], interleaved)
        assert layer["split"] == split == is_mixed(fmt)  # 2-D stacks: the split gate/up form, never zero padded
        for got, want in zip(op, converted):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        a13, b13, a2, b2 = op
        for name, weights in ours.items():
            s, experts = slot_of[name], weights[layer_name]
            delta13 = _delta13(a13[s], b13[s], split, interleaved)
            torch.testing.assert_close(delta13, experts.b13 @ experts.a13, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{fmt} {layer_name} adapter {name} w13: {m}")
            torch.testing.assert_close(b2[s] @ a2[s], experts.b2 @ experts.a2, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{fmt} {layer_name} adapter {name} w2: {m}")
            assert delta13.abs().max() > 0.1  # a real delta, not zeros on both sides
        for s in free:
            assert all(not t[s].any() for t in op), f"{layer_name}: free slot {s} is not zero"
