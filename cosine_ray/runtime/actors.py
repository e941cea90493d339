"""Ray actors: plain engine workers, decorated late (no logic here beyond hosting).

* ``StageActor``: one layer slice of the target + its KV cache (``engine.worker.target.StageWorker``).
* ``DrafterActor``: one drafter with its per-request state (``engine.drafters.worker.DrafterWorker``).
* The engine itself (request pool and step loop) is a Ray Serve deployment
  (``runtime.engine_server.EngineServer``, deployed by ``serve.app.build_app``).

Every actor sets its torch thread count first, so S stages and N drafters on a small
machine do not oversubscribe the cores.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Sequence

import ray
import torch

from cosine_ray.engine.build import build_stage, make_drafter_worker
from cosine_ray.engine.config import DrafterSpec, EngineConfig
from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             FinishedText)
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.worker.target import StageWorker, default_kv_tokens, kv_budgets
from cosine_ray.runtime import memory


class _Hosted:
    def _start(self, threads: int) -> None:
        torch.set_num_threads(threads)
        self.incarnation = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.started_at = time.time()
        # free heap pages back to the OS every few seconds, as the engine process does (runtime/memory.py):
        # a stage's step buffers change shape with every batch and tree size, and without the
        # trim a stage's private RSS climbed in steps well past warm-up in the serving soak test
        # (236 -> 264 MiB from 2 to 5 minutes: +6.5 MiB/min fitted, bound 2). With it the stages
        # fitted +0.15 and -0.47 MiB/min, their C heap in use +1.1 and +3.5 MiB warm -> idle.
        self._heap_trimmer = memory.start_heap_trimmer()

    def ping(self) -> str:
        """Liveness; the value changes when Ray restarts the actor (its state is new)."""
        return self.incarnation

    def pid(self) -> int:
        return os.getpid()

    def malloc_in_use_mib(self) -> float | None:
        """Bytes this process's C heap has handed out and not had back (MiB; None off glibc)."""
        return memory.malloc_in_use_mib()

    def held_mib(self) -> dict[str, float]:
        """This process's resident memory between two calls, after a heap trim (``memory.held_mib``)."""
        return memory.held_mib()


HEAD_METHOD_PREFIX = "draft_"
"""Of the ``StageHost`` methods that reach the feature head it hosts."""


class StageHost(_Hosted, StageWorker):
    """The stage worker, hosted: every method is ``StageWorker``'s, and ``draft_*`` those of the
    feature head the last stage hosts when the drafter set has one (``build_stage``: the head
    reads the features this process's last stage computes). The head's methods carry a prefix
    because ``release`` means freeing KV here (``RayDrafterClient(method_prefix=HEAD_METHOD_PREFIX)``)."""

    def __init__(self, config: EngineConfig, stage_index: int) -> None:
        self._start(config.cluster.threads_per_actor)
        stage, self.head = build_stage(config, stage_index)
        StageWorker.__init__(self, stage, kv_budget_bytes=kv_budgets([stage], config.kv_cache_memory)[0],
                             runner=config.runtime.runner, external_blocks=True,
                             kv_token_budget=default_kv_tokens(config, stage.config, stage.dtype))
        self.capture_graphs(config)  # CUDA: before the first request
        self.stage_index = stage_index
        memory.drop_file_pages()  # checkpoint pages read only to build fused copies (runtime/memory.py)


    def _head(self) -> DrafterWorker:
        if self.head is None:
            raise RuntimeError(f"stage {self.stage_index} hosts no feature head")
        return self.head

    def draft_propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return self._head().propose(inputs)

    def draft_continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        return self._head().continue_drafts(queries)

    def draft_continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        return self._head().continue_chains(queries)

    def draft_observe(self, feedback: Sequence[DraftFeedback]) -> None:
        self._head().observe(feedback)

    def draft_release(self, request_ids: Sequence[str]) -> None:
        self._head().release(request_ids)

    def draft_learn(self, texts: Sequence[FinishedText]) -> None:
        self._head().learn(texts)


class DrafterHost(_Hosted, DrafterWorker):
    """The drafter worker, hosted: every method is ``DrafterWorker``'s."""

    def __init__(self, config: EngineConfig, spec: DrafterSpec) -> None:
        self._start(config.cluster.threads_per_actor)
        DrafterWorker.__init__(self, make_drafter_worker(spec, config).drafter)
        memory.drop_file_pages()  # a model drafter's checkpoint pages, as for a stage


StageActor = ray.remote(StageHost)
DrafterActor = ray.remote(DrafterHost)
