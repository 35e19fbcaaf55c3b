"""Progress lines for the slow steps (building, compiling, capturing), on stderr, so stdout's reports stay as they
are for scripts. On when stderr is a terminal; ``MOE_LORA_PROGRESS=1`` (or the CLI's ``--verbose``) turns them on
anywhere, ``MOE_LORA_PROGRESS=0`` off. Imports nothing heavy."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Iterator

from . import settings


def enabled() -> bool:
    if settings.PROGRESS.value().strip():  # set: an on or off word (a ValueError naming the variable otherwise)
        return settings.PROGRESS.enabled()
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def say(message: str) -> None:
    """One progress line on stderr (when :func:`enabled`)."""
    if enabled():
        print(f"moe_lora_compile: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(message: str) -> Iterator[None]:
    """``message ...`` before, ``message: N.N s`` after (when :func:`enabled`)."""
    say(f"{message} ...")
    start = time.perf_counter()
    yield
    say(f"{message}: {time.perf_counter() - start:.1f} s")
