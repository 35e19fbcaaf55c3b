"""Inductor post-grad passes that rewrite MoE+LoRA and linear+LoRA subgraphs to the ``moe_lora`` ops."""

from .graph_pass import MoELoRAPass, fused_op_counts

__all__ = ["MoELoRAPass", "fused_op_counts"]
