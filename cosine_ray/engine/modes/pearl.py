"""PEARL: drafting and verification of a step run at the same time (``speculation.pearl``).

In a plain step the drafters draft, then the target verifies. With PEARL every step makes one
target call and one drafting call concurrently: the target verifies the tree the previous
step drafted ahead for the request (or, with none, just the root), while the drafters draft
from the optimistic context (the committed tokens plus the trunk being verified).

- **post-verify**: when the whole trunk is accepted and the target's next token ``t`` starts
  one of the ahead paths, the subtree under ``t`` is the next step's tree, already drafted;
- **pre-verify**: otherwise the ahead drafts are dropped and the next step verifies only its
  root while the drafters draft again. ``auto`` does that only while drafting measures at
  least half as long as verification; where drafting is quicker (lookup drafters), a request
  drafts first and verifies its tree, and still drafts ahead during that verification.

Segments of ``γ`` chain while the drafters keep agreeing with the target. Lossless: whatever
tree a step verifies, acceptance is the same rule (``engine.owners.verifier``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.tree_selection import SelectedTree
from cosine_ray.engine.types import Drafted, Verified
from cosine_ray.engine.request import Request


def trunk_tokens(selected: SelectedTree) -> tuple[int, ...]:
    """The tree's most likely path below the root: from the root, always the child with the
    highest cumulative confidence (ties: the earlier node)."""
    tree = selected.tree
    cum = tree.cumulative_confidences()
    node, out = 0, []
    while True:
        children = tree.children(node)
        if not children:
            return tuple(out)
        node = max(children, key=lambda c: (cum[c], -c))
        out.append(int(tree.token_ids[node]))


def after_token(drafted: Drafted, token: int) -> Drafted | None:
    """The drafts below ``token``: the paths that start with it, less it (answers and trunk
    likewise), or None when no path starts with it."""
    paths = [FusedPath(p.token_ids[1:], p.confidences[1:], p.owners[1:], p.raw_confidences[1:],
                       p.trunk_flags[1:])
             for p in drafted.paths if p.token_ids and p.token_ids[0] == token]
    if not paths:
        return None
    paths = [p for p in paths if p.token_ids]
    answers = {name: a[1:] for name, a in drafted.answers.items() if a and a[0][0] == token}
    trunk = drafted.trunk[1:] if drafted.trunk[:1] == (token,) else ()
    return Drafted(paths, answers, trunk, drafted.route)


@dataclass(frozen=True, slots=True)
class _Ahead:
    num_tokens: int
    """The request's token count when the drafts apply."""
    root: int
    """Its last token then (the target's token the drafts continue)."""
    drafted: Drafted


@dataclass(slots=True)
class PearlStats:
    steps: int = 0
    """Decoding requests' steps run with PEARL."""
    post_verify: int = 0
    """Of those, steps whose tree had been drafted ahead, during the previous verification."""
    pre_verify: int = 0
    """Steps that verified only their root while the drafters drafted (nothing drafted ahead applied)."""
    drafted_first: int = 0
    """Steps that drafted first, then verified (``auto``, while drafting measures the quicker)."""


EMA_WEIGHT = 0.2
"""Weight of the newest step in the drafting and verification times ``auto`` compares."""
PRE_VERIFY_MIN_DRAFT_SHARE = 0.5
"""``auto`` pre-verifies while drafting takes at least this share of a verification (lookup
drafters take well under 1 %, so they draft first; docs/history/2026-11-25-pearl.md)."""


class Pearl:
    """What was drafted ahead (kept on each request until the step it applies to) and, for
    ``auto``, how long drafting and verification take here."""

    def __init__(self, mode: str = "on") -> None:
        self.mode = mode
        self.stats = PearlStats()
        self.draft_s: float | None = None
        """Moving average of a step's drafting call (all its requests), seconds."""
        self.verify_s: float | None = None
        """Moving average of a step's target call, seconds."""

    def take(self, requests: Sequence[Request]) -> dict[str, Drafted]:
        """The drafts that apply to this step's decoding requests (drafted ahead by the
        previous step and still matching their context)."""
        out = {}
        for r in requests:
            ahead, r.drafted_ahead = r.drafted_ahead, None
            self.stats.steps += 1
            if ahead is not None and ahead.num_tokens == r.num_tokens and r.output_token_ids[-1:] == [ahead.root]:
                out[r.request_id] = ahead.drafted
                self.stats.post_verify += 1
        return out

    def pre_verify(self) -> bool:
        """Whether a request with nothing drafted ahead verifies its root alone while the drafters
        draft (``on``; ``auto`` while drafting measures at least half as long as verification:
        PEARL's case) rather than drafting first. Unmeasured, ``auto`` pre-verifies."""
        if self.mode != "auto" or self.draft_s is None or self.verify_s is None:
            return True
        return self.draft_s >= PRE_VERIFY_MIN_DRAFT_SHARE * self.verify_s

    def observe(self, draft_s: float | None, verify_s: float) -> None:
        """One step's drafting time (None: nothing was drafted) and verification time."""
        def ema(old: float | None, new: float) -> float:
            return new if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * new
        if draft_s is not None:
            self.draft_s = ema(self.draft_s, draft_s)
        if verify_s > 0:
            self.verify_s = ema(self.verify_s, verify_s)

    def keep(self, requests: Sequence[Request], trunks: Mapping[str, tuple[int, ...]],
             ahead: Mapping[str, Drafted], outcomes: Sequence[Verified]) -> None:
        """After verification: keep the drafts below the target's token for each request that
        accepted its whole trunk (call before the pool appends the new tokens)."""
        by_id = {r.request_id: r for r in requests}
        for o in outcomes:
            if o.is_prefill or o.request_id not in ahead or o.request_id not in trunks:
                continue
            *accepted, token = o.new_token_ids
            if tuple(accepted) != trunks[o.request_id]:
                continue  # a draft token was rejected: the ahead drafts continue a wrong text
            below = after_token(ahead[o.request_id], token)
            if below is not None:
                request = by_id[o.request_id]
                request.drafted_ahead = _Ahead(request.num_tokens + len(o.new_token_ids), token, below)
