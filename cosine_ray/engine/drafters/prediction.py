"""Prediction drafter: drafts from the text a client says it expects (OpenAI Predicted Outputs).

A request with ``prediction`` carries the tokens it expects the answer to be, as in a code
edit where most of the file comes back unchanged. The drafter follows that text: where the
answer so far ends, it finds the same tokens in the prediction (an *anchor*) and proposes
what follows there. After an edit the answer leaves the prediction; the drafter re-anchors
on the longest suffix of the answer found in the prediction (nearest the old anchor on a
tie), so it picks the prediction up again after the edited span::

    prediction:  def f(x):\\n    return x + 1\\n\\nprint(f(2))
    answer:      def f(x):\\n    return x * 2      <- edited: no anchor past "x"
    answer:      def f(x):\\n    return x * 2\\n   <- "\\n" + ... matched again: anchor after it

A draft from an anchor matching L tokens of the committed answer is at most
``⌊L · max_spec_factor + max_spec_offset⌋`` tokens long (SuffixDecoding's rule), up to
``max_spec_tokens``, its token at depth d with confidence (L + d) / (L + d + 1); at the start
of the answer the prediction is taken at its word. Both depend only on the anchor, so a level
asked alone answers what the chain did. Calibration then learns how often this drafter's
tokens are accepted, per domain and depth, like any other drafter's. The engine tells the
drafter each request's prediction as the request starts (``DraftRouting.start``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Sequence

from cosine_ray.engine.drafters.base import Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal

PREDICTION = "prediction"
"""The drafter's name: its tokens are what ``usage.completion_tokens_details`` counts."""


@dataclass(frozen=True, slots=True)
class PredictionConfig:
    min_match_len: int = 2
    """Shortest suffix of the answer that re-anchors it in the prediction (a single common
    token such as a newline matches almost anywhere)."""
    max_match_len: int = 64
    """Longest suffix compared when choosing between anchors (and the L of the length rule)."""
    max_spec_tokens: int = 64
    """Longest draft chain, whatever the match."""
    max_spec_factor: float = 2.0
    """A match of L tokens drafts at most ``⌊L · factor + offset⌋`` tokens."""
    max_spec_offset: float = 2.0
    """See ``max_spec_factor``."""
    start_confidence: float = 0.9
    """Confidence of the prediction's first tokens, before the answer has matched any."""
    max_candidates: int = 64
    """Anchors compared per search at most, those nearest where the last anchor would be by
    now: a prediction that repeats one pair of tokens thousands of times costs a search no more
    than one that does not."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_match_len <= self.max_match_len:
            raise ValueError("need 1 <= min_match_len <= max_match_len")
        if self.max_spec_tokens < 1 or self.max_spec_factor < 0:
            raise ValueError("max_spec_tokens must be >= 1 and max_spec_factor >= 0")
        if not 0.0 < self.start_confidence < 1.0:
            raise ValueError("start_confidence must be in (0, 1)")
        if self.max_candidates < 1:
            raise ValueError("max_candidates must be >= 1")

    def draft_length(self, match_len: int) -> int:
        return max(0, min(self.max_spec_tokens, int(match_len * self.max_spec_factor + self.max_spec_offset)))

    def confidence(self, match_len: int) -> float:
        """A match of L tokens: L / (L + 1), so one matched token is a coin toss and a long
        run is near certain (never 1: the answer may leave the prediction anywhere)."""
        return min(match_len, self.max_match_len) / (min(match_len, self.max_match_len) + 1.0)


@dataclass(slots=True)
class _Prediction:
    prompt_len: int
    tokens: tuple[int, ...]
    ends: dict[tuple[int, ...], list[int]] = field(default_factory=dict)
    """(a, b) → every position e with tokens[e-2:e] == (a, b); (a,) → every e with tokens[e-1] == a."""
    hint: int = 0
    """Where in the prediction the committed answer was last anchored (the next token's index)."""
    hint_len: int = -1
    """Length of the committed answer at that anchor (-1: not anchored yet)."""
    hint_match: int = 0
    """Match length of that anchor."""

    @classmethod
    def build(cls, prompt_len: int, tokens: Sequence[int]) -> "_Prediction":
        p = cls(prompt_len, tuple(int(t) for t in tokens))
        for e in range(1, len(p.tokens) + 1):
            p.ends.setdefault(p.tokens[e - 1:e], []).append(e)
            if e >= 2:
                p.ends.setdefault(p.tokens[e - 2:e], []).append(e)
        return p


def _common_suffix(answer: Sequence[int], tokens: Sequence[int], end: int, cap: int) -> int:
    """Tokens that ``answer`` and ``tokens[:end]`` have in common at their ends, at most ``cap``."""
    n = 0
    limit = min(cap, len(answer), end)
    while n < limit and answer[-1 - n] == tokens[end - 1 - n]:
        n += 1
    return n


class PredictionDrafter:
    """The drafter of requests that carry a prediction (module docstring); the engine tells it
    each request's prediction when the request starts (``expect``) and forgets it on ``release``."""

    def __init__(self, config: PredictionConfig = PredictionConfig(), name: str = PREDICTION) -> None:
        self.config = config
        self.name = name
        self._requests: dict[str, _Prediction] = {}

    @property
    def num_tracked_requests(self) -> int:
        return len(self._requests)

    def expect(self, request_id: str, prompt_len: int, prediction_token_ids: Sequence[int]) -> None:
        """Request ``request_id`` (prompt of ``prompt_len`` tokens) predicts this answer."""
        if prediction_token_ids:
            self._requests[request_id] = _Prediction.build(prompt_len, prediction_token_ids)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        pass

    # ---- anchors --------------------------------------------------------------------------------
    def _anchor(self, p: _Prediction, answer: Sequence[int], expected: int,
                cap: int | None = None) -> tuple[int, int] | None:
        """(index of the next predicted token, match length) for ``answer``, the longest match
        (compared up to ``cap`` tokens, default ``max_match_len``) winning and, among equal
        ones, the one nearest ``expected`` (where the last anchor would be by now), ahead of it
        before behind; None without one."""
        cfg = self.config
        cap = cfg.max_match_len if cap is None else cap
        if not answer:
            return 0, cfg.max_match_len  # the answer starts where the prediction does
        key = tuple(answer[-2:]) if len(answer) >= 2 else tuple(answer[-1:])
        ends = p.ends.get(key, ())
        if len(ends) > cfg.max_candidates:  # the ones nearest the expected position
            at = bisect.bisect_left(ends, expected)
            low = min(max(at - cfg.max_candidates // 2, 0), len(ends) - cfg.max_candidates)
            ends = ends[low:low + cfg.max_candidates]
        best: tuple[int, int, int] | None = None  # (match, -distance, end)
        for end in ends:
            match = _common_suffix(answer, p.tokens, end, cap)
            rank = (match, -(abs(end - expected) * 2 + (end < expected)), end)
            if best is None or rank > best:
                best = rank
        if best is None or best[0] < min(len(answer), cfg.min_match_len):
            return None
        return best[2], best[0]

    def _committed_anchor(self, p: _Prediction, answer: Sequence[int]) -> tuple[int, int] | None:
        """The anchor of the committed answer, following the last one while the answer agrees
        with the prediction (the common case costs a few comparisons, not a search)."""
        grown = len(answer) - p.hint_len
        if p.hint_len >= 0 and grown >= 0:
            end = p.hint + grown
            if end <= len(p.tokens) and tuple(answer[p.hint_len:]) == p.tokens[p.hint:end]:
                match = min(p.hint_match + grown, self.config.max_match_len)
                p.hint, p.hint_len, p.hint_match = end, len(answer), match
                return end, match
        found = self._anchor(p, answer, p.hint + max(grown, 0) if p.hint_len >= 0 else 0)
        if found is not None:
            p.hint, p.hint_len, p.hint_match = found[0], len(answer), found[1]
        return found

    def _chain(self, p: _Prediction, answer: Sequence[int], prefix: Sequence[int],
               committed: tuple[int, int] | None, depth: int) -> list[Candidates]:
        """Up to ``depth`` single-candidate levels continuing ``answer ⊕ prefix``, ended by an
        empty level where the drafter has nothing more (the ``continue_chains`` protocol).

        The rule sees the anchor's *root match* r: the tokens of the committed answer it
        matches (its match less the prefix). The level at depth d after the root has
        confidence ``confidence(r + d)`` and exists while d < ``draft_length(r)``, so a
        longer prefix along the same anchor (a level asked alone) gets the same answer."""
        cfg = self.config
        anchor = None
        if committed is not None:
            end = committed[0] + len(prefix)
            if end <= len(p.tokens) and tuple(prefix) == p.tokens[committed[0]:end]:
                anchor = (end, committed[1] + len(prefix))
        if anchor is None and (prefix or committed is None):
            anchor = self._anchor(p, list(answer) + list(prefix), (committed or (p.hint,))[0] + len(prefix),
                                  cfg.max_match_len + len(prefix))
        if anchor is None:
            return [[]]
        start, match = anchor
        root = match - len(prefix)
        if answer:
            limit = cfg.draft_length(root) if root > 0 else 0
            confidences = [cfg.confidence(root + d) for d in range(len(prefix), len(prefix) + depth)]
        else:  # nothing committed yet: the prediction is taken at its word
            limit, confidences = cfg.max_spec_tokens, [cfg.start_confidence] * depth
        n = min(depth, len(p.tokens) - start, limit - len(prefix))
        levels: list[Candidates] = [[(p.tokens[start + i], confidences[i])] for i in range(max(n, 0))]
        return levels if len(levels) >= depth else levels + [[]]

    # ---- the drafter protocol ----------------------------------------------------------------------
    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        out = []
        for q in queries:
            p = self._requests.get(q.request_id)
            if p is None or q.depth <= 0:
                out.append([[[]] if q.depth > 0 else [] for _ in q.prefixes])
                continue
            answer = q.context_token_ids[p.prompt_len:]
            committed = self._committed_anchor(p, answer)
            out.append([self._chain(p, answer, prefix, committed, q.depth) for prefix in q.prefixes])
        return out

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        chains = self.continue_chains([ContinueQuery(q.request_id, q.context_token_ids, q.prefixes, q.k, 1)
                                       for q in queries])
        return [[chain[0] for chain in per_prefix] for per_prefix in chains]

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        out = []
        for d in inputs:
            chain = [level for level in self.continue_chains([ContinueQuery(
                d.request_id, d.context_token_ids, ((),), 1, d.max_draft_tokens)])[0][0] if level]
            if not chain:
                out.append(DraftProposal.empty(d.request_id, self.name))
                continue
            out.append(DraftProposal(d.request_id, [[c[0][0] for c in chain]], [[c[0][1] for c in chain]], self.name))
        return out
