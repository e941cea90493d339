"""Confidence-based token fusion (CoSine eq. 4), one request at a time, round by round.

At draft position i every drafter routed to the request proposes its most likely token
``x[n,i]`` after the *fused* prefix, with confidence ``c[n,i]``; the most confident one,
``x*_i = argmax_n P(x[n,i])``, extends the trunk. A losing token stays as a *branch* and its
drafter is asked to continue it one more token. Trunk and branches form the request's draft
tree, which TreeSelection (``algo.tree_selection``) cuts to γ_i nodes::

    round 0   ngram: "def" 0.6   retrieval:code: "def" 0.9   → trunk [def]
    round 1   ngram: "(" 0.5     retrieval:code: "fib" 0.8   → trunk [def, fib]; branch [def, (]
    round 2   ngram: "n" 0.7 after "def fib", and ")" 0.4 after its own "def ("

The argmax compares *calibrated* confidences (the ``calibrate`` hook, ``algo.calibration``);
ties go to the drafter listed first. A drafter with no token for the fused prefix sits out the
rest of the step; fusion stops when no drafter answers, at ``max_depth``, or below
``min_cumulative``. The choices: docs/algorithms.md ("Confidence fusion").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

Candidates = Sequence[tuple[int, float]]
"""``(token_id, probability)`` continuations, most likely first."""

Calibrate = Callable[[str, float, int, bool], float]
"""``calibrate(drafter, raw confidence, depth, is_trunk)`` → P(the node is accepted | its parent
was); depth counts from 1 at the root's children."""


def _identity(_drafter: str, confidence: float, _depth: int = 1, _is_trunk: bool = True) -> float:
    return confidence


@dataclass(frozen=True, slots=True)
class FusedPath:
    """One root-to-leaf path of the fused tree."""

    token_ids: tuple[int, ...]
    confidences: tuple[float, ...]
    """Calibrated confidence of each token given its parent path."""
    owners: tuple[str, ...]
    """Drafter whose token each node is."""
    raw_confidences: tuple[float, ...] = ()
    """The owners' own probabilities (what calibration learns from); () = same as confidences."""
    trunk_flags: tuple[bool, ...] = ()
    """Per token: a trunk node (True) or a branch (a token that lost fusion's argmax); () = all trunk."""


@dataclass(slots=True)
class FusionState:
    drafters: tuple[str, ...]
    """Drafters routed to this request, best-scoring first (tie order)."""
    max_depth: int
    min_cumulative: float = 0.0
    calibrate: Calibrate = _identity
    trunk: list[int] = field(default_factory=list)
    trunk_confidences: list[float] = field(default_factory=list)
    trunk_owners: list[str] = field(default_factory=list)
    trunk_raw: list[float] = field(default_factory=list)
    branches: list[FusedPath] = field(default_factory=list)
    answers: dict[str, list[tuple[int | None, float]]] = field(default_factory=dict)
    """Per drafter, per depth: its token after the fused prefix and its raw confidence
    ((None, 0.0) when it had none) — the ``x[n,i]``, ``c[n,i]`` routing's eq. 1-2 score."""
    done: bool = False
    _own: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    """Drafter → its losing token at the last depth (calibrated, raw confidence) to continue."""
    _silent: set[str] = field(default_factory=set)
    """Drafters that had no token for the fused prefix: not asked again this step."""

    def __post_init__(self) -> None:
        self.drafters = tuple(self.drafters)
        if self.max_depth <= 0 or not self.drafters:
            self.done = True
        for d in self.drafters:
            self.answers.setdefault(d, [])

    @property
    def depth(self) -> int:
        return len(self.trunk)

    def trunk_cumulative(self) -> float:
        c = 1.0
        for x in self.trunk_confidences:
            c *= x
        return c

    def queries(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Prefixes each drafter is asked to continue this round: the fused trunk first, then
        (if its token lost last round) its own branch."""
        if self.done:
            return {}
        trunk = tuple(self.trunk)
        out = {}
        for d in self.drafters:
            if d not in self._silent:
                own = self._own.get(d)
                out[d] = (trunk,) if own is None else (trunk, trunk[:-1] + (own[0],))
        return out

    def absorb(self, answers: Mapping[str, Sequence[Candidates]]) -> None:
        """Fold one round of answers (drafter → candidates per queried prefix; a drafter
        missing from ``answers`` had nothing or failed)."""
        if self.done:
            return
        depth = self.depth
        proposals: list[tuple[float, int, str, float]] = []  # (calibrated, order, drafter, raw) per token
        tokens: dict[str, int] = {}
        for order, d in enumerate(self.drafters):
            per_prefix = answers.get(d) or ()
            trunk_cands = per_prefix[0] if len(per_prefix) > 0 else ()
            if trunk_cands:
                tok, raw = int(trunk_cands[0][0]), float(trunk_cands[0][1])
                tokens[d] = tok
                proposals.append((self.calibrate(d, raw, depth + 1, True), order, d, raw))
                self.answers[d].append((tok, raw))
            else:
                self.answers[d].append((None, 0.0))
                self._silent.add(d)
            own = self._own.get(d)
            own_cands = per_prefix[1] if own is not None and len(per_prefix) > 1 else ()
            if own_cands:  # the drafter's own branch grows to two tokens
                tok2, raw2 = int(own_cands[0][0]), float(own_cands[0][1])
                self.branches.append(FusedPath(
                    tuple(self.trunk[:-1]) + (own[0], tok2),
                    tuple(self.trunk_confidences[:-1]) + (own[1], self.calibrate(d, raw2, depth + 1, False)),
                    tuple(self.trunk_owners[:-1]) + (d, d),
                    tuple(self.trunk_raw[:-1]) + (own[2], raw2),
                    (True,) * (depth - 1) + (False, False)))
        self._own = {}
        if not proposals:
            self.done = True
            return
        best_conf, _, best, best_raw = max(proposals, key=lambda p: (p[0], -p[1]))
        best_token = tokens[best]
        prefix_cum = self.trunk_cumulative()
        seen = {best_token}
        for _, _, d, raw in sorted(proposals, key=lambda p: (-p[0], p[1])):
            tok = tokens[d]
            if tok in seen:
                continue
            conf = self.calibrate(d, raw, depth + 1, False)  # a losing token: a branch
            if prefix_cum * conf < self.min_cumulative:
                continue
            seen.add(tok)
            self.branches.append(FusedPath(tuple(self.trunk) + (tok,), tuple(self.trunk_confidences) + (conf,),
                                           tuple(self.trunk_owners) + (d,), tuple(self.trunk_raw) + (raw,),
                                           (True,) * depth + (False,)))
            self._own[d] = (tok, conf, raw)
        self.trunk.append(best_token)
        self.trunk_confidences.append(best_conf)
        self.trunk_owners.append(best)
        self.trunk_raw.append(best_raw)
        if depth + 1 >= self.max_depth or self.trunk_cumulative() < self.min_cumulative:
            self.done = True

    def paths(self) -> list[FusedPath]:
        """The fused trunk first, then the branches (in the order they were found)."""
        out = []
        if self.trunk:
            out.append(FusedPath(tuple(self.trunk), tuple(self.trunk_confidences), tuple(self.trunk_owners),
                                 tuple(self.trunk_raw)))
        return out + list(self.branches)

    def fusion_picks(self) -> dict[str, int]:
        """Trunk tokens taken from each drafter."""
        picks: dict[str, int] = {}
        for d in self.trunk_owners:
            picks[d] = picks.get(d, 0) + 1
        return picks
