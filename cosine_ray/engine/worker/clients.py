"""The engine's two clients, side by side: ``TargetClient`` (the target's stages) and
``DrafterClient`` (one drafter), with their in-process implementations over the workers a Ray
actor would host (``TargetWorker``, ``DrafterWorker``). ``runtime.clients`` has the Ray ones;
``engine.backend`` picks which a built engine gets.

After verification the engine calls ``TargetClient.commit`` with each request's kept slots
(root + accepted path, or the whole prefill chain). The in-process client applies it at once;
the Ray client sends it with the request's next forward (no extra round trip). Either way it
takes effect before that request's next forward.
"""

from __future__ import annotations

import asyncio
from typing import Protocol, Sequence

import torch

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             FinishedText)
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.worker.scoring import KVCommit, LayerItem, ScoreItem
from cosine_ray.engine.worker.target import TargetWorker


class TargetUnavailable(RuntimeError):
    """A stage died, hung past its deadline or lost its KV: the engine re-prefills."""


class PipelineTarget(Protocol):
    """What PipeDec needs of the target besides ``TargetClient``: a timestep in which every
    stage works on its own layer at once (``items[s]`` for stage s, None = idle), stage s
    reading stage s-1's output of the previous timestep. Returns the last stage's logits
    when it worked."""

    num_stages: int

    async def timestep(self, items: Sequence[LayerItem | None]) -> torch.Tensor | None: ...

    async def prune(self, request_id: str, per_stage: Sequence[tuple[tuple[int, ...], int] | None]) -> None:
        """Prune each stage's tree level (keep, num_committed) and forget held outputs."""
        ...

    async def settle(self, request_id: str) -> None:
        """Apply the request's pending ``commit`` on every stage now."""
        ...


class TargetClient(Protocol):
    async def score(self, items: Sequence[ScoreItem]) -> list[torch.Tensor]:
        """Per item: logits (fp32) [len(token_ids), vocab] or [1, vocab] for prefill, or with
        ``ids_only`` the argmax tokens [len(token_ids)] or [1] (int64).
        Raises TargetUnavailable when a stage is gone or its state is lost."""
        ...

    def commit(self, commits: Sequence[KVCommit]) -> None:
        """Keep the accepted slots; applied before each request's next forward."""
        ...

    async def release(self, request_ids: Sequence[str]) -> None:
        ...

    async def recover(self, timeout_s: float) -> bool:
        """Bring every stage back (restart if needed) and drop all per-request KV;
        False if that did not happen within ``timeout_s``."""
        ...

    async def kv_capacity(self) -> int | None:
        """KV blocks every stage can hold for the engine's block tables (``engine.owners.kv``);
        None: the pools grow as needed."""
        ...


class LocalTargetClient:
    """TargetClient over an in-process TargetWorker (and ``PipelineTarget``: the stages of a
    PipeDec timestep run one after another here)."""

    def __init__(self, worker: TargetWorker) -> None:
        self.worker = worker
        self._outputs: list[torch.Tensor | None] = [None] * len(worker.stages)

    @property
    def num_stages(self) -> int:
        return len(self.worker.stages)

    @property
    def runs_async(self) -> bool:
        """The forward is queued on a GPU and ``score`` waits without holding the host, so host
        work can overlap it (``SpeculationConfig.overlap_learning``: auto)."""
        return any(w.stage.device.type == "cuda" for w in self.worker.stages)

    async def timestep(self, items: Sequence[LayerItem | None]) -> torch.Tensor | None:
        outputs = [stage.forward_layer(item, self._outputs[s - 1] if s else None) if item is not None else None
                   for s, (stage, item) in enumerate(zip(self.worker.stages, items))]
        self._outputs = outputs
        return outputs[-1]

    async def prune(self, request_id: str, per_stage: Sequence[tuple[tuple[int, ...], int] | None]) -> None:
        for stage, p in zip(self.worker.stages, per_stage):
            if p is not None:
                stage.prune(request_id, *p)
        self._outputs = [None] * len(self._outputs)

    async def settle(self, request_id: str) -> None:
        """Nothing is pending here: ``commit`` applies at once."""

    async def score(self, items: Sequence[ScoreItem]) -> list[torch.Tensor]:
        pending = self.worker.score_pending(items)
        while not pending.ready():  # CUDA: the GPU verifies; other lanes' steps run meanwhile
            await asyncio.sleep(0)
        return pending.wait_and_split()

    def commit(self, commits: Sequence[KVCommit]) -> None:
        self.worker.commit(commits)

    async def release(self, request_ids: Sequence[str]) -> None:
        self.worker.release(request_ids)

    async def kv_capacity(self) -> int | None:
        return self.worker.kv_capacity()

    async def kv_usage(self) -> list[dict[str, int]]:
        return [stage.kv_usage() for stage in self.worker.stages]

    async def recover(self, timeout_s: float) -> bool:
        for stage in self.worker.stages:
            stage.release_all()
        return True


class DrafterClient(Protocol):
    name: str

    async def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]: ...

    async def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]: ...

    # optional: async def continue_chains(queries) -> list[list[list[Candidates]]] (drafters.base)

    async def observe(self, feedback: Sequence[DraftFeedback]) -> None: ...

    async def release(self, request_ids: Sequence[str]) -> None: ...

    learns: bool
    """Whether the drafter learns from finished requests (then the engine calls ``learn``)."""

    async def learn(self, texts: Sequence[FinishedText]) -> None: ...


class LocalDrafterClient:
    """DrafterClient over an in-process ``DrafterWorker`` (the same worker a drafter actor hosts)."""

    synchronous = True
    """Each call runs to completion when awaited, without yielding to the event loop: a
    deadline could not cut it, so ``call_drafters`` awaits it directly (no task per call,
    and no other lane's step runs in the middle of this one's drafting)."""

    def __init__(self, worker: DrafterWorker) -> None:
        self.worker = worker
        self.name = worker.name
        self.learns = worker.learns

    async def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return self.worker.propose(inputs)

    async def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        return self.worker.continue_drafts(queries)

    async def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        return self.worker.continue_chains(queries)

    async def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        self.worker.observe(feedback)

    async def release(self, request_ids: Sequence[str]) -> None:
        self.worker.release(request_ids)

    async def learn(self, texts: Sequence[FinishedText]) -> None:
        self.worker.learn(texts)
