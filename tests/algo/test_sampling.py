"""logits_to_probs against Hugging Face's warpers; greedy; seeded sampling."""

import itertools

import pytest
import torch

from cosine_ray.algo.sampling import logits_to_probs, make_generator, sample

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
    assert make_generator(None).initial_seed() >= 0
