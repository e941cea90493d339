"""One generation request's lifecycle in the OpenAI layer, from admission to the last byte:

* ``Admission``: the bound on generations in flight (503 + Retry-After past it);
* ``Readiness``: what ``/health`` answers, at once, while the engine starts or recovers;
* ``Generation``: one engine request seen as text (``TextStream``: incremental detokenization
  and stop strings), with the server-side request timeout; closing it aborts the request in
  the engine and frees its admission slot. A stop string ends it as a normal completion: the
  engine is told (``EngineClient.finish``) before the stream is closed, so its metrics count
  ``stop`` (with the request's latency), not ``abort``;
* ``unless_disconnected``, ``SSEResponse`` and ``sse``: cancelling the work or the event stream
  when the client goes away, and formatting server-sent events.

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
from starlette.types import Receive, Scope, Send

from cosine_ray.engine.client import EngineClient
from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.engine.request import RequestStats, SamplingParams
from cosine_ray.serve.errors import (OVERLOADED_CODE, EngineUnavailable, InvalidRequest, OpenAIError,
                                     RequestTimeout)
from cosine_ray.serve.schemas import CosineRayStats, PromptTokensDetails, Usage

log = logging.getLogger(__name__)

T = TypeVar("T")

HEALTH_ANSWER_S = 0.5
"""Longest ``/health`` waits for the engine before answering with what it knows."""
HEALTH_PROBE_TIMEOUT_S = 5.0
FINISH_NOTICE_TIMEOUT_S = 1.0
"""Longest wait for the engine to take a stop-string finish; past it the stream is closed
anyway (the request is freed all the same, and counted as an abort)."""


class TextStream:
    """Token ids → text deltas: decode everything, send the new suffix.

    Holds back a trailing U+FFFD (an incomplete UTF-8 sequence) and, with stop strings, the
    longest unsent suffix that could still begin a stop string; the text ends before the first
    stop string. Assumes decode(ids[:n]) is a prefix of decode(ids) once it has no trailing
    U+FFFD (true for byte-level BPE tokenizers with skip_special_tokens)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.token_ids: list[int] = []
        self.text = ""
        self.num_sent_chars = 0
        self.is_stopped = False

    def add(self, new_token_ids: Sequence[int], *, is_final: bool) -> str:
        num_before = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not is_final:
            text = text.rstrip("\ufffd")
        end = len(text)
        stop_at = self._first_stop(text)
        if stop_at is not None:
            end, self.is_stopped = stop_at, True
            del self.token_ids[self._num_tokens_to_stop(num_before):]
        elif not is_final:
            end -= self._num_held_back(text)
        self.text = text[:end] if self.is_stopped else text
        delta = text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return delta

    def _num_tokens_to_stop(self, num_before: int) -> int:
        """The fewest tokens whose text holds a stop string: the tokens an engine output (a
        speculative step, or several merged) carried past it are not the completion's, in its
        usage or its log-probabilities (vLLM counts up to the token that completed the stop)."""
        for n in range(num_before + 1, len(self.token_ids)):
            if self._first_stop(self.tokenizer.decode(self.token_ids[:n], skip_special_tokens=True)) is not None:
                return n
        return len(self.token_ids)

    def _first_stop(self, text: str) -> int | None:
        """Where the first stop string begins in the unsent part of ``text``, or None."""
        hits = [i for i in (text.find(s, self.num_sent_chars) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _num_held_back(self, text: str) -> int:
        longest = min(max((len(s) for s in self.stop), default=1) - 1, len(text) - self.num_sent_chars)
        for k in range(longest, 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0


class Admission:
    """Bounded admission: at most ``max_pending`` generation requests in this replica at once
    (running in the engine or waiting in its queue); one more is rejected at once with 503 +
    ``Retry-After`` instead of queueing without bound.

    ``try_acquire`` is synchronous (no await between the check and the increment), so with
    N + k concurrent requests exactly k are rejected while the first N are in flight. The
    slot is released when the request's engine stream is closed (finish, error, disconnect,
    timeout), via ``Generation.aclose``; ``release`` is idempotent per slot."""

    def __init__(self, max_pending: int | None) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError("max_pending_requests must be >= 1")
        self.max_pending = max_pending
        self.num_pending = 0
        self.num_rejected = 0

    def try_acquire(self) -> Callable[[], None]:
        """A release callback, or EngineUnavailable (503) when the replica is full."""
        if self.max_pending is not None and self.num_pending >= self.max_pending:
            self.num_rejected += 1
            raise EngineUnavailable(f"the server is at capacity ({self.max_pending} requests in flight); "
                                    "retry later", retry_after=1.0, code=OVERLOADED_CODE)
        self.num_pending += 1
        is_released = False

        def release() -> None:
            nonlocal is_released
            if not is_released:
                is_released = True
                self.num_pending -= 1

        return release


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
                 every_s: float = 0.0) -> None:
        self._on_close = on_close
        if on_close is not None:  # a Generation dropped without aclose() still frees its slot
            weakref.finalize(self, on_close)
        self.deadline = deadline
        """``time.monotonic()`` by which the request must finish (server-side timeout), or None."""
        self.engine = engine
        self.outputs = engine.stream(prompt_token_ids, params, request_id, every_s)
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
                raise InvalidRequest(str(exc)) from None
            log.exception("engine error in %s", self.request_id)
            raise EngineUnavailable("the engine failed while generating; retry") from None
        self._num_outputs += 1
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
                              num_preemptions=s.num_preemptions)


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
    """Server-sent events that stop on client disconnect and always run ``on_close``."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
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


def sse(data: Any) -> str:
    body = data if isinstance(data, str) else data.model_dump_json(exclude_none=True)
    return f"data: {body}\n\n"
