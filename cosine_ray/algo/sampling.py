"""Logits → sampling distributions, and seeded sampling.

``logits_to_probs`` applies temperature, top-k and top-p in the order and with the tie rules of
Hugging Face's warpers, so a request gets the distribution ``model.generate`` would give it. The
target and every drafter must use the same settings: verification reproduces whatever
distribution it is given as ``target_probs``.

*Keyed sampling* (``sample_keyed``) makes a seeded text independent of batching and speculation
by fixing the randomness of every *position* (a token's 0-based index in prompt + output):
``keyed_exponentials(seed, t, vocab)`` draws E_t(x) ~ Exp(1) i.i.d. from Philox keyed by
(seed, t), and token_t = argmax_x p_t(x) / E_t(x), the exponential race (Gumbel-max), an exact
sample of p_t. Speculation computes the same token_t at every position it commits
(``algo.verify.verify_keyed``), so the text is the same token for token. The proof, the numerics
and the cost are in docs/algorithms.md ("Lossless verification").
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
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


# ---- keyed sampling (module docstring) ------------------------------------------------------

_U64 = (1 << 64) - 1
_UNIFORM_BITS = 52
"""Bits of each raw word used for a uniform: (k + 1/2) * 2**-52 is exact in float64."""


def draw_seed() -> int:
    """A fresh random sampling seed in [0, 2**64), from ``os.urandom``."""
    return int.from_bytes(os.urandom(8), "little")


def keyed_exponentials(seed: int, position: int, vocab: int) -> torch.Tensor:  # [vocab] fp64
    """E(x) ~ Exp(1) i.i.d. for x < ``vocab``, a fixed function of (seed mod 2**64, position).

    Philox4x64-10 keyed with (seed mod 2**64, position), one raw word per token id; the noise
    of token x does not depend on ``vocab`` (a prefix of a longer vector). CPU tensor.
    """
    if not 0 <= position <= _U64:
        raise ValueError(f"position must be in [0, 2**64), got {position}")
    if vocab < 1:
        raise ValueError(f"vocab must be >= 1, got {vocab}")
    key = np.array([int(seed) & _U64, int(position)], dtype=np.uint64)
    raw = np.random.Philox(key=key).random_raw(vocab)  # [vocab] uint64
    raw >>= np.uint64(64 - _UNIFORM_BITS)  # top 52 bits: < 2**52, so int64 and float64 hold them
    uniforms = torch.from_numpy(raw.view(np.int64)).to(torch.float64)  # [vocab]
    uniforms.add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)  # (k + 1/2) / 2**52, exact, in (0, 1)
    return uniforms.log_().neg_()


def keyed_argmax(
    probs: torch.Tensor,  # [n, vocab]
    exponentials: torch.Tensor,  # [n, vocab] fp64
) -> torch.Tensor:  # [n] int64
    """Row-wise argmax_x probs(x) / exponentials(x) (the exponential race; first index on ties).

    Raises ValueError when a row has no positive entry (not a distribution). Elementwise, so a
    row's token does not depend on the other rows.
    """
    assert probs.ndim == 2 and exponentials.shape == probs.shape, (
        f"probs {tuple(probs.shape)} and exponentials {tuple(exponentials.shape)} must both be [n, vocab]")
    scores = probs.to(torch.float64, copy=True).div_(exponentials.to(probs.device, torch.float64))  # [n, vocab]
    tokens = scores.argmax(dim=-1)  # [n]
    chosen = probs.gather(1, tokens[:, None]).squeeze(1)  # [n]
    if not bool((chosen > 0).all()):  # all-zero rows (argmax 0) and NaN rows (argmax = the NaN)
        bad = int((~(chosen > 0)).nonzero()[0])
        raise ValueError(f"probs row {bad} is not a distribution (no positive probability)")
    return tokens


def sample_keyed(
    probs: torch.Tensor,  # [n, vocab]
    *,
    seed: int,
    positions: Sequence[int],  # n absolute positions (module docstring)
) -> torch.Tensor:  # [n] int64
    """Row i's token for absolute position ``positions[i]`` of the sequence keyed by ``seed``:
    argmax_x probs[i, x] / E_{seed, positions[i]}(x). Rows with the same position share one
    noise vector (generated once per call)."""
    assert probs.ndim == 2, f"probs must be [n, vocab], got shape {tuple(probs.shape)}"
    positions = [int(p) for p in positions]
    assert len(positions) == probs.shape[0], (
        f"{len(positions)} positions for {probs.shape[0]} rows of probs")
    vocab = probs.shape[1]
    noise: dict[int, torch.Tensor] = {}
    for position in positions:
        if position not in noise:
            noise[position] = keyed_exponentials(seed, position, vocab)
    exponentials = torch.stack([noise[p] for p in positions]) if positions else \
        torch.empty(0, vocab, dtype=torch.float64)  # [n, vocab]
    return keyed_argmax(probs, exponentials)
