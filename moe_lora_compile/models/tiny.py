"""Tiny random configs of every supported family (tests, examples): hidden 32, 2 layers, 4 experts, vocab 128,
expert intermediate 24 (so 2I = 48 != H), special token ids below the vocab. No hub access needed."""

from __future__ import annotations

_COMMON = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

from ..family_names import FAMILY_CHOICES, TINY_FAMILIES, canonical_family  # noqa: F401 (re-exported)


def tiny_config(family: str, **overrides):
    """A transformers config of ``family`` (a name in :data:`TINY_FAMILIES` or its model_type, e.g.
    ``llama4_text``), tiny and random-init friendly."""
    import transformers as tf

    family = canonical_family(family)

    c = dict(_COMMON)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**c, head_dim=8, moe_intermediate_size=24, intermediate_size=48, num_experts=4,
                                num_experts_per_tok=2, norm_topk_prob=True)
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**c, moe_intermediate_size=24, intermediate_size=48,
                                shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2)
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(**c, head_dim=8, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                              layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                              rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**c, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    elif family == "deepseek_v3":
        c["num_key_value_heads"] = 4
        cfg = tf.DeepseekV3Config(**c, moe_intermediate_size=24, intermediate_size=48, n_routed_experts=4,
                                  num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
                                  first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**c, intermediate_size=24, num_experts=4, num_experts_per_tok=2)
    elif family == "llama4":
        cfg = tf.Llama4TextConfig(**c, head_dim=8, intermediate_size=24, intermediate_size_mlp=48,
                                  num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**c, head_dim=8, intermediate_size=48)
    elif family == "llama":
        cfg = tf.LlamaConfig(**c, intermediate_size=48)
    elif family == "mistral":
        cfg = tf.MistralConfig(**c, intermediate_size=48)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**c, intermediate_size=48)
    else:  # pragma: no cover - canonical_family refuses unknown names first
        raise ValueError(f"family must be one of {TINY_FAMILIES}, got {family!r}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# Dense LoRA targets that PEFT's API reaches on transformers 5 (PEFT rewrites expert-like names such as
# `gate_proj` to the fused experts on MoE models, so shared experts are named by their parent).
_ALL_DENSE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_PEFT_DENSE_TARGETS = {
    "qwen2_moe": ["q_proj", "v_proj", "o_proj", "shared_expert.up_proj"],
    "deepseek_v3": ["q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
    "llama4": ["q_proj", "v_proj", "o_proj", "shared_expert.gate_proj"],
    "qwen3": _ALL_DENSE, "llama": _ALL_DENSE, "mistral": _ALL_DENSE, "qwen2": _ALL_DENSE,
}


def tiny_lora_config(family: str, **overrides):
    """A PEFT ``LoraConfig`` for a tiny ``family`` model: both expert parameters (``target_parameters``) plus
    attention / shared-expert / dense-MLP linears; ``overrides`` go to ``LoraConfig`` (r, lora_alpha, ...)."""
    from peft import LoraConfig

    from .families import FAMILIES

    family = canonical_family(family)
    fam = next(f for f in FAMILIES if f.name == family or family in f.model_types)
    kwargs = dict(r=4, lora_alpha=8, init_lora_weights=False,
                  target_modules=_PEFT_DENSE_TARGETS.get(family, ["q_proj", "v_proj", "o_proj"]))
    if fam.is_moe:
        kwargs["target_parameters"] = [f"{fam.block_attr}.experts.gate_up_proj", f"{fam.block_attr}.experts.down_proj"]
    kwargs.update(overrides)
    return LoraConfig(**kwargs)


def randomize_lora_(peft_model, std: float = 0.2, seed: int = 0) -> None:
    """Fill every LoRA A/B weight of a PEFT model with N(0, std) so deltas are real (in place)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
