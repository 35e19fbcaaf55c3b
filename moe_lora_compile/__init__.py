"""moe_lora_compile: many LoRA adapters on one Mixture-of-Experts model, batched per token, through torch.compile."""

from . import ops
from .ops import fused_moe_lora, lora_linear

__version__ = "0.1.0"

__all__ = ["fused_moe_lora", "lora_linear", "ops"]
