"""Draft tokens for the engine's speculative decoding: prompt lookup (n-gram matching), no draft model.

A drafter is any callable ``draft(handles, k) -> [len(handles), k]`` token ids (a tensor or nested lists): for each
live :class:`~moe_lora_compile.serving.RequestHandle` (``handle.prompt`` + ``handle.tokens`` so far, and its
``request.adapter``), ``k`` proposals for the tokens that follow. Proposals only cost compute: the engine keeps the
prefix the model itself would have produced (the same tokens, greedy or seeded sampling), so a bad drafter is slow,
never wrong.
"""

from __future__ import annotations

from typing import Sequence


class PromptLookupDraft:
    """Propose the ``k`` tokens that followed the latest earlier occurrence of the sequence's last ``n`` tokens
    (``n`` from ``max_ngram`` down to ``min_ngram``, longest match first) in the request's own prompt and output:
    code edits, extraction, summaries and chat that quotes its context repeat long spans. No match: the last token,
    repeated. Each request's n-gram index is built incrementally (O(max_ngram) per new token), kept on its handle."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram (ints), got {min_ngram!r}, {max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def __call__(self, handles: Sequence, k: int) -> list[list[int]]:
        return [self._index(h).draft(k, self.max_ngram, self.min_ngram) for h in handles]

    def _index(self, handle) -> "_NgramIndex":
        index = getattr(handle, "_prompt_lookup", None)
        if index is None or index.max_ngram != self.max_ngram:
            index = _NgramIndex(self.max_ngram)
            index.extend(handle.prompt)
            handle._prompt_lookup = index
        index.extend(handle.tokens[index.length - len(handle.prompt):])
        return index


class _NgramIndex:
    """``seq`` and, per n-gram (n <= max_ngram), where its latest occurrence's continuation starts."""

    def __init__(self, max_ngram: int):
        self.max_ngram, self.seq, self.next_of = max_ngram, [], {}

    @property
    def length(self) -> int:
        return len(self.seq)

    def extend(self, tokens) -> None:
        for token in tokens:
            i = len(self.seq)  # the n-grams ending just before i now have a continuation: token
            for n in range(1, min(self.max_ngram, i) + 1):
                self.next_of[tuple(self.seq[i - n: i])] = i
            self.seq.append(int(token))

    def draft(self, k: int, max_ngram: int, min_ngram: int) -> list[int]:
        seq = self.seq
        for n in range(min(max_ngram, len(seq)), min_ngram - 1, -1):
            start = self.next_of.get(tuple(seq[len(seq) - n:]))
            if start is not None:
                proposal = seq[start: start + k]
                return proposal + [proposal[-1]] * (k - len(proposal))
        return [seq[-1]] * k
