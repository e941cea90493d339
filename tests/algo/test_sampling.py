"""logits_to_probs against Hugging Face's warpers; greedy; seeded sampling; keyed sampling
(``sample_keyed``: its noise, its distribution by statistics, its determinism)."""

import itertools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from cosine_ray.algo.sampling import (draw_seed, keyed_argmax, keyed_exponentials, logits_to_probs,
                                      make_generator, sample, sample_keyed)

lp = pytest.importorskip("transformers.generation.logits_process")

VOCAB = 8


def _hf_probs(logits, temperature, top_k, top_p):  # [n, vocab]
    """What ``generate(do_sample=True)`` samples from: warpers in HF's order, then softmax."""
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)  # unused by these warpers
    scores = lp.TemperatureLogitsWarper(float(temperature))(input_ids, logits)
    if top_k > 0:
        scores = lp.TopKLogitsWarper(top_k)(input_ids, scores)
    if top_p < 1.0:
        scores = lp.TopPLogitsWarper(top_p)(input_ids, scores)
    return scores.softmax(dim=-1)


def _logit_batches():
    gen = torch.Generator().manual_seed(0)
    yield "normal", torch.randn(6, VOCAB, generator=gen) * 2
    yield "ties", torch.randint(0, 3, (6, VOCAB), generator=gen).float()  # many exact ties
    yield "peaked", torch.randn(6, VOCAB, generator=gen) * 12
    yield "all_equal", torch.zeros(3, VOCAB)


@pytest.mark.parametrize("name, logits", list(_logit_batches()))
def test_matches_hf_warpers(name, logits):
    for temperature, top_k, top_p in itertools.product(
            [0.3, 1.0, 1.7], [0, 1, 3, VOCAB, 50], [1.0, 0.95, 0.6, 0.3, 1e-6, 0.0]):
        ours = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        theirs = _hf_probs(logits, temperature, top_k, top_p)
        where = f"{name} T={temperature} top_k={top_k} top_p={top_p}"
        assert ours.dtype == torch.float32 and ours.shape == logits.shape
        assert torch.equal(ours > 0, theirs > 0), where  # same support, ties included
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7, msg=where)


def test_top_p_keeps_smallest_set_reaching_top_p():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for top_p, kept in [(0.45, 1), (0.55, 2), (0.79, 2), (0.81, 3), (0.96, 4), (1e-9, 1)]:
        probs = logits_to_probs(logits, temperature=1.0, top_p=top_p)
        assert int((probs > 0).sum()) == kept, top_p


def test_top_k_keeps_ties_at_the_boundary():
    probs = logits_to_probs(torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]]), temperature=1.0, top_k=2)
    assert (probs > 0).tolist() == [[True, False, True, True, False]]


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]], dtype=torch.float16)
    for top_k, top_p in [(0, 1.0), (2, 0.5)]:
        probs = logits_to_probs(logits, temperature=0.0, top_k=top_k, top_p=top_p)
        assert probs.dtype == torch.float32
        assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]  # first max on ties


def test_invalid_arguments():
    with pytest.raises(AssertionError):
        logits_to_probs(torch.zeros(VOCAB), temperature=1.0)
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(1, VOCAB), temperature=-0.5)
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(1, VOCAB), temperature=1.0, top_p=1.5)
    with pytest.raises(AssertionError):
        sample(torch.ones(VOCAB) / VOCAB, generator=make_generator(0))


def test_sample_is_seeded_and_respects_support():
    probs = logits_to_probs(torch.randn(64, VOCAB, generator=make_generator(1)), temperature=1.0, top_k=3)
    first = sample(probs, generator=make_generator(123))
    assert first.dtype == torch.int64 and first.shape == (64,)
    assert torch.equal(first, sample(probs, generator=make_generator(123)))
    assert not torch.equal(first, sample(probs, generator=make_generator(124)))
    assert bool((probs.gather(1, first[:, None]) > 0).all())


def test_sample_frequencies_follow_probs():
    probs = torch.tensor([[0.1, 0.6, 0.0, 0.3]]).expand(20_000, 4)
    counts = torch.bincount(sample(probs, generator=make_generator(5)), minlength=4).double()
    assert counts[2] == 0
    assert torch.allclose(counts / counts.sum(), probs[0].double(), atol=0.02)


def test_make_generator():
    a = torch.rand(4, generator=make_generator(7))
    assert torch.equal(a, torch.rand(4, generator=make_generator(7)))
    assert make_generator(None).initial_seed() != make_generator(None).initial_seed()
    # unseeded generators give different streams (a constant fallback seed would not)
    assert not torch.equal(torch.rand(8, generator=make_generator(None)), torch.rand(8, generator=make_generator(None)))


# ---- keyed sampling: the noise ---------------------------------------------------------------

def test_keyed_noise_known_answer():
    """Pinned values: a change here changes every seeded text ever produced (reproducibility
    across versions). Raw words: Philox4x64-10, key (123, 7), counter from 0 (numpy's Philox)."""
    top52 = [468290485427176, 4448918291942158, 4472066358094430, 2606201863930035]
    raw = np.random.Philox(key=np.array([123, 7], dtype=np.uint64)).random_raw(4)
    assert [int(r) >> 12 for r in raw] == top52
    expected = [-math.log((k + 0.5) * 2.0 ** -52) for k in top52]
    noise = keyed_exponentials(123, 7, 4)
    assert noise.dtype == torch.float64 and noise.shape == (4,)
    torch.testing.assert_close(noise, torch.tensor(expected, dtype=torch.float64), rtol=1e-14, atol=0)
    torch.testing.assert_close(noise, torch.tensor([2.2635434744654366, 0.012216008039602481,
                                                    0.007026419891663472, 0.5469830572873453],
                                                   dtype=torch.float64), rtol=1e-14, atol=0)


def test_keyed_noise_is_a_function_of_seed_and_position_only():
    a = keyed_exponentials(5, 100, 1000)
    assert torch.equal(a, keyed_exponentials(5, 100, 1000))
    assert torch.equal(a[:10], keyed_exponentials(5, 100, 10))  # token x's noise ignores vocab
    others = [keyed_exponentials(6, 100, 1000), keyed_exponentials(5, 101, 1000),
              keyed_exponentials(100, 5, 1000), keyed_exponentials(5 + 2**32, 100, 1000)]
    for other in others:  # another seed, another position, swapped, seeds equal mod 2**32
        assert not torch.isclose(a, other).any()
    # seeds are taken mod 2**64 (negative seeds are their two's complement)
    assert torch.equal(keyed_exponentials(-1, 3, 50), keyed_exponentials(2**64 - 1, 3, 50))
    assert torch.equal(keyed_exponentials(2**64 + 9, 3, 50), keyed_exponentials(9, 3, 50))
    with pytest.raises(ValueError):
        keyed_exponentials(5, -1, 10)
    with pytest.raises(ValueError):
        keyed_exponentials(5, 2**64, 10)
    with pytest.raises(ValueError):
        keyed_exponentials(5, 0, 0)


def test_keyed_noise_is_iid_exponential():
    """One 49,152-token vector (SmolLM2's vocabulary) is Exp(1) by Kolmogorov-Smirnov, strictly
    positive and finite, and vectors of neighbouring keys are uncorrelated."""
    vocab = 49_152
    noise = keyed_exponentials(123, 40, vocab)
    assert bool(torch.isfinite(noise).all()) and float(noise.min()) > 0
    assert stats.kstest(noise.numpy(), "expon").pvalue > 1e-4
    pooled = torch.cat([keyed_exponentials(s, t, 2_000) for s in range(5) for t in range(5)])
    assert stats.kstest(pooled.numpy(), "expon").pvalue > 1e-4
    bound = 5 / math.sqrt(vocab)  # |r| of independent vectors is ~N(0, 1/n): 5 sigma
    for other in (keyed_exponentials(123, 41, vocab), keyed_exponentials(124, 40, vocab),
                  keyed_exponentials(40, 123, vocab)):
        r = float(np.corrcoef(noise.numpy(), other.numpy())[0, 1])
        assert abs(r) < bound, r
    # within a vector: neighbouring tokens uncorrelated
    r = float(np.corrcoef(noise[:-1].numpy(), noise[1:].numpy())[0, 1])
    assert abs(r) < bound, r


def test_draw_seed():
    seeds = {draw_seed() for _ in range(100)}
    assert len(seeds) == 100 and all(0 <= s < 2**64 for s in seeds)


# ---- keyed sampling: the draw ------------------------------------------------------------------

def test_keyed_argmax_is_gumbel_max():
    """argmax p / E (what we compute) = argmax log p + G with G = -log E ~ Gumbel(0, 1)."""
    gen = torch.Generator().manual_seed(0)
    probs = logits_to_probs(torch.randn(200, 64, generator=gen) * 2, temperature=0.8, top_k=20)
    noise = torch.stack([keyed_exponentials(9, t, 64) for t in range(200)])  # [200, 64]
    gumbel = -noise.log()
    assert torch.equal(keyed_argmax(probs, noise), (probs.double().log() + gumbel).argmax(-1))
    assert torch.equal(sample_keyed(probs, seed=9, positions=range(200)), keyed_argmax(probs, noise))


def test_sample_keyed_is_deterministic_and_row_independent():
    gen = torch.Generator().manual_seed(1)
    probs = logits_to_probs(torch.randn(12, VOCAB, generator=gen), temperature=1.0)  # [12, vocab]
    positions = [3, 4, 4, 5, 9, 3, 100, 7, 8, 8, 2**40, 0]
    tokens = sample_keyed(probs, seed=77, positions=positions)
    assert tokens.dtype == torch.int64 and tokens.shape == (12,)
    assert torch.equal(tokens, sample_keyed(probs, seed=77, positions=positions))
    for i, position in enumerate(positions):  # the same row alone: the same token
        assert int(sample_keyed(probs[i:i + 1], seed=77, positions=[position])[0]) == int(tokens[i])
    # rows of the same position share the noise: identical rows, identical tokens
    same = sample_keyed(probs[:1].expand(5, VOCAB), seed=77, positions=[4] * 5)
    assert len(set(same.tolist())) == 1
    assert sample_keyed(torch.empty(0, VOCAB), seed=1, positions=[]).shape == (0,)
    # other seeds / positions give other draws (over 200 rows, not all equal)
    flat = torch.full((200, VOCAB), 1 / VOCAB)
    a = sample_keyed(flat, seed=1, positions=range(200))
    assert not torch.equal(a, sample_keyed(flat, seed=2, positions=range(200)))
    assert not torch.equal(a, sample_keyed(flat, seed=1, positions=range(1, 201)))


def test_sample_keyed_checks():
    with pytest.raises(AssertionError):
        sample_keyed(torch.full((VOCAB,), 1 / VOCAB), seed=0, positions=[0])
    with pytest.raises(AssertionError):
        sample_keyed(torch.full((2, VOCAB), 1 / VOCAB), seed=0, positions=[0])
    with pytest.raises(ValueError):
        sample_keyed(torch.zeros(1, VOCAB), seed=0, positions=[0])
    with pytest.raises(ValueError):
        sample_keyed(torch.full((1, VOCAB), float("nan")), seed=0, positions=[0])
    with pytest.raises(AssertionError):
        keyed_argmax(torch.ones(2, VOCAB), torch.ones(2, VOCAB + 1))


def test_sample_keyed_with_one_hot_probs_is_the_argmax():
    logits = torch.randn(30, VOCAB, generator=torch.Generator().manual_seed(2))
    greedy = logits_to_probs(logits, temperature=0.0)
    assert torch.equal(sample_keyed(greedy, seed=5, positions=range(30)), logits.argmax(-1))


@settings(max_examples=150, deadline=None)
@given(rows=st.lists(st.lists(st.floats(-30, 30, width=32), min_size=VOCAB, max_size=VOCAB), min_size=1,
                     max_size=4),
       temperature=st.floats(0.05, 2.0), top_k=st.integers(0, VOCAB + 2), top_p=st.floats(0.01, 1.0),
       seed=st.integers(-2**70, 2**70), position=st.integers(0, 2**64 - 1))
def test_sample_keyed_stays_in_support(rows, temperature, top_k, top_p, seed, position):
    probs = logits_to_probs(torch.tensor(rows), temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = sample_keyed(probs, seed=seed, positions=[position] * len(rows))
    assert (probs.gather(1, tokens[:, None]) > 0).all()


# ---- keyed sampling: the distribution, by statistics --------------------------------------------
#
# N draws of one distribution p over K tokens, each with its own key (N seeds at one position, or
# N positions under one seed). Tolerance, as in test_verify.py: E[TV] <= 0.5 sqrt(K / N) and by
# McDiarmid P(TV > E[TV] + t) <= exp(-2 N t^2); t = sqrt(ln(1e6) / (2 N)) makes a false alarm
# <= 1e-6 per check. Zero-probability tokens must never come out; chi-square p-value > 1e-4.

KEYED_N = 12_000


def keyed_tv_bound(num_outcomes: int, n: int) -> float:
    return 0.5 * math.sqrt(num_outcomes / n) + math.sqrt(math.log(1e6) / (2 * n))


def check_matches(tokens: torch.Tensor, p: torch.Tensor) -> None:
    n, p = len(tokens), p.double()
    counts = torch.bincount(tokens, minlength=len(p)).double()
    support = p > 0
    assert counts[~support].sum() == 0, "a zero-probability token was drawn"
    tv = 0.5 * float((counts / n - p).abs().sum())
    assert tv < keyed_tv_bound(int(support.sum()), n), (tv, keyed_tv_bound(int(support.sum()), n))
    if int(support.sum()) > 1:
        assert stats.chisquare(counts[support].numpy(), (p[support] / p[support].sum() * n).numpy()).pvalue > 1e-4


def _keyed_cases():
    logits = torch.tensor([[1.2, -0.3, 0.5, 2.0, -1.5, 0.0, 0.9, -0.7]])
    yield "plain", logits_to_probs(logits, temperature=1.0)[0]
    yield "temperature", logits_to_probs(logits, temperature=0.6)[0]
    yield "top_k", logits_to_probs(logits, temperature=0.8, top_k=3)[0]
    yield "top_p", logits_to_probs(logits, temperature=1.0, top_p=0.7)[0]
    yield "top_k_top_p", logits_to_probs(logits, temperature=1.3, top_k=5, top_p=0.9)[0]
    yield "skewed", torch.tensor([0.9, 0.0, 0.05, 0.0, 0.03, 0.015, 0.005, 0.0])


@pytest.mark.parametrize("name, p", list(_keyed_cases()), ids=[c[0] for c in _keyed_cases()])
def test_sample_keyed_over_positions_follows_probs(name, p):
    tokens = sample_keyed(p[None].expand(KEYED_N, -1), seed=20240601, positions=range(KEYED_N))
    check_matches(tokens, p)


@pytest.mark.parametrize("name, p", list(_keyed_cases())[::2], ids=[c[0] for c in _keyed_cases()][::2])
def test_sample_keyed_over_seeds_follows_probs(name, p):
    tokens = torch.cat([sample_keyed(p[None], seed=seed, positions=[17]) for seed in range(KEYED_N)])
    check_matches(tokens, p)


def test_wrong_keyed_sampler_fails_the_same_check():
    """The check has power: adding the Gumbel noise to p instead of log p is a biased sampler."""
    p = dict(_keyed_cases())["plain"]
    noise = torch.stack([keyed_exponentials(3, t, VOCAB) for t in range(KEYED_N)])  # [N, vocab]
    wrong = (p.double()[None] - noise.log()).argmax(-1)
    with pytest.raises(AssertionError):
        check_matches(wrong, p)
