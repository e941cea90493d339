"""Prompt lookup: draft by matching the context's suffix against the context's own past.

For each request the drafter keeps an index of every n-gram of the context (n in
``[min_n, max_n]``) with the counts of the tokens that followed it. To draft, it takes the
longest suffix of ``context ⊕ draft-so-far`` that occurred earlier and proposes that
suffix's most frequent continuation, with confidence ``count / total``::

    context:  a b c x  . . .  a b c y  . . .  a b c x  . . .  a b c
    index:    (a,b,c) → {x: 2, y: 1}       suffix (a,b,c) matched, n = 3
    paths:    [x, …] conf 2/3              [y, …] conf 1/3

Paths grow by re-lookup after each appended token (an n-gram model over the context: where
the context disagrees with itself, the confidence says how contested a position is; ties go
to the most recent continuation). The first level branches into up to ``max_branches``
tokens and the budget is spent best-first by cumulative confidence. The per-request index
grows with each call's new tokens; a context that does not extend the last one rebuilds it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             by_count)

DraftLookup = Callable[[list[int], int], list[tuple[int, float]]]
"""``lookup(tail_token_ids, k)``: up to k ``(token_id, confidence)`` continuations of the
longest matching suffix of ``tail_token_ids``, most likely first; ``[]`` when none matches."""


@dataclass(frozen=True, slots=True)
class NgramConfig:
    min_n: int = 1
    """Shortest context suffix that may be matched. 1 matches on the last token alone (a
    "bigram lookup"); frequent tokens then get low confidences from their many different
    continuations."""
    max_n: int = 3
    """Longest context suffix matched; the longest suffix that occurred earlier wins."""
    max_branches: int = 2
    """Distinct first tokens proposed (most frequent continuation first)."""
    min_confidence: float = 0.0
    """A path stops before a token whose confidence is below this (0 drafts to the budget
    and leaves pruning to tree selection)."""
    count_smoothing: float = 0.0
    """Pseudo-count added to the denominator: confidence = count / (total + smoothing).
    0 gives the plain frequency; 1 makes a continuation seen once 0.5 instead of 1.0."""
    max_tracked_requests: int = 4096
    """Per-request indexes kept at most; the least recently used is dropped beyond this
    (a safety net for requests never released; dropped ones are rebuilt on demand)."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")
        if self.max_n > 16:
            raise ValueError(f"max_n={self.max_n} is too long for context lookup; use at most 16")
        if self.max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {self.max_branches}")
        if not 0.0 <= self.min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {self.min_confidence}")
        if self.count_smoothing < 0.0:
            raise ValueError(f"count_smoothing must be >= 0, got {self.count_smoothing}")
        if self.max_tracked_requests < 1:
            raise ValueError(f"max_tracked_requests must be >= 1, got {self.max_tracked_requests}")


def walk_chains(lookup: DraftLookup, context: Sequence[int], prefixes: Sequence[Sequence[int]], depth: int,
                k: int, max_n: int) -> list[list[Candidates]]:
    """``Drafter.continue_chains`` for a drafter whose answer depends only on the last ``max_n``
    tokens (``lookup(tail, k)``): per prefix, up to ``depth`` candidate lists, each after the
    prefix and the top tokens of the lists before it; a chain ends after an empty list. The same
    answers as ``base.continue_chains`` gives level by level, walked in one pass per chain (no
    query objects per level: this runs for every request at every fusion round of every step)."""
    base = list(context[-max_n:])
    out: list[list[Candidates]] = []
    for prefix in prefixes:
        chain: list[Candidates] = []
        if depth > 0:
            tail = (base + list(prefix))[-max_n:]
            while True:
                cands = lookup(tail, k)
                chain.append(list(cands))
                if not cands or len(chain) >= depth:
                    break
                tail.append(int(cands[0][0]))
                if len(tail) > max_n:
                    del tail[0]
        out.append(chain)
    return out


def grow_paths(lookup: DraftLookup, tail_token_ids: list[int], budget: int, *,
               max_branches: int, min_confidence: float) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy branches from ``lookup``, trimmed best-first to ``budget`` tokens in total.

    ``tail_token_ids`` is the end of the context (at least the longest n the lookup
    matches); it is extended in place while drafting and restored before returning.
    Branch i is the i-th first-level continuation followed greedily; then the ``budget``
    nodes of highest cumulative confidence are kept. Cumulative confidence never rises
    along a path and ties keep the shallower node, so what is kept is a prefix of each
    branch. Returns ``(paths, confidences)`` without empty paths.
    """
    if budget <= 0:
        return [], []
    firsts = [(tok, conf) for tok, conf in lookup(tail_token_ids, min(max_branches, budget))
              if conf >= min_confidence]
    paths: list[list[int]] = []
    confidences: list[list[float]] = []
    for branch, (tok, conf) in enumerate(firsts):
        # Branch i can never get more than budget - i tokens: the first tokens of the
        # branches before it score at least as high.
        max_len = budget - branch
        path, path_confs = [tok], [conf]
        tail_token_ids.append(tok)
        while len(path) < max_len:
            found = lookup(tail_token_ids, 1)
            if not found or found[0][1] < min_confidence:
                break
            tok, conf = found[0]
            path.append(tok)
            path_confs.append(conf)
            tail_token_ids.append(tok)
        del tail_token_ids[len(tail_token_ids) - len(path):]
        paths.append(path)
        confidences.append(path_confs)
    if len(paths) <= 1:
        return paths, confidences
    nodes = []
    for branch, path_confs in enumerate(confidences):
        cumulative = 1.0
        for depth, conf in enumerate(path_confs):
            cumulative *= conf
            nodes.append((-cumulative, branch, depth))
    nodes.sort()
    lengths = [0] * len(paths)
    for _, branch, _ in nodes[:budget]:
        lengths[branch] += 1
    kept = [(p[:n], c[:n]) for p, c, n in zip(paths, confidences, lengths) if n]
    return [p for p, _ in kept], [c for _, c in kept]


class _ContextIndex:
    """n-gram (tuple) → {next token: count} over one request's context.

    Dict order of each continuation map is recency order (a token is re-inserted when
    seen again), so ties between equal counts resolve to the most recent continuation.
    Only n-grams whose continuation is known are indexed: the suffix ending at the root
    token (the last context token) is looked up, never counted as its own occurrence.
    """

    __slots__ = ("context", "table", "min_n", "max_n", "smoothing")

    def __init__(self, min_n: int, max_n: int, smoothing: float) -> None:
        self.context: tuple[int, ...] = ()
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self.min_n, self.max_n, self.smoothing = min_n, max_n, smoothing

    def update(self, context: tuple[int, ...]) -> None:
        """Index the tokens appended since the last call; rebuild on a non-extension."""
        old = self.context
        if len(context) >= len(old) and context[:len(old)] == old:
            start = max(len(old), 1)
        else:
            self.table = {}
            start = 1
        table, min_n, max_n = self.table, self.min_n, self.max_n
        for end in range(start, len(context)):
            next_token = context[end]
            for n in range(min_n, min(max_n, end) + 1):
                key = context[end - n:end]
                continuations = table.get(key)
                if continuations is None:
                    table[key] = {next_token: 1}
                else:
                    continuations[next_token] = continuations.pop(next_token, 0) + 1
        self.context = context

    def lookup(self, tail_token_ids: list[int], k: int) -> list[tuple[int, float]]:
        table = self.table
        for n in range(min(self.max_n, len(tail_token_ids)), self.min_n - 1, -1):
            continuations = table.get(tuple(tail_token_ids[-n:]))
            if continuations:
                return _rank(continuations, k, self.smoothing)
        return []


def _rank(continuations: dict[int, int], k: int, smoothing: float) -> list[tuple[int, float]]:
    """Top-k continuations by count, ties to the most recent (last in dict order)."""
    if len(continuations) == 1:
        (tok, count), = continuations.items()
        return [(tok, count / (count + smoothing))]
    denominator = sum(continuations.values()) + smoothing
    if k == 1:
        tok, count = max(reversed(continuations.items()), key=by_count)
        return [(tok, count / denominator)]
    ranked = sorted(reversed(continuations.items()), key=by_count, reverse=True)[:k]
    # sorted(reverse=True) is stable, so equal counts keep the most-recent-first order.
    return [(tok, count / denominator) for tok, count in ranked]


class NgramDrafter:
    """Prompt-lookup drafter over each request's own context (the ``Drafter`` protocol)."""

    def __init__(self, config: NgramConfig | None = None, *, name: str = "ngram") -> None:
        self.config = config or NgramConfig()
        self.name = name
        self._indexes: OrderedDict[str, _ContextIndex] = OrderedDict()

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return [self._propose_one(item) for item in inputs]

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        """Index the committed context, look up ``context ⊕ prefix`` (the prefix is not indexed)."""
        out = []
        for q in queries:
            context = q.context_token_ids
            index = self._indexed(q.request_id, context)
            tail = list(context[-self.config.max_n:])
            out.append([index.lookup((tail + list(prefix))[-self.config.max_n:], q.k) for prefix in q.prefixes])
        return out

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        """``continue_drafts`` level by level, walked in one pass per chain (``walk_chains``)."""
        out = []
        for q in queries:
            index = self._indexed(q.request_id, q.context_token_ids)
            out.append(walk_chains(index.lookup, q.context_token_ids, q.prefixes, q.depth, q.k, self.config.max_n))
        return out

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        """Nothing to learn: the index follows the context, which grows with accepted tokens."""

    def release(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        return len(self._indexes)

    def _propose_one(self, item: DraftInput) -> DraftProposal:
        cfg = self.config
        context = item.context_token_ids
        index = self._indexed(item.request_id, context)
        if item.max_draft_tokens <= 0 or not context:
            return DraftProposal.empty(item.request_id, self.name)
        tail = list(context[-cfg.max_n:])
        paths, confidences = grow_paths(index.lookup, tail, item.max_draft_tokens,
                                        max_branches=cfg.max_branches, min_confidence=cfg.min_confidence)
        return DraftProposal(item.request_id, paths, confidences, self.name)

    def _indexed(self, request_id: str, context: Sequence[int]) -> _ContextIndex:
        """The request's index, updated with its committed context."""
        index = self._index_for(request_id)
        index.update(context if isinstance(context, tuple) else tuple(context))
        return index

    def _index_for(self, request_id: str) -> _ContextIndex:
        index = self._indexes.get(request_id)
        if index is None:
            cfg = self.config
            index = _ContextIndex(cfg.min_n, cfg.max_n, cfg.count_smoothing)
            self._indexes[request_id] = index
            while len(self._indexes) > cfg.max_tracked_requests:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(request_id)
        return index
