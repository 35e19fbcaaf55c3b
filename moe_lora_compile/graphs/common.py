"""What :class:`~moe_lora_compile.graphs.DecodeGraphs` and :class:`~moe_lora_compile.graphs.RowGraphs` share: the
compile options of a captured step, each instance's own copy of the step functions, Dynamo's recompile limit per
bucket, the token of padding rows, the checks of a draft's proposal and of greedy-changing generation settings,
progress lines."""

from __future__ import annotations

import contextlib
import itertools
import operator
import sys
import types
from typing import Callable, Optional

import torch
from torch import Tensor


def compile_options(compile) -> Optional[dict]:
    """``compile`` (bool, or a dict of ``torch.compile`` keyword arguments) -> the keyword arguments, or None when
    off. Inductor's own CUDA graphs (``reduce-overhead``, ``max-autotune``) are refused: our capture holds the step
    in a CUDA graph already; ``dynamic`` is chosen by the caller (steps static per bucket, prefill dynamic).
    Inductor's options default to :data:`moe_lora_compile.compile.DEFAULT_INDUCTOR_OPTIONS`."""
    if not isinstance(compile, (bool, dict)):
        raise TypeError(f"compile must be a bool or a dict of torch.compile keyword arguments, got {compile!r}")
    if not compile:
        return None
    options = dict(compile) if isinstance(compile, dict) else {}
    if options.get("mode") in ("reduce-overhead", "max-autotune"):
        raise ValueError(f"compile: mode={options['mode']!r} adds Inductor's own CUDA graphs inside our capture; "
                         f"use the default mode or 'max-autotune-no-cudagraphs'")
    if "dynamic" in options:
        raise ValueError("compile: 'dynamic' is chosen here (decode steps static per bucket, prefill dynamic)")
    if options.get("backend", "inductor") == "inductor":  # torch.compile takes mode or options, not both: a mode's
        from ..compile import DEFAULT_INDUCTOR_OPTIONS  # options are folded in, under the caller's own

        mode = options.pop("mode", None)
        mode_options = torch._inductor.list_mode_options(mode) if mode is not None else {}
        options["options"] = {**DEFAULT_INDUCTOR_OPTIONS, **mode_options, **options.get("options", {})}
    return options


def in_range(t, n: int) -> bool:
    """An integer (Python, numpy or a 0-d integer tensor; not a bool) in ``[0, n)``."""
    if t is None or isinstance(t, bool):
        return False
    try:
        return 0 <= operator.index(t) < n
    except TypeError:
        return False


def padding_token(pad_token_id, configs, vocab_size: int) -> int:
    """The token of padding rows (their outputs are discarded): ``pad_token_id`` checked, else the first id in the
    vocabulary of the configs' pad ids, then eos ids (a config may say -1), else 0."""
    if pad_token_id is not None:
        if not in_range(pad_token_id, vocab_size):
            raise ValueError(f"pad_token_id must be a token id in [0, {vocab_size}), got {pad_token_id!r}")
        return operator.index(pad_token_id)
    candidates = []
    for key in ("pad_token_id", "eos_token_id"):
        for cfg in configs:
            ids = getattr(cfg, key, None)
            candidates += ids if isinstance(ids, (list, tuple)) else [ids]
    return next((operator.index(t) for t in candidates if in_range(t, vocab_size)), 0)


_COPIES = itertools.count()


# generation_config fields that change what greedy decoding picks (with their no-op values): mm.generate applies
# them through transformers' logits processors; DecodeGraphs.generate and the serving engine take the argmax of
# the model's logits (and warn when one is set)
GREEDY_PROCESSORS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
                      "min_length": 0, "min_new_tokens": None, "suppress_tokens": None,
                      "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
                      "sequence_bias": None, "exponential_decay_length_penalty": None}


def greedy_processors(generation_config) -> list[str]:
    """The :data:`GREEDY_PROCESSORS` settings of ``generation_config`` that are not their no-op values."""
    return [f"{name}={getattr(generation_config, name)!r}" for name, noop in GREEDY_PROCESSORS.items()
            if getattr(generation_config, name, noop) not in (noop, None, [], ())]


def validated_draft(proposal, b: int, k: int, vocab: int) -> Tensor:
    """``draft``'s result as a ``[b, k]`` int64 tensor of ids in ``[0, vocab)``, else a ValueError saying why."""
    what = f"draft must return [{b}, {k}] integer token ids in [0, {vocab})"
    if proposal is None:
        raise ValueError(f"{what}, got None")
    if not isinstance(proposal, Tensor):
        try:
            proposal = torch.as_tensor(proposal)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{what}, got {type(proposal).__name__} ({e})") from None
    if proposal.dtype.is_floating_point or proposal.dtype.is_complex or proposal.dtype == torch.bool:
        raise ValueError(f"{what}, got dtype {proposal.dtype}")
    if tuple(proposal.shape) != (b, k):
        raise ValueError(f"{what}, got shape {tuple(proposal.shape)}")
    # compared in int64: `int8_tensor >= 128` wraps the bound to -128 (valid ids refused), and unsigned tensors
    # (numpy uint16 id tables) have no `<` on CPU (NotImplementedError); uint64 ids >= 2**63 turn negative: refused
    proposal = proposal.long()
    if proposal.numel() and bool(((proposal < 0) | (proposal >= vocab)).any()):
        bad = proposal[(proposal < 0) | (proposal >= vocab)].unique().tolist()
        raise ValueError(f"{what}, got out-of-vocabulary ids {bad[:8]}")
    return proposal


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own. Dynamo keeps compiled graphs, and counts recompiles, per code object:
    each DecodeGraphs / RowGraphs compiling the module-level step functions added its buckets' graphs to one cache,
    so past the recompile limit (sized for one instance's buckets) a later instance's steps ran uncompiled, with
    only a log line to say so (and the cache held every earlier instance's graphs). A copy per instance keeps its
    graphs, and their lifetime, its own."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_COPIES)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compile_limits(compiled: bool, num_buckets: int):
    """Context: Dynamo's per-function recompile limit raised to the buckets' count (one static graph each)."""
    if not compiled:
        return contextlib.nullcontext()
    limit = max(torch._dynamo.config.recompile_limit, 2 * num_buckets + 2)
    return torch._dynamo.config.patch(recompile_limit=limit)


def say(log: Optional[Callable[[str], None]], line: str) -> None:
    """A progress line through ``log`` (None: silent; ``print``: flushed at once)."""
    if log is not None:
        log(line)
        if log is print:
            sys.stdout.flush()
