"""The supported model families in one table: where the MoE blocks live, the experts' layout and activation, and
which ``nn.Linear`` leaves get dense LoRA (``lora_linear``).

Transformers 5.x stores routed experts as fused 3-D parameters on an ``experts`` module (``gate_up_proj``,
``down_proj``); the layout column says how (see :mod:`moe_lora_compile.ops.layout`). Dense families have no MoE
block and use the dense path only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch.nn as nn

from ..family_names import FAMILY_MODEL_TYPES
from ..ops.layout import CONCAT, TRANSPOSED_CONCAT, TRANSPOSED_INTERLEAVED

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_TARGETS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")  # DeepSeek attention
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")  # dense MLP layers and shared experts


@dataclass(frozen=True)
class Family:
    """How to serve one transformers model family with multi-LoRA.

    ``block_attr``: the decoder layer's attribute holding the MoE block (its ``experts`` child holds ``gate_up_proj``
    / ``down_proj``); ``None`` for dense models. ``decorated``: the experts class uses transformers'
    ``@use_experts_implementation`` (routed through ``ExpertsInterface``); otherwise the whole block is swapped
    (Llama-4). ``per_expert_names``: (gate, up, down) leaf names in per-expert PEFT adapters.
    ``legacy_block_attrs``: the MoE block's name in older (transformers 4) checkpoints. ``peft_a_on_output``: current
    PEFT puts LoRA A on the output side of this family's expert weights (it does for Llama-4, whose experts lack
    ``is_transposed``); used only to break the tie when shapes cannot tell. ``per_expert_targets``: PEFT's
    ``target_modules`` reach this family's experts through the per-expert names (transformers maps its per-expert
    checkpoints onto the fused experts, and PEFT converts those targets); GPT-OSS and Llama-4 always shipped fused
    experts, so there PEFT adapts no expert for ``gate_proj`` & co. (checked with PEFT 0.21.2 and 0.22.0).
    """

    name: str
    model_types: tuple[str, ...]
    block_attr: Optional[str]
    layout: Optional[str] = None  # one of moe_lora_compile.ops.layout.LAYOUTS
    activation: Optional[str] = None
    routing_weight_on_input: bool = False
    decorated: bool = True
    per_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    legacy_block_attrs: tuple[str, ...] = ()
    peft_a_on_output: bool = False
    per_expert_targets: bool = True
    dense_targets: tuple[str, ...] = field(default=ATTENTION_TARGETS + MLP_TARGETS)
    notes: str = ""

    @property
    def is_moe(self) -> bool:
        return self.block_attr is not None


# names and model_types come from the one table in moe_lora_compile.family_names
FAMILIES: tuple[Family, ...] = (
    Family("qwen3_moe", FAMILY_MODEL_TYPES["qwen3_moe"], "mlp", CONCAT, "silu", notes="softmax top-k routing"),
    Family("qwen2_moe", FAMILY_MODEL_TYPES["qwen2_moe"], "mlp", CONCAT, "silu",
           notes="shared expert (dense LoRA) with sigmoid shared_expert_gate"),
    Family("gpt_oss", FAMILY_MODEL_TYPES["gpt_oss"], "mlp", TRANSPOSED_INTERLEAVED, "gptoss_swiglu",
           per_expert_targets=False, notes="interleaved gate/up, expert biases, clamped swiglu; attention biases"),
    Family("mixtral", FAMILY_MODEL_TYPES["mixtral"], "mlp", CONCAT, "silu", per_expert_names=("w1", "w3", "w2"),
           legacy_block_attrs=("block_sparse_moe",), notes="per-expert adapters use w1/w3/w2"),
    Family("deepseek_v3", FAMILY_MODEL_TYPES["deepseek_v3"], "mlp", CONCAT, "silu", dense_targets=MLA_TARGETS + MLP_TARGETS,
           notes="sigmoid group routing, shared experts and first dense layers (dense LoRA), MLA attention"),
    Family("olmoe", FAMILY_MODEL_TYPES["olmoe"], "mlp", CONCAT, "silu", notes="softmax top-k routing"),
    Family("llama4", FAMILY_MODEL_TYPES["llama4"], "feed_forward", TRANSPOSED_CONCAT, "silu", routing_weight_on_input=True,
           decorated=False, peft_a_on_output=True, per_expert_targets=False,
           notes="text model only; experts not decorated (block swapped); routing weight scales the input"),
    Family("dense", FAMILY_MODEL_TYPES["dense"], None, notes="dense causal LMs: lora_linear path only"),
)


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_for(model: nn.Module) -> Family:
    """The :class:`Family` of a transformers model, from ``model.config.model_type``; ValueError if unsupported."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else None
    text_type = getattr(text_config, "model_type", None)
    hint = ""
    if text_config is not config and any(text_type in f.model_types for f in FAMILIES):
        hint = (f" (a multimodal model whose text model is {text_type!r}: attach the text model, e.g. "
                f"attach(model.language_model), with adapters trained on it)")
    raise ValueError(
        f"model: unsupported model_type {model_type!r}{hint}; supported families: "
        + ", ".join(f"{f.name} ({'/'.join(f.model_types)})" for f in FAMILIES)
    )


def find_experts(model: nn.Module, family: Family) -> dict[str, nn.Module]:
    """``{module name: experts module}`` for every MoE block (ordered as in the model): transformers' fused
    experts, or MXFP4 ones (:class:`.mxfp4_gpt_oss.GptOssMxfp4Experts`)."""
    if not family.is_moe:
        return {}
    from .mxfp4_gpt_oss import GptOssMxfp4Experts

    suffix = f".{family.block_attr}.experts"
    return {
        name: module for name, module in model.named_modules()
        if name.endswith(suffix) and (isinstance(getattr(module, "gate_up_proj", None), nn.Parameter)
                                      and module.gate_up_proj.dim() == 3 or isinstance(module, GptOssMxfp4Experts))
    }


def find_dense_targets(model: nn.Module, family: Family, target_modules=None) -> dict[str, nn.Linear]:
    """``{module name: nn.Linear}`` inside the decoder layers whose leaf name is a dense LoRA target.

    ``target_modules`` (leaf names) narrows the family's default list; the LM head and embeddings are never targets,
    nor are linears of zero width (a shared expert a config turns off with ``shared_expert_intermediate_size=0`` /
    ``n_shared_experts=0``: the model adds nothing from it; wrapped, its first forward failed)."""
    return {name: module for name, module in _dense_linears(model, family, target_modules).items()
            if module.in_features > 0 and module.out_features > 0}


def find_zero_width_targets(model: nn.Module, family: Family, target_modules=None) -> frozenset[str]:
    """Names of the linears :func:`find_dense_targets` leaves out for their zero width. PEFT adapts them; their LoRA
    delta is empty (no output) or zero (no input), so an adapter's factors for them are dropped at load."""
    return frozenset(name for name, module in _dense_linears(model, family, target_modules).items()
                     if module.in_features == 0 or module.out_features == 0)


def _dense_linears(model: nn.Module, family: Family, target_modules) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` in the decoder layers whose leaf name is one of the dense targets, any width."""
    allowed = tuple(family.dense_targets) if target_modules is None else tuple(target_modules)
    unknown = sorted(set(allowed) - set(family.dense_targets))
    if unknown:
        raise ValueError(f"target_modules: {unknown} are not dense LoRA targets of {family.name}; "
                         f"choose from {list(family.dense_targets)}")
    return {name: module for name, module in model.named_modules()
            if type(module) is nn.Linear and ".layers." in f".{name}" and name.rpartition(".")[2] in allowed}
