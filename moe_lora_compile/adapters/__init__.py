"""PEFT adapter loading and the fixed-size slot buffers adapters are copied into."""

from .peft_loader import ExpertsLoRA, ExpertsTarget, LinearLoRA, LinearTarget, load_peft_adapter, read_adapter_config
from .slots import AdapterSlots, AdapterWeights

__all__ = ["AdapterSlots", "AdapterWeights", "ExpertsLoRA", "ExpertsTarget", "LinearLoRA", "LinearTarget",
           "load_peft_adapter", "read_adapter_config"]
