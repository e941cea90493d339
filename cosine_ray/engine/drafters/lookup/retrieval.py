"""Retrieval drafter: continue the context with what followed the same text in a datastore.

The longest suffix of ``context ⊕ draft-so-far`` (length ``max_n`` down to ``min_match``)
found in the datastore's n-gram index gives the next token: its most frequent
continuation, with confidence ``count / total`` over that suffix's occurrences. Paths are
built greedily, re-matching the extended suffix after every token, and branch at the first
level into up to ``max_branches`` distinct tokens; the budget is then spent best-first by
cumulative confidence (``ngram.grow_paths``, shared with the context n-gram drafter)::

    datastore:  … for i in range ( n ) : …   … for i in range ( len ( …
    context:    … for i in range (            suffix "i in range (" matched (n = 4)
    paths:      [n, ), :] conf [1/2, 1, 1]   [len, (, …] conf [1/2, …]

Drafting stops where confidence drops below ``min_confidence`` or the match would be shorter
than ``min_match``: a rejected draft token still costs a verify slot, and unigram matches are
noise. Stateless per request: nothing is kept between calls, so ``release`` is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cosine_ray.engine.drafters.base import Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal
from cosine_ray.engine.drafters.lookup.datastore import ContinuationIndex, Datastore
from cosine_ray.engine.drafters.lookup.ngram import grow_paths, walk_chains


@dataclass(frozen=True, slots=True)
class RetrievalConfig:
    max_n: int = 4
    """Longest context suffix matched against the datastore; the longest match wins."""
    min_match: int = 2
    """Shortest suffix match that may propose a token (1 would allow unigram matches, noise)."""
    max_branches: int = 2
    """Distinct first tokens proposed (most frequent continuation first)."""
    min_confidence: float = 0.2
    """A path stops before a token whose confidence is below this; a first-level branch
    below it is not proposed. Rejected drafts cost verify slots, so this trades recall for
    cheaper trees."""
    count_smoothing: float = 0.0
    """Pseudo-count added to the denominator: confidence = count / (total + smoothing).
    0 gives the plain frequency; 1 makes a continuation seen once 0.5 instead of 1.0
    (a small datastore's single occurrences are otherwise fully trusted)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_match <= self.max_n:
            raise ValueError(f"need 1 <= min_match <= max_n, got min_match={self.min_match}, max_n={self.max_n}")
        if self.max_n > 16:
            raise ValueError(f"max_n={self.max_n} makes the datastore index too large; use at most 16")
        if self.max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {self.max_branches}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.count_smoothing < 0.0:
            raise ValueError(f"count_smoothing must be >= 0, got {self.count_smoothing}")


class RetrievalDrafter:
    """Drafts from a domain ``Datastore`` (the ``Drafter`` protocol)."""

    def __init__(self, datastore: Datastore, config: RetrievalConfig | None = None, *,
                 name: str | None = None) -> None:
        self.config = config or RetrievalConfig()
        self.datastore = datastore
        self.name = name or f"retrieval:{datastore.domain}"
        self._index: ContinuationIndex = datastore.continuation_index(self.config.max_n)

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return [self._propose_one(item) for item in inputs]

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        max_n = self.config.max_n
        return [[self._lookup((list(q.context_token_ids[-max_n:]) + list(prefix))[-max_n:], q.k)
                 for prefix in q.prefixes] for q in queries]

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        """``continue_drafts`` level by level, walked in one pass per chain (``walk_chains``)."""
        max_n = self.config.max_n
        return [walk_chains(self._lookup, q.context_token_ids, q.prefixes, q.depth, q.k, max_n) for q in queries]

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        """Nothing to learn: the datastore is fixed."""

    def release(self, request_id: str) -> None:
        """Nothing to free: no per-request state."""

    def _lookup(self, tail_token_ids: list[int], k: int) -> list[tuple[int, float]]:
        cfg = self.config
        return self._index.lookup(tail_token_ids, k, min_n=cfg.min_match, max_n=cfg.max_n,
                                  smoothing=cfg.count_smoothing)

    def _propose_one(self, item: DraftInput) -> DraftProposal:
        cfg = self.config
        context = item.context_token_ids
        if item.max_draft_tokens <= 0 or len(context) < cfg.min_match:
            return DraftProposal.empty(item.request_id, self.name)
        tail = list(context[-cfg.max_n:])
        paths, confidences = grow_paths(self._lookup, tail, item.max_draft_tokens,
                                        max_branches=cfg.max_branches, min_confidence=cfg.min_confidence)
        return DraftProposal(item.request_id, paths, confidences, self.name)
