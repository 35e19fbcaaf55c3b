"""The custom ops (``torch.ops.moe_lora.*``: ``fused_moe_lora``, ``fused_moe_lora_mxfp4``, ``lora_linear``,
``route``, ``decode_attention``), their pure-PyTorch references, the shared contract and the expert layouts."""

from .contract import ACTIVATIONS
from .decode_attention import decode_attention, decode_attention_reference
from .fused_moe_lora import fused_moe_lora
from .fused_moe_lora_mxfp4 import fused_moe_lora_mxfp4
from .layout import LAYOUTS
from .lora_linear import lora_linear
from .reference import fused_moe_lora_reference, lora_linear_reference
from .router import route, route_reference

__all__ = [
    "ACTIVATIONS",
    "LAYOUTS",
    "decode_attention",
    "decode_attention_reference",
    "fused_moe_lora",
    "fused_moe_lora_mxfp4",
    "fused_moe_lora_reference",
    "lora_linear",
    "lora_linear_reference",
    "route",
    "route_reference",
]
