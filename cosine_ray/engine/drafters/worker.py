"""One drafter with its per-request state, as a plain worker.

The in-process engine wraps it in ``engine.owners.drafting.LocalDrafterClient``; the Ray runtime
makes it an actor (``runtime.actors.DrafterActor`` subclasses it) behind
``runtime.clients.RayDrafterClient``. Both therefore run exactly this code.
"""

from __future__ import annotations

from typing import Any, Sequence

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             Drafter, FinishedText, continue_chains)


class DrafterWorker:
    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.learns = callable(getattr(drafter, "learn", None))
        """The drafter learns from finished requests (``learn``)."""

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return self.drafter.propose(inputs)

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        return self.drafter.continue_drafts(queries)

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        """The drafter's own chains when it has them (one lookup per chain), else level by level."""
        native = getattr(self.drafter, "continue_chains", None)
        return native(queries) if native is not None else continue_chains(self.drafter, queries)

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        self.drafter.observe(feedback)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.drafter.release(rid)

    def learn(self, texts: Sequence[FinishedText]) -> None:
        if self.learns:
            self.drafter.learn(texts)

    def state_size(self) -> dict[str, Any]:
        """Requests the drafter holds state for (tests check nothing leaks), plus whatever
        the drafter reports itself (``state_size()``: index sizes of learning drafters)."""
        own = getattr(self.drafter, "state_size", None)
        out: dict[str, Any] = dict(own()) if callable(own) else {}
        tracked = getattr(self.drafter, "num_tracked_requests", None)
        cache = getattr(self.drafter, "cache", None)
        out["requests"] = tracked if isinstance(tracked, int) else (len(cache.request_ids) if cache is not None else 0)
        return out
