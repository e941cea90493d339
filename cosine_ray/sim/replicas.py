"""Engine replicas in the simulator: N pipelines behind one request router, with failover.

A scenario's ``replicas`` key runs ``count`` copies of its whole deployment, as
``--engine-replicas`` deploys them: each replica has its own devices, stages, drafters and
``EngineCore`` (its own scheduler and prefix cache) on the one virtual clock. ``Fleet`` is the
ingress's side of them:

- **Routing** (``routing``): ``prefix`` sends a request to the least loaded of the replicas that
  served its prompt's prefix before (the workload's ``shared_prefix`` group: a system prompt;
  their caches hold it), unless it holds ``imbalance`` more requests than the least loaded
  replica, as Ray Serve LLM's prefix-affinity router does; then, and for a prefix served
  nowhere, the less loaded of two replicas drawn at random takes it and becomes one of the
  prefix's replicas (``least_loaded`` always routes that way);
  ``round_robin`` takes them in turn. Load is the requests a replica holds.
- **Failover** (``failures``): at ``at_s`` a replica dies. Every stream it held ends, and its
  client sends the prompt plus the tokens it already has to a live replica (``max_attempts``
  sends in all), as the ingress does. The oracle keys the text by (request, position), so the
  continuation is exactly the text an uninterrupted run gives, and the runner checks it is.
  The replica is replaced ``restart_s`` later with a cold cache; while none is alive, clients wait.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from cosine_ray.engine.loop import EngineLoop

ROUTINGS = ("prefix", "least_loaded", "round_robin")
REPLICAS_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["count"],
    "properties": {
        "count": {"type": "integer", "minimum": 1, "maximum": 64},
        "routing": {"enum": list(ROUTINGS)},
        "imbalance": {"type": "integer", "minimum": 1},
        "max_attempts": {"type": "integer", "minimum": 1, "maximum": 16},
        "failures": {"type": "array", "maxItems": 1024, "items": {
            "type": "object", "additionalProperties": False, "required": ["replica", "at_s"],
            "properties": {"replica": {"type": "integer", "minimum": 0}, "at_s": {"type": "number", "minimum": 0},
                           "restart_s": {"type": "number", "minimum": 0}}}}}}
"""The scenario's ``replicas`` key (``sim.scenario.SCHEMA``)."""
DEFAULT_IMBALANCE = 4
"""Requests more than the least loaded replica a prefix's replica may hold and still get it."""
DEFAULT_MAX_ATTEMPTS = 3
DEFAULT_RESTART_S = 30.0
"""Seconds from a replica's death to its replacement serving (a model load), unless a failure says."""


class ReplicaLost(Exception):
    """A request's replica died under it (the client sends it again)."""


@dataclass(slots=True)
class Replica:
    index: int
    world: Any
    """Its ``runner.Deployment``."""
    engine: EngineLoop
    alive: bool = True
    streams: set[str] = field(default_factory=set)
    """Request ids it is serving now."""


class Fleet:
    """The replicas of a scenario and the ingress's routing and failover over them."""

    def __init__(self, scenario: Any, build: Callable[[int], tuple[Any, EngineLoop]]) -> None:
        spec = scenario.get("replicas") or {"count": 1}
        self.routing = spec.get("routing", "prefix")
        self.imbalance = int(spec.get("imbalance", DEFAULT_IMBALANCE))
        self.max_attempts = int(spec.get("max_attempts", DEFAULT_MAX_ATTEMPTS))
        self.failures = list(spec.get("failures", ()))
        self._build = build
        self.replicas = [Replica(i, *build(i)) for i in range(int(spec["count"]))]
        self.retired: list[Replica] = []
        """Replicas that died (their worlds' busy time still counts)."""
        self._homes: dict[Any, set[int]] = {}
        """Prefix → the replicas that served it (their caches hold it)."""
        self._turn = 0
        self._rng = np.random.default_rng(scenario.seed)
        self._revived = asyncio.Event()
        self.resubmissions = 0

    # ---- routing ------------------------------------------------------------------------------
    async def choose(self, prefix: Any) -> Replica:
        """The replica for a request whose prompt starts with ``prefix`` (None: none shared);
        waits while no replica is alive."""
        while True:
            alive = [r for r in self.replicas if r.alive]
            if alive:
                break
            self._revived.clear()
            await self._revived.wait()
        if self.routing == "round_robin":
            self._turn += 1
            return alive[(self._turn - 1) % len(alive)]
        least = min(len(r.streams) for r in alive)
        if self.routing == "prefix" and prefix is not None:
            homes = [r for r in alive if r.index in self._homes.get(prefix, ())]
            home = min(homes, key=lambda r: (len(r.streams), r.index), default=None)
            if home is not None and len(home.streams) - least < self.imbalance:
                return home
        picks = alive if len(alive) <= 2 else [alive[i] for i in self._rng.choice(len(alive), 2, replace=False)]
        chosen = min(picks, key=lambda r: (len(r.streams), r.index))
        if prefix is not None:
            self._homes.setdefault(prefix, set()).add(chosen.index)
        return chosen

    # ---- failures -----------------------------------------------------------------------------
    async def run_failures(self, clock: Callable[[], float]) -> None:
        """Kill and replace replicas at the scenario's times (a task beside the clients)."""
        for f in sorted(self.failures, key=lambda f: f["at_s"]):
            await asyncio.sleep(max(0.0, f["at_s"] - clock()))
            index = f["replica"] % len(self.replicas)
            if self.replicas[index].alive:
                await self.kill(index)
                asyncio.get_running_loop().create_task(self._replace(index, f.get("restart_s", DEFAULT_RESTART_S)))

    async def kill(self, index: int) -> None:
        replica = self.replicas[index]
        replica.alive = False
        for homes in self._homes.values():  # its replacement starts with a cold cache
            homes.discard(index)
        for rid in list(replica.streams):
            replica.engine.abort(rid)
        await asyncio.sleep(0)  # the aborted streams read their ends before the loop stops
        await replica.engine.shutdown()

    async def _replace(self, index: int, after_s: float) -> None:
        await asyncio.sleep(after_s)
        self.retired.append(self.replicas[index])
        self.replicas[index] = Replica(index, *self._build(index))
        self._revived.set()

    # ---- a request ----------------------------------------------------------------------------
    async def stream(self, replica: Replica, request_id: str, prompt: list[int], params: Any):
        """The outputs of one send to ``replica``; ReplicaLost when it dies before the end."""
        replica.streams.add(request_id)
        try:
            async for out in replica.engine.generate(prompt, params, request_id):
                if out.finished and not replica.alive:
                    if out.new_token_ids:
                        yield out
                    raise ReplicaLost(request_id)
                yield out
        finally:
            replica.streams.discard(request_id)

    async def shutdown(self) -> None:
        for r in self.replicas:
            if r.alive:
                await r.engine.shutdown()

    def every(self) -> list[Replica]:
        """Every replica the run had: those that died, then those serving at the end."""
        return self.retired + self.replicas
