"""The engine's step loop is nobody's child call: on a real Ray cluster, a request call that
started the loop (the first ``generate`` after an engine start) and is then cancelled the way
Serve cancels a request whose client left (``ray.cancel``, recursive) must not take the
loop's stage calls with it. Before ``EngineLoop`` started its tasks in a fresh context, that
cancel reached the in-flight stage call, the step failed and its stage counted as lost; after an
engine restart under load (the chaos test) requests then hung until Serve replaced the engine
a second time."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray]

STAGE_SECONDS = 2.0


def _actors():
    """The stage and engine actor classes, defined here so that Ray pickles them by value (a
    test module is not importable in a worker)."""

    @ray.remote(num_cpus=0)
    class Stage:
        """A stage whose forward takes ``seconds``; ``finished`` counts the forwards that ran to the
        end (a cancelled one does not)."""

        def __init__(self) -> None:
            self.finished = 0

        async def forward(self, seconds: float) -> str:
            await asyncio.sleep(seconds)
            self.finished += 1
            return "done"

        async def num_finished(self) -> int:
            return self.finished


    class _Core:
        """What EngineLoop asks of EngineCore, with one step that calls the stage actor."""

        def __init__(self, stage) -> None:
            self.stage = stage
            self.config = SimpleNamespace(scheduler=SimpleNamespace(num_lanes=1))
            self.stepping = False
            self.outcome: str | None = None

        def lane_has_work(self, lane: int) -> bool:
            return self.outcome is None and not self.stepping

        async def flush_learning(self) -> None:
            return None

        async def step(self, lane: int) -> list:
            self.stepping = True
            try:
                self.outcome = await self.stage.forward.remote(STAGE_SECONDS)
            except BaseException as exc:  # what a cancelled child call raises
                self.outcome = type(exc).__name__
                raise
            finally:
                self.stepping = False
            return []


    @ray.remote(num_cpus=0)
    class Engine:
        def __init__(self, stage) -> None:
            from cosine_ray.engine.loop import EngineLoop

            self.stage = stage
            self.core = _Core(stage)
            self.loop = EngineLoop(self.core)

        async def first_request(self) -> None:
            """What ``generate`` does on an engine's first request: start the loop, then stream
            until the caller leaves."""
            self.loop._ensure_running()
            await asyncio.sleep(3600)

        async def direct_stage_call(self) -> str:
            """The premise: a stage call made in the request's own task is its child."""
            return await self.stage.forward.remote(STAGE_SECONDS)

        async def stepping(self) -> bool:
            return self.core.stepping

        async def outcome(self) -> str | None:
            return self.core.outcome

    return Stage, Engine


def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_cancelling_the_request_that_started_the_loop_spares_its_stage_calls(ray_cluster):
    Stage, Engine = _actors()
    stage = Stage.remote()
    engine = Engine.remote(stage)
    try:
        # the premise: a recursive cancel of a request takes the stage call it made with it
        direct = engine.direct_stage_call.remote()
        time.sleep(0.5)
        ray.cancel(direct, recursive=True)
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
            ray.get(direct, timeout=30)
        time.sleep(STAGE_SECONDS + 0.5)
        assert ray.get(stage.num_finished.remote(), timeout=30) == 0, "the premise does not hold on this Ray"

        # the loop's step, started inside the request, is not that request's child
        request = engine.first_request.remote()
        _until(lambda: ray.get(engine.stepping.remote(), timeout=30))
        ray.cancel(request, recursive=True)
        with pytest.raises((ray.exceptions.TaskCancelledError, ray.exceptions.RayTaskError)):
            ray.get(request, timeout=30)
        _until(lambda: ray.get(engine.outcome.remote(), timeout=30) is not None)
        assert ray.get(engine.outcome.remote(), timeout=30) == "done"
        assert ray.get(stage.num_finished.remote(), timeout=30) == 1
    finally:
        ray.kill(engine)
        ray.kill(stage)
