"""Family names in one table, importable without torch (the CLI parses its arguments before loading torch).

Each family has a short name (what the CLI, the examples and :func:`~moe_lora_compile.models.tiny.tiny_config`
call it) and the transformers ``model_type`` values it serves (what ``config.model_type`` says, and what the README's
table lists). Every command accepts either: ``llama4`` and ``llama4_text`` name the same family, in any case and with
``-`` for ``_`` (``Qwen3-MoE``, ``GPT-OSS``). The dense models are named by their own ``model_type`` (``llama``,
``mistral``, ``qwen2``, ``qwen3``), not by the group's name ``dense``.
"""

from __future__ import annotations

import argparse

# short name -> transformers model_type(s); models.families.FAMILIES is built from this table
FAMILY_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "qwen3_moe": ("qwen3_moe",),
    "qwen2_moe": ("qwen2_moe",),
    "gpt_oss": ("gpt_oss",),
    "mixtral": ("mixtral",),
    "deepseek_v3": ("deepseek_v3",),
    "olmoe": ("olmoe",),
    "llama4": ("llama4_text",),
    "dense": ("llama", "mistral", "qwen2", "qwen3"),
}

# the names a tiny model can be built for: every MoE family, and each dense model_type on its own
TINY_FAMILIES: tuple[str, ...] = tuple(
    t for name, types in FAMILY_MODEL_TYPES.items() for t in (types if name == "dense" else (name,)))

# model_type -> short name, where they differ (``llama4_text`` -> ``llama4``)
ALIASES: dict[str, str] = {t: name for name, types in FAMILY_MODEL_TYPES.items() if name != "dense"
                           for t in types if t != name}

# every accepted spelling, short names first
FAMILY_CHOICES: tuple[str, ...] = TINY_FAMILIES + tuple(ALIASES)


def canonical_family(name: str) -> str:
    """The short name (one of :data:`TINY_FAMILIES`) of ``name``, which may be a short name or a model_type (any
    case, ``-`` for ``_``, surrounding blanks ignored)."""
    given = name
    if isinstance(name, str) and name not in TINY_FAMILIES and name not in ALIASES:
        name = name.strip().lower().replace("-", "_")
    if name in TINY_FAMILIES:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if name == "dense":
        raise ValueError(f"family 'dense' is a group: name the model_type, one of {FAMILY_MODEL_TYPES['dense']}")
    raise ValueError(f"unknown family {given!r}; choose one of: {describe_choices()}")


def describe_choices() -> str:
    """``qwen3_moe, ..., llama4 (or llama4_text), ...``: the names, each alias next to its short name."""
    also = {short: model_type for model_type, short in ALIASES.items()}
    return ", ".join(f"{n} (or {also[n]})" if n in also else n for n in TINY_FAMILIES)


def family_arg(value: str) -> str:
    """``argparse`` ``type=`` for a ``--family`` option: accepts both spellings, returns the short name."""
    try:
        return canonical_family(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
