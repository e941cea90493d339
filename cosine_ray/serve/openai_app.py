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
import dataclasses
import hmac
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from starlette.types import ASGIApp, Receive, Scope, Send

from cosine_ray.engine.client import EngineClient
from cosine_ray.engine.request import SamplingParams, StructuredOutput
from cosine_ray.serve.errors import (DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware, CatchAllMiddleware,
                                     EngineUnavailable, HeaderLimitMiddleware, InvalidRequest, NotFound,
                                     OpenAIError, error_payload, error_response, install_error_handlers)
from cosine_ray.serve import tools
from cosine_ray.serve.choices import ChatDeltas, Choice, Logprobs, interleave
from cosine_ray.serve.generation import Admission, Generation, Readiness, SSEResponse, sse, unless_disconnected
from cosine_ray.serve.metrics_http import METRICS_PATH, HttpCounts, HttpMetricsMiddleware, metrics_response
from cosine_ray.serve.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                      CompletionChoice, CompletionRequest, CompletionResponse,
                                      ErrorResponse, ModelCard, ModelList, PromptTokensDetails, Usage)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: min(this, context left after the prompt)."""
NOT_STREAMED_EVERY_S = 0.1
"""A response that is not streamed gets the engine's outputs merged to one per 0.1 s at most
(``EngineClient.stream``): each output crossing from the engine to the ingress costs both
processes CPU time that a small machine takes from the forward. A stop string is then found up
to 0.1 s late; the tokens generated meanwhile leave the text, the usage and the log-probabilities
(``TextStream``)."""
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
    readiness = Readiness(engine)
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
        messages, tool_list = tools.render(req, tokenizer)
        kwargs = {"tools": tool_list} if tool_list else {}
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
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

    def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, num_logprobs: int | None,
                        structured: StructuredOutput | None) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
                seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                logit_bias=tuple(req.logit_bias), logprobs=num_logprobs, prompt_logprobs=req.prompt_logprobs,
                structured=structured)
        except ValueError as exc:
            param = "min_tokens" if "min_tokens" in str(exc) else None
            raise InvalidRequest(str(exc), param=param) from None

    async def start(req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], prompt_param: str,
                    request_id: str, *, structured: tuple[StructuredOutput, str] | None,
                    num_choices: int, num_logprobs: int | None) -> list[Choice]:
        """Check the request with the engine and start one generation per choice (each its own
        engine request and sampling key: seed + i), and await each one's first output."""
        requested, max_tokens_param = req.requested_max_tokens
        room = engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequest(f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                                 f"{engine.max_model_len} tokens", param=prompt_param)
        if requested is not None and requested > room:
            raise InvalidRequest(f"{max_tokens_param}={requested} plus the prompt's {len(prompt_ids)} tokens "
                                 f"exceeds the model's context of {engine.max_model_len}; use "
                                 f"{max_tokens_param} <= {room}", param=max_tokens_param)
        spec, spec_param = structured or (None, None)
        params = sampling_params(req, requested or min(default_max_tokens, room), num_logprobs, spec)
        releases = [admission.try_acquire()]  # before any await: the count is exact
        try:
            for _ in range(num_choices - 1):
                releases.append(admission.try_acquire())
            await engine.check_request(prompt_ids, params)
        except ValueError as exc:
            for release in releases:
                release()
            msg = str(exc)
            raise InvalidRequest(msg, param=_param_of(msg, max_tokens_param, prompt_param, spec_param)) from None
        except BaseException as exc:  # cancelled (client gone), overloaded, engine down
            for release in releases:
                release()
            if isinstance(exc, (OpenAIError, asyncio.CancelledError)) or not isinstance(exc, Exception):
                raise
            log.exception("engine.check_request failed")
            raise EngineUnavailable("the engine could not check the request; retry") from None
        deadline = None if request_timeout_s is None else time.monotonic() + request_timeout_s
        choices = []
        for i, release in enumerate(releases):
            seed = None if params.seed is None else (params.seed + i) % 2**64
            choice_params = dataclasses.replace(params, seed=seed) if i else params
            rid = request_id if num_choices == 1 else f"{request_id}-{i}"
            choices.append(Choice(i, Generation(engine, tokenizer, prompt_ids, choice_params, req.stop, rid,
                                                on_close=release, deadline=deadline,
                                                every_s=0.0 if req.stream else NOT_STREAMED_EVERY_S)))
        return choices

    async def first_outputs(request: Request, choices: list[Choice]) -> None:
        """Each choice's first output before any header: errors before the first token get a
        real status code."""
        try:
            firsts = await unless_disconnected(request, asyncio.gather(*(c.gen.step() for c in choices)))
        except BaseException:
            await close_all(choices)
            raise
        for c, first in zip(choices, firsts):
            c.first = first

    async def close_all(choices: list[Choice]) -> None:
        await asyncio.gather(*(c.gen.aclose() for c in choices), return_exceptions=True)

    async def collect_all(request: Request, choices: list[Choice]) -> None:
        try:
            async def run(c: Choice) -> None:
                await c.gen.collect()
            await unless_disconnected(request, asyncio.gather(*(run(c) for c in choices)))
        finally:
            await close_all(choices)

    async def guarded_events(choices: list[Choice], events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Errors after the headers become an SSE error event; ``[DONE]`` always ends the stream."""
        try:
            async for event in events:
                yield event
        except OpenAIError as exc:
            yield sse(json.dumps(exc.payload()))
        except Exception:
            log.exception("stream %s failed", choices[0].gen.request_id)
            yield sse(json.dumps(error_payload(500, "internal server error")))
        finally:
            await close_all(choices)
        yield "data: [DONE]\n\n"

    def usage(choices: list[Choice]) -> Usage:
        n = sum(c.gen.num_tokens for c in choices)
        prompt = choices[0].gen.num_prompt_tokens
        cached = max((c.gen.usage().prompt_tokens_details.cached_tokens for c in choices), default=0)
        return Usage(prompt_tokens=prompt, completion_tokens=n, total_tokens=prompt + n,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def stats_block(req: Any, choices: list[Choice]) -> Any:
        return choices[0].gen.stats_block() if wants_stats(req) else None

    @app.post("/v1/chat/completions", response_model=None,
              responses={200: {"model": ChatCompletionResponse}})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        check_model(req.model)
        req.check_supported()
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        forced = tools.grammar(req)
        structured = req.structured or ((forced, "tools") if forced is not None else None)
        choices = await start(req, chat_prompt(req), "messages", rid, structured=structured,
                              num_choices=req.n, num_logprobs=req.num_logprobs)
        await first_outputs(request, choices)
        now = int(time.time())
        logprobs = Logprobs(tokenizer)

        def finish_reason(choice: Choice, has_calls: bool) -> str | None:
            return "tool_calls" if has_calls and choice.gen.finish_reason == "stop" or \
                has_calls and tools.mode(req) == "named" else choice.gen.finish_reason

        if not req.stream:
            await collect_all(request, choices)
            out = []
            for c in choices:
                content, calls = tools.parse(req, c.gen.text.text)
                out.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                                      finish_reason=finish_reason(c, bool(calls)),
                                      logprobs=logprobs.chat(c.gen.logprobs) if req.logprobs else None))
            body = ChatCompletionResponse(id=rid, created=now, model=model_name, usage=usage(choices), choices=out,
                                          cosine_ray=stats_block(req, choices),
                                          prompt_logprobs=logprobs.vllm_prompt(choices[0].gen.prompt_logprobs))
            return JSONResponse(body.model_dump(mode="json", exclude_none=True, by_alias=True))

        def chunk(choice: ChatChunkChoice | None) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=now, model=model_name, choices=[choice] if choice else [],
                                       usage=usage(choices) if req.continuous_usage else None)

        async def events() -> AsyncIterator[str]:
            streams = {c.index: ChatDeltas(req) for c in choices}
            for c in choices:
                yield sse(chunk(ChatChunkChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))))
            finished = set()
            async for c, delta, lps, last in interleave(choices):
                streamer = streams[c.index]
                out = streamer.feed(delta)
                if out is not None or lps and req.logprobs:
                    yield sse(chunk(ChatChunkChoice(index=c.index, delta=out or ChatDelta(),
                                                    logprobs=logprobs.chat(lps) if req.logprobs else None)))
                if last:
                    finished.add(c.index)
                    for rest in streamer.finish():
                        yield sse(chunk(ChatChunkChoice(index=c.index, delta=rest)))
                    final = chunk(ChatChunkChoice(index=c.index, delta=ChatDelta(),
                                                  finish_reason=finish_reason(c, streamer.has_calls)))
                    if len(finished) == len(choices):
                        final.cosine_ray = stats_block(req, choices)
                    yield sse(final)
            if req.include_usage:
                yield sse(ChatCompletionChunk(id=rid, created=now, model=model_name, choices=[], usage=usage(choices)))

        return SSEResponse(guarded_events(choices, events()), on_close=lambda: close_all(choices))

    @app.post("/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
    async def completions(req: CompletionRequest, request: Request) -> Any:
        check_model(req.model)
        req.check_supported()
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompt_ids = completion_prompt(req)
        k = req.num_logprobs
        ranked = req.num_generated > req.n  # best_of: rank by the model's own log-probability
        num_logprobs = (k or 0) if ranked or k is not None else None
        if req.echo and k is not None and req.prompt_logprobs is None:
            req.prompt_logprobs = k
        choices = await start(req, prompt_ids, "prompt", rid, structured=req.structured,
                              num_choices=req.num_generated, num_logprobs=num_logprobs)
        await first_outputs(request, choices)
        now = int(time.time())
        logprobs = Logprobs(tokenizer)
        prompt_text = (req.prompt if isinstance(req.prompt, str) else tokenizer.decode(prompt_ids)) if req.echo else ""

        def choice_logprobs(c: Choice, lps: list, token_ids: list[int], offset: int, with_prompt: bool):
            if k is None:
                return None
            if with_prompt and req.echo:
                prompt_lps = list(c.gen.prompt_logprobs or [None] * len(prompt_ids))
                return logprobs.completion(prompt_lps + lps, prompt_ids + token_ids, 0)
            return logprobs.completion(lps, token_ids, offset)

        if not req.stream:
            await collect_all(request, choices)
            if ranked:
                choices = sorted(choices, key=lambda c: -c.gen.cumulative_logprob)[:req.n]
            out = [CompletionChoice(index=i, text=prompt_text + c.gen.text.text, finish_reason=c.gen.finish_reason,
                                    logprobs=choice_logprobs(c, c.gen.logprobs, c.gen.text.token_ids,
                                                             len(prompt_text), True),
                                    prompt_logprobs=logprobs.vllm_prompt(c.gen.prompt_logprobs))
                   for i, c in enumerate(choices)]
            body = CompletionResponse(id=rid, created=now, model=model_name, usage=usage(choices), choices=out,
                                      cosine_ray=stats_block(req, choices))
            return JSONResponse(body.model_dump(mode="json", exclude_none=True))

        def chunk(choice: CompletionChoice | None, **extra: Any) -> CompletionResponse:
            return CompletionResponse(id=rid, created=now, model=model_name, choices=[choice] if choice else [],
                                      usage=usage(choices) if req.continuous_usage else None, **extra)

        async def events() -> AsyncIterator[str]:
            sent = {c.index: 0 for c in choices}
            if req.echo:
                for c in choices:
                    yield sse(chunk(CompletionChoice(
                        index=c.index, text=prompt_text,
                        logprobs=None if k is None else logprobs.completion(
                            list(c.gen.prompt_logprobs or [None] * len(prompt_ids)), prompt_ids, 0),
                        prompt_logprobs=logprobs.vllm_prompt(c.gen.prompt_logprobs))))
            finished = set()
            async for c, delta, lps, last in interleave(choices):
                n = len(lps)
                if delta or (lps and k is not None):
                    ids = c.gen.text.token_ids[sent[c.index]:sent[c.index] + n]
                    yield sse(chunk(CompletionChoice(index=c.index, text=delta,
                                                     logprobs=choice_logprobs(c, lps, ids, 0, False))))
                sent[c.index] += n
                if last:
                    finished.add(c.index)
                    done = len(finished) == len(choices)
                    yield sse(chunk(CompletionChoice(index=c.index, text="", finish_reason=c.gen.finish_reason),
                                    cosine_ray=stats_block(req, choices) if done else None))
            if req.include_usage:
                yield sse(CompletionResponse(id=rid, created=now, model=model_name, choices=[], usage=usage(choices)))

        return SSEResponse(guarded_events(choices, events()), on_close=lambda: close_all(choices))

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
        status = await readiness.status()
        if status == "ok":
            return {"status": "ok"}
        body = {"status": status, **error_payload(503, f"engine status: {status}")}
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.get(METRICS_PATH, include_in_schema=False)
    async def metrics() -> Any:
        return await metrics_response(engine, http_counts)

    known_paths = frozenset(getattr(r, "path", "") for r in app.routes)
    return app


def _param_of(message: str, max_tokens_param: str, prompt_param: str, grammar_param: str | None) -> str:
    """The request field an engine ValueError is about (by the message's first words)."""
    for field in ("logit_bias", "stop_token_ids", "min_tokens"):
        if message.startswith(field):
            return field
    if message.startswith(("the json schema", "the regex", "the choice", "the lark", "structured outputs",
                           "choice must")) and grammar_param is not None:
        return grammar_param
    return max_tokens_param if message.startswith("max_tokens") else prompt_param
