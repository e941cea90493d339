"""Run a scenario: the real engine on the virtual clock, clients from cosine-loadgen's arrivals.

``simulate(scenario)`` builds the simulated deployment (``sim.world``), an ``EngineCore`` with
the scenario's ``engine`` config and the engine's real scheduler, routing, fusion, tree selection,
verifier, learner and ``EngineLoop``, and one client task per request that arrives at its
offset (``loadgen.arrivals``: rates, burstiness, the CoSine low/high/fluctuating modes), waits
for a concurrency slot when ``max_concurrency`` is set, streams its tokens and records when
each came on the virtual clock. Every output is checked against the oracle: a simulated run
that is not lossless fails loudly instead of reporting figures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import SamplingParams
from cosine_ray.sim.clock import Link, Resource, run_virtual
from cosine_ray.sim.replicas import Fleet, ReplicaLost
from cosine_ray.sim.latency import drafter_cost, engine_model, target_cost
from cosine_ray.sim.scenario import ENGINE_DEVICE, Scenario, ScenarioError, engine_config, request_rate
from cosine_ray.sim.world import (Acceptance, DomainOfPrompt, DrafterModel, Oracle, SimDrafter, SimDrafterClient,
                                  SimStage, SimTarget, TargetShape, _mix)
from loadgen.arrivals import ArrivalConfig, arrival_offsets
from loadgen.workload import split_counts, spread_lengths

SIM_VOCAB = 4096
"""Vocabulary of the oracle's tokens (the engine's vocab in the simulation; transfer sizes use
the real target's ``target.vocab_size``)."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    domain: str
    input_len: int
    output_len: int
    arrival_s: float
    prefix_group: int | None = None
    """The shared prefix (system prompt) its prompt starts with (``workload.shared_prefix``)."""


@dataclass(slots=True)
class RequestResult:
    request: SimRequest
    start_s: float
    """When it got its concurrency slot and was sent (= arrival in open loop)."""
    ttft_s: float
    tpot_s: float
    e2e_s: float
    num_tokens: int
    accepted_length: float
    verify_steps: int
    routed_to: dict[str, int] = field(default_factory=dict)
    pipedec: tuple[int, int, int] = (0, 0, 0)
    """PipeDec timesteps, the tokens they committed, and the hits among them."""
    replica: int = 0
    """The engine replica that finished it."""
    prompt_tokens_sent: int = 0
    """Prompt tokens of all its sends (a resubmission sends the prompt and the tokens so far)."""
    cached_tokens: int = 0
    """Of those, the ones its replicas' prefix caches held."""


@dataclass(slots=True)
class SimResult:
    requests: list[RequestResult]
    makespan_s: float
    wall_s: float
    resources: dict[str, float]
    """Device/link name → busy seconds."""
    forwards: int
    drafter_calls: dict[str, int]
    decode: tuple[int, int, float] = (0, 0, 0.0)
    """Forwards without a prefill: (how many, tokens scored, stage seconds)."""
    replicas: int = 1
    resubmissions: int = 0
    """Sends of requests whose replica died under them (``sim.replicas``)."""

    def summary(self) -> dict[str, Any]:
        rs = self.requests
        tokens = sum(r.num_tokens for r in rs)
        steps = sum(r.verify_steps for r in rs)
        committed = sum(r.accepted_length * r.verify_steps for r in rs)  # accepted + bonus tokens
        tpots = [r.tpot_s for r in rs if r.num_tokens > 1]
        pipedec = [sum(r.pipedec[i] for r in rs) for i in range(3)]
        return {
            "requests": len(rs),
            "output_tokens": tokens,
            "makespan_s": self.makespan_s,
            "throughput_tok_s": tokens / self.makespan_s if self.makespan_s > 0 else 0.0,
            "ttft_mean_s": statistics.fmean(r.ttft_s for r in rs),
            "ttft_p99_s": float(np.percentile([r.ttft_s for r in rs], 99)),
            "tpot_mean_s": statistics.fmean(tpots) if tpots else 0.0,
            "e2e_mean_s": statistics.fmean(r.e2e_s for r in rs),
            "mean_accepted_length": committed / steps if steps else 0.0,
            # the engine's convention (RequestStats.mean_accepted_length): tokens committed per
            # verify step, bonus included; the first token of each request comes from its prefill
            "utilisation": {k: v / self.makespan_s for k, v in self.resources.items()} if self.makespan_s else {},
            "forwards": self.forwards,
            "decode_tokens_per_forward": self.decode[1] / self.decode[0] if self.decode[0] else 0.0,
            "decode_forward_ms": 1e3 * self.decode[2] / self.decode[0] if self.decode[0] else 0.0,
            "drafter_calls": self.drafter_calls,
            "pipedec_timesteps": pipedec[0],
            "pipedec_tokens_per_timestep": pipedec[1] / pipedec[0] if pipedec[0] else 0.0,
            "pipedec_hit_rate": pipedec[2] / pipedec[1] if pipedec[1] else 0.0,
            "wall_s": self.wall_s,
            "replicas": self.replicas,
            "resubmissions": self.resubmissions,
            "prefix_hit_rate": (sum(r.cached_tokens for r in rs) / sent) if (sent := sum(r.prompt_tokens_sent
                                                                                          for r in rs)) else 0.0,
            "served_share": [sum(r.replica == i for r in rs) / len(rs) for i in range(self.replicas)] if rs else [],
        }


def build_requests(scenario: Scenario) -> list[SimRequest]:
    """The workload's requests: the explicit list, or ``num_requests`` (or as many as arrive in
    ``duration_s``) with seeded lengths and a seeded domain order."""
    w = scenario.workload
    rng = np.random.default_rng(scenario.seed)
    if "requests" in w:
        requests = [SimRequest(f"r{i:06d}", r.get("domain", "default"), r["input_len"], r["output_len"],
                               float(r.get("arrival_s", 0.0))) for i, r in enumerate(w["requests"])]
    else:
        requests = _drawn_requests(w, rng)
    if w.get("shared_prefix"):  # drawn last: a scenario without it draws what it always drew
        groups = rng.integers(w["shared_prefix"]["groups"], size=len(requests))
        requests = [dataclasses.replace(r, prefix_group=int(g)) for r, g in zip(requests, groups)]
    return requests


def _drawn_requests(w: dict[str, Any], rng: np.random.Generator) -> list[SimRequest]:
    a = w.get("arrival", {})
    arrivals = ArrivalConfig(request_rate=request_rate(a.get("request_rate")), burstiness=a.get("burstiness", 1.0),
                             schedule=a.get("schedule", "constant"), low_fraction=a.get("low_fraction", 0.25),
                             period_s=a.get("period_s", 60.0))
    if "duration_s" in w:  # enough draws to cover the duration at the peak rate, then cut
        num = int(arrivals.request_rate * w["duration_s"] * 1.5) + 10
        offsets = arrival_offsets(num, arrivals, rng)
        offsets = offsets[offsets < w["duration_s"]]
    else:
        offsets = arrival_offsets(w["num_requests"], arrivals, rng)
    mix = w.get("domains") or {"default": 1.0}
    total = sum(mix.values()) or 1.0
    counts = split_counts(len(offsets), {d: v / total for d, v in mix.items() if v > 0})
    domains = [d for d, c in counts.items() for _ in range(c)]
    domains = [domains[i] for i in rng.permutation(len(domains))]
    if not len(offsets):
        raise ScenarioError("workload: no request arrives (duration_s too short for the rate?)")
    ratio = w.get("range_ratio", 0.0)
    ins = spread_lengths(w.get("input_len", 128), ratio, len(offsets), rng)
    outs = spread_lengths(w.get("output_len", 64), ratio, len(offsets), rng)
    return [SimRequest(f"r{i:06d}", d, int(n), int(m), float(t))
            for i, (d, n, m, t) in enumerate(zip(domains, ins, outs, offsets))]


class Deployment:
    """The simulated devices, links, target and drafters of a scenario."""

    def __init__(self, scenario: Scenario, domains: list[str]) -> None:
        data = scenario.data
        self.oracle = Oracle(SIM_VOCAB, scenario.seed)
        self.devices = {name: Resource(name) for name in dict.fromkeys([ENGINE_DEVICE, *data.get("devices", ())])}
        links = data.get("links", {})

        def link(key: str, name: str) -> Link:
            spec = links.get(key, {})
            return Link(name, bandwidth_bps=spec.get("bandwidth_mbps", math.inf) * 1e6,
                        latency_s=spec.get("latency_ms", 0.0) / 1e3)

        costs, profiles = {}, {}
        for name, spec in data["latency"].items():
            costs[name], prof = target_cost(spec, scenario.base_dir)
            if prof is not None:
                profiles[name] = prof
        stage_specs = data["stages"]
        num = len(stage_specs)
        self.links = [link("engine_stage", "link:engine->stage0"), link("engine_stage", "link:stage->engine")]
        self.links += [link("stage_stage", f"link:stage{i}->stage{i + 1}") for i in range(num - 1)]
        self.stages = [SimStage(self.devices[s["device"]], costs[s["latency"]], s.get("layers", 1.0 / num),
                                self.links[2 + i] if i < num - 1 else None) for i, s in enumerate(stage_specs)]
        t = data.get("target", {})
        shape = TargetShape(t.get("hidden_size", 576), t.get("vocab_size", 49152), t.get("activation_bytes", 4),
                            t.get("returns", "logits"))
        host = data.get("engine_host", {})
        self.host = self.devices[host.get("device", ENGINE_DEVICE)]
        self.target = SimTarget(self.oracle, self.stages, shape=shape, host=self.host,
                                step_overhead_s=host.get("step_overhead_ms", 0.0) / 1e3,
                                overhead_per_request_s=host.get("step_overhead_per_request_ms", 0.0) / 1e3,
                                link_in=self.links[0], link_back=self.links[1])
        self.drafters: list[SimDrafterClient] = []
        drafter_costs = {}
        for d in data.get("drafters", ()):
            cost = drafter_cost(d.get("latency"), d["name"], profiles)
            drafter_costs[d["name"]] = cost
            model = DrafterModel(d["name"], {dom: Acceptance(tuple(a["by_depth"]), a.get("coverage", 1.0))
                                             for dom, a in d["acceptance"].items()},
                                 cost, d.get("correlation", 0.5), d.get("sharpness", 0.3))
            device = d.get("device", ENGINE_DEVICE)
            lk = Link(f"link:{d['name']}") if device == host.get("device", ENGINE_DEVICE) else \
                link("engine_drafter", f"link:engine<->{d['name']}")
            self.links.append(lk)
            self.drafters.append(SimDrafterClient(SimDrafter(model, self.oracle), self.devices[device], lk))
        used = {s["latency"] for s in stage_specs}
        profile = profiles.get(used.pop()) if len(used) == 1 else None
        self.latency_model = engine_model([(s.cost, s.layers) for s in self.stages], drafter_costs, profile=profile)
        self.kv_bytes_per_token = int(t.get("kv_bytes_per_token", 0))
        self.classifier = DomainOfPrompt(domains)

    def busy(self) -> dict[str, float]:
        out = {f"device:{name}": r.busy_s for name, r in self.devices.items()}
        out.update({lk.name: lk.wire.busy_s for lk in self.links if lk.wire.busy_s})
        return out


async def _simulate(scenario: Scenario, requests: list[SimRequest]) -> SimResult:
    loop = asyncio.get_running_loop()
    clock = loop.time
    domains = sorted({r.domain for r in requests} | {"default"})

    def build(index: int) -> tuple[Deployment, EngineLoop]:
        world = Deployment(scenario, domains)
        core = EngineCore(engine_config(scenario.data), world.target, world.drafters, vocab_size=SIM_VOCAB,
                          clock=clock, domain_classifier=world.classifier, latency_model=world.latency_model,
                          kv_bytes_per_token=world.kv_bytes_per_token, seed=scenario.seed)
        return world, EngineLoop(core)

    fleet = Fleet(scenario, build)
    limit = scenario.workload.get("max_concurrency")
    slots = asyncio.Semaphore(limit) if limit else None
    results: list[RequestResult] = []
    shared = scenario.workload.get("shared_prefix") or {}

    async def client(req: SimRequest) -> None:
        await asyncio.sleep(max(0.0, req.arrival_s - clock()))
        if slots is not None:
            await slots.acquire()
        try:
            await run_one(req)
        finally:
            if slots is not None:
                slots.release()

    def prompt_of(req: SimRequest, world: Deployment) -> list[int]:
        key = world.oracle.key(req.request_id)
        head = [world.classifier.encode(req.domain)]
        if req.prefix_group is not None:  # a system prompt its group shares
            head += [_mix(0x5EED, req.prefix_group, i) % SIM_VOCAB for i in range(min(shared["tokens"], req.input_len - 1))]
        return head + [_mix(key, i, 7) % SIM_VOCAB for i in range(req.input_len - len(head))]

    async def run_one(req: SimRequest) -> None:
        start = clock()
        tokens: list[int] = []
        first = last = None
        steps = committed = cached = sent = 0
        routed: dict[str, int] = {}
        pipedec = [0, 0, 0]
        replica = None
        for attempt in range(fleet.max_attempts):
            replica = await fleet.choose(req.prefix_group)
            world = replica.world
            world.oracle.domains[req.request_id] = req.domain
            prompt = prompt_of(req, world) + tokens
            sent += len(prompt)
            stats = None
            try:
                async for out in fleet.stream(replica, req.request_id, prompt,
                                              SamplingParams(max_tokens=req.output_len - len(tokens))):
                    if out.new_token_ids:
                        last = clock()
                        first = last if first is None else first
                    tokens.extend(out.new_token_ids)
                    stats = out.stats or stats
                    if out.error:
                        raise RuntimeError(f"simulated request {req.request_id} failed: {out.error}")
            except ReplicaLost:
                if attempt + 1 == fleet.max_attempts:
                    raise RuntimeError(f"simulated request {req.request_id} lost its replica "
                                       f"{fleet.max_attempts} times") from None
                fleet.resubmissions += 1
                continue
            finally:
                if stats is not None:
                    steps += stats.num_verify_steps
                    committed += stats.mean_accepted_length * stats.num_verify_steps
                    cached += stats.num_cached_tokens
                    for name, n in stats.routed_to.items():
                        routed[name] = routed.get(name, 0) + n
                    for i, v in enumerate((stats.pipedec_timesteps, stats.pipedec_tokens, stats.pipedec_hits)):
                        pipedec[i] += v
            break
        expected = [replica.world.oracle.token(req.request_id, req.input_len + i) for i in range(len(tokens))]
        if tokens != expected or len(tokens) != req.output_len:
            raise AssertionError(f"simulated request {req.request_id} is not the oracle's text "
                                 f"({len(tokens)} tokens, {req.output_len} expected): the engine lost losslessness")
        n = len(tokens)
        results.append(RequestResult(req, start, first - start, (last - first) / (n - 1) if n > 1 else 0.0,
                                     last - start, n, committed / steps if steps else 0.0, steps, routed,
                                     tuple(pipedec), replica.index, sent, cached))

    wall = time.perf_counter()
    t0 = clock()
    failures = loop.create_task(fleet.run_failures(clock))
    try:
        await asyncio.gather(*(client(r) for r in requests))
    finally:
        failures.cancel()
        await fleet.shutdown()
    end = max((r.start_s + r.e2e_s for r in results), default=t0)
    begin = min((r.request.arrival_s for r in results), default=t0)
    replicas = fleet.every()
    worlds = [r.world for r in replicas]
    several = len(replicas) > 1
    busy: dict[str, float] = {}
    for replica in replicas:  # a device of replica i is named DEVICE@i
        for k, v in replica.world.busy().items():
            name = f"{k}@{replica.index}" if several else k
            busy[name] = busy.get(name, 0.0) + v
    forwards = sum(w.target.forwards for w in worlds)
    calls: dict[str, int] = {}
    for w in worlds:
        for d in w.drafters:
            calls[d.name] = calls.get(d.name, 0) + d.calls
    decode = tuple(sum(getattr(w.target, a) for w in worlds)
                   for a in ("decode_forwards", "decode_tokens", "decode_seconds"))
    return SimResult(sorted(results, key=lambda r: r.request.request_id), end - begin, time.perf_counter() - wall,
                     busy, forwards, calls, decode, len(fleet.replicas), fleet.resubmissions)


def simulate(scenario: Scenario, requests: list[SimRequest] | None = None) -> SimResult:
    """Run the scenario's workload (or ``requests``) to completion on a virtual clock."""
    return run_virtual(_simulate(scenario, requests if requests is not None else build_requests(scenario)))
