"""The OpenAI-compatible HTTP layer: a plain FastAPI app over any ``EngineClient``.

No Ray here: ``build_openai_app`` is served by uvicorn, wrapped by a Serve ingress, or driven
in-process by tests. Per request:

    validate (schemas) → model + supported-feature checks → prompt token ids → max_tokens
    → engine.check_request → engine.stream → TextStream (incremental detokenization, stop
    strings) → JSON response or SSE chunks ... ``data: [DONE]``

NOTE(serve): every engine iterator is closed on every path (finish, stop string, error, client
disconnect, cancellation): closing it is what aborts the request in the engine. Streaming waits
for the first engine output before sending headers, so errors that happen before the first
token (validation in the engine, overload, a recovering stage) still get a real status code.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from cosine_ray.engine.client import EngineClient
from cosine_ray.engine.request import RequestStats, SamplingParams
from cosine_ray.serve.errors import (DEFAULT_MAX_BODY_BYTES, OVERLOADED_CODE, BodyLimitMiddleware,
                                     CatchAllMiddleware, EngineUnavailable, HeaderLimitMiddleware,
                                     InvalidRequest, NotFound, OpenAIError, RequestTimeout, error_payload,
                                     error_response, install_error_handlers)
from cosine_ray.serve.metrics_http import METRICS_PATH, HttpCounts, HttpMetricsMiddleware, metrics_response
from cosine_ray.serve.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                      CompletionChoice, CompletionRequest, CompletionResponse,
                                      CosineRayStats, ErrorResponse, ModelCard, ModelList, Usage)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: min(this, context left after the prompt)."""
PUBLIC_PATHS = frozenset({"/health", METRICS_PATH})
"""Routes that need no API key (Prometheus scrapes carry none; ``metrics_require_key`` drops
``/metrics`` from this set)."""
T = TypeVar("T")


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
        self.token_ids.extend(new_token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if not is_final:
            text = text.rstrip("\ufffd")
        end = len(text)
        hits = [i for i in (text.find(s, self.num_sent_chars) for s in self.stop) if i >= 0]
        if hits:
            end, self.is_stopped = min(hits), True
        elif not is_final:
            end -= self._num_held_back(text)
        self.text = text[:end] if self.is_stopped else text
        delta = text[self.num_sent_chars:end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return delta

    def _num_held_back(self, text: str) -> int:
        longest = min(max((len(s) for s in self.stop), default=1) - 1, len(text) - self.num_sent_chars)
        for k in range(longest, 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0


class Admission:
    """Bounded admission: at most ``max_pending`` generation requests in this replica at once
    (running in the engine or waiting in its queue); one more is rejected at once with 503 +
    ``Retry-After`` instead of queueing without bound (reliability guide R8).

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


class Generation:
    """One engine request seen as text: ``step()`` until ``is_done``; always ``aclose()``."""

    def __init__(self, engine: EngineClient, tokenizer: Any, prompt_token_ids: list[int],
                 params: SamplingParams, stop: Sequence[str], request_id: str,
                 on_close: Callable[[], None] | None = None, deadline: float | None = None) -> None:
        self._on_close = on_close
        if on_close is not None:  # a Generation dropped without aclose() still frees its slot
            weakref.finalize(self, on_close)
        self.deadline = deadline
        """``time.monotonic()`` by which the request must finish (server-side timeout), or None."""
        self.outputs = engine.stream(prompt_token_ids, params, request_id)
        self.text = TextStream(tokenizer, stop)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.request_id = request_id
        self.finish_reason: str | None = None
        self.stats: RequestStats | None = None
        self.is_done = False
        self._num_outputs = 0

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
        delta = self.text.add(out.new_token_ids, is_final=out.finished)
        if self.text.is_stopped or out.finished:
            self.finish_reason = "stop" if self.text.is_stopped else out.finish_reason
            self.is_done = True
            await self.aclose()
        return delta

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
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=n,
                     total_tokens=self.num_prompt_tokens + n)

    def stats_block(self) -> CosineRayStats:
        s = self.stats or RequestStats()
        return CosineRayStats(num_draft_tokens=s.num_draft_tokens, num_accepted_tokens=s.num_accepted_tokens,
                              mean_accepted_length=s.mean_accepted_length, num_verify_steps=s.num_verify_steps,
                              drafted_by=dict(s.drafted_by), accepted_by=dict(s.accepted_by),
                              domain=s.domain,
                              drafters_used=sorted(name for name, n in s.drafted_by.items() if n > 0))


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


class ApiKeyMiddleware:
    """``Authorization: Bearer KEY`` on every path except PUBLIC_PATHS (constant-time compare)."""

    def __init__(self, app: ASGIApp, *, api_key: str, public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given.strip(), self.expected):
                response = error_response(401, "missing or invalid API key: send `Authorization: Bearer KEY`",
                                          headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def build_openai_app(engine: EngineClient, tokenizer: Any, *, model_name: str,
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
                     default_max_tokens: int = DEFAULT_MAX_TOKENS, return_spec_stats: bool = False,
                     metrics_require_key: bool = False, max_pending_requests: int | None = None,
                     request_timeout_s: float | None = None) -> FastAPI:
    """The OpenAI-compatible app. ``tokenizer`` is the target's HF tokenizer (chat template).
    ``return_spec_stats`` adds the ``cosine_ray`` stats block to every completion (otherwise
    only when a request asks with ``cosine_ray_stats``); ``metrics_require_key`` makes
    ``GET /metrics`` need the API key too (by default it is public, like ``/health``).
    ``max_pending_requests`` bounds the generations in flight (``Admission``: one more gets
    503 + Retry-After); ``request_timeout_s`` bounds one generation's wall time from its
    admission: past it the engine request is cancelled and the client gets 408 (before the
    first streamed byte) or an SSE error event with the 408 payload, then ``[DONE]``."""
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError("request_timeout_s must be > 0")
    admission = Admission(max_pending_requests)
    app = FastAPI(title="cosine_ray", summary="OpenAI-compatible lossless speculative decoding",
                  responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                             503: {"model": ErrorResponse}})
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    if api_key:
        public = PUBLIC_PATHS - {METRICS_PATH} if metrics_require_key else PUBLIC_PATHS
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public_paths=public)
    app.add_middleware(HeaderLimitMiddleware)  # added after (outside) the key check: runs first
    app.add_middleware(CatchAllMiddleware)
    known_paths: frozenset[str] = frozenset()
    http_counts = HttpCounts(engine)
    app.add_middleware(HttpMetricsMiddleware, counts=http_counts,  # outermost: counts 401/413/500
                       known_paths=lambda: known_paths)
    created = int(time.time())

    def wants_stats(req: ChatCompletionRequest | CompletionRequest) -> bool:
        return return_spec_stats or req.cosine_ray_stats

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise NotFound(f"model {model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def chat_prompt(req: ChatCompletionRequest) -> list[int]:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest(f"model {model_name} has no chat template; use /v1/completions",
                                 param="messages")
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template rejects the conversation (e.g. role order)
            raise InvalidRequest(f"messages do not fit the model's chat template: {exc}",
                                 param="messages") from None
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def completion_prompt(req: CompletionRequest) -> list[int]:
        if isinstance(req.prompt, str):
            ids = [int(t) for t in tokenizer(req.prompt, add_special_tokens=True)["input_ids"]]
            if not ids:
                raise InvalidRequest("prompt encodes to no tokens", param="prompt")
            return ids
        bad = [t for t in req.prompt if not 0 <= t < engine.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, "
                                 f"{engine.vocab_size})", param="prompt")
        return list(req.prompt)

    async def start(req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
                    prompt_param: str, request_id: str) -> Generation:
        requested, max_tokens_param = req.requested_max_tokens
        room = engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequest(f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                                 f"{engine.max_model_len} tokens", param=prompt_param)
        if requested is not None and requested > room:
            raise InvalidRequest(f"{max_tokens_param}={requested} plus the prompt's {len(prompt_ids)} tokens "
                                 f"exceeds the model's context of {engine.max_model_len}; use "
                                 f"{max_tokens_param} <= {room}", param=max_tokens_param)
        params = SamplingParams(max_tokens=requested or min(default_max_tokens, room),
                                temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                                seed=req.seed)
        release = admission.try_acquire()  # before any await: the count is exact
        try:
            await engine.check_request(prompt_ids, params)
        except ValueError as exc:
            release()
            msg = str(exc)
            raise InvalidRequest(msg, param=max_tokens_param if msg.startswith("max_tokens")
                                 else prompt_param) from None
        except Exception as exc:
            release()
            if isinstance(exc, OpenAIError):
                raise
            log.exception("engine.check_request failed")
            raise EngineUnavailable("the engine could not check the request; retry") from None
        except BaseException:  # cancelled (client gone)
            release()
            raise
        deadline = None if request_timeout_s is None else time.monotonic() + request_timeout_s
        return Generation(engine, tokenizer, prompt_ids, params, req.stop, request_id,
                          on_close=release, deadline=deadline)

    async def respond(request: Request, gen: Generation, complete: Callable[[str], Any],
                      events: Callable[[Generation, str], AsyncIterator[str]], is_stream: bool) -> Any:
        if not is_stream:
            try:
                text = await unless_disconnected(request, gen.collect())
            finally:
                await gen.aclose()
            return JSONResponse(complete(text).model_dump(mode="json", exclude_none=True))
        try:
            first = await unless_disconnected(request, gen.step())
        except BaseException:
            await gen.aclose()
            raise
        return SSEResponse(guarded_events(gen, events(gen, first)), on_close=gen.aclose)

    async def guarded_events(gen: Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Errors after the headers become an SSE error event; ``[DONE]`` always ends the stream."""
        try:
            async for event in events:
                yield event
        except OpenAIError as exc:
            yield sse(json.dumps(exc.payload()))
        except Exception:
            log.exception("stream %s failed", gen.request_id)
            yield sse(json.dumps(error_payload(500, "internal server error")))
        finally:
            await gen.aclose()
        yield "data: [DONE]\n\n"

    async def generate_deltas(gen: Generation, first: str) -> AsyncIterator[str]:
        delta = first
        while True:
            if delta:
                yield delta
            if gen.is_done:
                return
            delta = await gen.step()

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse}})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        req.check_supported()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        gen = await start(req, chat_prompt(req), "messages", rid)
        now = int(time.time())

        def complete(text: str) -> ChatCompletionResponse:
            return ChatCompletionResponse(
                id=rid, created=now, model=model_name, usage=gen.usage(),
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=gen.finish_reason)],
                cosine_ray=gen.stats_block() if wants_stats(req) else None)

        def chunk(delta: ChatDelta, finish_reason: str | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=now, model=model_name,
                                       choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

        async def events(gen: Generation, first: str) -> AsyncIterator[str]:
            yield sse(chunk(ChatDelta(role="assistant", content="")))
            async for delta in generate_deltas(gen, first):
                yield sse(chunk(ChatDelta(content=delta)))
            last = chunk(ChatDelta(), gen.finish_reason)
            last.cosine_ray = gen.stats_block() if wants_stats(req) else None
            yield sse(last)
            if req.include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=now, model=model_name, choices=[],
                                              usage=gen.usage()))

        return await respond(request, gen, complete, events, req.stream)

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        req.check_supported()
        rid = f"cmpl-{uuid.uuid4().hex}"
        gen = await start(req, completion_prompt(req), "prompt", rid)
        now = int(time.time())

        def response(text: str, finish_reason: str | None = None, *, usage: Usage | None = None,
                     stats: bool = False, choices: bool = True) -> CompletionResponse:
            return CompletionResponse(
                id=rid, created=now, model=model_name, usage=usage,
                choices=[CompletionChoice(text=text, finish_reason=finish_reason)] if choices else [],
                cosine_ray=gen.stats_block() if stats and wants_stats(req) else None)

        def complete(text: str) -> CompletionResponse:
            return response(text, gen.finish_reason, usage=gen.usage(), stats=True)

        async def events(gen: Generation, first: str) -> AsyncIterator[str]:
            async for delta in generate_deltas(gen, first):
                yield sse(response(delta))
            yield sse(response("", gen.finish_reason, stats=True))
            if req.include_usage:
                yield sse(response("", usage=gen.usage(), choices=False))

        return await respond(request, gen, complete, events, req.stream)

    def model_card() -> ModelCard:
        return ModelCard(id=model_name, created=created, max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id)
        return model_card()

    @app.get("/health")
    async def health() -> Any:
        try:
            info = await asyncio.wait_for(engine.health(), timeout=5.0)
            status = str(info.get("status", "unknown"))
        except Exception as exc:
            log.warning("health check failed: %s: %s", type(exc).__name__, exc)
            status = "unreachable"
        if status == "ok":
            return {"status": "ok"}
        body = {"status": status, **error_payload(503, f"engine status: {status}")}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics() -> Any:
        return await metrics_response(engine, http_counts)

    known_paths = frozenset(getattr(r, "path", "") for r in app.routes)
    return app
