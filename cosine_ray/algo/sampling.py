"""Logits → sampling distributions, and seeded sampling.

``logits_to_probs`` applies the filters in the order Hugging Face transformers applies its
warpers (``TemperatureLogitsWarper`` → ``TopKLogitsWarper`` → ``TopPLogitsWarper``), with the
same tie rules, so a request gets the distribution it would get from ``model.generate``:

* top-k keeps every token whose logit is >= the k-th largest (ties at the boundary are kept);
* top-p keeps the smallest set of most-likely tokens whose cumulative probability is >= top_p
  (always at least one token; ties broken by ``torch.sort``, as HF does).

Both the target and every drafter must use the *same* ``logits_to_probs`` settings: lossless
verification (``algo.verify``) reproduces whatever distribution it is given as ``target_probs``.

Keyed sampling (``sample_keyed``): reproducible, batch- and speculation-independent
------------------------------------------------------------------------------------
A stream generator (``sample`` / ``make_generator``) gives a request a reproducible text only
if the request consumes it the same way every time, which speculation breaks (rejection
sampling draws a coin per draft node, and the drafts depend on the batch). Keyed sampling
instead fixes, for every *position* of the sequence, the randomness that decides its token:

* **Position.** The absolute position of a token is its 0-based index in the request's whole
  sequence (prompt + output), i.e. the number of tokens before it. The first output token of a
  prompt of L tokens has position L. (In a token tree whose root, the last committed token,
  sits at position P, a node of depth d holds position P + d, and the target's row at that
  node draws the token of position P + d + 1; ``algo.verify.verify_keyed``.)
* **Noise.** ``keyed_exponentials(seed, t, vocab)``: E_t(x), x < vocab, i.i.d. Exp(1), from the
  counter-based generator Philox4x64-10 (Salmon et al. 2011, "Parallel random numbers: as easy
  as 1, 2, 3"; numpy's ``Philox``) keyed with the 128-bit key (seed mod 2**64, t): one raw
  64-bit word per token, its top 52 bits k give u = (k + 1/2) / 2**52 (exact in float64,
  strictly inside (0, 1), so no clamping), and E = -log u in float64. Distinct keys are
  independent streams by the generator's design and no two (seed, t) pairs share a key (a
  splitmix64 mix into a ``torch.Generator`` seed would not do: the CPU generator keeps only
  the low 32 bits of its seed). The raw words are pinned by a known-answer test.
* **Draw.** token_t = argmax_x p_t(x) / E_t(x), the "exponential race". It is the Gumbel-max
  trick: -log E ~ Gumbel(0, 1), so this is argmax_x (log p_t(x) + G_t(x)) with G_t(x) =
  -log E_t(x), computed without the second logarithm. p_t is the row ``logits_to_probs`` gives.

Lossless, in short. (1) One position: E(x) / p(x) ~ Exp(rate p(x)) independently for each x with
p(x) > 0, and the smallest of independent exponentials is the one of rate p(x) with probability
p(x) / sum(p) = p(x); tokens with p(x) = 0 score 0 and never win. So token_t ~ p_t exactly, for
a uniformly random seed. (2) A sequence: the prefix before t is a function of the prompt and
E_s for s < t only, and E_t is independent of those (another key), so conditionally on any
prefix, token_t ~ p_t(. | prefix); by the chain rule the text has the target's distribution.
(3) Speculation (``algo.verify.verify_keyed``) computes the very same token_t at every position
it commits, from the same row and noise, whatever the tree (module docstring there), so the
text is the same as without speculation, token for token, not only in distribution.

Numerics and ties. p is float32 (exact in float64), E float64, the division is correctly
rounded and the argmax exact; on an exact tie of two scores ``argmax`` takes the first token id
(deterministic; a tie needs two uniforms of the 2**52-point grid to make the two best scores
equal to the last bit, probability ~1e-15 per draw). The grid itself moves the draw's
distribution by at most of order vocab * 2**-52 * ln(2**52) ~ 4e-10 in total variation for
49,152 tokens (coupled with exact uniforms, a draw can change only when a uniform falls within k
grid cells of 1, where E is off by ~1/k relative), far below the float32 rounding of p itself (~1e-8). Everything is elementwise, so a
row gives the same token alone or in a batch. Two things can still change a token, each only
at a near-exact tie of the two best scores: the target's logits for a position differing in
the last bits between forwards (a chain vs a tree, another batch; the greedy-equivalence tests
rely on the same) and, on another machine, ``torch.log``'s last bit.

Cost. One noise vector per committed token: ``verify_keyed`` generates a position's noise only
when its walk reaches that depth. For SmolLM2's 49,152-token vocabulary, one CPU thread:
noise ~0.55 ms (Philox words ~0.25 ms, conversion and log ~0.3 ms) + race ~0.15 ms, so
~0.75 ms per committed token with the walk (a fully accepted 8-token chain: ~6.8 ms for its 9
tokens; the rejection sampler it replaces: ~0.2 ms per step, whatever it commits), against
~60 ms for one SmolLM2-135M decode forward on the same CPU: ~1 % per token.
Each request gets a seed (its own, else ``draw_seed()`` from os.urandom), so unseeded
requests are random and every request takes the same code path.
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
