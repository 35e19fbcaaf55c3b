"""moe_lora_compile: many LoRA adapters on one Mixture-of-Experts model, batched per token, through torch.compile.

``import moe_lora_compile`` loads torch and registers the ``torch.ops.moe_lora.*`` ops. The one exception is the
command line (``python -m moe_lora_compile ...`` and the ``moe-lora-compile`` script): there the package defers its
imports so that ``--help`` and argument errors answer before torch loads; the names below then load on first use.
"""

import importlib as _importlib
import os as _os
import sys as _sys

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "FAMILIES": ".models",
    "MoELoRAPass": ".passes",
    "MultiLoRAModel": ".models",
    "attach": ".models",
    "compile": ".compile",
    "dump_graphs": ".dump",
    "fused_moe_lora": ".ops",
    "load_peft_adapter": ".adapters",
    "lora_linear": ".ops",
    "pass_runs": ".compile",
    "supported_model_types": ".models",
}

__all__ = sorted([*_EXPORTS, "ops"])


def __getattr__(name):
    if name == "ops":
        return _importlib.import_module(".ops", __name__)
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


def _started_as_cli() -> bool:
    """Whether this process is the command line: ``python -m moe_lora_compile[.x]`` or the console script."""
    argv = list(getattr(_sys, "orig_argv", []))
    for i, arg in enumerate(argv[:-1]):
        if arg == "-m":
            return argv[i + 1].split(".")[0] == __name__
    return _os.path.basename(_sys.argv[0] if _sys.argv else "").startswith("moe-lora-compile")


def _load_all() -> None:
    """Import every public name now (this also registers ``torch.ops.moe_lora.*``)."""
    for name in __all__:
        value = __getattr__(name)
        globals()[name] = value  # over a submodule of the same name (``compile``) imported meanwhile


if not _started_as_cli():
    _load_all()
