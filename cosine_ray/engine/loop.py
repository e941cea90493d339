"""Drive a Router in the background and stream each request's tokens to its caller."""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import AsyncIterator, Sequence

from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.engine.router import Router
from cosine_ray.metrics.serving import RequestTimeline

log = logging.getLogger(__name__)


class EngineLoop:
    """Owns the step task. ``generate`` yields RequestOutputs until the request finishes;
    a caller that stops iterating (client disconnect, cancellation) aborts its request."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()

    def _ensure_running(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if not self._tasks or all(t.done() for t in self._tasks):
            loop = asyncio.get_running_loop()
            self._tasks = [loop.create_task(self._run(lane))
                           for lane in range(self.router.config.num_lanes)]

    async def _run(self, lane: int) -> None:
        while True:
            if not self.router.lane_has_work(lane):
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await self.router.step(lane)
            except Exception as exc:  # a failed step fails the running requests, never hangs them
                log.exception("engine step failed")
                self._fail_running(f"{type(exc).__name__}: {exc}")
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            self._wakeup.set()  # this step may have admitted requests into a sleeping lane
            if not outputs:
                await asyncio.sleep(0.001)  # nothing ran in this lane: do not spin
            await asyncio.sleep(0)  # let streams and new arrivals run between steps

    def _fail_running(self, message: str) -> None:
        for rid in list(self.router.running):
            self.router.abort(rid)
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait(RequestOutput(rid, [], True, "error", error=message))

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._ensure_running()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            request = self.router.add_request(request_id, prompt_token_ids, params)
        except Exception:
            del self._queues[request_id]
            raise
        timeline = RequestTimeline(self.router.metrics, self.router.clock, request)
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                timeline.observe(out.new_token_ids, out.finished, out.finish_reason)
                if out.stats is not None:
                    out.stats.domain = request.domain  # classified by the router after arrival
                yield out
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                timeline.finish("abort")
                self.router.abort(request_id)
                self._wakeup.set()

    @property
    def num_streams(self) -> int:
        """Requests with a live ``generate`` iterator (a leak check: 0 when idle)."""
        return len(self._queues)

    def metrics_snapshot(self) -> dict:
        """The router's registry with the running/waiting gauges read now (what /metrics shows)."""
        metrics = self.router.metrics
        metrics.set("cosine_ray:num_requests_running", len(self.router.running))
        metrics.set("cosine_ray:num_requests_waiting", len(self.router.waiting))
        return metrics.snapshot()

    async def generate_all(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                           request_id: str | None = None) -> RequestOutput:
        """Run to completion; returns one output holding every token."""
        tokens: list[int] = []
        last = None
        async for out in self.generate(prompt_token_ids, params, request_id):
            tokens.extend(out.new_token_ids)
            last = out
        return RequestOutput(last.request_id, tokens, True, last.finish_reason, last.num_prompt_tokens,
                             last.num_output_tokens, last.stats, last.error)

    async def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self._wakeup = None  # bound to this event loop; a later loop makes its own
