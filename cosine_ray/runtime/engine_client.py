"""EngineClient over the engine deployment's ``DeploymentHandle``: what the ingress uses.

Tokens stream back through a Serve streaming call; every wait has a deadline and nothing here
blocks the event loop (no ``ray.get``). A lost engine ends the stream with an error output (the
ingress's 503), never a hang:

* the first item is ``Accepted`` (a live replica runs the call, and its id), awaited for
  ``call_timeout_s`` only: a call Serve holds while no engine replica is up gets its 503 in seconds;
* then outputs and, after each ``HEARTBEAT_S`` without one, ``ALIVE``: a stream silent for
  ``token_timeout_s`` lost its engine, even when Ray has not reported the replica dead;
* a ``Mailbox`` merges what the caller has not taken yet (a slow caller costs one output);
* failover (``failover_attempts`` > 0: several engine replicas): a stream whose replica is lost
  after it accepted the call is submitted again with the tokens it produced (``resume_token_ids``:
  the engine goes on as from a preemption, so greedy and seeded texts are an uninterrupted run's,
  no token sent twice or lost), each try waiting ``failover_wait_s`` for a replica; the
  caller's deadline still holds;
* closing the stream early cancels the call (Serve aborts it in the engine) and, as that is
  best effort, also sends an explicit ``abort`` in the background, to the replica it ran on.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from cosine_ray.engine.mailbox import Mailbox
from cosine_ray.engine.request import NO_TENANT, RequestOutput, RequestRefused, SamplingParams, Tenant, merge_outputs

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "cosine_ray_engine"
"""Serve deployment name of the engine (the ingress deployment is ``cosine_ray``)."""
ACCEPTED = "accepted"
"""What ``Accepted`` stands for where no replica id is known (a stand-in engine)."""
REPLICA_KWARG = "engine_replica"
"""The keyword with which a call names the engine replica it is for (the router reads it,
``runtime.engine_router``; ``EngineServer``'s abort and finish take and ignore it)."""
ALIVE = "alive"
"""An item of ``EngineServer.generate``'s stream after ``HEARTBEAT_S`` without an output."""
HEARTBEAT_S = 5.0
FAILOVER_BACKOFF_S = 0.5
"""Pause before the first resubmission of a stream whose replica was lost (doubled each time):
Serve's router learns of a dead replica within moments."""
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Accepted:
    """The first item of ``EngineServer.generate``'s stream: the call reached a live engine
    replica, the one named (Serve's replica id)."""

    replica: str


@dataclass(slots=True)
class EngineCall:
    """One request's stream as the client submitted it, and where it runs now."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    every_s: float
    tenant: Tenant
    gen: Any = None
    """The Serve streaming call of the current attempt."""
    engine_request_id: str = ""
    """The id the engine knows it by: ``request_id``, suffixed ``~<attempt>`` on a resubmission."""
    replica: str | None = None
    """The engine replica that accepted the current attempt."""
    produced: list[int] = field(default_factory=list)
    """Tokens sent to the caller so far."""


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
                 token_timeout_s: float = 30.0, call_timeout_s: float = 5.0, failover_attempts: int = 0,
                 failover_wait_s: float = 60.0) -> None:
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
        engine is up) and of a stream's ``Accepted``. While no engine replica is up, Serve holds a
        call until one is, so this is also how long a request waits for a restarting engine
        before its 503."""
        self.failover_attempts = failover_attempts
        """Resubmissions of a stream whose engine replica was lost (0: it ends with an error,
        the single-replica contract: a 503 at once)."""
        self.failover_wait_s = failover_wait_s
        """Longest a resubmission waits for a replica to accept it."""
        self._aborts: set[asyncio.Task] = set()
        """Explicit aborts in flight (held so they are not collected before they run)."""
        self._calls: dict[str, EngineCall] = {}
        """The open streams by request id (``finish`` and ``replica_of`` find their replica)."""

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        response = getattr(self.handle, method).remote(*args, **kwargs)
        try:
            return await asyncio.wait_for(response, timeout=timeout_s or self.call_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise

    def replica_of(self, request_id: str) -> str | None:
        """The engine replica an open stream runs on now (None: not known, or not open)."""
        call = self._calls.get(request_id)
        return call.replica if call is not None else None

    async def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     request_id: str, every_s: float = 0.0, tenant: Tenant = NO_TENANT) -> AsyncIterator[RequestOutput]:
        call = EngineCall(list(prompt_token_ids), params, request_id, every_s, tenant, engine_request_id=request_id)
        self._submit(call)
        self._calls[request_id] = call
        mailbox = Mailbox()
        reader = asyncio.ensure_future(self._read(call, mailbox))
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
                self._cancel(call)
            if not reader.done():
                reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if self._calls.get(request_id) is call:
                del self._calls[request_id]

    def _submit(self, call: EngineCall) -> None:
        """Start the call's current attempt (with the tokens it produced, if any)."""
        resume = {"resume_token_ids": tuple(call.produced)} if call.produced else {}
        call.gen = self.handle.options(stream=True).generate.remote(
            call.prompt_token_ids, call.params, call.engine_request_id, call.every_s, call.tenant, **resume)

    async def _read(self, call: EngineCall, mailbox: Mailbox) -> None:
        """The engine's items into ``mailbox`` as they come, until the request finishes. A lost
        engine (no ``Accepted`` within ``call_timeout_s``, no item within ``token_timeout_s``, an
        error) ends it with an error output, unless the stream was accepted and failover
        attempts are left: then it is submitted again from the tokens it produced. A stream that
        ends early closes the mailbox."""
        for attempt in range(self.failover_attempts + 1):
            try:
                await self._pump(call, mailbox, self.call_timeout_s if attempt == 0 else self.failover_wait_s)
                return
            except _Lost as lost:
                self._cancel(call)  # a held call must never start on the next replica
                retry = attempt < self.failover_attempts and lost.retriable(attempt)
                if not retry:
                    log.warning("request %s lost its engine: %r", call.request_id, lost.cause)
                    mailbox.put(RequestOutput(call.request_id, [], True, "error",
                                              error=f"engine unavailable: {type(lost.cause).__name__}"))
                    return
                log.warning("request %s lost engine replica %s after %d tokens (%r): resubmitting", call.request_id,
                            call.replica, len(call.produced), lost.cause)
                await asyncio.sleep(FAILOVER_BACKOFF_S * 2 ** attempt)
                call.engine_request_id, call.replica = f"{call.request_id}~{attempt + 1}", None
                self._submit(call)

    async def _pump(self, call: EngineCall, mailbox: Mailbox, accept_s: float) -> None:
        """One attempt's items into ``mailbox``; ``_Lost`` if its engine is lost."""
        accepted = False
        while True:
            try:
                out = await asyncio.wait_for(call.gen.__anext__(), timeout=self.token_timeout_s if accepted else accept_s)
                if not accepted:
                    if isinstance(out, Accepted):
                        call.replica = out.replica
                    elif out != ACCEPTED:
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
                raise _Lost(exc, accepted) from None
            call.produced.extend(out.new_token_ids)
            mailbox.put(out)
            if out.finished:
                return

    def _cancel(self, call: EngineCall) -> None:
        """Cancel the engine call (Serve cancels the engine's generator: the request is aborted
        there) and, in case that cancellation is lost, abort the request id explicitly, on the
        replica that accepted it when that is known."""
        call.gen.cancel()
        request_id = call.engine_request_id
        pin = {REPLICA_KWARG: call.replica} if call.replica else {}

        async def abort() -> None:
            try:
                await self._call("abort", request_id, **pin)
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
        call = self._calls.get(request_id)
        if call is None or call.replica is None:
            await self._call("finish", request_id)
        else:
            await self._call("finish", call.engine_request_id, **{REPLICA_KWARG: call.replica})

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


class _Lost(Exception):
    """An attempt lost its engine: ``cause``; ``accepted``: after a replica accepted it."""

    def __init__(self, cause: BaseException, accepted: bool) -> None:
        super().__init__(repr(cause))
        self.cause = cause
        self.accepted = accepted

    def retriable(self, attempt: int) -> bool:
        """Whether submitting it again may help: not for a refusal (a ValueError) or a stream
        that began with something else than ``Accepted`` (a RuntimeError here), nor for a first
        call no replica accepted in time (no replica is up: admission's 503, as with one)."""
        if isinstance(self.cause, (ValueError, RuntimeError)):
            return False
        return self.accepted or attempt > 0 or not isinstance(self.cause, asyncio.TimeoutError)
