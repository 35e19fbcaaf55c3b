"""Every environment switch of moe_lora_compile, in one place: its name, default and meaning.

Switches read on the hot path (every kernel launch or op call: ``MOE_LORA_PDL``, ``MOE_LORA_CHECK_IDS``,
``MOE_LORA_PAIR_SHRINK``, ``MOE_LORA_EARLY_SHRINK``, ``MOE_LORA_CONFIGS``, ``TRITON_INTERPRET``) are read once, at
their first use, and kept (``read_once``); :func:`reload` forgets what was read (tests that change them call it).
``MOE_LORA_PASS_LOG`` is read once too, when :mod:`moe_lora_compile.passes` is imported (it sets up the pass's
logger: set it before that import, which ``import moe_lora_compile`` makes).
The others are read where they act, at call time. An on/off switch set to a word that is neither is refused, naming
the variable (:meth:`Switch.enabled`). Imports nothing heavy (the CLI reads it before torch is loaded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

_OFF = ("", "0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


_READ: dict[str, Optional[str]] = {}  # read_once switches: name -> value at first use (None: unset)


def reload() -> None:
    """Forget the values of the ``read_once`` switches: the next use reads the environment again."""
    _READ.clear()


@dataclass(frozen=True)
class Switch:
    """One environment variable: ``name``, the value used when it is unset (``default``), what it does (``doc``);
    ``read_once``: read at first use and kept (hot-path switches); ``strict``: :meth:`enabled` refuses a value that
    is neither an on nor an off word (a typo must not turn a switch on); False for Triton's own variable, read as
    Triton reads it: on only for an on word as written (``2``, ``garbage`` or `` 1 `` leave Triton's interpreter
    off, so they must not send our code down its interpreter paths);
    ``on_off``: an on/off switch (False: its values are words of its own, checked where it is read)."""

    name: str
    default: str
    doc: str
    read_once: bool = False
    strict: bool = True
    on_off: bool = True

    def raw(self) -> Optional[str]:
        """The variable's value, or None when it is unset."""
        if not self.read_once:
            return os.environ.get(self.name)
        if self.name not in _READ:
            _READ[self.name] = os.environ.get(self.name)
        return _READ[self.name]

    def value(self) -> str:
        """The value in effect: the variable's, or ``default`` when it is unset or empty (``VAR=`` from an empty
        shell substitution must not turn a default-on switch off)."""
        raw = self.raw()
        return self.default if raw is None or not raw.strip() else raw

    def enabled(self) -> bool:
        """False for ``0``, ``false``, ``off``, ``no``, True for ``1``, ``true``, ``on``, ``yes`` (case-insensitive;
        unset or empty: the default's); anything else is a ValueError naming the variable (if not
        ``strict``: on for an on word as written, off otherwise)."""
        if not self.strict:
            return self.value().lower() in _ON
        value = self.value().strip().lower()
        if value in _OFF:
            return False
        if value in _ON:
            return True
        raise ValueError(f"{self.name}={self.raw()!r}: use 1, true, on or yes, or 0, false, off or no "
                         f"(unset: {self.default!r})")


PDL = Switch("MOE_LORA_PDL", "late",
             "programmatic dependent launch between a layer's kernels on SM90+: 0 (off), late (default: the next "
             "kernel may launch once this one's programs are past their main loop), early, 1 (= late); when set it "
             "wins over a tuned config entry's 'pdl' (precedence: moe_lora_compile.ops.triton.configs.requested_pdl)",
             read_once=True, on_off=False)
CHECK_IDS = Switch("MOE_LORA_CHECK_IDS", "1",
                   "device-side range asserts of topk_ids / token_lora_ids in the CUDA impls (no host sync; off while "
                   "a CUDA graph is captured); 0 turns them off", read_once=True)
PASS_LOG = Switch("MOE_LORA_PASS_LOG", "0",
                  "1: log every rewrite of the compile pass and every near miss with the reason it was rejected")
PROGRESS = Switch("MOE_LORA_PROGRESS", "",
                  "progress lines on stderr for slow steps (compiling, capturing, loading): 1 on, 0 off; unset: on "
                  "when stderr is a terminal (the CLI's --verbose sets 1)")

VLLM = Switch("MOE_LORA_VLLM", "0",
              "1/true/yes/on: the vLLM general plugin (moe_lora_compile.integrations.vllm) runs vLLM's MoE LoRA "
              "through fused_moe_lora; listing moe_lora_compile in VLLM_PLUGINS does the same; unset: installing "
              "the package changes no vLLM deployment")

PAIR_SHRINK = Switch("MOE_LORA_PAIR_SHRINK", "1",
                     "1 (default): the fused MoE op's LoRA shrinks run one program per (token, expert) pair in sorted "
                     "mode up to 512 pairs (decode batches) where a config does not say otherwise; 0: the block "
                     "shrink there (moe_lora_compile.ops.triton.configs.default_per_pair_shrink)",
                     read_once=True)
EARLY_SHRINK = Switch("MOE_LORA_EARLY_SHRINK", "1",
                      "1 (default), with PDL late: the kernel after a LoRA shrink that opens a chain (the dense GEMV "
                      "/ GEMM, the MoE w13 kernel with w13_overlap: their main loops read nothing the shrink writes) "
                      "launches as soon as the shrink's programs start, so its weights stream while the shrink runs; "
                      "0: once the shrink's programs are past their main loop "
                      "(moe_lora_compile.ops.triton.pdl.LaunchChain)",
                      read_once=True)
CONFIGS = Switch("MOE_LORA_CONFIGS", "auto",
                 "which tuned kernel-config tables the Triton ops read: auto (default: this GPU's, "
                 "moe_lora_compile/configs/<gpu>.json and <gpu>_linear.json, the heuristics where none), 0 (the "
                 "heuristics only: the baseline of a tuning A/B), or a GPU name whose tables to use (e.g. 'NVIDIA "
                 "H200' on a card that has none of its own; moe_lora_compile.ops.triton.configs.table_gpu)",
                 read_once=True, on_off=False)
SWITCHES: tuple[Switch, ...] = (PDL, CHECK_IDS, PASS_LOG, PROGRESS, VLLM, PAIR_SHRINK, EARLY_SHRINK, CONFIGS)


def check_switches() -> None:
    """ValueError naming the first on/off switch set to a word that is neither (the CLI asks before any work,
    instead of failing where the switch is first read)."""
    for switch in SWITCHES:
        if switch.on_off:
            switch.enabled()

# Not ours, read here for what it changes in our code: Triton's interpreter (kernels on CPU tensors; no PDL).
TRITON_INTERPRET = Switch("TRITON_INTERPRET", "0", "Triton's own: 1 runs @triton.jit kernels in its interpreter",
                          read_once=True, strict=False)
