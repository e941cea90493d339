"""Logits → sampling distributions, and seeded sampling.

``logits_to_probs`` applies the filters in the order Hugging Face transformers applies its
warpers (``TemperatureLogitsWarper`` → ``TopKLogitsWarper`` → ``TopPLogitsWarper``), with the
same tie rules, so a request gets the distribution it would get from ``model.generate``:

* top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept);
* top-p keeps the smallest set of most-likely tokens whose cumulative probability is >= top_p
  (always at least one token; ties broken by ``torch.sort``, as HF does).

Both the target and every drafter must use the *same* ``logits_to_probs`` settings: lossless
verification (``algo.verify``) reproduces whatever distribution it is given as ``target_probs``.
"""

from __future__ import annotations

import os

import torch


def logits_to_probs(
    logits: torch.Tensor,  # [n, vocab]
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [n, vocab] fp32
    """Sampling distribution of each row. ``temperature == 0`` means greedy (one-hot argmax).

    ``top_k <= 0`` and ``top_p >= 1`` switch the respective filter off.
    """
    assert logits.ndim == 2, f"logits must be [n, vocab], got shape {tuple(logits.shape)}"
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1] (1 = off), got {top_p}")
    scores = logits.float()  # [n, vocab]
    if temperature == 0:
        probs = torch.zeros_like(scores)
        probs.scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
        return probs

    if temperature != 1.0:
        scores = scores / temperature
    if top_k > 0:
        k = min(top_k, scores.size(-1))
        kth_largest = torch.topk(scores, k)[0][..., -1, None]  # [n, 1]
        scores = scores.masked_fill(scores < kth_largest, -float("inf"))
    if top_p < 1.0:
        # Same steps as TopPLogitsWarper: drop the ascending-sorted prefix whose cumulative
        # mass is <= 1 - top_p; the most likely token is always kept.
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)  # [n, vocab]
        cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [n, vocab]
        sorted_is_removed = cumulative_probs <= (1 - top_p)
        sorted_is_removed[..., -1:] = False
        is_removed = sorted_is_removed.scatter(1, sorted_indices, sorted_is_removed)
        scores = scores.masked_fill(is_removed, -float("inf"))
    return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, *, generator: torch.Generator) -> torch.Tensor:  # [n] int64
    """One token per row of ``probs  # [n, vocab]``."""
    assert probs.ndim == 2, f"probs must be [n, vocab], got shape {tuple(probs.shape)}"
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, *, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator seeded with ``seed``, or from ``os.urandom`` when ``seed`` is None."""
    generator = torch.Generator(device=device)
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little") >> 1  # non-negative int64
    generator.manual_seed(int(seed))
    return generator
