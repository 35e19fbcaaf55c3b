"""The custom ops (``torch.ops.moe_lora.*``: ``fused_moe_lora``, ``lora_linear``, ``route``), their pure-PyTorch
references, the shared contract and the expert layouts."""

from .contract import ACTIVATIONS
from .fused_moe_lora import fused_moe_lora
from .fused_moe_lora_mxfp4 import fused_moe_lora_mxfp4
from .layout import LAYOUTS
from .lora_linear import lora_linear
from .reference import fused_moe_lora_reference, lora_linear_reference
from .router import route, route_reference

__all__ = [
    "ACTIVATIONS",
    "LAYOUTS",
    "fused_moe_lora",
    "fused_moe_lora_mxfp4",
    "fused_moe_lora_reference",
    "lora_linear",
    "lora_linear_reference",
    "route",
    "route_reference",
]
