"""transformers integration: the family table, our experts implementation, the dense wrapper and ``attach``."""

from .attach import MultiLoRAModel, attach
from .families import FAMILIES, Family, family_for, supported_model_types

__all__ = ["FAMILIES", "Family", "MultiLoRAModel", "attach", "family_for", "supported_model_types"]
