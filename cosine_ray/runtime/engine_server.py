"""The engine as a Ray Serve deployment: the request pool and step loop, owner of the stages
and drafters (the Ray Serve LLM pattern: ``LLMServer`` bound into the OpenAI ingress).

``serve.app.build_app`` deploys ``EngineServer`` and binds its handle into the ingress, so
Serve starts it, health-checks it (``check_health``), restarts it when it dies, and replaces
it when the application's config changes (a ``serve deploy`` with other engine settings
starts a new engine and drains the old one). The engine is built by
``engine.backend.build_engine`` on ``runtime.backend.ActorBackend``: the stage and drafter
actors are created by the engine replica and owned by it, so they die with it (Ray's ownership
fate-sharing) and a replaced or restarted engine never leaves stages behind. With
``cluster.stages_in_engine`` the replica builds the stages itself and runs them in its own process.

Actor names: ``cosine_ray:stage:<i>`` and ``cosine_ray:drafter:<i>`` in the engine's own
namespace ``cosine_ray.<engine id>`` (``describe()["namespace"]``): during a rolling update
the old and the new engine run side by side for a moment, and with ``cluster.engine_replicas``
several replicas run at once, each with its own set (stages and drafters are per replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import time
import uuid
from typing import Any, AsyncIterator, Sequence

import torch

from cosine_ray.engine.backend import build_engine
from cosine_ray.engine.config import config_from_dict
from cosine_ray.engine.drafters.prediction import PREDICTION
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import NO_TENANT, RequestOutput, RequestRefused, SamplingParams, Tenant
from cosine_ray.engine.worker.clients import LocalDrafterClient, LocalTargetClient
from cosine_ray.metrics.console import StatsLine
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.runtime.backend import READY_TIMEOUT_S, ActorBackend
from cosine_ray.runtime.clients import RayDrafterClient, await_ref
from cosine_ray.runtime.cluster import NAMESPACE
from cosine_ray.runtime.engine_client import Accepted, coalesced, with_heartbeats
from cosine_ray.runtime.memory import drop_file_pages, malloc_in_use_mib, start_heap_trimmer
from cosine_ray.runtime.metrics_scrape import StageUtilisationReader, collect_drafter_restarts
from cosine_ray.runtime.placement import check_placement, cluster_nodes, without_drafters

log = logging.getLogger(__name__)
STATS_LOG = logging.getLogger("ray.serve")
"""Serve's logger in a replica: its format, level (``logging_config``) and files."""

DRAFTER_READY_S = 60.0
"""Longest wait for the drafter actors once the stages are up: a drafter never blocks serving
(one that comes up later joins the drafting then)."""


class EngineServer:
    async def __init__(self, config_data: dict[str, Any], ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        torch.set_num_threads(1)
        config = config_from_dict(config_data)
        # an actor no node can ever host would wait in Ray's queue forever: a stage is an error
        # that says so, a drafter is left out (runtime/placement.py)
        unplaceable = check_placement(config, await asyncio.to_thread(cluster_nodes))
        for ask, why in unplaceable:
            log.warning("serving without %s: %s", ask.what, why)
        config = without_drafters(config, [ask.drafter_index for ask, _ in unplaceable])
        self.engine_id = uuid.uuid4().hex[:8]
        self.replica = _replica_id() or self.engine_id
        """Serve's id of this replica (``serve.get_replica_context``): what the router and the
        ingress name it by (``Accepted``, the ``x-cosine-ray-engine-replica`` header)."""
        self.namespace = f"{NAMESPACE}.{self.engine_id}"
        checkpoint = resolve_checkpoint(config.model, **config.checkpoint_args)
        if config.cluster.stages_in_engine:
            # the threads the stage actors would have had together; set on this loop's thread,
            # which runs the forwards (a thread's OpenMP setting is its own)
            torch.set_num_threads(config.num_threads or config.cluster.threads_per_actor * config.num_stages)
        self.backend = ActorBackend(config, self.namespace, ready_timeout_s=ready_timeout_s)
        # nothing is served before the stages are up; the EOS id is read from the tokenizer's
        # files, and the tokenizer (~100 MB) loaded only when a request first asks for a grammar
        self.core = await build_engine(config, self.backend, checkpoint=checkpoint, profile_if_missing=True)
        if config.cluster.stages_in_engine:
            drop_file_pages()  # checkpoint pages read only to build fused copies, as in a stage actor
        self.config = self.core.config
        self.model_name = checkpoint.name
        self.vocab_size = checkpoint.config.vocab_size
        self.max_model_len = self.config.scheduler.max_model_len
        self.target = self.core.target.inner
        self.stage_slots = self.backend.stage_slots
        self.drafter_slots = self.backend.drafter_slots
        self.local_drafters = [d for d in self.core.drafters if isinstance(d, LocalDrafterClient)]
        self.actor_drafters = [d for d in self.core.drafters if isinstance(d, RayDrafterClient) and not d.method_prefix]
        self.loop = EngineLoop(self.core)
        self._stage_reader = StageUtilisationReader(self.core.exporter, self.stage_slots)
        self._heap_trimmer = start_heap_trimmer()  # runtime/memory.py: RSS that tracks what is held
        interval = self.config.runtime.log_stats_interval_s
        self._stats_logger = asyncio.create_task(self._log_stats(interval)) if interval > 0 else None
        await self.backend.await_drafters(min(ready_timeout_s, DRAFTER_READY_S))

    async def _log_stats(self, every_s: float) -> None:
        """One console line every ``every_s`` seconds while there is work (``metrics.console``),
        through Serve's logger: the replica's log file, and the console of ``cosine-ray serve``."""
        line = StatsLine.start(self.loop.metrics_snapshot(), time.monotonic())
        while True:
            await asyncio.sleep(every_s)
            try:
                text = line.update(self.loop.metrics_snapshot(), time.monotonic())
            except Exception:  # a figure that cannot be read must not end the logging
                log.warning("the stats line failed", exc_info=True)
                continue
            if text:
                STATS_LOG.info(text)

    # ---- Serve hooks --------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve's health check: fails (and Serve restarts this engine with fresh stages) only
        when a lost stage did not come back within ``stage_recovery_s``; a stage being
        restarted is a recovering engine, not a dead one (``/health`` says so)."""
        if self.core.target.failed:
            raise RuntimeError("a pipeline stage was lost and did not come back")

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str, every_s: float = 0.0, tenant: Tenant = NO_TENANT,
                       resume_token_ids: Sequence[int] = ()) -> AsyncIterator[RequestOutput | Accepted | str]:
        """``Accepted`` (this replica's id), then the request's outputs, merged to one every
        ``every_s`` seconds at most (``coalesced``), with ``ALIVE`` after each ``HEARTBEAT_S``
        without one (``RayEngineClient.stream``); a cancelled stream (client gone) aborts it.
        ``tenant``: whose request it is (the scheduler's fair share); ``resume_token_ids``: the
        tokens it already produced on a replica that died (``EngineCore.add_request``)."""
        yield Accepted(self.replica)  # RayEngineClient.stream: a call that reached no live replica ends in seconds
        # closed here, not left to the collector: Serve may cancel this generator at its yield
        outputs = coalesced(self.loop.generate(prompt_token_ids, params, request_id, tenant, resume_token_ids),
                            every_s)
        async with contextlib.aclosing(with_heartbeats(outputs)) as outs:
            async for out in outs:
                yield out

    async def abort(self, request_id: str, engine_replica: str | None = None) -> bool:
        """``EngineLoop.abort``: the ingress's explicit abort after closing a stream early
        (``engine_replica``: the replica it is meant for, read by the router alone)."""
        return self.loop.abort(request_id)

    async def finish(self, request_id: str, engine_replica: str | None = None) -> bool:
        """The ingress ends a streaming request as a normal completion (a stop string): its
        stream's cancellation, which follows, counts as ``stop`` (``EngineLoop.finish``);
        ``engine_replica`` as in ``abort``."""
        return self.loop.finish(request_id)

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> RequestRefused | None:
        """None if servable, else why not (``RequestRefused``: the field and the reason). A
        grammar is compiled off the event loop, once per spec (``EngineCore.prepare_request``)."""
        try:
            await self.core.prepare_request(prompt_token_ids, params)
        except ValueError as exc:
            return exc if isinstance(exc, RequestRefused) else RequestRefused(str(exc))
        return None

    # ---- status and metrics ------------------------------------------------------------------------
    async def describe(self) -> dict[str, Any]:
        return {"model": self.model_name, "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "engine_id": self.engine_id, "replica": self.replica, "namespace": self.namespace,
                "stages": [s.name for s in self.stage_slots],
                "drafters": [d.name for d in self.core.drafters if d.name != PREDICTION],  # the configured ones
                "prediction_drafter": self.core.prediction is not None,
                "config": {"num_stages": self.config.num_stages,
                           "num_speculative_tokens": self.config.speculation.num_speculative_tokens,
                           "stages_in_engine": self.config.cluster.stages_in_engine}}

    async def health(self) -> dict[str, Any]:
        status = {"status": "ok", "running": len(self.core.running), "waiting": len(self.core.waiting)}
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
            "running": len(self.core.running), "waiting": len(self.core.waiting),
            "streams": self.loop.num_streams, "to_release": self.core.pool.num_to_release,
            "kv": await self.target.kv_usage(),
            "drafters": {**{s.name: (d if isinstance(d, dict) else {"error": type(d).__name__})
                            for s, d in zip(self.drafter_slots, drafter_state)},
                         **{f"engine:{c.name}": c.worker.state_size() for c in self.local_drafters}},
            "drafter_failures": self.core.exporter.drafter_failures(),
            "respawns": {s.name: s.num_respawns for s in self.stage_slots + self.drafter_slots},
        }

    async def metrics_snapshot(self, http: tuple[str, dict] | None = None) -> dict[str, Any]:
        """The deployment's one metrics registry (single exporter), with the figures counted
        elsewhere read now: drafter respawns, and stage busy/idle (a background read the
        scrape waits for briefly; see runtime/metrics_scrape.py), and the calling ingress
        replica's HTTP counts ``http`` = (replica id, cumulative totals)."""
        if http is not None:
            self.core.metrics.add_http_totals(*http)
        if isinstance(self.target, LocalTargetClient):  # stages in this process: read them now
            for index, stage in enumerate(self.target.worker.stages):
                self.core.exporter.stage_utilisation(index, *stage.utilisation(), self.engine_id)
        else:
            await self._stage_reader.refresh()
        collect_drafter_restarts(self.core.exporter, self.drafter_slots, [d.name for d in self.actor_drafters])
        return self.loop.metrics_snapshot()

    async def record_http(self, replica: str, totals: dict) -> None:
        """Cumulative HTTP counts of one ingress replica (every replica pushes here)."""
        self.core.metrics.add_http_totals(replica, totals)

    async def actor_pids(self, timeout_s: float = 5.0) -> dict[str, int]:
        """PID of this engine and of every stage and drafter that answers within ``timeout_s``
        (soak tests read each one's resident memory from /proc)."""
        slots = self.stage_slots + self.drafter_slots
        pids = await asyncio.gather(*(await_ref(s.handle.pid.remote(), timeout_s) for s in slots),
                                    return_exceptions=True)
        return {"engine": os.getpid(), **{s.name: p for s, p in zip(slots, pids) if isinstance(p, int)}}

    async def memory_stats(self) -> dict[str, float]:
        """What a leak in this process would grow (the soak test reads it): objects the
        garbage collector tracks, and bytes in use in glibc's heap (``mallinfo2``; absent on
        other C libraries). RSS alone also counts freed pages the allocator keeps."""
        gc.collect()
        out: dict[str, float] = {"python_objects": len(gc.get_objects())}
        in_use = malloc_in_use_mib()
        if in_use is not None:
            out["malloc_in_use_mib"] = in_use
        return out

    async def actor_handles(self) -> dict[str, Any]:
        return {s.name: s.handle for s in self.stage_slots + self.drafter_slots}


def _replica_id() -> str | None:
    """Serve's unique id of the replica this runs in, or None outside a Serve replica."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not in a replica (a test builds the server directly)
        return None
