"""The engine's sampler: draws follow softmax(logits / T) within top-k and the nucleus (checked against the
distribution computed directly in float64), a row's draw depends only on its own (logits, seed, counter), greedy
rows are the argmax."""

from __future__ import annotations

import pytest
import torch

from moe_lora_compile.serving.sampling import filtered_scores, sample, uniform_noise, unit_interval

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 0.9, 1.4])
TIED = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, 1.5, 1.4])
TIED_TOP = torch.tensor([2.0, 1.5, 1.0, 0.2, 2.0, -1.0, 0.9, 1.4])


def _expected(logits, temperature, top_p, top_k):
    """The target distribution, as transformers' warpers define it: softmax(l / T), keep the k most likely,
    renormalise, then keep the fewest most likely of those whose probability reaches top_p, renormalise (float64)."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = p.argsort(descending=True, stable=True).tolist()
    if top_k:  # the k most likely and every token tied with the k-th
        order = [t for t in order if p[t] >= p[order[top_k - 1]]]
    p_k = p[order] / p[order].sum()
    keep, mass = [], 0.0
    for token, q in zip(order, p_k.tolist()):
        if mass >= top_p:
            break
        keep.append(token)
        mass += q
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("temperature, top_p, top_k, logits", [
    (1.0, 1.0, 0, LOGITS),    # plain softmax
    (0.7, 1.0, 0, LOGITS),    # temperature sharpens
    (1.3, 0.8, 0, LOGITS),    # nucleus cuts the tail
    (1.0, 1.0, 3, LOGITS),    # top-k
    (2.0, 0.9, 5, LOGITS),    # both: the nucleus of the top-5 distribution
    (1.0, 0.6, 2, LOGITS),    # both: the top-2 nucleus keeps 1 token (a nucleus over all 8, cut to 2, kept 2)
    (1.0, 1.0, 2, TIED),  # the 2nd and 3rd logits tie: top-2 keeps 3 tokens (transformers and vLLM keep ties)
    (1.0, 1.0, 1, TIED_TOP),  # two tokens tie for the largest logit: top-1 draws either
])
def test_draws_follow_the_target_distribution(temperature, top_p, top_k, logits):
    n = 20000
    rows = logits.expand(n, -1)
    full = lambda v: torch.full((n,), v)  # noqa: E731
    tokens = sample(rows, full(float(temperature)), full(float(top_p)), full(top_k).long(),
                    torch.full((n,), 1234, dtype=torch.long), torch.arange(n))
    freq = torch.bincount(tokens, minlength=logits.numel()).double() / n
    want = _expected(logits, temperature, top_p, top_k)
    assert torch.all(freq[want == 0] == 0)  # never outside top-k / the nucleus
    sigma = (want * (1 - want) / n).sqrt()
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-9), (freq, want)


def test_a_rows_draw_depends_only_on_its_logits_seed_and_counter():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    temp, top_p, top_k = torch.full((6,), 1.2), torch.full((6,), 0.95), torch.zeros(6, dtype=torch.long)
    seeds, counters = torch.tensor([5, 5, 6, 7, 2**40 + 5, 5]), torch.tensor([0, 1, 0, 0, 0, 0])
    batch = sample(logits, temp, top_p, top_k, seeds, counters)
    for row in range(6):
        alone = sample(logits[row:row + 1], temp[:1], top_p[:1], top_k[:1], seeds[row:row + 1], counters[row:row + 1])
        assert alone.item() == batch[row].item()
    noise = uniform_noise(seeds, counters, 50)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])  # counter, seed matter
    assert not torch.equal(noise[0], noise[4])  # so do a seed's high 32 bits
    assert torch.equal(noise[0], noise[5]) and bool(((noise > 0) & (noise < 1)).all())
    # greedy rows (temperature 0) are the argmax, beside sampled ones
    temp[::2] = 0
    mixed = sample(logits, temp, top_p, top_k, seeds, counters)
    assert torch.equal(mixed[::2], logits[::2].argmax(-1)) and torch.equal(mixed[1::2], batch[1::2])


@pytest.mark.parametrize("temperature", [1e-6, 1e-30, 1e-40, 1e-300])  # 1e-40: float32 subnormal; 1e-300: below it
def test_tiny_temperature_is_greedy(temperature):
    """A temperature > 0 but tiny is the argmax (the limit of softmax(l / T)), whatever the logits' scale: dividing
    unshifted logits overflowed to inf - inf = NaN and drew arbitrary tokens."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 300, generator=g) * 30
    n = logits.shape[0]
    tokens = sample(logits, torch.full((n,), temperature, dtype=torch.float64), torch.full((n,), 0.9),
                    torch.zeros(n, dtype=torch.long), torch.arange(n), torch.zeros(n, dtype=torch.long))
    assert torch.equal(tokens, logits.argmax(-1))


def test_noise_stays_inside_the_open_interval():
    """The extreme hashes map strictly inside (0, 1): with 24 bits the largest rounded to 1.0 in float32, E = -log U
    was 0 and that token won the draw (an argmax at +inf) whatever its probability and filters."""
    u = unit_interval(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1]))
    assert u.dtype == torch.float32 and bool(((u > 0) & (u < 1)).all())
    assert bool(torch.isfinite(torch.log(-torch.log(u))).all())


def test_top_p_one_drops_nothing_beside_a_filtering_row():
    """top_p = 1 is off: a row keeps every token whether or not a batch mate filters (the float32 cumsum of a
    201088-token softmax reaches 1.0 before its tail, which the unfiltered row then lost: its draw depended on
    its batch mates)."""
    g = torch.Generator().manual_seed(0)
    row = -torch.log(-torch.log(torch.rand(1, 201088, generator=g))) * 1.5  # a flat-ish logit row, GPT-OSS vocab
    logits = torch.cat([row, row])
    scores = filtered_scores(logits, torch.ones(2), torch.tensor([1.0, 0.5], dtype=torch.float64),
                             torch.zeros(2, dtype=torch.long), filtered=True)
    assert bool(torch.isfinite(scores[0]).all())
    assert bool(torch.isinf(scores[1]).any())  # the filtering row still filters


@pytest.mark.parametrize("temperature", [1e30, 1e39, 1e300])  # near, past and far past float32's largest number
def test_top_k_and_top_p_hold_at_huge_temperatures(temperature):
    """A huge temperature flattens softmax(l / T) to uniform, but top-k still keeps the k largest logits and top-p
    the fewest most likely tokens (ranked by the logits): the scores rounded to ties (all 0, or NaN where a logit
    is -inf over an inf temperature) and the filters then kept arbitrary tokens."""
    n = 400
    logits = LOGITS.expand(n, -1).clone()
    logits[:, 5] = float("-inf")  # a token masked out before sampling
    top3 = set(LOGITS.topk(3).indices.tolist())
    seeds = torch.arange(n)
    t = torch.full((n,), temperature, dtype=torch.float64)
    drawn = sample(logits, t, torch.ones(n, dtype=torch.float64), torch.full((n,), 3), seeds, torch.zeros(n))
    assert set(drawn.tolist()) == top3  # only the top 3, each of them drawn (uniform: ~133 draws each)
    # top-p 0.3 of a uniform distribution over the 7 finite tokens keeps the 3 most likely (3 / 7 >= 0.3 > 2 / 7)
    drawn = sample(logits, t, torch.full((n,), 0.3, dtype=torch.float64), torch.zeros(n, dtype=torch.long), seeds,
                   torch.zeros(n))
    assert set(drawn.tolist()) == top3


@pytest.mark.parametrize("top_k, top_p, ties", [
    (2, 1.0, True),    # bf16-rounded logits with a 4-way tie: top-k keeps the tokens tied with the k-th
    (1, 1.0, True),    # the tie may be for the largest logit: top-1 keeps all four
    (3, 0.7, False),   # both filters, distinct logits (a nucleus ending inside a tie depends on sort order)
    (5, 0.5, False),
    (40, 0.9, False),
])
def test_the_kept_tokens_are_transformers_warpers(top_k, top_p, ties):
    """The tokens left finite are exactly the ones transformers' TopK then TopP warpers leave, row by row."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 300, generator=g, dtype=torch.float64).float() * 2
    if ties:  # (a GPT-OSS row at bf16 ties near its top often)
        logits = logits.bfloat16().float()
        logits[:, :4] = logits[:, :1]  # a 4-way tie for the row's first logit, wherever it ranks
    scores = filtered_scores(logits, torch.ones(32), torch.full((32,), top_p), torch.full((32,), top_k),
                             filtered=True)
    want = warpers.TopKLogitsWarper(top_k)(None, logits.clone())
    if top_p < 1:
        want = warpers.TopPLogitsWarper(top_p)(None, want)
    assert torch.equal(torch.isfinite(scores), torch.isfinite(want))
