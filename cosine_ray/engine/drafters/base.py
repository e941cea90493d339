"""The drafter protocol: every speculation source (n-gram, retrieval, model) speaks it.

A drafter is called once per step with the whole batch. For each request it gets the
context (prompt + committed tokens, the last one being the tree root whose KV the target
has not computed yet) and a budget of draft tokens, and returns draft paths that continue
the context, each token with the drafter's confidence (its probability of that token).
``observe`` tells it what the target accepted; ``release`` frees per-request state.

``continue_drafts`` is the step-by-step form CoSine's token fusion (eq. 4) drives: for each
request the engine gives the committed context and a few draft prefixes (the fused prefix,
and the drafter's own last token as a branch), and the drafter answers, per prefix, its most
likely next tokens with their probabilities. One call per drafter per fusion round covers
the whole batch. ``continue_chains`` answers several rounds ahead in one call, assuming the
drafter's own tokens keep winning (a round trip to a drafter actor costs more than the
lookups; the engine calls again only where fusion's trunk leaves the chain).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable


@dataclass(frozen=True, slots=True)
class DraftInput:
    request_id: str
    context_token_ids: tuple[int, ...]
    """Prompt + committed output; the last token is the root of this step's tree."""
    max_draft_tokens: int
    """Budget: at most this many draft tokens in total over all returned paths."""

    @classmethod
    def make_dummy(cls, request_id: str = "r0", budget: int = 4) -> "DraftInput":
        return cls(request_id, (1, 2, 3, 1, 2), budget)


@dataclass(frozen=True, slots=True)
class DraftProposal:
    request_id: str
    paths: list[list[int]] = field(default_factory=list)
    """Each path continues the context (its first token is a child of the root)."""
    confidences: list[list[float]] = field(default_factory=list)
    """Per token of each path: the drafter's probability of that token, in [0, 1]."""
    drafter: str = ""

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(p) for p in self.paths)

    @classmethod
    def empty(cls, request_id: str, drafter: str = "") -> "DraftProposal":
        return cls(request_id, [], [], drafter)


@dataclass(frozen=True, slots=True)
class DraftFeedback:
    request_id: str
    num_draft_tokens: int
    """How many draft tokens this drafter had in the verified tree."""
    num_accepted_tokens: int
    """Draft tokens accepted on the committed path (bonus token excluded)."""


@dataclass(frozen=True, slots=True)
class ContinueQuery:
    request_id: str
    context_token_ids: tuple[int, ...]
    """Prompt + committed output; the last token is the root of this step's tree."""
    prefixes: tuple[tuple[int, ...], ...]
    """Draft tokens after the root; the drafter continues each one."""
    k: int = 1
    """Continuations wanted per prefix (most likely first)."""
    depth: int = 1
    """``continue_chains`` only: positions to answer per prefix, each after the drafter's own
    most likely tokens so far (``continue_drafts`` answers one)."""


@dataclass(frozen=True, slots=True)
class FinishedText:
    """A request that finished normally, for drafters that learn from what the server writes
    (``Drafter.learn``, optional): its text and the domain the engine classified it into."""

    request_id: str
    domain: str
    token_ids: tuple[int, ...]
    """Prompt + output."""
    prompt_len: int


Candidates = list[tuple[int, float]]
"""``(token_id, probability)`` continuations, most likely first; ``[]`` when the drafter has none."""


def by_count(item: tuple[int, int]) -> int:
    """Sort key of a ``(token, count)`` pair; Python's sorts and ``max`` are stable, so equal
    counts keep their input order."""
    return item[1]


@runtime_checkable
class Drafter(Protocol):
    name: str

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        """One proposal per input, same order; an empty proposal is always allowed."""
        ...

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        """Per query, per prefix: up to ``k`` candidates for the token after ``context ⊕ prefix``."""
        ...

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        ...

    def release(self, request_id: str) -> None:
        ...

    # optional: def learn(self, texts: Sequence[FinishedText]) -> None  (drafters that learn
    # from finished requests; the engine calls it when requests end with stop or length)


def one_level_chains(drafter: Drafter, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
    """``continue_chains`` answered one level a prefix, whatever depth is asked (an answer may
    cover 1..depth levels): for drafters whose every level is a forward. Fusion leaves a
    drafter's chain whenever another drafter's token wins, so chains to the tree's depth at
    every call cost on the order of depth²/2 forwards a step; one level a call costs at most
    two forwards a fusion round (the trunk and the drafter's own branch) and gives the same
    answers, since fusion asks again for exactly the prefixes it still needs."""
    return continue_chains(drafter, [ContinueQuery(q.request_id, q.context_token_ids, q.prefixes, q.k, min(q.depth, 1))
                                     for q in queries])


def continue_chains(drafter: Drafter, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
    """Per query, per prefix: up to ``depth`` candidate lists, the i-th continuing
    ``prefix ⊕ (top token of each earlier list)``; a chain ends after an empty list. Exactly
    what ``continue_drafts`` answers for those prefixes, level by level (one batched
    ``continue_drafts`` call per level for every chain still growing)."""
    chains: list[list[list[Candidates]]] = [[[] for _ in q.prefixes] for q in queries]
    growing = {(qi, si): tuple(prefix) for qi, q in enumerate(queries) if q.depth > 0
               for si, prefix in enumerate(q.prefixes)}
    while growing:
        slots: dict[int, list[int]] = {}
        for qi, si in growing:
            slots.setdefault(qi, []).append(si)
        batch = [ContinueQuery(queries[qi].request_id, queries[qi].context_token_ids,
                               tuple(growing[(qi, si)] for si in sis), queries[qi].k) for qi, sis in slots.items()]
        answers = drafter.continue_drafts(batch)
        for (qi, sis), per_prefix in zip(slots.items(), answers):
            for si, cands in zip(sis, per_prefix):
                chain = chains[qi][si]
                chain.append(list(cands))
                if not cands or len(chain) >= queries[qi].depth:
                    del growing[(qi, si)]
                else:
                    growing[(qi, si)] += (int(cands[0][0]),)
    return chains
