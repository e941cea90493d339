"""A target client that survives a lost stage: the step never sees recovery.

When a stage dies, hangs past its deadline or loses its KV, the inner client raises
``TargetUnavailable``. ``RecoveringTarget`` then waits for the stages to come back (the
inner client restarts them and drops all per-request KV), tells the pool (``on_lost``:
running requests re-prefill from prompt + committed tokens, or fail if the target did not
come back within ``recovery_s``), and returns no logits for that step.

Several lanes may be in flight at once: one recovery at a time, counted by an *epoch*. A
score that started under an older epoch returns nothing (a recovery finished meanwhile and
dropped the KV its logits belong to), and a lane whose failure was already covered by the
recovery that ended its epoch does not recover again.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import torch

from cosine_ray.engine.worker.scoring import KVCommit, LayerItem, ScoreItem

from cosine_ray.engine.worker.clients import TargetClient, TargetUnavailable


class RecoveringTarget:
    def __init__(self, inner: TargetClient, *, recovery_s: float, on_lost: Callable[[bool, str], None]) -> None:
        self.inner = inner
        self.recovery_s = recovery_s
        self.on_lost = on_lost
        self.epoch = 0
        """Completed recoveries."""
        self.failed = False
        """The last recovery did not bring the target back (a health check reports it)."""
        self._lock: asyncio.Lock | None = None

    async def score(self, items: Sequence[ScoreItem]) -> list[torch.Tensor] | None:
        """Logits per item, or None when the step's KV was lost (its requests re-prefill)."""
        epoch = self.epoch
        try:
            logits = await self.inner.score(items)
        except TargetUnavailable as exc:
            await self._recover(str(exc), epoch)
            return None
        return logits if epoch == self.epoch else None

    async def timestep(self, items: Sequence[LayerItem | None]) -> tuple[bool, torch.Tensor | None]:
        """A PipeDec timestep (``engine.worker.target.PipelineTarget``): (False, None) when the KV was
        lost (recovered as for ``score``), else (True, the last stage's logits or None)."""
        epoch = self.epoch
        try:
            logits = await self.inner.timestep(items)
        except TargetUnavailable as exc:
            await self._recover(str(exc), epoch)
            return False, None
        return epoch == self.epoch, logits

    @property
    def supports_pipedec(self) -> bool:
        return all(hasattr(self.inner, m) for m in ("timestep", "prune", "settle"))

    async def prune(self, request_id: str, per_stage) -> None:
        await self.inner.prune(request_id, per_stage)

    async def settle(self, request_id: str) -> None:
        await self.inner.settle(request_id)

    def commit(self, commits: Sequence[KVCommit]) -> None:
        self.inner.commit(commits)

    async def release(self, request_ids: Sequence[str]) -> None:
        await self.inner.release(request_ids)

    async def _recover(self, reason: str, epoch: int) -> None:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if epoch != self.epoch:  # the recovery that ended our epoch covered this failure
                return
            recovered = await self.inner.recover(self.recovery_s)
            self.failed = not recovered
            self.epoch += 1
            self.on_lost(recovered, reason)
