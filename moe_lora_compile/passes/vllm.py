"""The pass as a vLLM ``InductorPass``, for ``CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass":
vllm_pass()})``. vLLM is optional: it is imported only when :func:`vllm_pass` is called.

Inside vLLM's own models the MoE runs in the opaque ``vllm.moe_forward`` op, so there the pass rewrites only
subgraphs traced from plain torch ops (ours, transformers').
"""

from __future__ import annotations

import functools

from .graph_pass import MoELoRAPass


@functools.lru_cache(maxsize=None)
def _vllm_pass_class() -> type:
    try:
        from vllm.compilation.inductor_pass import InductorPass
    except ImportError as e:
        raise ImportError("vllm_pass() needs vLLM (vllm.compilation.inductor_pass); without vLLM use "
                          "MoELoRAPass() with torch.compile or moe_lora_compile.compile") from e

    class VllmMoELoRAPass(MoELoRAPass, InductorPass):
        """:class:`MoELoRAPass` that vLLM's ``PostGradPassManager`` accepts; uuid from our sources + options."""

        uuid = MoELoRAPass.uuid
        __call__ = MoELoRAPass.__call__

    return VllmMoELoRAPass


def vllm_pass(**options) -> MoELoRAPass:
    """A vLLM ``InductorPass`` doing what :class:`MoELoRAPass` does (same options). ImportError without vLLM."""
    return _vllm_pass_class()(**options)
