"""What ``LLM.generate`` and ``LLM.chat`` return, in vLLM's shapes: one ``RequestOutput`` per
prompt holding its ``CompletionOutput``s, log-probabilities as ``{token id: Logprob}`` per
position, and each completion's speculation figures (``stats``: the engine's ``RequestStats``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.engine.request import RequestStats


@dataclass(frozen=True, slots=True)
class Logprob:
    """One token's log-probability at one position."""

    logprob: float
    rank: int | None
    """1 for the most likely token; None where the token was not among the alternatives asked
    for (the engine ranks only those)."""
    decoded_token: str | None
    """The token's text (None for a model without a tokenizer)."""


PositionLogprobs = dict[int, Logprob]
"""token id → its Logprob at one position: the chosen token first, then the alternatives."""


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt."""

    index: int
    text: str
    """Special tokens left out; it ends before the first stop string."""
    token_ids: list[int]
    """Generated tokens, EOS or the stop token included, up to the token that completed a
    stop string."""
    cumulative_logprob: float | None
    """Sum of ``logprobs``' chosen tokens; None when ``logprobs`` was not asked for."""
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    """stop (EOS, a stop token or a stop string) | length (``max_tokens`` or the context)."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended it; None for EOS or length."""
    stats: RequestStats | None = None
    """Speculation figures: ``num_verify_steps``, ``num_draft_tokens``, ``num_accepted_tokens``
    (draft tokens the target accepted), ``mean_accepted_length`` (tokens per verify step, the
    bonus token included), ``accepted_by``/``drafted_by`` per drafter, ``num_cached_tokens``."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """All completions of one prompt."""

    request_id: str
    prompt: str | None
    """The prompt's text (for ``chat``: the rendered chat template); None for token ids."""
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    """With ``SamplingParams.prompt_logprobs``: None for the first prompt token, then one each."""
    outputs: list[CompletionOutput]
    finished: bool = True

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache."""
        return max((o.stats.num_cached_tokens for o in self.outputs if o.stats is not None), default=0)


def position_logprobs(lp: TokenLogprob, decode: Any) -> PositionLogprobs:
    """vLLM's shape of one position: ``decode(token_id)`` gives a token's text (or None)."""
    ranks = {token_id: rank for rank, (token_id, _) in enumerate(lp.top, start=1)}
    out = {lp.token_id: Logprob(lp.logprob, ranks.get(lp.token_id), decode(lp.token_id))}
    for token_id, logprob in lp.top:
        out.setdefault(token_id, Logprob(logprob, ranks[token_id], decode(token_id)))
    return out


def logprobs_list(logprobs: Sequence[TokenLogprob | None] | None, decode: Any) -> list[PositionLogprobs | None] | None:
    if logprobs is None:
        return None
    return [None if lp is None else position_logprobs(lp, decode) for lp in logprobs]
