"""EngineClient over the engine deployment's ``DeploymentHandle``: what the ingress uses.

Tokens stream back through a Serve streaming call. Every wait has a deadline: an engine that
dies or stops producing tokens ends the stream with an error output (the ingress turns it
into a 503), never a hang. No call here blocks the event loop (no ``ray.get``).

* The engine's first item is ``ACCEPTED`` (a live replica runs the call), awaited for
  ``call_timeout_s`` only: a call Serve holds because no engine replica is up (one was just
  killed, a new one is starting) gets its 503 within seconds.
* Then come outputs and, after each ``HEARTBEAT_S`` without one, ``ALIVE``. A stream that gets
  neither for ``token_timeout_s`` has lost its engine (killed, paused, cut off) and ends with an
  error, also when Ray has not reported the replica dead: a streaming call to a dead actor is
  not always failed at once.
* The stream is read as it comes into a ``Mailbox`` that merges what the caller has not taken
  yet: a slow caller costs one pending output, not a Ray stream buffered an item a step.
* Closing the stream early (client disconnect) cancels the call, which Serve propagates into
  the engine's generator: the request is aborted there and its state freed everywhere. That
  cancellation is best effort (one that lands while Serve still routes the call is lost), so
  the close also sends an explicit ``abort`` of the request id, in the background, with its
  own deadline.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from cosine_ray.engine.mailbox import Mailbox
from cosine_ray.engine.request import NO_TENANT, RequestOutput, RequestRefused, SamplingParams, Tenant, merge_outputs

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "cosine_ray_engine"
"""Serve deployment name of the engine (the ingress deployment is ``cosine_ray``)."""
ACCEPTED = "accepted"
"""The first item of ``EngineServer.generate``'s stream: the call reached a live engine replica."""
ALIVE = "alive"
"""An item of ``EngineServer.generate``'s stream after ``HEARTBEAT_S`` without an output."""
HEARTBEAT_S = 5.0
T = TypeVar("T")


async def coalesced(outputs: AsyncIterator[RequestOutput], every_s: float,
                    clock: Callable[[], float] = time.monotonic) -> AsyncIterator[RequestOutput]:
    """``outputs`` merged (``merge_outputs``) so that one goes out at most every ``every_s``
    seconds, and the last at once; ``every_s`` 0 passes each through. Every item of a Serve
    streaming call costs both processes CPU time, which on a small machine the forward's
    threads pay for. Closing this closes ``outputs``."""
    try:
        if every_s <= 0:
            async for out in outputs:
                yield out
            return
        held, sent = None, clock()
        async for out in outputs:
            held = out if held is None else merge_outputs(held, out)
            if held.finished or clock() - sent >= every_s:
                yield held
                held, sent = None, clock()
        if held is not None:
            yield held
    finally:
        await outputs.aclose()


async def with_heartbeats(items: AsyncIterator[T], every_s: float = HEARTBEAT_S) -> AsyncIterator[T | str]:
    """``items``, with ``ALIVE`` after every ``every_s`` seconds in which none came. Closing or
    cancelling this closes ``items`` (a pending wait for its next item is cancelled first)."""
    it = items.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield ALIVE
                continue
            finished, pending = pending, None
            try:
                item = finished.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:  # cancelled inside ``items`` (its own cleanup runs), then awaited
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await it.aclose()


class RayEngineClient:
    def __init__(self, handle: Any, *, model_name: str, max_model_len: int, vocab_size: int,
                 token_timeout_s: float = 30.0, call_timeout_s: float = 5.0) -> None:
        self.handle = handle
        """``DeploymentHandle`` of the engine deployment (``runtime.engine_server.EngineServer``)."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_timeout_s = token_timeout_s
        """Longest wait for the next item of an accepted stream: an output or the engine's
        ``ALIVE`` (every ``HEARTBEAT_S`` without one, so a stage restart and re-prefill, or a
        long queue, are covered by heartbeats; six missed ones mean the engine is gone)."""
        self.call_timeout_s = call_timeout_s
        """Deadline of the unary calls (check_request, finish, health, ...: milliseconds when the
        engine is up) and of a stream's ``ACCEPTED``. While no engine replica is up, Serve holds a
        call until one is, so this is also how long a request waits for a restarting engine
        before its 503."""
        self._aborts: set[asyncio.Task] = set()
        """Explicit aborts in flight (held so they are not collected before they run)."""

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        response = getattr(self.handle, method).remote(*args)
        try:
            return await asyncio.wait_for(response, timeout=timeout_s or self.call_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise

    async def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     request_id: str, every_s: float = 0.0, tenant: Tenant = NO_TENANT) -> AsyncIterator[RequestOutput]:
        gen = self.handle.options(stream=True).generate.remote(list(prompt_token_ids), params, request_id, every_s,
                                                               tenant)
        mailbox = Mailbox()
        reader = asyncio.ensure_future(self._read(gen, request_id, mailbox))
        finished = False
        try:
            while not finished:
                out = await mailbox.get()
                if out is None:  # the engine ended the stream without finishing the request
                    return
                finished = out.finished
                yield out
        finally:
            if not finished:  # first, before any await: a second cancellation must not skip it
                self._cancel(gen, request_id)
            if not reader.done():
                reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, gen: Any, request_id: str, mailbox: Mailbox) -> None:
        """The engine's items into ``mailbox`` as they come, until the request finishes; an
        engine that is lost (no ``ACCEPTED`` within ``call_timeout_s``, no item within
        ``token_timeout_s``, an error) ends it with an error output, a stream that ends early
        closes the mailbox."""
        accepted = False
        while True:
            try:
                out = await asyncio.wait_for(gen.__anext__(),
                                             timeout=self.token_timeout_s if accepted else self.call_timeout_s)
                if not accepted:
                    if out != ACCEPTED:
                        raise RuntimeError(f"the engine's stream began with {out!r}, not {ACCEPTED!r}")
                    accepted = True
                    continue
                if out == ALIVE:
                    continue
            except StopAsyncIteration:
                mailbox.close()
                return
            except (asyncio.TimeoutError, Exception) as exc:
                if isinstance(exc, asyncio.CancelledError):
                    raise
                log.warning("request %s lost its engine: %r", request_id, exc)
                self._cancel(gen, request_id)  # a held call must never start on the next replica
                mailbox.put(RequestOutput(request_id, [], True, "error", error=f"engine unavailable: {type(exc).__name__}"))
                return
            mailbox.put(out)
            if out.finished:
                return

    def _cancel(self, gen: Any, request_id: str) -> None:
        """Cancel the engine call (Serve cancels the engine's generator: the request is aborted
        there) and, in case that cancellation is lost, abort the request id explicitly."""
        gen.cancel()

        async def abort() -> None:
            try:
                await self._call("abort", request_id)
            except Exception as exc:  # the engine is gone or restarting: nothing left to abort
                log.debug("explicit abort of %s failed: %r", request_id, exc)

        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # closed outside an event loop (collected at shutdown)
            return
        # a fresh context: not a child call of the cancelled request, which Serve would cancel too
        task = contextvars.Context().run(loop.create_task, abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def finish(self, request_id: str) -> None:
        """Awaited before the stream is closed: the engine must have it before the cancellation."""
        await self._call("finish", request_id)

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        refusal = await self._call("check_request", list(prompt_token_ids), params)
        if refusal is not None:
            raise refusal if isinstance(refusal, RequestRefused) else RequestRefused(str(refusal))

    async def health(self) -> dict[str, Any]:
        return await self._call("health")

    async def describe(self) -> dict[str, Any]:
        return await self._call("describe")

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def metrics_snapshot(self, http: tuple[str, dict] | None = None) -> dict[str, Any]:
        return await self._call("metrics_snapshot", http)

    def record_http(self, replica: str, totals: dict) -> None:
        """Fire and forget (never blocks a response): cumulative totals, so a late or lost
        push is repaired by the next one or by this replica's next ``metrics_snapshot``."""
        try:  # a fresh context: not a child call of this request, so a disconnect never cancels it
            contextvars.Context().run(self.handle.record_http.remote, replica, totals)
        except Exception:
            log.debug("could not count an HTTP response", exc_info=True)
