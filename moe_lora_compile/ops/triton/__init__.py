"""Triton kernels of the ``moe_lora`` ops: device-side routing, grouped expert GEMMs with the LoRA delta fused in,
host launchers and tuned configs. Import :mod:`.launch` for the entry points."""
