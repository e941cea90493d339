"""The Ray backend of ``engine.backend.build_engine``: stage and drafter actors (vLLM's Ray executor).

``ActorBackend`` gives each pipeline stage a ``StageActor`` (or, with ``cluster.stages_in_engine``,
builds the stages in this process as ``InProcess`` does), runs the drafters of
``cluster.drafters_in_engine`` kinds in this process, reaches a feature head beside the last
stage, and gives every other drafter a ``DrafterActor``. Actors are named
``cosine_ray:<role>:<i>`` in the engine's own namespace and owned by this process, so they die
with it. ``ready`` waits for the stages (a stage that does not come up fails the start);
``await_drafters``, after the engine is built, for the drafters, which never block serving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Sequence

import ray

from cosine_ray.engine.backend import InProcess, StartedTarget
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.spec import DrafterSpec
from cosine_ray.engine.worker.clients import DrafterClient
from cosine_ray.models.loader import Checkpoint
from cosine_ray.runtime.actors import HEAD_METHOD_PREFIX, DrafterActor, StageActor
from cosine_ray.runtime.clients import ActorSlot, RayDrafterClient, RayTargetClient, await_ref
from cosine_ray.runtime.cluster import actor_name
from cosine_ray.runtime.placement import actor_asks, actor_options, describe, public

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
"""Longest wait for the stages to load (a first start converts the model)."""
PENDING_REPORT_S = 30.0
"""While actors are not up yet, say every this often which, what they ask and what is free."""


def stage_slots(config: EngineConfig, namespace: str) -> list[ActorSlot]:
    """One ``StageActor`` per pipeline stage of ``config`` (resolved), named
    ``cosine_ray:stage:<i>`` in ``namespace``."""
    def spawn(i: int):
        options = {**actor_options("stage", i, config), "namespace": namespace}
        return lambda: StageActor.options(**options).remote(config, i)

    return [ActorSlot(actor_name("stage", i), spawn(i), namespace=namespace) for i in range(config.num_stages)]


class ActorBackend:
    """Stages and drafters as Ray actors owned by this process, named in ``namespace``."""

    def __init__(self, config: EngineConfig, namespace: str, *, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.namespace = namespace
        self.stages_in_process = config.cluster.stages_in_engine
        self.ready_timeout_s = ready_timeout_s
        self.asks = {a.name: a for a in actor_asks(config)}
        self.local = InProcess()
        """Builds what runs in this process: the stages with ``stages_in_engine``, lookup drafters."""
        self.stage_slots: list[ActorSlot] = []
        self.drafter_slots: list[ActorSlot] = []

    def target(self, config: EngineConfig, checkpoint: Checkpoint) -> StartedTarget:
        if self.stages_in_process:
            return self.local.target(config, checkpoint)
        self.stage_slots = stage_slots(config, self.namespace)
        return StartedTarget(RayTargetClient(self.stage_slots, deadline_s=config.cluster.stage_deadline_s))

    def drafters(self, config: EngineConfig, checkpoint: Checkpoint, target: StartedTarget,
                 tokenizer: Any) -> list[DrafterClient]:
        """A feature head drafts beside the last stage, which computes its features (in its
        actor, ``runtime.actors.StageHost``, or here with the stages); drafters of
        ``cluster.drafters_in_engine`` kinds run here; every other drafter gets an actor, named
        ``cosine_ray:drafter:<i>`` by its place in the drafter list."""
        deadline_s = config.runtime.drafter_deadline_s

        def client(i: int, spec: DrafterSpec) -> DrafterClient:
            if spec.kind == "head" and not self.stages_in_process:
                return RayDrafterClient(self.stage_slots[-1], spec.name, deadline_s=deadline_s,
                                        method_prefix=HEAD_METHOD_PREFIX)
            if spec.kind == "head" or spec.kind in config.cluster.drafters_in_engine:
                return self.local.drafter(spec, config, checkpoint, target, tokenizer)
            options = {**actor_options("drafter", i, config), "namespace": self.namespace}
            slot = ActorSlot(actor_name("drafter", i), lambda: DrafterActor.options(**options).remote(config, spec),
                             namespace=self.namespace)
            self.drafter_slots.append(slot)
            return RayDrafterClient(slot, spec.name, deadline_s=deadline_s, learns=spec.learns)

        return [client(i, spec) for i, spec in enumerate(config.drafters)]

    async def ready(self) -> None:
        await self.await_up(self.stage_slots, self.ready_timeout_s, required=True)

    async def await_drafters(self, timeout_s: float) -> None:
        """Until the drafter actors answer; one not up within ``timeout_s`` joins when it is."""
        await self.await_up(self.drafter_slots, timeout_s, required=False)

    async def await_up(self, slots: Sequence[ActorSlot], timeout_s: float, *, required: bool) -> None:
        """Until every slot's actor answers a ping: a stage not up within ``timeout_s`` fails the
        engine's start, a drafter is left to join later. Pending ones are named every
        ``PENDING_REPORT_S`` with what they ask and what the cluster has free."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = {s.name: asyncio.ensure_future(await_ref(s.handle.ping.remote(), timeout_s)) for s in slots}
        while pending:
            await asyncio.wait(pending.values(), timeout=min(PENDING_REPORT_S, max(0.1, deadline - loop.time())))
            for name, fut in list(pending.items()):
                if fut.done():
                    del pending[name]
                    if fut.exception() is not None and required:
                        raise RuntimeError(f"{name} did not start: {type(fut.exception()).__name__}: "
                                           f"{fut.exception()}") from fut.exception()
                    if fut.exception() is not None:
                        log.warning("drafter %s not up (%r); serving without it until it is", name, fut.exception())
            if pending:
                free = describe(public(await asyncio.to_thread(ray.available_resources)))
                log.warning("waiting for %s: %s; free in the cluster now: %s", ", ".join(pending),
                            "; ".join(f"{n} asks {describe(self.asks[n].resources)}" for n in pending
                                      if n in self.asks), free)

