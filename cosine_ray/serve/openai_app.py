"""The OpenAI-compatible HTTP layer: a plain FastAPI app over any ``EngineClient``.

No Ray here: ``build_openai_app`` is served by uvicorn, wrapped by a Serve ingress, or driven
in-process by tests. Per request:

    validate (schemas) → model + supported-feature checks → prompt token ids → max_tokens
    → engine.check_request → engine.stream → TextStream (incremental detokenization, stop
    strings) → JSON response or SSE chunks ... ``data: [DONE]``

NOTE(serve): every engine iterator is closed on every path (finish, stop string, error, client
disconnect, cancellation): closing it is what aborts the request in the engine (at a stop
string the engine is first told the request finished, so it counts as a completion). Streaming waits
for the first engine output before sending headers, so errors that happen before the first
token (validation in the engine, overload, a recovering stage) still get a real status code.

This module holds the app and its routes; the per-request machinery (``Admission``,
``Generation``, ``TextStream``, SSE, disconnects) is in ``cosine_ray.serve.generation``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.types import ASGIApp, Receive, Scope, Send

from cosine_ray.engine.client import EngineClient
from cosine_ray.engine.request import SamplingParams
from cosine_ray.serve.errors import (DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, CatchAllMiddleware,
                                     EngineUnavailable, HeaderLimitMiddleware, InvalidRequest, NotFound,
                                     OpenAIError, error_payload, error_response, install_error_handlers)
from cosine_ray.serve.generation import Admission, Generation, SSEResponse, sse, unless_disconnected
from cosine_ray.serve.metrics_http import METRICS_PATH, HttpCounts, HttpMetricsMiddleware, metrics_response
from cosine_ray.serve.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                      CompletionChoice, CompletionRequest, CompletionResponse,
                                      ErrorResponse, ModelCard, ModelList, Usage)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: min(this, context left after the prompt)."""
PUBLIC_PATHS = frozenset({"/health", METRICS_PATH})
"""Routes that need no API key (Prometheus scrapes carry none; ``metrics_require_key`` drops
``/metrics`` from this set)."""


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
        except TemplateError as exc:  # the template rejects the conversation (e.g. role order)
            raise InvalidRequest(f"messages do not fit the model's chat template: {str(exc).splitlines()[0]}",
                                 param="messages") from None
        except Exception:  # the tokenizer failed: say so without its internals
            log.warning("chat template or tokenizer failed", exc_info=True)
            raise InvalidRequest("messages could not be tokenized with the model's chat template",
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
