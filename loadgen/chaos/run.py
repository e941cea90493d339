"""The chaos run: load, faults on a schedule, recovery measured, memory sampled, one verdict.

Phases on one clock (seconds since the server answered /health): a **warm-up** pass asks every
shape once, non-streaming (the reference of each shape the independent run gave none; a failure
there stops the run: the server was not healthy before the chaos); then ``clients`` closed-loop
callers send one request after another (a failed one waits 1 s, as ``Retry-After`` asks) for
``duration_s``, while the fault loop injects one fault every ``kill_every_s``. After each fault
it polls ``/health`` and, once that answers 200, sends a short greedy **probe**: the first probe
that succeeds ends the recovery. The next fault waits for the previous recovery (so each
recovery is measured alone) and none is injected in the last ``kill_every_s`` of the load. The
run ends when the callers have finished their last requests; then the server must be idle
(``cosine_ray:num_requests_running`` and ``_waiting`` 0 on ``/metrics``) within
``idle_timeout_s``. Once a second all along, and once at the end, the server's record of the
request ids it answered is read (``server_ledger.py``); every id starts with the run's tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx
import numpy as np

from loadgen.chaos import audit as audit_mod
from loadgen.chaos.faults import KINDS, Fault, Injector
from loadgen.chaos.memory import MemoryLog
from loadgen.chaos.procs import Proc
from loadgen.chaos.server_ledger import ServerLedger
from loadgen.chaos.shapes import Shape, probe_shape
from loadgen.chaos.traffic import Call, Mix, send
from loadgen.ledger import Ledger

BACKOFF_S = 1.0
HEALTH_POLL_S = 0.5
LEDGER_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    duration_s: float = 1800.0
    """Seconds of load after the warm-up pass."""
    clients: int = 16
    kill_every_s: float = 30.0
    kinds: tuple[str, ...] = KINDS
    order: str = "random"
    """``random``: each fault's kind drawn at random; ``cycle``: the kinds in turn (a seeded
    shuffle), so a short run meets every kind."""
    max_kills: int = 1000
    pause_s: float = 10.0
    """How long a ``pause`` fault keeps its process stopped."""
    recovery_timeout_s: float = 300.0
    """A fault the server has not recovered from by then fails the run."""
    request_timeout_s: float = 180.0
    """Per request: no outcome by then = hung."""
    mix: Mix = field(default_factory=Mix)
    warmup_concurrency: int = 4
    memory_interval_s: float = 10.0
    memory_warmup_s: float = 300.0
    """Seconds of load before memory slopes are fitted (and the age a process must reach)."""
    memory_min_span_s: float = 300.0
    """Post-warm-up seconds a process needs for its own slope."""
    idle_timeout_s: float = 30.0
    max_failed_fraction: float = 0.0
    """Of the load requests no fault overlapped, the fraction that may fail."""
    seed: int = 0
    api_key: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        for name in ("duration_s", "kill_every_s", "pause_s", "recovery_timeout_s", "request_timeout_s",
                     "memory_interval_s"):
            if not getattr(self, name) > 0:
                flag = name.removesuffix("_s").replace("_", "-")
                raise ValueError(f"--{flag} must be > 0, got {getattr(self, name)}")
        if self.clients < 1 or self.max_kills < 0 or self.warmup_concurrency < 1:
            raise ValueError("--clients must be >= 1 and --max-kills >= 0")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            raise ValueError(f"--max-failed-fraction must be in [0, 1], got {self.max_failed_fraction}")
        if self.order not in ("random", "cycle"):
            raise ValueError(f"--order must be random or cycle, got {self.order!r}")


@dataclass
class ChaosResult:
    config: ChaosConfig
    shapes: list[Shape]
    references: dict[str, list[str]]
    """Per shape, each choice's expected text."""
    calls: list[Call]
    ledger: Ledger
    faults: list[Fault]
    memory: MemoryLog
    load_start_t: float
    load_end_t: float
    skipped: list[dict[str, Any]]
    """Faults that could not be injected (no target of the kind then)."""
    idle: dict[str, Any]
    abort_reason: str | None = None
    model: str | None = None
    probe_baseline_s: list[float] = field(default_factory=list)
    """Latencies of probes sent under load before the first fault."""
    server: ServerLedger = field(default_factory=ServerLedger)
    independent: list[str] = field(default_factory=list)
    """Shapes whose references came from the independent run, not the warm-up."""


class ChaosRun:
    def __init__(self, cfg: ChaosConfig, base_url: str, shapes: Sequence[Shape], *,
                 find: Callable[[], list[Proc]], injector: Injector | None,
                 clock: Callable[[], float] = time.perf_counter, log: Callable[[str], None] = print,
                 references: dict[str, list[str]] | None = None) -> None:
        self.cfg, self.base_url, self.shapes = cfg, base_url.rstrip("/"), list(shapes)
        self.find, self.injector, self.log = find, injector, log
        self._clock = clock
        self.t_zero = clock()
        self.model = cfg.model
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.probe = probe_shape()
        self.references: dict[str, list[str]] = dict(references or {})
        self.independent = sorted(self.references)
        self.tag = uuid.uuid4().hex[:8]
        self.server = ServerLedger(prefix=f"{self.tag}-")
        self.calls: list[Call] = []
        self.in_flight: dict[str, Call] = {}
        self.ledger = audit_mod.new_ledger()
        self.faults: list[Fault] = []
        self.skipped: list[dict[str, Any]] = []
        self.memory = MemoryLog()
        self.stopping = asyncio.Event()
        self.abort_reason: str | None = None
        self.interrupted = False
        self._main: asyncio.Task | None = None
        self.load_start_t = self.load_end_t = 0.0
        self._num_probes = 0
        self.probe_baseline_s: list[float] = []
        self._cycle: list[str] = []
        seeds = np.random.SeedSequence(cfg.seed).spawn(cfg.clients + 1)
        self.fault_rng = np.random.default_rng(seeds[0])
        self.client_rngs = [np.random.default_rng(s) for s in seeds[1:]]

    def clock(self) -> float:
        return self._clock() - self.t_zero

    # ---- one request ---------------------------------------------------------------------------
    async def call(self, client: httpx.AsyncClient, shape: Shape, call: Call) -> Call:
        self.calls.append(call)
        self.ledger.record("planned", call.request_id)
        self.ledger.record("sent", call.request_id, self.clock())
        self.in_flight[call.request_id] = call
        try:
            await send(client, shape, call, model=self.model, timeout_s=self.cfg.request_timeout_s,
                       clock=self.clock, headers=self.headers)
        finally:
            if call.outcome is None:  # cancelled (Ctrl-C): still one terminal event
                call.fail("cancelled", "cancelled by an interrupt")
                call.outcome, call.end_t = "failed", self.clock()
            self.in_flight.pop(call.request_id, None)
            audit_mod.record_outcome(self.ledger, call)
        return call

    # ---- phases --------------------------------------------------------------------------------
    async def discover_model(self, client: httpx.AsyncClient) -> None:
        if self.model is not None:
            return
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            resp = await client.get("/v1/models", headers=self.headers, timeout=30)
            self.model = str(resp.json()["data"][0]["id"])

    async def warm_up(self, client: httpx.AsyncClient) -> None:
        """Every shape (and the probe) once, non-streaming: the references."""
        gate = asyncio.Semaphore(self.cfg.warmup_concurrency)

        async def one(shape: Shape) -> None:
            async with gate:
                for attempt in range(3):
                    call = await self.call(client, shape, Call(f"{self.tag}-w-{shape.key}-{attempt}", shape.key,
                                                               "warmup", False))
                    if call.outcome == "ok":
                        self.references.setdefault(shape.key, list(call.texts))
                        return
                    await asyncio.sleep(BACKOFF_S)
                self.abort_reason = self.abort_reason or f"warm-up: shape {shape.key} failed 3 times: {call.error}"

        await asyncio.gather(*(one(s) for s in [self.probe, *self.shapes]))

    async def client_loop(self, index: int, client: httpx.AsyncClient) -> None:
        rng, n = self.client_rngs[index], 0
        while not self.stopping.is_set():
            shape = self.shapes[int(rng.integers(len(self.shapes)))]
            stream, leave = self.cfg.mix.draw(rng)
            call = await self.call(client, shape, Call(f"{self.tag}-c{index:02d}-{n:05d}", shape.key, "load", stream,
                                                       leave, client=index))
            n += 1
            if call.outcome == "failed":
                await asyncio.sleep(BACKOFF_S)

    async def server_ledger_loop(self, client: httpx.AsyncClient) -> None:
        while not self.stopping.is_set():
            await self.server.poll(client, self.headers, self.clock)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), LEDGER_POLL_S)

    async def memory_loop(self) -> None:
        while not self.stopping.is_set():
            t = self.clock()
            await asyncio.to_thread(lambda: self.memory.sample(self.find(), t))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.cfg.memory_interval_s)

    async def fault_loop(self, client: httpx.AsyncClient) -> None:
        if self.injector is None or not self.cfg.kinds or self.cfg.max_kills == 0:
            return
        next_t = self.load_start_t + self.cfg.kill_every_s
        last_t = self.load_start_t + self.cfg.duration_s - self.cfg.kill_every_s
        await self.probe_baseline(client, count=3)
        while len(self.faults) < self.cfg.max_kills:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), max(0.0, next_t - self.clock()))
            if self.stopping.is_set() or self.clock() > last_t:
                return
            fault = await self.inject()
            if fault is None:
                next_t = self.clock() + 5.0
                continue
            follow = asyncio.ensure_future(asyncio.to_thread(self.injector.follow_up, fault, self.clock))
            await self.recover(client, fault)
            await follow
            if fault.recovered_t is None:
                self.abort_reason = self.abort_reason or (f"fault #{fault.index} ({fault.kind}): not recovered "
                                                          f"within {self.cfg.recovery_timeout_s:g} s")
                self.stopping.set()
                return
            self.log(f"[chaos] #{fault.index} {fault.kind}: recovered in {fault.recovery_s:.1f} s "
                     f"({len(fault.in_flight)} requests were in flight)")
            next_t = max(fault.t + self.cfg.kill_every_s, fault.recovered_t + 1.0)

    def probe_call(self) -> Call:
        self._num_probes += 1
        return Call(f"{self.tag}-p-{self._num_probes:05d}", "probe", "probe", False)

    async def probe_baseline(self, client: httpx.AsyncClient, count: int) -> None:
        """Probe latency under load before any fault: what a recovery time is to be read against."""
        for _ in range(count):
            probe = await self.call(client, self.probe, self.probe_call())
            if probe.outcome == "ok":
                self.probe_baseline_s.append(probe.end_t - probe.sent_t)

    async def inject(self) -> Fault | None:
        kinds = list(self.cfg.kinds)
        if self.cfg.order == "cycle":
            if not self._cycle:
                self._cycle = [str(k) for k in self.fault_rng.permutation(kinds)]
            first = self._cycle.pop(0)
        else:
            first = kinds[int(self.fault_rng.integers(len(kinds)))]
        for kind in [first, *[k for k in self.fault_rng.permutation(kinds) if k != first]]:
            t = self.clock()
            in_flight = list(self.in_flight)
            fault = await asyncio.to_thread(self.injector.inject, kind, len(self.faults), t)
            if fault is not None:
                fault.in_flight = in_flight
                self.faults.append(fault)
                return fault
            self.skipped.append({"t": t, "kind": kind, "why": "no target"})
        return None

    async def health(self, client: httpx.AsyncClient) -> int | None:
        try:
            return (await client.get("/health", timeout=10.0)).status_code
        except httpx.HTTPError:
            return None

    async def recover(self, client: httpx.AsyncClient, fault: Fault) -> None:
        """Until /health is 200 and a probe sent after it succeeds (or the recovery deadline)."""
        deadline = fault.t + self.cfg.recovery_timeout_s
        while self.clock() < deadline and not self.interrupted:
            status = await self.health(client)
            if status != 200:
                fault.health_down = True
                fault.health_ok_t = None
                await asyncio.sleep(HEALTH_POLL_S)
                continue
            fault.health_ok_t = fault.health_ok_t or self.clock()
            probe = await self.call(client, self.probe, self.probe_call())
            if probe.outcome == "ok":
                fault.recovered_t = probe.end_t
                return
            await asyncio.sleep(HEALTH_POLL_S)

    async def idle_state(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """After the load: /health and the engine's running/waiting gauges until idle."""
        start = self.clock()
        state: dict[str, Any] = {}
        while True:
            state = {"health": await self.health(client), **await self.gauges(client)}
            if state["health"] == 200 and state.get("running") == 0 and state.get("waiting") == 0:
                break
            if self.clock() - start > self.cfg.idle_timeout_s:
                break
            await asyncio.sleep(0.5)
        state["idle"] = state["health"] == 200 and state.get("running") == 0 and state.get("waiting") == 0
        state["after_s"] = self.clock() - start
        return state

    async def gauges(self, client: httpx.AsyncClient) -> dict[str, float]:
        try:
            text = (await client.get("/metrics", headers=self.headers, timeout=10.0)).text
        except httpx.HTTPError:
            return {}
        out = {}
        for name in ("running", "waiting"):
            m = re.search(rf"^cosine_ray:num_requests_{name}(?:{{[^}}]*}})?\s+(\S+)", text, re.M)
            if m:
                out[name] = float(m.group(1))
        return out

    def interrupt(self) -> None:
        """First Ctrl-C: stop the load and the faults, finish, write what was measured; second: cancel."""
        if self.interrupted and self._main is not None:
            self._main.cancel()
        self.interrupted = True
        self.abort_reason = self.abort_reason or "interrupted (Ctrl-C): the load stopped early"
        self.stopping.set()

    async def main(self) -> ChaosResult:
        self._main = asyncio.current_task()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
        try:
            return await self._main_body()
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGINT)

    async def _main_body(self) -> ChaosResult:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=10.0)
        idle: dict[str, Any] = {}
        async with httpx.AsyncClient(base_url=self.base_url, timeout=timeout, limits=limits) as client:
            await self.discover_model(client)
            memory = asyncio.ensure_future(self.memory_loop())
            ledger = asyncio.ensure_future(self.server_ledger_loop(client))
            try:
                await self.warm_up(client)
                if self.abort_reason is None:
                    await self.load(client)
                idle = await self.idle_state(client)
            finally:
                self.stopping.set()
                await memory
                await ledger
            await self.server.poll(client, self.headers, self.clock)  # what was answered last
        return ChaosResult(self.cfg, self.shapes, self.references, self.calls, self.ledger, self.faults,
                           self.memory, self.load_start_t, self.load_end_t, self.skipped, idle, self.abort_reason,
                           self.model, self.probe_baseline_s, self.server, self.independent)

    async def load(self, client: httpx.AsyncClient) -> None:
        self.load_start_t = self.clock()
        self.log(f"[chaos] warm-up done at {self.load_start_t:.1f} s ({len(self.references)} references); "
                 f"{self.cfg.clients} clients for {self.cfg.duration_s:g} s")
        loops = [asyncio.ensure_future(self.client_loop(i, client)) for i in range(self.cfg.clients)]
        faults = asyncio.ensure_future(self.fault_loop(client))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), self.cfg.duration_s)
        self.stopping.set()
        self.load_end_t = self.clock()
        await asyncio.gather(faults, *loops)
