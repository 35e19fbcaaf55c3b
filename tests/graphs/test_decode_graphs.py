"""DecodeGraphs: bucketed decode / speculative-verify steps of a MultiLoRAModel equal the eager model.

CPU tests run the very same static-buffer steps eagerly (``capture=False``) on the tiny Qwen3-MoE model with three
PEFT adapters from ``moe_lora_compile.__main__.build``; ``@pytest.mark.gpu`` tests capture and replay CUDA graphs
with the Triton kernels (``use_ops=True``); run them with ``pytest -m gpu tests/graphs``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from moe_lora_compile.__main__ import ADAPTERS, build
from moe_lora_compile.graphs import DecodeGraphs, RowGraphs
from moe_lora_compile.models import attach
from moe_lora_compile.models.tiny import tiny_config

FAMILY = "qwen3_moe"
MIXED = ["alpha", "beta", None]  # 3 sequences -> bucket 4 (one padding row)
ATOL = 2e-5  # fp32


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("adapters")
    s = build(FAMILY, dtype=torch.float32, device=torch.device("cpu"), batch=3, seq_len=6, workdir=str(workdir))
    s.workdir = str(workdir)
    return s


def _eager_logits(mm, tokens, adapters):
    """Logits of a full eager forward (no cache) of ``tokens [b, S]``."""
    with torch.no_grad():
        return mm(tokens, adapters=adapters, use_cache=False).logits


def _tokens(shape, seed):
    return torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))


# --- decode ----------------------------------------------------------------------------------------------------
def test_decode_steps_match_eager_with_padding_row(setup):
    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(1, 2, 4), max_cache_len=32, capture=False, log=None)
    state, last = graphs.prefill(prompt, adapters=MIXED)
    assert state.bucket == 4 and state.batch_size == 3
    seq = prompt
    torch.testing.assert_close(last, _eager_logits(mm, seq, MIXED)[:, -1], atol=ATOL, rtol=0)
    for i in range(3):
        token = _tokens((3, 1), seed=i)
        logits = graphs.step(state, token)
        assert logits.shape == (3, 1, 128)
        # the adapter ids of the step: one slot per real row, -1 for the padding row
        slots = [mm.adapters["alpha"], mm.adapters["beta"], -1, -1]
        assert mm.token_lora_ids[:4].tolist() == slots
        seq = torch.cat([seq, token], dim=1)
        torch.testing.assert_close(logits[:, 0], _eager_logits(mm, seq, MIXED)[:, -1], atol=ATOL, rtol=0)
    assert state.position == prompt.shape[1] + 3


def test_generate_equals_mm_generate(setup):
    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(2, 4), max_cache_len=32, capture=False, log=None)
    ours = graphs.generate(prompt, adapters=MIXED, max_new_tokens=8)
    theirs = mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False)
    assert torch.equal(ours, theirs)
    # prompts of different lengths (left padding), one row per bucket size
    mask = torch.ones_like(prompt)
    mask[1, :2] = mask[2, :4] = 0
    padded = prompt.masked_fill(mask == 0, 0)
    ours = graphs.generate(padded, adapters=MIXED, max_new_tokens=6, attention_mask=mask)
    theirs = mm.generate(padded, adapters=MIXED, max_new_tokens=6, do_sample=False, attention_mask=mask)
    assert torch.equal(ours, theirs)
    one = graphs.generate(prompt[:1], adapters=["gamma"], max_new_tokens=5)
    assert torch.equal(one, mm.generate(prompt[:1], adapters=["gamma"], max_new_tokens=5, do_sample=False))


def test_generate_stops_at_eos_like_mm_generate(setup):
    """Row 2 of the demo batch emits EOS (id 2) early: pad tokens after it, and the output ends when all rows have
    ended, as in transformers' greedy search."""
    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, log=None)
    theirs = mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False)
    eos = theirs[2, 6:].tolist().index(2)  # this seed: the 'None' row ends after two tokens
    ours = graphs.generate(prompt, adapters=MIXED, max_new_tokens=8)
    assert torch.equal(ours, theirs) and (ours[2, 6 + eos + 1:] == 0).all()
    # all rows stop: the output is shorter than max_new_tokens, like mm.generate's
    short = graphs.generate(prompt[2:], adapters=[None], max_new_tokens=8)
    assert torch.equal(short, mm.generate(prompt[2:], adapters=[None], max_new_tokens=8, do_sample=False))
    assert short.shape[1] == 6 + eos + 1


# --- speculative decoding ----------------------------------------------------------------------------------------
def test_speculative_verify_matches_eager_and_accept_rolls_back(setup):
    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, num_speculative_tokens=2, capture=False,
                          log=None)
    assert graphs.query_len == 3
    state, _ = graphs.prefill(prompt, adapters=MIXED)
    first = _tokens((3, 3), seed=1)
    logits = graphs.step(state, first).clone()
    assert logits.shape == (3, 3, 128)
    torch.testing.assert_close(logits, _eager_logits(mm, torch.cat([prompt, first], 1), MIXED)[:, -3:],
                               atol=ATOL, rtol=0)
    keep = [1, 2, 3]  # per row: the fed token plus 0, 1, 2 accepted drafts
    graphs.accept(state, torch.tensor(keep))
    assert state.lengths[:3].tolist() == [6 + k for k in keep]
    second = _tokens((3, 3), seed=2)
    logits = graphs.step(state, second)
    for row, k in enumerate(keep):  # each row equals the eager forward of its own kept tokens
        seq = torch.cat([prompt[row], first[row, :k], second[row]])[None]
        torch.testing.assert_close(logits[row], _eager_logits(mm, seq, [MIXED[row]])[0, -3:], atol=ATOL, rtol=0)


def test_speculative_generate_equals_greedy_whatever_the_drafts(setup):
    mm, prompt = setup.model, setup.input_ids
    k, new = 2, 8
    reference = mm.generate(prompt, adapters=MIXED, max_new_tokens=new, do_sample=False)
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=6 + new * (k + 1), num_speculative_tokens=k,
                          capture=False, log=None)
    calls = []

    def oracle(sequences, garbage_rows=()):  # the right continuation (made up for garbage_rows)
        calls.append(len(sequences))
        rows = []
        for i, seq in enumerate(sequences):
            right = reference[i, len(seq):len(seq) + k].tolist()
            rows.append([3] * k if i in garbage_rows else right + [3] * (k - len(right)))
        return torch.tensor(rows)

    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=new, draft=oracle), reference)
    assert len(calls) <= -(-(new - 1) // (k + 1))  # every draft accepted: k + 1 tokens per step
    mixed = lambda seqs: oracle(seqs, garbage_rows=(1,))  # partial acceptance: rows advance differently
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=new, draft=mixed), reference)
    garbage = lambda seqs: _tokens((len(seqs), k), seed=len(seqs[0]))
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=new, draft=garbage), reference)


def test_gpt_oss_eager_attention_and_sliding_window(tmp_path):
    """GPT-OSS: eager attention (float masks), a sliding-window layer, expert biases; decode past the window."""
    s = build("gpt_oss", dtype=torch.float32, device=torch.device("cpu"), batch=3, seq_len=6, workdir=str(tmp_path))
    mm, prompt = s.model, s.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, log=None)
    new = 14  # 6 + 14 > sliding_window 16
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=new),
                       mm.generate(prompt, adapters=MIXED, max_new_tokens=new, do_sample=False))
    with pytest.warns(UserWarning, match="local attention over 16 tokens"):
        DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, num_speculative_tokens=1, capture=False, log=None)


def test_scalars_without_host_copies_mode():
    """The capture-time shim makes the same scalar tensors, with a fill instead of a host copy."""
    from moe_lora_compile.graphs.decode import ScalarsWithoutHostCopies

    with ScalarsWithoutHostCopies("cpu"):
        made = [torch.tensor(0.0, device="cpu", dtype=torch.bfloat16), torch.tensor(3, device="cpu"),
                torch.tensor(True, device="cpu"), torch.tensor(1.5, device="cpu"), torch.tensor([1, 2])]
    expected = [torch.tensor(0.0, dtype=torch.bfloat16), torch.tensor(3), torch.tensor(True), torch.tensor(1.5),
                torch.tensor([1, 2])]
    for a, b in zip(made, expected):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# --- errors ------------------------------------------------------------------------------------------------------
def test_clear_errors(setup):
    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(1, 2), max_cache_len=16, capture=False, log=None)
    with pytest.raises(ValueError, match=r"batch of 3 sequences is larger than the largest captured bucket \(2\)"):
        graphs.prefill(prompt, adapters=MIXED)
    with pytest.raises(ValueError, match="larger than the largest"):
        graphs.generate(prompt, adapters=MIXED, max_new_tokens=2)
    with pytest.raises(KeyError) as ours:
        graphs.prefill(prompt[:2], adapters=["alpha", "nope"])
    with pytest.raises(KeyError) as theirs:
        mm(prompt[:2], adapters=["alpha", "nope"])
    assert str(ours.value) == str(theirs.value) and "unknown adapter 'nope'" in str(ours.value)
    with pytest.raises(ValueError, match="one adapter name"):
        graphs.prefill(prompt[:2], adapters=["alpha"])
    state, _ = graphs.prefill(prompt[:2], adapters=["alpha", None])
    with pytest.raises(ValueError, match=r"tokens must be \[2, 1\]"):
        graphs.step(state, _tokens((2, 2), seed=0))
    with pytest.raises(ValueError, match=r"tokens: ids outside the vocabulary \[0, 128\) \(min 0, max 128\)"):
        graphs.step(state, torch.tensor([[0], [128]]))                 # host ids: checked before the step
    assert state.position == 6 and state.pending == 0
    with pytest.raises(RuntimeError, match="must follow a step"):
        graphs.accept(state, 1)
    with pytest.raises(ValueError, match="max_cache_len=16 is too small"):
        graphs.generate(prompt[:2], max_new_tokens=12)
    for _ in range(16 - 6):
        graphs.step(state, _tokens((2, 1), seed=0))
    with pytest.raises(ValueError, match="cache full"):
        graphs.step(state, _tokens((2, 1), seed=0))
    graphs.prefill(prompt[:1])
    with pytest.raises(RuntimeError, match="has ended"):
        graphs.step(state, _tokens((2, 1), seed=0))
    with pytest.raises(ValueError, match="num_speculative_tokens=1: generate needs draft="):
        DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=16, num_speculative_tokens=1, capture=False,
                     log=None).generate(prompt[:2], max_new_tokens=2)
    with pytest.raises(ValueError, match="capture=True needs the model on a CUDA device"):
        DecodeGraphs(mm, capture=True)
    with pytest.raises(ValueError, match="exceed mm.token_lora_ids"):
        DecodeGraphs(mm, batch_sizes=(4096,), num_speculative_tokens=3, capture=False)
    for warmup in (-1, 1.5, True):  # -1 ran no warmup silently; a bool or float is a typo
        with pytest.raises(ValueError, match="warmup must be an int >= 0"):
            DecodeGraphs(mm, capture=False, warmup=warmup)
        with pytest.raises(ValueError, match="warmup must be an int >= 0"):
            RowGraphs(mm, max_rows=2, max_cache_len=16, capture=False, warmup=warmup)


@pytest.mark.parametrize("call, error, message", [
    (lambda g, p: g.generate(p.float(), max_new_tokens=2), ValueError, "integer token ids"),      # float ids
    (lambda g, p: g.generate(p.bool(), max_new_tokens=2), ValueError, "integer token ids"),       # bool ids
    (lambda g, p: g.generate(p.tolist(), max_new_tokens=2), TypeError, "must be a torch.Tensor"),  # a list
    (lambda g, p: g.prefill(p + 200), ValueError, r"outside the vocabulary \[0, 128\)"),         # ids >= vocab
    (lambda g, p: g.prefill(p - 200), ValueError, "outside the vocabulary"),                      # negative ids
    (lambda g, p: g.generate(p, max_new_tokens=2, attention_mask=torch.full_like(p, 2)),          # mask of 2s
     ValueError, "only 0 .padding. and 1"),
    (lambda g, p: g.generate(p, max_new_tokens=2, attention_mask=torch.full(p.shape, 0.5)),       # fractional
     ValueError, "only 0 .padding. and 1"),
    (lambda g, p: g.generate(p, max_new_tokens=2,                                                 # right padding
                             attention_mask=torch.ones_like(p).index_fill_(1, torch.tensor([5]), 0)),
     ValueError, "padding must be on the left"),
    (lambda g, p: g.generate(p, max_new_tokens=2, attention_mask=torch.ones_like(p).index_fill_(0, torch.tensor([1]),
                                                                                                0)),
     ValueError, "a row has no token"),                                                           # an empty row
    (lambda g, p: g.generate(p, max_new_tokens=2, pad_token_id=-1), ValueError, "pad_token_id must be a token id"),
    (lambda g, p: g.generate(p, max_new_tokens=2, eos_token_id="x"), ValueError, "eos_token_id must be an int"),
    (lambda g, p: g.generate(p, max_new_tokens=2, eos_token_id=[1, 500]), ValueError, r"got 500"),
    (lambda g, p: DecodeGraphs(g.mm, batch_sizes=(4,), capture=False, pad_token_id=999), ValueError,
     r"pad_token_id must be a token id in \[0, 128\), got 999"),
    (lambda g, p: g.generate(p[:0], max_new_tokens=2), ValueError, "batch, seq_len >= 1"),        # no sequence
    (lambda g, p: g.generate(p, max_new_tokens=True), ValueError, "max_new_tokens"),               # a bool
    (lambda g, p: DecodeGraphs(g.mm, batch_sizes=(4,), capture=False, num_speculative_tokens=True),  # a bool
     ValueError, "num_speculative_tokens"),
    (lambda g, p: g.generate(p, max_new_tokens=2, draft=lambda seqs: None), ValueError,            # ignored before
     "draft= needs a DecodeGraphs built with num_speculative_tokens > 0"),
    (lambda g, p: g.generate(torch.cat([p[:, :2], torch.zeros_like(p[:, :1]), p[:, 3:]], 1), max_new_tokens=2),
     ValueError, "the pad id 0 other than as left padding"),                                      # pad mid-prompt
])
def test_bad_token_inputs(setup, call, error, message):
    """Ids, masks and special tokens are checked before anything runs: a float id would be truncated, a mask of
    2s or right padding would shift positions, an out-of-range id is a device-side assert on CUDA."""
    graphs = DecodeGraphs(setup.model, batch_sizes=(4,), max_cache_len=32, capture=False, log=None)
    with pytest.raises(error, match=message):
        call(graphs, setup.input_ids)


def test_left_padding_without_a_mask_is_inferred_like_mm_generate(setup):
    """Prompts left-padded with the pad id and no attention_mask: mm.generate infers the mask (transformers'
    rule: ids != pad, where the pad id occurs and is no EOS id); DecodeGraphs took the pads for tokens and gave
    other tokens. An explicit eos_token_id / tensor eos as mm.generate takes them."""
    mm, prompt = setup.model, setup.input_ids.clone()
    pad, eos = mm.model.generation_config.pad_token_id, mm.model.generation_config.eos_token_id
    assert pad is not None and pad not in ([eos] if isinstance(eos, int) else eos or [])
    prompt[1, :3] = pad
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, log=None)
    want = mm.generate(prompt, adapters=MIXED, max_new_tokens=6, do_sample=False)
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=6), want)
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=6, attention_mask=(prompt != pad).long()),
                       want)
    eos = int(want[0, -3])
    expected = mm.generate(prompt, adapters=MIXED, max_new_tokens=6, do_sample=False, eos_token_id=torch.tensor(eos))
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=6, eos_token_id=torch.tensor(eos)),
                       expected)
    # numpy integers (ids read from a numpy tokenizer output), as mm.generate takes them (refused before, the pad
    # message saying an in-range id was out of range)
    np = pytest.importorskip("numpy")
    for eos_id in (np.int64(eos), [np.int64(eos)], np.array([eos])):
        assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=6, eos_token_id=eos_id,
                                           pad_token_id=np.int64(pad)), expected)


def test_generate_warns_of_generation_config_it_does_not_apply(setup):
    """A checkpoint's generation_config with a repetition penalty (or min_new_tokens, ...): mm.generate applies it
    even greedy, DecodeGraphs.generate takes the argmax; it says so, once. The tiny model's own config: no word."""
    import warnings

    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, log=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        graphs.generate(prompt, adapters=MIXED, max_new_tokens=3)
    config = mm.model.generation_config
    try:
        config.repetition_penalty = 1.3
        with pytest.warns(RuntimeWarning, match=r"sets repetition_penalty=1.3, which mm.generate\(do_sample=False\) "
                                                r"applies") as caught:
            graphs.generate(prompt, adapters=MIXED, max_new_tokens=3)
        assert caught[0].filename == __file__  # the caller's line
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            graphs.generate(prompt, adapters=MIXED, max_new_tokens=3)  # once
    finally:
        config.repetition_penalty = 1.0


def test_generate_warns_when_the_config_samples_and_takes_numpy_ints(setup):
    """A generation_config with do_sample=True (Qwen3's checkpoints ship one): mm.generate then samples by default,
    DecodeGraphs.generate stays greedy; it says so once, and its tokens are mm.generate(do_sample=False)'s. A
    numpy max_new_tokens is taken, as mm.generate and the serving engine take it (it was a ValueError)."""
    import numpy as np

    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, log=None)
    config = mm.model.generation_config
    saved = config.do_sample
    try:
        config.do_sample = True
        with pytest.warns(RuntimeWarning, match=r"sets do_sample=True, so mm.generate samples by default"):
            got = graphs.generate(prompt, adapters=MIXED, max_new_tokens=np.int64(4))
    finally:
        config.do_sample = saved
    assert torch.equal(got, mm.generate(prompt, adapters=MIXED, max_new_tokens=4, do_sample=False))


def test_a_config_pad_id_outside_the_vocabulary_falls_back_as_in_row_graphs(setup):
    """A config saying pad_token_id = -1 (some checkpoints do): padding rows take the eos id, as RowGraphs' do
    (one rule, graphs.common.padding_token); DecodeGraphs raised, asking for pad_token_id=."""
    mm, prompt = setup.model, setup.input_ids
    gen, config = mm.model.generation_config, mm.model.config
    saved = gen.pad_token_id, config.pad_token_id
    try:
        gen.pad_token_id = config.pad_token_id = -1
        graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, log=None)
        eos = gen.eos_token_id
        assert graphs.pad_token_id == (eos if isinstance(eos, int) else eos[0])
    finally:
        gen.pad_token_id, config.pad_token_id = saved
    out = graphs.generate(prompt, adapters=MIXED, max_new_tokens=3, pad_token_id=0)
    assert torch.equal(out, mm.generate(prompt, adapters=MIXED, max_new_tokens=3, do_sample=False))


def test_accept_checks_its_counts(setup):
    graphs = DecodeGraphs(setup.model, batch_sizes=(4,), max_cache_len=32, num_speculative_tokens=2, capture=False,
                          log=None)
    state, _ = graphs.prefill(setup.input_ids, adapters=MIXED)
    graphs.step(state, _tokens((3, 3), seed=1))
    for bad in ([1, 2], [1, 2, 3, 1], [1.7, 2.2, 2.9], [[1, 1, 1]]):  # a raw expand error; floats were truncated
        with pytest.raises(ValueError, match="an int or 3 ints"):
            graphs.accept(state, bad)
    graphs.accept(state, [1, 3, 2])
    assert state.lengths[:3].tolist() == [setup.input_ids.shape[1] + n for n in (1, 3, 2)]


def test_unloaded_adapter_ends_the_live_batch_and_a_hot_swap_does_not(setup):
    """A batch's adapters are resolved to slots at prefill: unloading one (its slot free for another tenant's
    adapter) makes the next step an error, instead of decoding its rows with the new slot content; a hot swap
    (replace=True) keeps the slot and the batch goes on with the new weights, as documented."""
    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=32, capture=False, log=None)
    alpha_slot = mm.adapters["alpha"]
    token = _tokens((2, 1), seed=7)
    state, _ = graphs.prefill(prompt[:2], adapters=["alpha", None])
    graphs.step(state, token)
    try:
        mm.unload_adapter("alpha")
        assert mm.load_adapter("intruder", os.path.join(setup.workdir, "gamma")) == alpha_slot
        with pytest.raises(RuntimeError, match="adapter 'alpha' was unloaded after this batch's prefill"):
            graphs.step(state, token)
    finally:
        if "intruder" in mm.adapters:
            mm.unload_adapter("intruder")
        if "alpha" not in mm.adapters:
            assert mm.load_adapter("alpha", os.path.join(setup.workdir, "alpha")) == alpha_slot
    state, _ = graphs.prefill(prompt[:2], adapters=["alpha", None])
    graphs.step(state, token)
    try:
        mm.load_adapter("alpha", os.path.join(setup.workdir, "gamma"), replace=True)
        seq = torch.cat([prompt[:2], token, token], dim=1)
        logits = graphs.step(state, token)  # the prompt's cache was made with alpha, this token with gamma
        assert logits.shape == (2, 1, 128)
        torch.testing.assert_close(logits[1:, 0], _eager_logits(mm, seq[1:], [None])[:, -1], atol=ATOL, rtol=0)
    finally:
        mm.load_adapter("alpha", os.path.join(setup.workdir, "alpha"), replace=True)


def test_token_lora_ids_api(setup):
    """MultiLoRAModel.set_token_lora_ids pads with -1; inside manual_token_lora_ids the pre-hook keeps its hands
    off the buffer."""
    mm, prompt = setup.model, setup.input_ids
    view = mm.set_token_lora_ids(["beta", None], 2, batch_size=3)
    beta = mm.adapters["beta"]
    assert view.tolist() == [beta, beta, -1, -1, -1, -1]
    with pytest.raises(ValueError, match="exceed token_lora_ids"):
        mm.set_token_lora_ids(None, mm.token_lora_ids.numel() + 1, batch_size=1)
    with mm.manual_token_lora_ids():
        mm.model(input_ids=prompt[:1, :2])  # would write slot -1 for 'no adapters' without the bypass
    assert mm.token_lora_ids[:2].tolist() == [beta, beta]
    mm(prompt[:1, :2])
    assert mm.token_lora_ids[:2].tolist() == [-1, -1]
    # the device-side writer of replayed steps: per-token ids in, each sequence's slot from its first token
    ids = torch.tensor([beta, beta, -1, -1, 0, 0], dtype=torch.int32)
    mm.write_lora_ids(ids, tokens_per_sequence=2)
    assert mm.token_lora_ids[:6].tolist() == ids.tolist() and mm.sequence_lora_ids[:3].tolist() == [beta, -1, 0]
    with pytest.raises(ValueError, match="whole sequences"):
        mm.write_lora_ids(ids[:5], tokens_per_sequence=2)
    assert mm.slots_for(["beta", None], 2) == [beta, -1]
    # misuse that ran silently wrong (attach audit): adapters= ignored inside the context; ids written for another
    # length (the experts' per-token ids shifted by a row); a float id truncated; zero / negative lengths
    with mm.manual_token_lora_ids():
        with pytest.raises(ValueError, match="inside manual_token_lora_ids"):
            mm(prompt[:2, :2], adapters=["beta", "beta"])
        mm.set_token_lora_ids(["beta", None], 5)
        with pytest.raises(ValueError, match=r"a forward of 2 x 6 tokens .* written for 2 x 5"):
            mm.model(input_ids=prompt[:2, :6])
        with pytest.raises(ValueError, match=r"a forward of 3 x 5 tokens"):
            mm.model(input_ids=prompt[:3, :5])
        mm.model(input_ids=prompt[:1, :5])  # fewer rows of the written length: their ids are right
    for call, message in [(lambda: mm.write_lora_ids(ids, tokens_per_sequence=0), "tokens_per_sequence must be"),
                          (lambda: mm.write_lora_ids(ids.float() - 0.5, 2), "integer slot ids"),
                          (lambda: mm.set_token_lora_ids(None, -1, batch_size=1), "seq_len must be an int >= 1")]:
        with pytest.raises(ValueError, match=message):
            call()


def test_capture_false_logs_and_runs(setup):
    lines = []
    graphs = DecodeGraphs(setup.model, batch_sizes=(2,), max_cache_len=16, capture=False, log=lines.append)
    assert graphs.capture() is graphs and "capture=False" in lines[0] and not graphs.captured


# --- hot swap ----------------------------------------------------------------------------------------------------
def test_hot_swap_changes_exactly_the_rows_of_that_adapter(setup):
    mm, prompt = setup.model, setup.input_ids
    graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=16, capture=False, log=None)
    adapters = ["alpha", "beta", None, "alpha"]
    prompt4 = torch.cat([prompt, prompt[:1]])
    token = _tokens((4, 1), seed=3)

    def step_logits():
        state, _ = graphs.prefill(prompt4, adapters=adapters)
        return graphs.step(state, token).clone()

    before = step_logits()
    try:
        mm.load_adapter("alpha", os.path.join(setup.workdir, "gamma"), replace=True)
        after = step_logits()
        changed = (after - before).abs().amax(dim=(1, 2)) > 1e-4
        assert changed.tolist() == [True, False, False, True]
        torch.testing.assert_close(after[[1, 2]], before[[1, 2]], atol=1e-6, rtol=0)
        eager = _eager_logits(mm, torch.cat([prompt4, token], 1), ["gamma", "beta", None, "gamma"])[:, -1:]
        torch.testing.assert_close(after, eager, atol=ATOL, rtol=0)
    finally:
        mm.load_adapter("alpha", os.path.join(setup.workdir, "alpha"), replace=True)


# --- compiled steps -----------------------------------------------------------------------------------------------
def test_compiled_steps_equal_eager_one_graph_per_bucket_no_recompiles(setup):
    """compile=True: each bucket's step is compiled once, in capture(); its logits equal the eager model's; a new
    adapter mix, a smaller batch in the same bucket and a hot swap reuse the graphs."""
    mm, prompt = setup.model, setup.input_ids
    torch._dynamo.reset()
    lines = []
    graphs = DecodeGraphs(mm, batch_sizes=(2, 4), max_cache_len=32, capture=False, compile=True,
                          log=lines.append).capture()
    assert graphs.compiled_graphs()["decode"] == 2 and sum("compiling decode step" in line for line in lines) == 2

    def check(adapters, prompt, steps=2):
        state, last = graphs.prefill(prompt, adapters=adapters)
        torch.testing.assert_close(last, _eager_logits(mm, prompt, adapters)[:, -1], atol=ATOL, rtol=0)
        seq = prompt
        for i in range(steps):
            token = _tokens((len(adapters), 1), seed=10 + i)
            logits = graphs.step(state, token)
            seq = torch.cat([seq, token], 1)
            torch.testing.assert_close(logits[:, 0], _eager_logits(mm, seq, adapters)[:, -1], atol=ATOL, rtol=0)

    check(MIXED, prompt)  # bucket 4, a padding row
    check(["gamma", None, "beta", "alpha"], torch.cat([prompt, prompt[:1]]))  # bucket 4, another mix
    check(["beta"], prompt[:1])  # bucket 2, one padding row
    try:
        mm.load_adapter("alpha", os.path.join(setup.workdir, "gamma"), replace=True)
        check(["alpha", None], prompt[:2])
    finally:
        mm.load_adapter("alpha", os.path.join(setup.workdir, "alpha"), replace=True)
    assert graphs.compiled_graphs()["decode"] == 2  # nothing recompiled
    torch._dynamo.reset()


@pytest.mark.parametrize("compile_prefill", [True, False])
def test_compile_prefill_switch(setup, compile_prefill):
    """compile_prefill=False: only the decode steps go through torch.compile (a counting backend sees one frame per
    bucket and none for the prefill); the eager prefill gives the same logits and tokens."""
    from torch._dynamo.testing import CompileCounter

    mm, prompt = setup.model, setup.input_ids
    torch._dynamo.reset()
    counter = CompileCounter()
    try:
        graphs = DecodeGraphs(mm, batch_sizes=(4,), max_cache_len=32, capture=False, compile={"backend": counter},
                              compile_prefill=compile_prefill, log=None).capture()
        after_capture = counter.frame_count
        state, last = graphs.prefill(prompt, adapters=MIXED)
        torch.testing.assert_close(last, _eager_logits(mm, prompt, MIXED)[:, -1], atol=ATOL, rtol=0)
        assert after_capture >= 1  # the decode step of the bucket
        assert (counter.frame_count > after_capture) == compile_prefill
        out = graphs.generate(prompt, adapters=MIXED, max_new_tokens=3)
        assert torch.equal(out, mm.generate(prompt, adapters=MIXED, max_new_tokens=3, do_sample=False))
    finally:
        torch._dynamo.reset()


def test_each_instance_compiles_its_own_buckets(setup):
    """Five DecodeGraphs of four buckets each in one process: every one compiles its four decode steps (a counting
    backend sees four frames per instance). The step functions were shared, and so was Dynamo's cache and its
    recompile limit (sized for one instance's buckets): the third instance compiled two buckets, later ones none,
    and ran their steps uncompiled (only a log line said so)."""
    from torch._dynamo.testing import CompileCounter

    mm, prompt = setup.model, setup.input_ids
    torch._dynamo.reset()
    counter = CompileCounter()
    frames = []
    try:
        for extra in range(5):
            before = counter.frame_count
            graphs = DecodeGraphs(mm, batch_sizes=(1, 2, 4, 8), max_cache_len=24 + extra, capture=False,
                                  compile={"backend": counter}, compile_prefill=False, log=None).capture()
            with torch.no_grad():
                for batch in (1, 2, 4, 8):
                    graphs._forward_step(batch)
            frames.append(counter.frame_count - before)
        out = graphs.generate(prompt, adapters=MIXED, max_new_tokens=3)
        assert torch.equal(out, mm.generate(prompt, adapters=MIXED, max_new_tokens=3, do_sample=False))
    finally:
        torch._dynamo.reset()
    assert frames == [4] * 5


@pytest.mark.parametrize("setup_call", ["capture", "first_prefill"])
def test_setting_up_graphs_never_touches_a_running_forward(setup, setup_call):
    """Another thread is inside a forward of mm (paused after its first layer) when DecodeGraphs.capture() or the
    first prefill of a fresh instance runs: their warm-up ids waited for mm.lock, so the forward's logits are its
    own. They wrote mm's id buffers unlocked, mid-forward: every row of it computed with -1 (no adapter)."""
    import threading

    mm, prompt = setup.model, setup.input_ids
    with torch.no_grad():
        want = mm(prompt, adapters=MIXED).logits.clone()
    graphs = DecodeGraphs(mm, batch_sizes=(1, 2, 4), max_cache_len=24, capture=False, log=None)
    paused, go, result = threading.Event(), threading.Event(), {}

    def pause(module, args):
        if not paused.is_set():
            paused.set()
            go.wait(30)

    hook = mm.model.model.layers[1].register_forward_pre_hook(pause)

    def serve():
        with torch.no_grad():
            result["logits"] = mm(prompt, adapters=MIXED).logits.clone()

    server = threading.Thread(target=serve)
    server.start()
    try:
        assert paused.wait(30)
        target = graphs.capture if setup_call == "capture" else (lambda: graphs.prefill(prompt[:1]))
        setter = threading.Thread(target=target)
        setter.start()
        setter.join(1.0)  # it waits for mm.lock (it wrote the ids before)
    finally:
        go.set()
        hook.remove()
    server.join(60)
    setter.join(60)
    assert not server.is_alive() and not setter.is_alive()
    assert torch.equal(result["logits"], want)


def test_compile_option_errors(setup):
    with pytest.raises(ValueError, match="reduce-overhead"):
        DecodeGraphs(setup.model, batch_sizes=(2,), capture=False, compile={"mode": "reduce-overhead"})
    with pytest.raises(ValueError, match="dynamic"):
        DecodeGraphs(setup.model, batch_sizes=(2,), capture=False, compile={"dynamic": True})
    with pytest.raises(TypeError, match="compile"):
        DecodeGraphs(setup.model, batch_sizes=(2,), capture=False, compile="yes")


@pytest.mark.parametrize("compile, expected", [
    (True, {"shape_padding": False}),
    ({"mode": "max-autotune-no-cudagraphs"},  # a mode's options, with shape padding still off (was: on)
     {"shape_padding": False, **torch._inductor.list_mode_options("max-autotune-no-cudagraphs")}),
    ({"mode": "max-autotune-no-cudagraphs", "options": {"shape_padding": True}},  # the caller's own option wins
     {**torch._inductor.list_mode_options("max-autotune-no-cudagraphs"), "shape_padding": True}),
])
def test_compile_options_fold_a_mode_under_the_defaults(compile, expected):
    from moe_lora_compile.graphs.common import compile_options

    options = compile_options(compile)
    assert "mode" not in options and options["options"] == expected


# --- GPU: captured graphs ----------------------------------------------------------------------------------------
def _gpu_setup(tmp_path, dtype, family=FAMILY):
    """build()'s tiny model and adapters on CUDA, attached again with use_ops=True (the Triton kernels)."""
    s = build(family, dtype=dtype, device=torch.device("cuda"), batch=3, seq_len=6, workdir=str(tmp_path))
    mm = attach(copy.deepcopy(s.base), max_loras=4, max_rank=8, use_ops=True)
    for name in ADAPTERS:
        mm.load_adapter(name, tmp_path / name)
    return s, mm


def _tolerance(dtype):
    return dict(atol=2e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("family", [
    "qwen3_moe",  # sdpa attention
    "gpt_oss",    # eager attention (its mask needs ScalarsWithoutHostCopies on transformers < 5.24), sliding window
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_step", "compiled_step"])
def test_gpu_replay_equals_eager_new_mix_and_hot_swap_without_recapture(tmp_path, dtype, family, compiled):
    s, mm = _gpu_setup(tmp_path, dtype, family)
    prompt = s.input_ids
    lines = []
    torch._dynamo.reset()
    graphs = DecodeGraphs(mm, batch_sizes=(1, 2, 4, 8), max_cache_len=64, log=lines.append, compile=compiled)
    assert graphs.use_graphs
    graphs.capture()
    captures = [line for line in lines if line.startswith("capturing")]
    assert graphs.num_captures == 4 and len(captures) == 4 and "graph 1/4: batch 8" in captures[0]
    if compiled:
        assert graphs.compiled_graphs()["decode"] == 4  # one static graph per bucket, all compiled during capture()
    tol = _tolerance(dtype)

    def check(adapters, prompt, steps=3):
        state, _ = graphs.prefill(prompt, adapters=adapters)
        seq = prompt
        for i in range(steps):
            token = _tokens((len(adapters), 1), seed=i).cuda()
            logits = graphs.step(state, token).float()
            seq = torch.cat([seq, token], 1)
            torch.testing.assert_close(logits[:, 0], _eager_logits(mm, seq, adapters)[:, -1].float(), **tol)
        return logits

    check(MIXED, prompt)  # bucket 4, one padding row
    check(["gamma", None, "alpha", "beta", "beta"], torch.cat([prompt, prompt[:2]]))  # bucket 8, another mix
    check([None], prompt[:1])  # bucket 1, no adapter at all
    before = check(["alpha", "beta"], prompt[:2]).clone()
    mm.load_adapter("alpha", tmp_path / "gamma", replace=True)  # hot swap: written in place into alpha's slot
    after = check(["alpha", "beta"], prompt[:2])
    assert (after[0] - before[0]).abs().max() > 1e-3
    torch.testing.assert_close(after[1], before[1], **tol)  # beta's row: untouched
    assert graphs.num_captures == 4  # nothing was recaptured
    if compiled:
        assert graphs.compiled_graphs()["decode"] == 4  # nor recompiled
    if dtype == torch.float32:  # greedy tokens: the same as the eager model's generate
        out = graphs.generate(prompt, adapters=MIXED, max_new_tokens=8)
        assert torch.equal(out, mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False))


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager_step", "compiled_step"])
def test_gpu_speculative_replay_equals_eager(tmp_path, compiled):
    s, mm = _gpu_setup(tmp_path, torch.float32)
    prompt = s.input_ids
    torch._dynamo.reset()
    graphs = DecodeGraphs(mm, batch_sizes=(2, 4), max_cache_len=64, num_speculative_tokens=2, log=None,
                          compile=compiled).capture()
    assert graphs.num_captures == 2
    state, _ = graphs.prefill(prompt, adapters=MIXED)
    first = _tokens((3, 3), seed=1).cuda()
    logits = graphs.step(state, first).clone()
    tol = _tolerance(torch.float32)
    torch.testing.assert_close(logits, _eager_logits(mm, torch.cat([prompt, first], 1), MIXED)[:, -3:], **tol)
    keep = torch.tensor([1, 2, 3], device="cuda")
    graphs.accept(state, keep)
    second = _tokens((3, 3), seed=2).cuda()
    logits = graphs.step(state, second)
    for row, k in enumerate(keep.tolist()):
        seq = torch.cat([prompt[row], first[row, :k], second[row]])[None]
        torch.testing.assert_close(logits[row], _eager_logits(mm, seq, [MIXED[row]])[0, -3:], **tol)
    reference = mm.generate(prompt, adapters=MIXED, max_new_tokens=8, do_sample=False)
    garbage = lambda seqs: _tokens((len(seqs), 2), seed=len(seqs[0])).cuda()
    assert torch.equal(graphs.generate(prompt, adapters=MIXED, max_new_tokens=8, draft=garbage), reference)
    assert graphs.num_captures == 2


def test_example_runs_on_cpu():
    """examples/cuda_graph_decode.py as a user runs it: without CUDA it says so and still checks every result."""
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "cuda_graph_decode.py"
    result = subprocess.run([sys.executable, str(example), "--max-new-tokens", "4"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    if not torch.cuda.is_available():
        assert "no CUDA device: running the decode steps eagerly (capture=False)" in result.stdout
    assert result.stdout.rstrip().endswith("OK")


def test_chunked_prefill_and_a_grown_id_buffer_compile_as_documented():
    """DecodeGraphs(compile=...) on a CompileCounter: a prompt longer than one prefill chunk (max_tokens // bucket)
    is prefilled in slices, given a layout of their own, so the prefill keeps its one graph (the slices' strides
    or base compiled a second); a forward past max_tokens, which grows the id buffers every compiled step guards on,
    warns as it does after mlc.compile (it was silent)."""
    import warnings

    from torch._dynamo.testing import CompileCounter

    torch.manual_seed(0)
    mm = attach(AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).eval(), max_loras=2, max_rank=4,
                max_tokens=32)
    counter = CompileCounter()
    torch._dynamo.reset()
    try:
        graphs = DecodeGraphs(mm, batch_sizes=(2,), max_cache_len=48, capture=False, compile={"backend": counter},
                              log=None).capture()
        for length in (6, 16, 20, 30):  # 20 and 30: two chunks of at most 16
            graphs.generate(torch.randint(3, 128, (2, length)), max_new_tokens=2)
        assert graphs.compiled_graphs() == {"decode": 1, "prefill": 1}
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            mm(torch.randint(3, 128, (4, 9)), use_cache=False)  # 36 tokens > 32
        assert any("exceeds max_tokens" in str(w.message) for w in caught if w.category is RuntimeWarning)
    finally:
        torch._dynamo.reset()
