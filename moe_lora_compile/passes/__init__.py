"""Inductor post-grad passes that rewrite MoE and linear LoRA subgraphs to the ``moe_lora`` ops: our references'
subgraphs, transformers' experts (with or without LoRA) and PEFT's own LoRA (expert ``target_parameters`` adapters,
single-adapter and mixed-adapter dense LoRA)."""

from .graph_pass import MoELoRAPass, fused_op_counts

__all__ = ["MoELoRAPass", "fused_op_counts"]
