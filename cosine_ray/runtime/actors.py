"""Ray actors: plain engine workers, decorated late (no logic here beyond hosting).

* ``StageActor``: one layer slice of the target + its KV cache (``engine.target.StageWorker``).
* ``DrafterActor``: one drafter with its per-request state.
* ``RouterActor`` (``runtime.router_actor``): the request pool and the step loop.

Every actor sets its torch thread count first, so S stages and N drafters on a small
machine do not oversubscribe the cores.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any, Sequence

import ray
import torch

from cosine_ray.engine.config import DrafterSpec, EngineConfig
from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             continue_chains)
from cosine_ray.engine.local import make_drafter, make_stage_worker
from cosine_ray.engine.target import ScoreItem


class _Hosted:
    def _start(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()

    def ping(self) -> str:
        """Liveness; the value changes when Ray restarts the actor (its state is new)."""
        return self.incarnation

    def pid(self) -> int:
        return os.getpid()


class StageHost(_Hosted):
    def __init__(self, config: EngineConfig, stage_index: int) -> None:
        self._start(config.cluster.threads_per_actor)
        self.worker = make_stage_worker(config, stage_index)
        self.stage_index = stage_index

    def forward(self, items: Sequence[ScoreItem], hidden: torch.Tensor | None = None) -> torch.Tensor:
        return self.worker.forward(items, hidden)

    def release(self, request_ids: Sequence[str]) -> None:
        self.worker.release(request_ids)

    def release_all(self) -> None:
        self.worker.release(self.worker.cache.request_ids)

    def kv_usage(self) -> dict[str, int]:
        return {"requests": self.worker.num_cached_requests(), "tokens": self.worker.num_cached_tokens()}


class DrafterHost(_Hosted):
    def __init__(self, config: EngineConfig, spec: DrafterSpec) -> None:
        self._start(config.cluster.threads_per_actor)
        self.drafter = make_drafter(spec, config)
        self.name = self.drafter.name

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return self.drafter.propose(inputs)

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        return self.drafter.continue_drafts(queries)

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        return continue_chains(self.drafter, queries)

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        self.drafter.observe(feedback)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.drafter.release(rid)

    def state_size(self) -> dict[str, Any]:
        return drafter_state_size(self.drafter)


def drafter_state_size(drafter: Any) -> dict[str, Any]:
    """Requests a drafter holds state for (tests check nothing leaks)."""
    tracked = getattr(drafter, "num_tracked_requests", None)
    cache = getattr(drafter, "cache", None)
    return {"requests": tracked if isinstance(tracked, int) else (len(cache.request_ids) if cache is not None else 0)}


StageActor = ray.remote(StageHost)
DrafterActor = ray.remote(DrafterHost)
