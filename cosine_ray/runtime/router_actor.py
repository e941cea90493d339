"""The router actor: owns the request pool and the step loop; creates the stages and drafters.

Ownership (reliability guide): the router is a named, *detached* actor
(``cosine_ray:router:0``) that the Serve ingress gets or creates, so replacing an ingress
replica never kills in-flight generation. Stage and drafter actors are owned by the router
and die with it; a restarted router (``max_restarts``) builds a fresh set.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from typing import Any, AsyncIterator, Sequence

import ray
import torch

from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.local import cosine_components, eos_token_ids, make_drafter, router_config_for
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.engine.router import Router
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.engine.speculation import LocalDrafterClient
from cosine_ray.runtime.actors import DrafterActor, StageActor, drafter_state_size
from cosine_ray.runtime.clients import ActorSlot, RayDrafterClient, RayTargetClient, await_ref
from cosine_ray.runtime.memory import malloc_in_use_bytes, start_heap_trimmer
from cosine_ray.runtime.metrics_scrape import StageUtilisationReader, collect_drafter_restarts
from cosine_ray.runtime.cluster import NAMESPACE, actor_name
from cosine_ray.runtime.placement import actor_options

log = logging.getLogger(__name__)

ROUTER_NAME = actor_name("router", 0)


class RouterHost:
    def __init__(self, config: EngineConfig) -> None:
        torch.set_num_threads(1)
        self.config = config
        checkpoint = resolve_checkpoint(config.model)
        tokenizer = checkpoint.load_tokenizer() if checkpoint.has_tokenizer else None
        self.model_name = checkpoint.name
        self.vocab_size = checkpoint.config.vocab_size

        def spawner(role: str, index: int, cls: Any, *args: Any):
            return lambda: cls.options(**actor_options(role, index, config)).remote(config, *args)

        self.stage_slots = [ActorSlot(actor_name("stage", i), spawner("stage", i, StageActor, i))
                            for i in range(config.num_stages)]
        # Lookup drafters run here (cluster.drafters_in_router); the others get an actor each,
        # named by their place in the drafter list.
        drafters: list[LocalDrafterClient | RayDrafterClient] = [
            LocalDrafterClient(make_drafter(spec, config)) if spec.kind in config.cluster.drafters_in_router else
            RayDrafterClient(ActorSlot(actor_name("drafter", i), spawner("drafter", i, DrafterActor, spec)),
                             spec.name, deadline_s=config.router.drafter_deadline_s)
            for i, spec in enumerate(config.drafters)]
        self.local_drafters = [d for d in drafters if isinstance(d, LocalDrafterClient)]
        self.actor_drafters = [d for d in drafters if isinstance(d, RayDrafterClient)]
        self.drafter_slots = [d.slot for d in self.actor_drafters]
        self.target = RayTargetClient(self.stage_slots, deadline_s=config.cluster.stage_deadline_s)
        router_config = router_config_for(config, checkpoint)
        self.max_model_len = router_config.max_model_len
        self.router = Router(router_config, self.target, drafters, vocab_size=self.vocab_size,
                             eos_token_ids=eos_token_ids(checkpoint, tokenizer),
                             **cosine_components(config, checkpoint, run_profile_if_missing=True))
        self.loop = EngineLoop(self.router)
        self._heap_trimmer = start_heap_trimmer()  # runtime/memory.py: RSS that tracks what is held

    async def ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        """Wait until every stage and drafter has loaded (first start loads the weights)."""
        slots = self.stage_slots + self.drafter_slots
        await asyncio.gather(*(await_ref(s.handle.ping.remote(), timeout_s) for s in slots))
        return await self.describe()

    async def describe(self) -> dict[str, Any]:
        return {"model": self.model_name, "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "stages": [s.name for s in self.stage_slots], "drafters": [d.name for d in self.router.drafters]}

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        async for out in self.loop.generate(prompt_token_ids, params, request_id):
            yield out

    async def abort(self, request_id: str) -> bool:
        return self.router.abort(request_id)

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> str | None:
        """None if servable, else the reason (ValueError message)."""
        try:
            self.router.check_request(prompt_token_ids, params)
        except ValueError as exc:
            return str(exc)
        return None

    async def health(self) -> dict[str, Any]:
        status = {"status": "ok", "running": len(self.router.running), "waiting": len(self.router.waiting)}
        try:
            await asyncio.gather(*(await_ref(s.handle.ping.remote(), 5.0) for s in self.stage_slots))
        except Exception as exc:  # a stage is down or restarting
            status.update(status="recovering", error=f"{type(exc).__name__}")
        return status

    async def stats(self) -> dict[str, Any]:
        """State held per request across the cluster (tests check nothing leaks)."""
        drafter_state = await asyncio.gather(*(await_ref(s.handle.state_size.remote(), 5.0)
                                               for s in self.drafter_slots), return_exceptions=True)
        return {
            "running": len(self.router.running), "waiting": len(self.router.waiting),
            "streams": self.loop.num_streams, "to_release": len(self.router._to_release),
            "kv": await self.target.kv_usage(),
            "drafters": {**{s.name: (d if isinstance(d, dict) else {"error": type(d).__name__})
                            for s, d in zip(self.drafter_slots, drafter_state)},
                         **{f"router:{c.name}": drafter_state_size(c.drafter) for c in self.local_drafters}},
            "drafter_failures": dict(self.router.speculation_stats.failures),
            "respawns": {s.name: s.num_respawns for s in self.stage_slots + self.drafter_slots},
        }

    async def metrics_snapshot(self, http: tuple[str, dict] | None = None) -> dict[str, Any]:
        """The deployment's one metrics registry (single exporter), with the figures counted
        elsewhere read now: drafter respawns, and stage busy/idle (a background read the
        scrape waits for briefly; see runtime/metrics_scrape.py), and the calling ingress
        replica's HTTP counts ``http`` = (replica id, cumulative totals)."""
        if http is not None:
            self.router.metrics.add_http_totals(*http)
        if getattr(self, "_stage_reader", None) is None:  # made on first scrape (no state before)
            self._stage_reader = StageUtilisationReader(self.router.metrics, self.stage_slots)
        await self._stage_reader.refresh()
        collect_drafter_restarts(self.router.metrics, self.drafter_slots, [d.name for d in self.actor_drafters])
        return self.loop.metrics_snapshot()

    async def record_http(self, replica: str, totals: dict) -> None:
        """Cumulative HTTP counts of one ingress replica (every replica pushes here)."""
        self.router.metrics.add_http_totals(replica, totals)

    async def actor_pids(self, timeout_s: float = 5.0) -> dict[str, int]:
        """PID of this router and of every stage and drafter that answers within ``timeout_s``
        (soak tests read each one's resident memory from /proc)."""
        slots = self.stage_slots + self.drafter_slots
        pids = await asyncio.gather(*(await_ref(s.handle.pid.remote(), timeout_s) for s in slots),
                                    return_exceptions=True)
        return {ROUTER_NAME: os.getpid(), **{s.name: p for s, p in zip(slots, pids) if isinstance(p, int)}}

    async def memory_stats(self) -> dict[str, float]:
        """What a leak in this process would grow (the soak test reads it): objects the
        garbage collector tracks, and bytes in use in glibc's heap (``mallinfo2``; absent on
        other C libraries). RSS alone also counts freed pages the allocator keeps."""
        gc.collect()
        out: dict[str, float] = {"python_objects": len(gc.get_objects())}
        in_use = malloc_in_use_bytes()
        if in_use is not None:
            out["malloc_in_use_mib"] = in_use / 2**20
        return out

    async def actor_handles(self) -> dict[str, Any]:
        return {s.name: s.handle for s in self.stage_slots + self.drafter_slots}

    async def shutdown(self) -> None:
        await self.loop.shutdown()
        for slot in self.stage_slots + self.drafter_slots:
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:
                pass


RouterActor = ray.remote(RouterHost)


def get_or_create_router(config: EngineConfig, *, fresh: bool = False, ready_timeout_s: float = 900.0):
    """The detached router actor (created if absent, or replaced when ``fresh``); waits until
    its stages and drafters are loaded."""
    if fresh:
        kill_router()
    handle = RouterActor.options(name=ROUTER_NAME, namespace=NAMESPACE, lifetime="detached",
                                 get_if_exists=True, max_restarts=-1, max_task_retries=0,
                                 num_cpus=0, max_concurrency=1000).remote(config)
    ray.get(handle.ready.remote(ready_timeout_s), timeout=ready_timeout_s)  # sync caller only
    return handle


def kill_router() -> None:
    try:
        handle = ray.get_actor(ROUTER_NAME, namespace=NAMESPACE)
    except ValueError:
        return
    try:
        ray.get(handle.shutdown.remote(), timeout=30)
    except Exception:
        pass
    ray.kill(handle, no_restart=True)
