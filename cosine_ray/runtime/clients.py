"""Ray implementations of the engine's client protocols; every remote call has a deadline.

``ActorSlot`` keeps a live handle for one role: Ray restarts a crashed actor itself
(``max_restarts``); an actor killed for good (``ray.kill``) is spawned again by the slot.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Sequence

import ray
import torch
from ray.exceptions import ActorDiedError, RayActorError

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             FinishedText)
from cosine_ray.engine.worker.scoring import KVCommit, LayerItem, ScoreItem, split_output
from cosine_ray.engine.worker.clients import TargetUnavailable
from cosine_ray.runtime.cluster import NAMESPACE

log = logging.getLogger(__name__)


async def await_ref(ref: ray.ObjectRef, timeout_s: float) -> Any:
    """Await an ObjectRef with a deadline (never a blocking ray.get in async code)."""
    return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=timeout_s)


class ActorSlot:
    def __init__(self, name: str, spawn: Callable[[], Any], *, namespace: str = NAMESPACE) -> None:
        self.name = name
        self.namespace = namespace
        self._spawn = spawn
        self.handle = spawn()
        self.num_respawns = 0

    def respawn_if_dead(self, exc: BaseException) -> None:
        """After an ActorDiedError that Ray will not repair (killed with no_restart)."""
        if isinstance(exc, ActorDiedError) and not getattr(exc, "preempted", False):
            try:
                ray.get_actor(self.name, namespace=self.namespace)  # still registered: Ray restarts it
                return
            except ValueError:
                pass
            log.warning("actor %s is gone; spawning a new one", self.name)
            self.handle = self._spawn()
            self.num_respawns += 1


class RayDrafterClient:
    """DrafterClient over a DrafterActor, or over the feature head a last StageActor hosts
    (``method_prefix``). A call that overruns its deadline keeps running in
    the actor; until it returns, this drafter sits out the following steps instead of
    queueing more work behind it."""

    def __init__(self, slot: ActorSlot, name: str, *, deadline_s: float, learns: bool = False,
                 method_prefix: str = "") -> None:
        self.slot = slot
        self.name = name
        self.deadline_s = deadline_s
        self.learns = learns
        """The hosted drafter learns from finished requests (``learn`` is sent to it)."""
        self.method_prefix = method_prefix
        """Before each method name: ``draft_`` for the feature head a last stage hosts (``StageHost``)."""
        self._inflight: ray.ObjectRef | None = None

    def _method(self, name: str):
        return getattr(self.slot.handle, self.method_prefix + name)

    async def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return await self._call("propose", list(inputs))

    async def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        return await self._call("continue_drafts", list(queries))

    async def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        return await self._call("continue_chains", list(queries))

    async def _call(self, method: str, arg: list) -> Any:
        if self._inflight is not None:
            ready, _ = ray.wait([self._inflight], timeout=0)
            if not ready:
                raise TimeoutError(f"drafter {self.name} is still busy with an earlier call")
            self._inflight = None
        ref = self._method(method).remote(arg)
        try:
            return await await_ref(ref, self.deadline_s)
        except asyncio.TimeoutError:
            self._inflight = ref
            raise
        except RayActorError as exc:
            self.slot.respawn_if_dead(exc)
            raise

    async def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        self._method("observe").remote(list(feedback))  # fire and forget: ordered before the next propose

    async def release(self, request_ids: Sequence[str]) -> None:
        self._method("release").remote(list(request_ids))

    async def learn(self, texts: Sequence[FinishedText]) -> None:
        self._method("learn").remote(list(texts))  # fire and forget, like observe


class RayTargetClient:
    """TargetClient over the chain of StageActors.

    Stage s's output ObjectRef is passed straight to stage s+1: Ray moves the hidden
    states between the stage actors without a round trip through the engine, and the
    engine only awaits the last stage's logits. Commits travel with the next forward (every
    pending one, whichever request it is for): no extra message, and every stage applies them
    before it writes anything, so a block the engine freed by a commit and handed to another
    request is read before it is written. A released request's pending commit goes first, so
    its full blocks hold what the prefix cache says they hold."""

    def __init__(self, slots: Sequence[ActorSlot], *, deadline_s: float) -> None:
        self.slots = list(slots)
        self.deadline_s = deadline_s
        self._pending: dict[str, tuple[int, ...]] = {}
        self._layer_refs: list[ray.ObjectRef | None] = [None] * len(self.slots)
        """PipeDec: each stage's output of the last timestep (the next stage's input)."""

    def commit(self, commits: Sequence[KVCommit]) -> None:
        for c in commits:
            self._pending[c.request_id] = c.keep

    async def score(self, items: Sequence[ScoreItem]) -> list[torch.Tensor]:
        if not items:
            return []
        commits = [KVCommit(rid, keep) for rid, keep in self._pending.items()]
        self._pending.clear()
        ref = None
        for slot in self.slots:
            ref = slot.handle.forward.remote(items, ref, commits)
        return split_output(items, await self._await(asyncio.wrap_future(ref.future())))

    async def _await(self, work: Any) -> Any:
        """Await stage results with the chain's deadline; a lost stage is TargetUnavailable."""
        try:
            return await asyncio.wait_for(work, timeout=self.deadline_s)
        except asyncio.TimeoutError as exc:
            raise TargetUnavailable(f"stage chain missed its {self.deadline_s:.0f} s deadline") from exc
        except (RayActorError, ray.exceptions.RayTaskError) as exc:
            for slot in self.slots:
                slot.respawn_if_dead(exc)
            raise TargetUnavailable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}") from exc

    # ---- PipeDec (engine.worker.target.PipelineTarget) ----------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.slots)

    async def timestep(self, items: Sequence[LayerItem | None]) -> torch.Tensor | None:
        """Every stage with a layer starts at once; stage s gets stage s-1's output of the
        previous timestep as an ObjectRef (Ray moves it actor to actor)."""
        refs = [slot.handle.forward_layer.remote(item, self._layer_refs[s - 1] if s else None)
                if item is not None else None
                for s, (slot, item) in enumerate(zip(self.slots, items))]
        self._layer_refs = refs
        live = [asyncio.wrap_future(r.future()) for r in refs if r is not None]
        results = await self._await(asyncio.gather(*live))
        return results[-1] if refs[-1] is not None else None

    async def prune(self, request_id: str, per_stage: Sequence[tuple[tuple[int, ...], int] | None]) -> None:
        for slot, p in zip(self.slots, per_stage):  # ordered before this caller's next call to the stage
            if p is not None:
                slot.handle.prune.remote(request_id, *p)
        self._layer_refs = [None] * len(self.slots)

    async def settle(self, request_id: str) -> None:
        keep = self._pending.pop(request_id, None)
        if keep is not None:
            for slot in self.slots:
                slot.handle.commit.remote([KVCommit(request_id, keep)])

    async def release(self, request_ids: Sequence[str]) -> None:
        commits = [KVCommit(rid, self._pending.pop(rid)) for rid in request_ids if rid in self._pending]
        for slot in self.slots:  # ordered: the commits land before the release
            if commits:
                slot.handle.commit.remote(commits)
            slot.handle.release.remote(list(request_ids))

    async def kv_capacity(self) -> int | None:
        capacities = await asyncio.gather(*(await_ref(s.handle.kv_capacity.remote(), self.deadline_s)
                                            for s in self.slots))
        return None if None in capacities else min(capacities)

    async def recover(self, timeout_s: float) -> bool:
        """Wait until every stage answers, then drop all per-request KV everywhere."""
        self._pending.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for slot in self.slots:
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return False
                try:
                    await await_ref(slot.handle.ping.remote(), min(5.0, remaining))
                    break
                except (RayActorError, asyncio.TimeoutError) as exc:
                    if isinstance(exc, RayActorError):
                        slot.respawn_if_dead(exc)
                    await asyncio.sleep(0.2)
        try:
            await asyncio.gather(*(await_ref(s.handle.release_all.remote(), 10.0) for s in self.slots))
        except (RayActorError, asyncio.TimeoutError):
            return False
        return True

    async def kv_usage(self, timeout_s: float = 5.0) -> list[dict[str, int]]:
        return list(await asyncio.gather(*(await_ref(s.handle.kv_usage.remote(), timeout_s)
                                           for s in self.slots)))
