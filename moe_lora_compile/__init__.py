"""moe_lora_compile: many LoRA adapters on one Mixture-of-Experts model, batched per token, through torch.compile."""

from . import ops
from .adapters import load_peft_adapter
from .compile import compile, pass_runs
from .inspect import dump_graphs
from .models import FAMILIES, MultiLoRAModel, attach, supported_model_types
from .ops import fused_moe_lora, lora_linear
from .passes import MoELoRAPass

__version__ = "0.1.0"

__all__ = [
    "FAMILIES",
    "MoELoRAPass",
    "MultiLoRAModel",
    "attach",
    "compile",
    "dump_graphs",
    "fused_moe_lora",
    "load_peft_adapter",
    "lora_linear",
    "ops",
    "pass_runs",
    "supported_model_types",
]
