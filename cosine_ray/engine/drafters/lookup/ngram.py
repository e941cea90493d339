"""Prompt lookup: draft by matching the context's suffix against the context's own past.

For each request the drafter keeps an index of every n-gram of the context (n in
``[min_n, max_n]``) with the counts of the tokens that followed it. To draft, it takes the
longest suffix of ``context ⊕ draft-so-far`` that occurred earlier and proposes that
suffix's most frequent continuation, with confidence ``count / total``::

    context:  a b c x  . . .  a b c y  . . .  a b c x  . . .  a b c
    index:    (a,b,c) → {x: 2, y: 1}       suffix (a,b,c) matched, n = 3
    paths:    [x, …] conf 2/3              [y, …] conf 1/3

Paths grow by re-lookup after each appended token (ties go to the most recent continuation).
The first level branches into up to ``max_branches`` tokens and the budget is spent best-first
by cumulative confidence. The index grows with each call's new tokens; a context that does not
extend the last one rebuilds it.

*Copying* (``copy_min_len``): where the context's end matched an earlier span of L ≥
``copy_min_len`` tokens (``NgramConfig``: ``copy_*``), the drafts copy what followed it for
``⌊L · max_spec_factor + max_spec_offset⌋`` tokens (SuffixDecoding's rule), the i-th with
confidence (L + i) / (L + i + 1) times the n-gram's share of that token; then the n-gram goes on.
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
    copy_min_len: int = 0
    """Shortest match of the context's end (in tokens, at least ``max_n``) that drafts by
    copying what followed it (module docstring); 0: never, the n-gram model alone."""
    copy_max_match: int = 64
    """Longest match compared when choosing what to copy (the L of the length rule)."""
    copy_candidates: int = 16
    """Earlier occurrences of the context's last ``max_n`` tokens compared, the most recent first."""
    max_spec_factor: float = 2.0
    """A copy from a match of L tokens drafts at most ``⌊L · factor + offset⌋`` tokens."""
    max_spec_offset: float = 0.0
    """See ``max_spec_factor``."""

    def copy_length(self, match_len: int) -> int:
        return max(0, int(match_len * self.max_spec_factor + self.max_spec_offset))

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
        if self.copy_min_len and not self.max_n <= self.copy_min_len <= self.copy_max_match:
            raise ValueError(f"copy_min_len must be 0 or in [max_n, copy_max_match], got {self.copy_min_len}")
        if self.copy_candidates < 1 or self.max_spec_factor < 0:
            raise ValueError("copy_candidates must be >= 1 and max_spec_factor >= 0")


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

    __slots__ = ("context", "table", "min_n", "max_n", "smoothing", "ends", "copies", "_root")

    def __init__(self, min_n: int, max_n: int, smoothing: float, copies: bool = False) -> None:
        self.context: tuple[int, ...] = ()
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self.min_n, self.max_n, self.smoothing = min_n, max_n, smoothing
        self.copies = copies
        self.ends: dict[tuple[int, ...], list[int]] = {}
        """Copying only: ``max_n``-gram → every e with ``context[e - max_n:e]`` that gram, ``e < len(context)``."""
        self._root: tuple[int, int] | None = None
        """The committed context's copy (start, match length), computed once per context."""

    def update(self, context: tuple[int, ...]) -> None:
        """Index the tokens appended since the last call; rebuild on a non-extension."""
        old = self.context
        if len(context) >= len(old) and context[:len(old)] == old:
            start = max(len(old), 1)
        else:
            self.table, self.ends = {}, {}
            start = 1
        if len(context) != len(old) or start == 1:
            self._root = None
        table, min_n, max_n, ends = self.table, self.min_n, self.max_n, self.ends
        for end in range(start, len(context)):
            next_token = context[end]
            if self.copies and end >= max_n:
                ends.setdefault(context[end - max_n:end], []).append(end)
            for n in range(min_n, min(max_n, end) + 1):
                key = context[end - n:end]
                continuations = table.get(key)
                if continuations is None:
                    table[key] = {next_token: 1}
                else:
                    continuations[next_token] = continuations.pop(next_token, 0) + 1
        self.context = context

    def root_copy(self, config: NgramConfig) -> tuple[int, int] | None:
        """(start, L): where the copy of the committed context starts (what followed its
        longest earlier match, the most recent on a tie) and the match's length L; None below
        ``copy_min_len``."""
        if self._root is None:
            self._root = self._find_copy(config) or (0, 0)
        return self._root if self._root[1] else None

    def _find_copy(self, config: NgramConfig) -> tuple[int, int] | None:
        context, n = self.context, self.max_n
        if len(context) <= n:
            return None
        best = None
        for end in reversed(self.ends.get(context[-n:], ())[-config.copy_candidates:]):
            match, limit = n, min(config.copy_max_match, end)
            while match < limit and context[end - 1 - match] == context[-1 - match]:
                match += 1
            if best is None or match > best[1]:
                best = (end, match)
        return best if best is not None and best[1] >= config.copy_min_len else None

    def share(self, tail_token_ids: Sequence[int], token: int) -> float:
        """The n-gram's share of ``token`` after ``tail_token_ids``' last ``max_n`` tokens (1 if unseen)."""
        continuations = self.table.get(tuple(tail_token_ids[-self.max_n:]))
        if not continuations:
            return 1.0
        return continuations.get(token, 0) / sum(continuations.values())

    def lookup(self, tail_token_ids: list[int], k: int) -> list[tuple[int, float]]:
        table = self.table
        for n in range(min(self.max_n, len(tail_token_ids)), self.min_n - 1, -1):
            continuations = table.get(tuple(tail_token_ids[-n:]))
            if continuations:
                return _rank(continuations, k, self.smoothing)
        return []


def _source(context: Sequence[int], after: Sequence[int], position: int) -> int:
    """Token ``position`` of ``context ⊕ after``."""
    return context[position] if position < len(context) else after[position - len(context)]


class _Copy:
    """A walk's copy of the committed context (``NgramConfig.copy_min_len``): the answer after
    ``context ⊕ after`` is what follows ``start`` + len(after) while the walk's tokens after the
    root have followed the copy and fewer than ``limit`` of them were drafted; the n-gram model
    answers elsewhere. It depends only on the tokens after the root, so a level asked alone (a
    longer prefix, ``continue_drafts``) answers as the one-pass walk does."""

    __slots__ = ("context", "start", "match", "limit", "follows", "max_n")

    def __init__(self, context: Sequence[int], start: int, match: int, limit: int, follows: bool, max_n: int) -> None:
        self.context, self.start, self.match, self.limit, self.follows, self.max_n = \
            context, start, match, limit, follows, max_n

    @classmethod
    def of(cls, index: _ContextIndex, context: Sequence[int], after: Sequence[int], config: NgramConfig) -> "_Copy":
        root = index.root_copy(config)
        if root is None:
            return cls(context, 0, 0, 0, False, config.max_n)
        start, match = root
        limit = config.copy_length(match)
        follows = all(_source(context, after, start + i) == t for i, t in enumerate(after[:limit]))
        return cls(context, start, match, limit, follows, config.max_n)

    def next(self, index: _ContextIndex, after: Sequence[int], tail: Sequence[int], k: int) -> list[tuple[int, float]]:
        """Candidates after ``context ⊕ after`` (``tail``: at least its last ``max_n`` tokens)."""
        at = len(after)
        if not self.follows or at >= self.limit:
            return index.lookup(list(tail[-self.max_n:]), k)
        token = _source(self.context, after, self.start + at)
        reach = self.match + at
        cands = [(token, reach / (reach + 1.0) * index.share(tail, token))]
        if k > 1:
            cands += [c for c in index.lookup(list(tail[-self.max_n:]), k) if c[0] != token][:k - 1]
        return cands

    def step(self, after: list[int], token: int) -> None:
        """``token`` joins the walk."""
        if self.follows and len(after) < self.limit:
            self.follows = _source(self.context, after, self.start + len(after)) == token
        after.append(token)


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
        if self.config.copy_min_len:
            chains = self.continue_chains([ContinueQuery(q.request_id, q.context_token_ids, q.prefixes, q.k, 1)
                                           for q in queries])
            return [[chain[0] if chain else [] for chain in per_prefix] for per_prefix in chains]
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
            if self.config.copy_min_len:
                out.append([self._walk(index, q.context_token_ids, prefix, q.depth, q.k) for prefix in q.prefixes])
            else:
                out.append(walk_chains(index.lookup, q.context_token_ids, q.prefixes, q.depth, q.k, self.config.max_n))
        return out

    def _walk(self, index: _ContextIndex, context: Sequence[int], prefix: Sequence[int], depth: int,
              k: int) -> list[Candidates]:
        """The chain from ``context ⊕ prefix`` with copying (``_next``), one pass."""
        copy = _Copy.of(index, context, prefix, self.config)
        after, chain = list(prefix), []
        tail = list(context[-self.config.max_n:]) + after
        while len(chain) < depth:
            cands = copy.next(index, after, tail, k)
            chain.append(cands)
            if not cands:
                break
            copy.step(after, int(cands[0][0]))
            tail.append(after[-1])
        return chain

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
        lookup = index.lookup
        if cfg.copy_min_len:
            base = len(tail)

            def lookup(path_tail: list[int], k: int) -> list[tuple[int, float]]:  # grow_paths extends the tail
                after = path_tail[base:]
                return _Copy.of(index, context, after, cfg).next(index, after, path_tail, k)
        paths, confidences = grow_paths(lookup, tail, item.max_draft_tokens,
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
            index = _ContextIndex(cfg.min_n, cfg.max_n, cfg.count_smoothing, copies=bool(cfg.copy_min_len))
            self._indexes[request_id] = index
            while len(self._indexes) > cfg.max_tracked_requests:
                self._indexes.popitem(last=False)
        else:
            self._indexes.move_to_end(request_id)
        return index
