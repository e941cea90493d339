"""Drive an EngineCore in the background and stream each request's tokens to its caller.

What a step produced for a request waits in its ``Mailbox`` until the caller takes it, merged
with what later steps produced: a caller that reads slowly (a client held back by the
ingress) costs one pending output, never a queue that grows a step at a time.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections import OrderedDict
from typing import AsyncIterator, Sequence

from cosine_ray.engine.mailbox import Mailbox
from cosine_ray.engine.request import NO_TENANT, RequestOutput, SamplingParams, Tenant, merge_outputs
from cosine_ray.engine.core import EngineCore
from cosine_ray.metrics.serving import RequestTimeline

log = logging.getLogger(__name__)

ABORTED_IDS_KEPT = 4096
"""How many explicitly aborted request ids the loop remembers (``EngineLoop.abort``)."""


class EngineLoop:
    """Owns the step task. ``generate`` yields RequestOutputs until the request finishes;
    a caller that stops iterating (client disconnect, cancellation) aborts its request, or
    finishes it as ``stop`` when it said so first (``finish``: a stop string). ``abort`` ends a
    request by id, for a caller whose closing of the stream may not arrive."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._queues: dict[str, Mailbox] = {}
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count()
        self._finished_by_caller: set[str] = set()
        self._aborted: OrderedDict[str, None] = OrderedDict()
        """Ids aborted before their ``generate`` arrived (the last ``ABORTED_IDS_KEPT``)."""

    def _ensure_running(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if not self._tasks or all(t.done() for t in self._tasks):
            loop = asyncio.get_running_loop()
            # A fresh context, not the caller's: Ray's async actors keep the current task in a
            # context variable, which create_task copies, so steps started inside the first
            # request's call made their stage and drafter calls as that request's children, and
            # Serve's cancel of the request (its client left) cancelled them with it: the step
            # failed, and its stage counted as lost (tests/runtime/test_loop_context.py).
            self._tasks = [loop.create_task(self._run(lane), context=contextvars.Context())
                           for lane in range(self.core.config.scheduler.num_lanes)]

    async def _run(self, lane: int) -> None:
        while True:
            if not self.core.lane_has_work(lane):
                await self.core.flush_learning()  # what the last step taught, before going idle
                if self.core.lane_has_work(lane):
                    continue
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                outputs = await self.core.step(lane)
            except Exception as exc:  # a failed step fails the running requests, never hangs them
                log.exception("engine step failed")
                self._fail_running(f"{type(exc).__name__}: {exc}")
                continue
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put(out)
            self._wakeup.set()  # this step may have admitted requests into a sleeping lane
            if not outputs:
                await asyncio.sleep(0.001)  # nothing ran in this lane: do not spin
            # Let streams and new arrivals run between steps: two turns of the event loop, so
            # that in one of them no step runs. A step need not yield at all (in-process drafting
            # does not; on CPU neither does the forward); with one turn, a step ran in every
            # turn and resolved each stream's next output before anyio could deliver a client's
            # disconnect (it cancels only a task blocked on a future), so a stream whose client
            # had left ran to the end of its request (tests/serve/test_openai_app.py).
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    def _fail_running(self, message: str) -> None:
        for rid in list(self.core.running):
            self.core.abort(rid)
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put(RequestOutput(rid, [], True, "error", error=message))

    def finish(self, request_id: str) -> bool:
        """The caller ends a streaming request as a normal completion (the HTTP layer found a
        stop string in its text): when the caller closes the iterator next, the request is
        freed like an abort but its timeline ends with ``stop`` (counted as a completion, its
        latency observed) instead of ``abort``. False if the request is not streaming."""
        if request_id not in self._queues:
            return False
        self._finished_by_caller.add(request_id)
        return True

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                       request_id: str | None = None, tenant: Tenant = NO_TENANT,
                       resume_token_ids: Sequence[int] = ()) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes (``tenant``: whose it is; ``resume_token_ids``:
        its output so far, generated elsewhere, ``EngineCore.add_request``). Its grammar is
        compiled off the event loop before it enters the pool (``EngineCore.prepare_request``):
        the steps of the others go on meanwhile."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        if request_id in self._aborted:  # its caller gave up before the call got here
            del self._aborted[request_id]
            yield RequestOutput(request_id, [], True, "abort")
            return
        self._ensure_running()
        queue = self._queues[request_id] = Mailbox()
        try:
            await self.core.prepare_request(prompt_token_ids, params)
            request = None if queue.holds_end else self.core.add_request(request_id, prompt_token_ids, params, tenant,
                                                                              resume_token_ids)
        except BaseException:
            del self._queues[request_id]
            raise
        if request is None:  # aborted while its grammar compiled: it never started
            del self._queues[request_id]
            self._finished_by_caller.discard(request_id)
            yield await queue.get()
            return
        timeline = RequestTimeline(self.core.metrics, self.core.clock, request)
        self._wakeup.set()
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                timeline.observe(out.new_token_ids, out.finished, out.finish_reason)
                if out.stats is not None:
                    out.stats.domain = request.domain  # classified by the engine on arrival
                yield out
        finally:
            self._queues.pop(request_id, None)
            by_caller = request_id in self._finished_by_caller
            self._finished_by_caller.discard(request_id)
            if not finished:
                timeline.finish("stop" if by_caller else "abort")
                self.core.abort(request_id)
                self._wakeup.set()

    def abort(self, request_id: str) -> bool:
        """End a request by id, whatever became of its stream. The ingress sends this besides
        closing the stream: Serve carries a stream's cancellation on a best-effort basis, and
        one lost in transit (a cancel that lands while Serve is still routing the call) would
        leave the request running to its length with nobody reading. A live stream ends now
        (``abort``, or ``stop`` after ``finish``); an id not seen here is remembered, so that a
        ``generate`` arriving after its abort ends at once. True if a live stream was ended."""
        queue = self._queues.get(request_id)
        if queue is None:
            self._aborted[request_id] = None
            while len(self._aborted) > ABORTED_IDS_KEPT:
                self._aborted.popitem(last=False)
            return False
        self.core.abort(request_id)
        reason = "stop" if request_id in self._finished_by_caller else "abort"
        queue.put(RequestOutput(request_id, [], True, reason))
        if self._wakeup is not None:
            self._wakeup.set()
        return True

    @property
    def num_streams(self) -> int:
        """Requests with a live ``generate`` iterator (a leak check: 0 when idle)."""
        return len(self._queues)

    def metrics_snapshot(self) -> dict:
        """The engine's registry with the running/waiting gauges read now (what /metrics shows)."""
        self.core.read_gauges()
        return self.core.metrics.snapshot()

    async def generate_all(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                           request_id: str | None = None, tenant: Tenant = NO_TENANT) -> RequestOutput:
        """Run to completion; returns one output holding every token."""
        merged = None
        async for out in self.generate(prompt_token_ids, params, request_id, tenant):
            merged = out if merged is None else merge_outputs(merged, out)
        return merged

    async def shutdown(self) -> None:
        await self.core.flush_learning()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []
        self._wakeup = None  # bound to this event loop; a later loop makes its own
