"""Twins: identical greedy requests in flight draft from each other instead of racing.

With greedy decoding the target writes the same text for requests with the same prompt, so
the one ahead (the *leader*) has already written what the others (its *followers*) are about
to verify. Applied by the scheduler each step:

- **a follower takes its leader's text as its draft** (the tokens beyond its output, up to its
  budget, as one chain owned by ``twin``) and is not routed to the drafters that step;
- **a follower waits while its leader is less than a whole tree ahead** (fewer than budget +
  1 tokens): held back, it commits budget + 1 tokens a step and finishes right after it.

Who leads: among requests with the same prompt, the one with the longest output (the earlier
admitted on a tie); a follower follows the most advanced request whose output starts with its
own. The first is never held, so the group advances; a finished leader still lends its text;
a leader that has not advanced for ``max_stall_s`` holds nobody. Sampled requests are never
twins. Lossless as ever: the target verifies every token a follower commits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from cosine_ray.engine.request import Request, needs_prefill

TWIN = "twin"
"""Owner of a twin draft's nodes (calibration, stats and metrics count it like a drafter)."""


@dataclass(slots=True)
class TwinPlan:
    held: set[str] = field(default_factory=set)
    """Followers that wait this step."""
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Follower id → its leader's tokens beyond the follower's output (at most its budget)."""


def _admitted(request: Request) -> float:
    return request.arrival_time if request.admitted_time is None else request.admitted_time


class Twins:
    def __init__(self, *, max_stall_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_stall_s = max_stall_s
        self.clock = clock
        self._best: dict[int, Request] = {}
        """Per prompt hash shared by running requests: the most advanced request seen with it,
        kept when it leaves the pool (its text still drafts the others)."""

    def plan(self, running: Iterable[Request], lane: Sequence[Request], budget: Callable[[Request], int]) -> TwinPlan:
        """Who of ``lane`` waits and who drafts from a twin, given every running request."""
        groups: dict[int, list[Request]] = {}
        for r in running:
            if not r.params.is_greedy or not r.output_token_ids:
                continue
            if r.prompt_key is None:  # computed once; equal prompts are then compared in full
                r.prompt_key = hash(tuple(r.prompt_token_ids))
            groups.setdefault(r.prompt_key, []).append(r)
        best = {}
        for key, members in groups.items():
            top = max(members, key=lambda r: len(r.output_token_ids))
            old = self._best.get(key)
            best[key] = old if old is not None and len(old.output_token_ids) > len(top.output_token_ids) \
                and old.prompt_token_ids == top.prompt_token_ids else top
        self._best = best
        plan = TwinPlan()
        in_lane = {r.request_id for r in lane}
        now = self.clock()
        for key, members in groups.items():
            gone = [best[key]] if all(r is not best[key] for r in members) else []
            if len(members) + len(gone) < 2:
                for r in members:  # not a twin now: its progress clock starts again if it becomes one
                    r.twin_progress = None
                continue
            for r in members:
                length, since = r.twin_progress or (-1, now)
                r.twin_progress = (length, since) if length == len(r.output_token_ids) \
                    else (len(r.output_token_ids), now)
            # most advanced first; on a tie the earlier admitted
            order = sorted(members + gone, key=lambda r: (-len(r.output_token_ids), _admitted(r)))
            for k, follower in enumerate(order):
                rid = follower.request_id
                if rid not in in_lane or gone and follower is gone[0] or needs_prefill(follower):
                    continue
                out = follower.output_token_ids
                leader = next((r for r in order[:k] if r.prompt_token_ids == follower.prompt_token_ids
                               and r.output_token_ids[:len(out)] == out), None)
                if leader is None:
                    continue
                lead = leader.output_token_ids[len(out):]
                need = budget(follower) + 1
                leader_runs = not (gone and leader is gone[0])
                leader_since = (leader.twin_progress or (0, now))[1]
                if leader_runs and len(lead) < need and now - leader_since < self.max_stall_s:
                    plan.held.add(rid)
                    continue
                if lead and need > 1:
                    plan.drafts[rid] = tuple(lead[:need - 1])
        return plan

    def forget(self, running: Iterable[Request]) -> None:
        """Drop the kept leaders of prompts no running request shares any more."""
        live = {r.prompt_key for r in running}
        self._best = {k: r for k, r in self._best.items() if k in live}

    @property
    def num_tracked(self) -> int:
        """Requests kept here (finished leaders lending their text)."""
        return len(self._best)


class NoTwins:
    """Twins off: nobody waits, nobody drafts from a twin."""

    def plan(self, running: Iterable[Request], lane: Sequence[Request], budget: Callable[[Request], int]) -> TwinPlan:
        return TwinPlan()

    def forget(self, running: Iterable[Request]) -> None:
        return None

    num_tracked = 0
