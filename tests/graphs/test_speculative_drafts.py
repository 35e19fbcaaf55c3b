"""Speculative decoding on CPU (``capture=False``): malformed drafts are a clear ValueError, and on a model with a
sliding window the exact limit of "same as greedy" holds and is announced when it is crossed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_lora_compile.graphs import DecodeGraphs
from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import tiny_config

K = 2


def _mm(family):
    torch.manual_seed(0)
    return attach(AutoModelForCausalLM.from_config(tiny_config(family)).eval(), max_loras=1, max_rank=4)


def _prompt(b, s, seed=0):
    return torch.randint(3, 128, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bad, why", [
    (lambda seqs: torch.full((len(seqs), K), 128), "out-of-vocabulary ids \\[128\\]"),  # vocab 128
    (lambda seqs: torch.full((len(seqs), K), -1), "out-of-vocabulary ids \\[-1\\]"),
    (lambda seqs: None, "None"),
    (lambda seqs: torch.zeros(len(seqs), K + 1, dtype=torch.long), "shape \\(2, 3\\)"),
    (lambda seqs: torch.zeros(K, dtype=torch.long), "shape \\(2,\\)"),
    (lambda seqs: torch.full((len(seqs), K), 5.0), "dtype torch.float32"),
    (lambda seqs: [[5, 6], [7]], "list"),
    (lambda seqs: [[5, 6], [7, 500]], "out-of-vocabulary ids \\[500\\]"),
])
def test_malformed_drafts_raise_a_clear_value_error(bad, why):
    graphs = DecodeGraphs(_mm("qwen3_moe"), batch_sizes=(2,), max_cache_len=24, num_speculative_tokens=K,
                          capture=False, log=None)
    with pytest.raises(ValueError, match=f"draft must return \\[2, {K}\\] integer token ids in \\[0, 128\\), got .*{why}"):
        graphs.generate(_prompt(2, 4), max_new_tokens=4, draft=bad)


def test_valid_drafts_as_lists_and_int32_are_accepted():
    mm = _mm("qwen3_moe")
    prompt = _prompt(2, 4)
    reference = mm.generate(prompt, max_new_tokens=4, do_sample=False)
    graphs = DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=24, num_speculative_tokens=K, capture=False, log=None)
    assert torch.equal(graphs.generate(prompt, max_new_tokens=4, draft=lambda s: [[5, 6]] * len(s)), reference)
    draft = lambda s: torch.full((len(s), K), 7, dtype=torch.int32)
    assert torch.equal(graphs.generate(prompt, max_new_tokens=4, draft=draft), reference)
    # narrow and unsigned integer ids (numpy uint16 id tables): compared in int64 (int8 wrapped the bound 128 to
    # -128 and refused valid ids; unsigned ones had no `<` on CPU: NotImplementedError)
    for dtype in (torch.int8, torch.uint16, torch.uint32):
        draft = lambda s, dtype=dtype: torch.full((len(s), K), 7, dtype=dtype)  # noqa: E731
        assert torch.equal(graphs.generate(prompt, max_new_tokens=4, draft=draft), reference), dtype
    draft = lambda s: np.full((len(s), K), 7, dtype=np.uint16)  # noqa: E731
    assert torch.equal(graphs.generate(prompt, max_new_tokens=4, draft=draft), reference)
    with pytest.raises(ValueError, match="out-of-vocabulary"):  # 2**63 turns negative in int64: still refused
        graphs.generate(prompt, max_new_tokens=4, draft=lambda s: torch.full((len(s), K), 2**63, dtype=torch.uint64))
    state, _ = graphs.prefill(prompt)
    assert graphs.step(state, torch.full((2, K + 1), 7, dtype=torch.uint16)).shape[:2] == (2, K + 1)


def test_sliding_window_limit_is_exact_and_announced():
    """GPT-OSS tiny: sliding window 16 on layer 0. Rejected drafts inside the window: warned, and output equal to
    greedy up to that point; every draft accepted (no masked slot): equal to greedy past the window, no warning."""
    mm = _mm("gpt_oss")
    prompt, new = _prompt(2, 6, seed=3), 16
    reference = mm.generate(prompt, max_new_tokens=new, do_sample=False)
    with pytest.warns(UserWarning, match="equals greedy decoding while prompt \\+ cache slots used stay <= 16"):
        graphs = DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=6 + new * (K + 1), num_speculative_tokens=K,
                              capture=False, log=None)

    def oracle(seqs):
        return torch.stack([torch.cat([reference[i, len(s):len(s) + K], torch.full((K,), 3)])[:K]
                            for i, s in enumerate(seqs)])

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(graphs.generate(prompt, max_new_tokens=new, draft=oracle), reference)
    # always-rejected drafts: each step takes 3 slots and keeps 1; the 4th step feeds slots 15..17, and its last
    # query (slot 17) sees slots 2..17: slots 0-1 drop out while rejected slots 7-8, 10-11, 13-14 stay masked inside
    garbage = lambda seqs: torch.full((len(seqs), K), 3)
    exact = 4  # tokens before that step: the prefill's and 3 steps'
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short = graphs.generate(prompt, max_new_tokens=exact, draft=garbage)
    assert torch.equal(short, reference[:, : 6 + exact])
    with pytest.warns(RuntimeWarning, match="rows \\[0, 1\\] have rejected draft slots inside the 16-slot"):
        graphs.generate(prompt, max_new_tokens=new, draft=garbage)
