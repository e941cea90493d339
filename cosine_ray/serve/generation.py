"""One generation request's lifecycle in the OpenAI layer, from admission to the last byte:

* ``Readiness``: what ``/health`` answers, at once, while the engine starts or recovers;
* ``Generation``: one engine request seen as text (``serve.text.stream.TextStream``: incremental
  detokenization and stop strings), with the server-side request timeout; closing it aborts the
  request in the engine and frees its admission slot (``serve.guards.admission``). A stop string ends
  it as a normal completion: the engine is told (``EngineClient.finish``) before the stream is
  closed, so its metrics count ``stop`` (with the request's latency), not ``abort``;
* ``unless_disconnected``, ``SSEResponse`` and ``sse``: cancelling the work or the event stream
  when the client goes away (or cannot keep up), and formatting server-sent events.

``cosine_ray.serve.openai_app`` builds the routes on these.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

from cosine_ray.engine.client import EngineClient
from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.engine.request import NO_TENANT, REFUSED, RequestStats, SamplingParams, Tenant
from cosine_ray.serve.errors import EngineUnavailable, InvalidRequest, OpenAIError, RequestTimeout
from cosine_ray.serve.schemas import CosineRayStats, PromptTokensDetails, Usage
from cosine_ray.serve.text.stream import TextStream  # noqa: F401 - importable from here too

log = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_ANSWER_S = 0.5
"""Longest ``/health`` waits for the engine before answering with what it knows."""
HEALTH_PROBE_TIMEOUT_S = 5.0
FINISH_NOTICE_TIMEOUT_S = 1.0
"""Longest wait for the engine to take a stop-string finish; past it the stream is closed
anyway (the request is freed all the same, and counted as an abort)."""
DEFAULT_SEND_TIMEOUT_S = 30.0
"""Longest a streamed response waits for its client to take the next bytes: a client that
cannot keep up is dropped and its work in the engine cancelled (``SSEResponse``)."""


class Readiness:
    """``/health`` answers at once: it asks the engine in the background (one probe at a time,
    ``HEALTH_PROBE_TIMEOUT_S`` each) and waits at most ``HEALTH_ANSWER_S`` for it; until the
    engine has answered once the status is ``starting`` (503), later the last answer stands.
    A probe that fails before the engine ever answered is its start (Serve holds calls to a
    replica still in ``__init__``: model load, stage actors), logged at debug; once it has
    answered, a failed probe is a warning."""

    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine
        self.last = "starting"
        self._probe: asyncio.Future | None = None

    async def _ask(self) -> str:
        try:
            info = await asyncio.wait_for(self.engine.health(), timeout=HEALTH_PROBE_TIMEOUT_S)
            self.last = str(info.get("status", "unknown"))
        except Exception as exc:
            why = (f"no answer within {HEALTH_PROBE_TIMEOUT_S:g} s" if isinstance(exc, asyncio.TimeoutError)
                   else f"{type(exc).__name__}: {exc}")
            if self.last == "starting":
                log.debug("engine still starting (health probe: %s)", why)
            else:
                log.warning("health check failed: %s", why)
                self.last = "unreachable"
        return self.last

    async def status(self) -> str:
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ask())
        try:
            return await asyncio.wait_for(asyncio.shield(self._probe), timeout=HEALTH_ANSWER_S)
        except asyncio.TimeoutError:
            return self.last if self.last != "ok" else "unresponsive"


class Generation:
    """One engine request seen as text: ``step()`` until ``is_done``; always ``aclose()``."""

    def __init__(self, engine: EngineClient, tokenizer: Any, prompt_token_ids: list[int],
                 params: SamplingParams, stop: Sequence[str], request_id: str,
                 on_close: Callable[[], None] | None = None, deadline: float | None = None,
                 every_s: float = 0.0, refusal: Callable[[BaseException], OpenAIError] | None = None,
                 tenant: Tenant = NO_TENANT) -> None:
        self._on_close = on_close
        if on_close is not None:  # a Generation dropped without aclose() still frees its slot
            weakref.finalize(self, on_close)
        self.deadline = deadline
        """``time.monotonic()`` by which the request must finish (server-side timeout), or None."""
        self.engine = engine
        self.outputs = engine.stream(prompt_token_ids, params, request_id, every_s, tenant=tenant)
        """``every_s``: a response not streamed needs its text only at the end, and a stop string
        found up to ``every_s`` late only costs the engine those extra tokens (``EngineClient.stream``)."""
        self.text = TextStream(tokenizer, stop)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.request_id = request_id
        self.finish_reason: str | None = None
        self.stats: RequestStats | None = None
        self.is_done = False
        self._num_outputs = 0
        self.logprobs: list[TokenLogprob] = []
        """The generated tokens' log-probabilities so far (when the request asked)."""
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        self._num_taken = 0
        self.engine_replica: str | None = None
        """The engine replica that produced its latest output (None: not known, e.g. in process)."""
        self._refusal = refusal or (lambda exc: InvalidRequest("the engine cannot serve this request"))
        """The client's error for an engine ValueError at submission (its text is internal)."""

    async def _next_output(self) -> Any:
        if self.deadline is None:
            return await self.outputs.__anext__()
        remaining = self.deadline - time.monotonic()
        try:
            # asyncio.timeout, not wait_for: wait_for runs __anext__ in another task, and a
            # cancellation arriving meanwhile (client disconnect) leaves that task running the
            # generator, so the aclose() that aborts the request fails ("already running").
            async with asyncio.timeout(max(remaining, 0.0)):
                return await self.outputs.__anext__()
        except TimeoutError:
            await self.aclose()  # cancels the engine request: its state is freed at the next step
            raise RequestTimeout("the request ran past the server's request timeout and was cancelled",
                                 code="timeout") from None

    async def step(self) -> str:
        try:
            out = await self._next_output()
        except StopAsyncIteration:
            raise EngineUnavailable("the engine ended the request without finishing it") from None
        except OpenAIError:
            raise
        except Exception as exc:
            if isinstance(exc, ValueError) and self._num_outputs == 0:  # rejected at submission
                log.info("engine refused %s: %s", self.request_id, exc)
                raise self._refusal(exc) from None
            log.exception("engine error in %s", self.request_id)
            raise EngineUnavailable("the engine failed while generating; retry") from None
        self._num_outputs += 1
        replica_of = getattr(self.engine, "replica_of", None)  # the engine client knows where it runs now
        self.engine_replica = (replica_of(self.request_id) if replica_of else None) or self.engine_replica
        if out.finish_reason == REFUSED:  # the request's own rules left no token: its fault alone
            log.info("engine ended %s: %s", self.request_id, out.error)
            raise InvalidRequest(f"no token can follow the first {out.num_output_tokens} generated tokens: the "
                                 "request's grammar, min_tokens, stop_token_ids and logit_bias together allow none",
                                 code="no_token_allowed")
        if out.error or (out.finished and out.finish_reason not in ("stop", "length")):
            log.warning("request %s failed in the engine: %s (%s)", self.request_id, out.error,
                        out.finish_reason)
            raise EngineUnavailable("the engine failed while generating; retry")
        self.stats = out.stats or self.stats
        self.logprobs.extend(out.logprobs or ())
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        delta = self.text.add(out.new_token_ids, is_final=out.finished)
        if self.text.is_stopped:
            del self.logprobs[len(self.text.token_ids):]  # those of tokens past the stop
        if self.text.is_stopped or out.finished:
            self.finish_reason = "stop" if self.text.is_stopped else out.finish_reason
            self.is_done = True
            if not out.finished:
                await self._finish_in_engine()
            await self.aclose()
        return delta

    async def _finish_in_engine(self) -> None:
        """A stop string ended the text while the engine was still generating: tell the engine
        this is a normal completion (``finished_reason="stop"``, latency observed) before the
        close frees the request. Best effort: a response is never failed or held up over a
        metric (an engine client without ``finish``, e.g. a test fake, just gets the close)."""
        finish = getattr(self.engine, "finish", None)
        if finish is None:
            return
        try:
            async with asyncio.timeout(FINISH_NOTICE_TIMEOUT_S):
                await finish(self.request_id)
        except Exception:
            log.debug("could not tell the engine that %s finished", self.request_id, exc_info=True)

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities that arrived since the last call (a streamed chunk's)."""
        new, self._num_taken = self.logprobs[self._num_taken:], len(self.logprobs)
        return new

    @property
    def num_tokens(self) -> int:
        return len(self.text.token_ids)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)

    async def collect(self) -> str:
        while not self.is_done:
            await self.step()
        return self.text.text

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.outputs.aclose()
            finally:
                if self._on_close is not None:
                    self._on_close()

    def usage(self) -> Usage:
        n = len(self.text.token_ids)
        cached = self.stats.num_cached_tokens if self.stats is not None else 0
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=n,
                     total_tokens=self.num_prompt_tokens + n,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def stats_block(self) -> CosineRayStats:
        s = self.stats or RequestStats()
        return CosineRayStats(num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                              mean_accepted_length=s.mean_accepted_length, num_verify_steps=s.num_verify_steps,
                              drafted_by=dict(s.drafted_by), accepted_by=dict(s.accepted_by),
                              domain=s.domain,
                              drafters_used=sorted(name for name, n in s.drafted_by.items() if n > 0),
                              pipedec_timesteps=s.pipedec_timesteps, pipedec_tokens=s.pipedec_tokens,
                              pipedec_hits=s.pipedec_hits, num_cached_tokens=s.num_cached_tokens,
                              num_preemptions=s.num_preemptions, engine_replica=self.engine_replica)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (raising ClientDisconnect) if the client goes away first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watcher):
            t.cancel()  # a no-op on a finished task
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


class SSEResponse(StreamingResponse):
    """Server-sent events that stop on client disconnect and always run ``on_close``. A client
    that takes no bytes for ``send_timeout_s`` (it stopped reading, or reads slower than tokens
    come) is dropped the same way: what the response still holds is bounded (the events are
    made one at a time, as the client takes them) and the engine work is cancelled. Behind Ray
    Serve the app's sends never block (the proxy buffers), so there the proxy's guard drops such
    a client (``serve.guards.proxy_guard``)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]], *,
                 send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S, headers: dict[str, str] | None = None) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._on_close = on_close
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed_send(message: Message) -> None:
            with anyio.fail_after(self.send_timeout_s):
                await send(message)

        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(timed_send)
                    except TimeoutError:  # before OSError, its base class
                        log.warning("dropped a client that took no bytes for %g s", self.send_timeout_s)
                    except OSError:  # the client went away (ASGI spec 2.4 servers)
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self._on_close()


ENGINE_REPLICA_HEADER = "x-cosine-ray-engine-replica"


def replica_header(generations: Sequence[Generation]) -> dict[str, str]:
    """``ENGINE_REPLICA_HEADER``: the engine replicas the generations ran on when the headers
    go (a comma list; the first output's for a stream, the last one's for a response that is
    not streamed); none where the engine client does not know them."""
    replicas = sorted({g.engine_replica for g in generations if g.engine_replica})
    return {ENGINE_REPLICA_HEADER: ",".join(replicas)} if replicas else {}


def sse(data: Any) -> str:
    body = data if isinstance(data, str) else data.model_dump_json(exclude_none=True)
    return f"data: {body}\n\n"
