"""The engine as a Ray Serve deployment: the request pool and step loop, owner of the stages
and drafters (the Ray Serve LLM pattern: ``LLMServer`` bound into the OpenAI ingress).

``serve.app.build_app`` deploys ``EngineServer`` and binds its handle into the ingress, so
Serve starts it, health-checks it (``check_health``), restarts it when it dies, and replaces
it when the application's config changes (a ``serve deploy`` with other engine settings
starts a new engine and drains the old one). The stage and drafter actors are created by the
engine replica and owned by it: they die with it (Ray's ownership fate-sharing), so a
replaced or restarted engine never leaves stages behind. With ``cluster.stages_in_engine`` the
replica builds the stages itself and runs them in its own process (``local_target``).

Actor names: ``cosine_ray:stage:<i>`` and ``cosine_ray:drafter:<i>`` in the engine's own
namespace ``cosine_ray.<engine id>`` (``describe()["namespace"]``). During a rolling update
the old and the new engine run side by side for a moment, each with its own set.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, AsyncIterator, Sequence

import ray
import torch

from cosine_ray.engine.build import build_head, build_target, eos_token_ids, head_spec, make_drafter_worker
from cosine_ray.engine.components import cosine_components
from cosine_ray.engine.config import DrafterSpec, EngineConfig, config_from_dict, step_config_for
from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.worker.target import LocalTargetClient
from cosine_ray.engine.owners.constraints import TokenizerLoader
from cosine_ray.engine.owners.drafting import LocalDrafterClient
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.models.native import load_weights
from cosine_ray.runtime.actors import HEAD_METHOD_PREFIX, DrafterActor, StageActor
from cosine_ray.runtime.clients import ActorSlot, RayDrafterClient, RayTargetClient, await_ref
from cosine_ray.runtime.cluster import NAMESPACE, actor_name
from cosine_ray.runtime.engine_client import ACCEPTED, coalesced, with_heartbeats
from cosine_ray.runtime.memory import drop_file_pages, malloc_in_use_mib, start_heap_trimmer
from cosine_ray.runtime.metrics_scrape import StageUtilisationReader, collect_drafter_restarts
from cosine_ray.runtime.placement import (ActorAsk, actor_asks, actor_options, check_placement, cluster_nodes,
                                          describe, public, without_drafters)

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
"""Longest wait for the stages to load (a first start converts the model)."""
DRAFTER_READY_S = 60.0
"""Longest wait for the drafter actors once the stages are up: a drafter never blocks serving
(one that comes up later joins the drafting then)."""
PENDING_REPORT_S = 30.0
"""While actors are not up yet, say every this often which, what they ask and what is free."""


def stage_slots(config: EngineConfig, namespace: str) -> list[ActorSlot]:
    """One ``StageActor`` per pipeline stage, named ``cosine_ray:stage:<i>`` in ``namespace``
    (the engine's own; benchmarks and tests that build an ``EngineCore`` over stage actors
    without Serve pass a fresh one)."""
    def spawn(i: int):
        options = {**actor_options("stage", i, config), "namespace": namespace}
        return lambda: StageActor.options(**options).remote(config, i)

    return [ActorSlot(actor_name("stage", i), spawn(i), namespace=namespace) for i in range(config.num_stages)]


def drafter_clients(config: EngineConfig, stages: Sequence[ActorSlot], namespace: str, *,
                    head: DrafterWorker | None = None) -> list[LocalDrafterClient | RayDrafterClient]:
    """One client per drafter of ``config``: a feature head drafts beside the last stage, which
    computes its features: in its actor (``runtime.actors.StageHost``), or here as ``head``
    when the stages run in this process; lookup drafters run in this process
    (``cluster.drafters_in_engine``); the others get an actor each, named
    ``cosine_ray:drafter:<i>`` by their place in the drafter list."""
    deadline_s = config.step.drafter_deadline_s

    def client(i: int, spec: DrafterSpec) -> LocalDrafterClient | RayDrafterClient:
        if spec.kind == "head" and head is not None:
            return LocalDrafterClient(head)
        if spec.kind == "head":
            return RayDrafterClient(stages[-1], spec.name, deadline_s=deadline_s, method_prefix=HEAD_METHOD_PREFIX)
        if spec.kind in config.cluster.drafters_in_engine:
            return LocalDrafterClient(make_drafter_worker(spec, config))
        options = {**actor_options("drafter", i, config), "namespace": namespace}
        slot = ActorSlot(actor_name("drafter", i), lambda: DrafterActor.options(**options).remote(config, spec),
                         namespace=namespace)
        return RayDrafterClient(slot, spec.name, deadline_s=deadline_s, learns=spec.learns)

    return [client(i, spec) for i, spec in enumerate(config.drafters)]


def tokenizer_eos_id(path: Path) -> int | None:
    """The tokenizer's end-of-sequence id as its files state it (``eos_token`` of
    tokenizer_config.json or special_tokens_map.json, looked up in tokenizer.json's added
    tokens, then its vocabulary); None when they do not say."""
    def read(name: str) -> Any:
        try:
            return json.loads((path / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    token = next((t for cfg in (read("tokenizer_config.json"), read("special_tokens_map.json"))
                  if isinstance(cfg, dict) and (t := cfg.get("eos_token"))), None)
    token = token.get("content") if isinstance(token, dict) else token
    spec = read("tokenizer.json")
    if not isinstance(token, str) or not isinstance(spec, dict):
        return None
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (spec.get("model") or {}).get("vocab")
    found = vocab.get(token) if isinstance(vocab, dict) else None
    return found if isinstance(found, int) else None


def eos_source(checkpoint: Any) -> Any:
    """What ``engine.build.eos_token_ids`` reads the tokenizer's EOS from: the id its files state
    (the engine needs nothing else of the tokenizer, which holds ~100 MB once loaded), else the
    loaded tokenizer; None without tokenizer files."""
    if not checkpoint.has_tokenizer:
        return None
    eos = tokenizer_eos_id(Path(checkpoint.path))
    return SimpleNamespace(eos_token_id=eos) if eos is not None else checkpoint.load_tokenizer()


def local_target(config: EngineConfig, checkpoint: Any,
                 step_config: Any) -> tuple[LocalTargetClient, DrafterWorker | None]:
    """``cluster.stages_in_engine``: every stage built in this process (``engine.build.build_target``),
    and the feature head that drafts from the last stage's features (None without one)."""
    state = load_weights(checkpoint, config.weights, device=config.device, dtype=config.dtype)
    worker, features = build_target(config, checkpoint, state)
    worker.capture_graphs(step_config)  # CUDA: before the first request
    spec = head_spec(config)
    head = build_head(spec, config, checkpoint, state, features) if spec is not None else None
    del state
    drop_file_pages()  # checkpoint pages read only to build fused copies, as in a stage actor
    return LocalTargetClient(worker), head


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
        self.config = config
        self.engine_id = uuid.uuid4().hex[:8]
        self.namespace = f"{NAMESPACE}.{self.engine_id}"
        checkpoint = resolve_checkpoint(config.model)
        self.model_name = checkpoint.name
        self.vocab_size = checkpoint.config.vocab_size

        step_config = step_config_for(config, checkpoint)
        head = None
        if config.cluster.stages_in_engine:
            # the threads the stage actors would have had together; set on this loop's thread,
            # which runs the forwards (a thread's OpenMP setting is its own)
            torch.set_num_threads(config.num_threads or config.cluster.threads_per_actor * config.num_stages)
            # before the stages: a missing latency profile is measured on a model of its own,
            # which on CUDA must not find the stages' KV pools holding the device's memory
            components = cosine_components(config, checkpoint, run_profile_if_missing=True)
            self.stage_slots: list[ActorSlot] = []
            self.target, head = local_target(config, checkpoint, step_config)  # nothing is served before
        else:
            self.stage_slots = stage_slots(config, self.namespace)
            self.target = RayTargetClient(self.stage_slots, deadline_s=config.cluster.stage_deadline_s)
        drafters = drafter_clients(config, self.stage_slots, self.namespace, head=head)
        self.local_drafters = [d for d in drafters if isinstance(d, LocalDrafterClient)]
        self.actor_drafters = [d for d in drafters if isinstance(d, RayDrafterClient) and not d.method_prefix]
        self.drafter_slots = [d.slot for d in self.actor_drafters]
        self.max_model_len = step_config.max_model_len
        if not config.cluster.stages_in_engine:  # while the stage and drafter actors load
            components = cosine_components(config, checkpoint, run_profile_if_missing=True)
        asks = {a.name: a for a in actor_asks(config)}
        await self._await_up(self.stage_slots, asks, ready_timeout_s, required=True)
        # the tokenizer (~100 MB) is loaded only when a request first asks for a grammar
        tokenizer = TokenizerLoader(checkpoint.load_tokenizer) if checkpoint.has_tokenizer else None
        self.core = EngineCore(step_config, self.target, drafters, vocab_size=self.vocab_size,
                               eos_token_ids=eos_token_ids(checkpoint, eos_source(checkpoint)),
                               kv_num_blocks=await self.target.kv_capacity(),
                               tokenizer=tokenizer, **components)
        self.loop = EngineLoop(self.core)
        self._stage_reader = StageUtilisationReader(self.core.exporter, self.stage_slots)
        self._heap_trimmer = start_heap_trimmer()  # runtime/memory.py: RSS that tracks what is held
        await self._await_up(self.drafter_slots, asks, min(ready_timeout_s, DRAFTER_READY_S), required=False)

    async def _await_up(self, slots: Sequence[ActorSlot], asks: dict[str, ActorAsk], timeout_s: float, *,
                        required: bool) -> None:
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
                            "; ".join(f"{n} asks {describe(asks[n].resources)}" for n in pending if n in asks), free)

    # ---- Serve hooks --------------------------------------------------------------------------
    async def check_health(self) -> None:
        """Serve's health check: fails (and Serve restarts this engine with fresh stages) only
        when a lost stage did not come back within ``stage_recovery_s``; a stage being
        restarted is a recovering engine, not a dead one (``/health`` says so)."""
        if self.core.target.failed:
            raise RuntimeError("a pipeline stage was lost and did not come back")

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str, every_s: float = 0.0) -> AsyncIterator[RequestOutput | str]:
        """``ACCEPTED``, then the request's outputs, merged to one every ``every_s`` seconds at
        most (``coalesced``), with ``ALIVE`` after each ``HEARTBEAT_S`` without one
        (``RayEngineClient.stream``); a cancelled stream (client gone) aborts it."""
        yield ACCEPTED  # RayEngineClient.stream: a call that reached no live replica ends in seconds
        # closed here, not left to the collector: Serve may cancel this generator at its yield
        outputs = coalesced(self.loop.generate(prompt_token_ids, params, request_id), every_s)
        async with contextlib.aclosing(with_heartbeats(outputs)) as outs:
            async for out in outs:
                yield out

    async def abort(self, request_id: str) -> bool:
        """``EngineLoop.abort``: the ingress's explicit abort after closing a stream early."""
        return self.loop.abort(request_id)

    async def finish(self, request_id: str) -> bool:
        """The ingress ends a streaming request as a normal completion (a stop string): its
        stream's cancellation, which follows, counts as ``stop`` (``EngineLoop.finish``)."""
        return self.loop.finish(request_id)

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> str | None:
        """None if servable, else the reason (ValueError message)."""
        try:
            self.core.check_request(prompt_token_ids, params)
        except ValueError as exc:
            return str(exc)
        return None

    # ---- status and metrics ------------------------------------------------------------------------
    async def describe(self) -> dict[str, Any]:
        return {"model": self.model_name, "max_model_len": self.max_model_len, "vocab_size": self.vocab_size,
                "engine_id": self.engine_id, "namespace": self.namespace,
                "stages": [s.name for s in self.stage_slots], "drafters": [d.name for d in self.core.drafters],
                "config": {"num_stages": self.config.num_stages,
                           "num_speculative_tokens": self.config.step.num_speculative_tokens,
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
