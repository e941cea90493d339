"""Per-request rules on logits rows, and log-probabilities.

A *rule* changes a request's next-token scores from what it has generated: the grammar's
allowed set (a boolean mask per row), ``min_tokens`` (end tokens masked until enough were
generated), ``logit_bias`` (added), the repetition penalty (CTRL's: a seen token's positive
logit divided by p, a negative one multiplied by it; seen = in the prompt or the output) and
the frequency and presence penalties (OpenAI's: minus f·count and minus p·[count > 0], counts
over the output). Each row is scored with its *own* history — the request's output plus the
draft path to that row's node — so a tree node gets exactly the scores plain decoding would
give at that point. Order: mask, min_tokens, bias, repetition, frequency, presence (vLLM's).

Log-probabilities are the model's own: ``log_softmax`` of the raw logits, before any rule
or temperature (vLLM's default ``raw_logprobs``).

torch is imported inside the functions: the OpenAI ingress builds ``RowRules``-bearing params
and receives ``TokenLogprob``s without loading it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class RowRules:
    """What a request asks of its scores (all off by default)."""

    presence_penalty: float = 0.0
    """Subtracted once from every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted per occurrence of the token in the output."""
    repetition_penalty: float = 1.0
    """> 1 discourages tokens seen in the prompt or output (1 = off)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to the logit."""
    min_tokens: int = 0
    """End tokens (``end_ids``) are masked until this many tokens were generated."""
    end_ids: tuple[int, ...] = ()
    """EOS and stop token ids (what ``min_tokens`` holds back)."""

    @property
    def is_identity(self) -> bool:
        return (self.presence_penalty == 0.0 and self.frequency_penalty == 0.0 and self.repetition_penalty == 1.0
                and not self.logit_bias and (self.min_tokens == 0 or not self.end_ids))


def apply_rules(
    logits: torch.Tensor,  # [n, vocab]
    rules: RowRules,
    *,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    paths: Sequence[Sequence[int]],  # n token paths after the output
    allowed: torch.Tensor | None = None,  # [n, vocab] bool
) -> torch.Tensor:  # [n, vocab] fp32
    """Row i's scores for the token after ``output_ids + paths[i]`` (module docstring)."""
    import torch
    n, vocab = logits.shape
    assert len(paths) == n, f"{len(paths)} paths for {n} rows"
    scores = logits.float().clone()
    if allowed is not None:
        scores.masked_fill_(~allowed, -float("inf"))
    if rules.min_tokens and rules.end_ids:
        held = [i for i, p in enumerate(paths) if len(output_ids) + len(p) < rules.min_tokens]
        if held:
            rows = torch.tensor(held)[:, None]
            ends = torch.tensor([t for t in rules.end_ids if 0 <= t < vocab])[None, :]
            scores[rows, ends] = -float("inf")
    if rules.logit_bias:
        ids = torch.tensor([t for t, _ in rules.logit_bias])
        scores[:, ids] += torch.tensor([b for _, b in rules.logit_bias], dtype=scores.dtype)
    if rules.repetition_penalty != 1.0:
        seen = _path_counts(prompt_ids, output_ids, paths, vocab) > 0  # [n, vocab]
        p = rules.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / p, scores * p), scores)
    if rules.frequency_penalty or rules.presence_penalty:
        counts = _path_counts((), output_ids, paths, vocab)  # [n, vocab]
        scores -= rules.frequency_penalty * counts + rules.presence_penalty * (counts > 0).float()
    return scores


def _path_counts(prefix: Sequence[int], output_ids: Sequence[int], paths: Sequence[Sequence[int]],
                 vocab: int) -> torch.Tensor:  # [n, vocab] fp32
    """Occurrences of each token in prefix + output + paths[i], per row."""
    import torch
    base = torch.bincount(torch.tensor([*prefix, *output_ids], dtype=torch.long), minlength=vocab).float()
    counts = base.expand(len(paths), vocab).clone()
    for i, path in enumerate(paths):
        if path:
            counts[i].index_add_(0, torch.tensor(path, dtype=torch.long), torch.ones(len(path)))
    return counts


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:  # [n, vocab] bool
    """``bitmask  # [n, ceil(vocab / 32)] int32`` (bit j of word w = token 32·w + j) → bool."""
    import torch
    bits = torch.arange(32, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's log-probability and, if asked, its most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, logprob) of the ``k`` most likely tokens, most likely first."""


def token_logprobs(
    logits: torch.Tensor,  # [n, vocab]
    token_ids: Sequence[int],  # n
    top_k: int,
) -> list[TokenLogprob]:
    """The model's log-probability of ``token_ids[i]`` under row i, and row i's top ``top_k``."""
    import torch
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [n, vocab]
    chosen = logprobs.gather(1, torch.tensor(list(token_ids), dtype=torch.long)[:, None]).squeeze(1).tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if top_k > 0:
        values, ids = logprobs.topk(min(top_k, logprobs.shape[1]), dim=-1)  # [n, k]
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(int(t), float(lp), top) for t, lp, top in zip(token_ids, chosen, tops)]
