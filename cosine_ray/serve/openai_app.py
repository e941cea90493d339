"""The OpenAI-compatible HTTP layer: a plain FastAPI app over any ``EngineClient``.

No Ray here: ``build_openai_app`` is served by uvicorn, wrapped by a Serve ingress, or driven
in-process by tests. The routes are module-level functions declared with ``@route``; each reads
the one ``ServerState`` (``serve.state``) through its ``State`` parameter, so adding a route is
adding one function here. ``build_openai_app`` makes the state and the app, adds the routes and
installs the error handlers and middlewares. A generation request goes:

    key (``serve.guards.tenants``) → validate (schemas, ``serve.guards.limits``) → the request's
    model (its engine and tokenizer: ``ServerState.for_model``) → supported-feature and
    vocabulary checks → prompt token ids (``serve.text.prompts``, off the event loop; a batch's
    each) → max_tokens → admission (``serve.guards.admission``, per key) → engine.check_request
    → engine.stream → TextStream (``serve.text.stream``) → JSON response or SSE chunks ...
    ``data: [DONE]``

Every engine iterator is closed on every path (finish, stop string, error, client disconnect,
cancellation): closing it is what aborts the request in the engine (``serve.choices``). Streaming
waits for the first engine output before sending headers, so errors that happen before the first
token (validation in the engine, overload, a recovering stage) still get a real status code.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from cosine_ray.engine.client import EngineClient
from cosine_ray.serve.text import tokenization, tools
from cosine_ray.serve.guards.admission import Admission
from cosine_ray.serve.choices import (ChatDeltas, Choice, Logprobs, close_all, collect_all, first_outputs,
                                      guarded_events, interleave, start_choices, usage)
from cosine_ray.serve.errors import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, BodyLimitMiddleware,
                                     CatchAllMiddleware, HeaderLimitMiddleware, error_payload, install_error_handlers)
from cosine_ray.serve.generation import DEFAULT_SEND_TIMEOUT_S, Readiness, SSEResponse, replica_header, sse
from cosine_ray.serve.guards.limits import check_duplicate_keys, check_vocabulary
from cosine_ray.serve.metrics_http import (METRICS_PATH, PUSH_INTERVAL_S, HttpCounts, HttpMetricsMiddleware,
                                          metrics_response)
from cosine_ray.serve.text.prompts import chat_prompt, completion_prompts, longest_token_chars
from cosine_ray.serve.schemas import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                      CompletionChoice, CompletionRequest, CompletionResponse,
                                      ErrorResponse, ModelCard, ModelList)
from cosine_ray.serve.state import DEFAULT_MAX_TOKENS, ServedModel, ServerState, State
from cosine_ray.serve.guards.tenants import ApiKey, ApiKeyMiddleware, key_ring, tenant_of
from cosine_ray.serve.text.tokenization import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                                TokenizeResponse)

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", METRICS_PATH})
"""Routes that need no API key (Prometheus scrapes carry none; ``metrics_require_key`` drops
``/metrics`` from this set)."""


try:
    VERSION = importlib.metadata.version("cosine_ray")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"
"""What ``GET /version`` answers (vLLM's route: ``{"version": ...}``)."""

ROUTES: list[tuple[str, str, Callable[..., Any], dict[str, Any]]] = []
"""(method, path, function, FastAPI options) of every route, in the order they are declared."""


def route(method: str, path: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a module-level function as a route of every app ``build_openai_app`` makes: it is
    added with ``app.add_api_route(path, function, methods=[method], **options)``, exactly as
    ``@app.post`` would. Not an included ``APIRouter``: recent FastAPI keeps one as a single opaque
    entry of ``app.routes``, hiding the paths that the HTTP metrics' ``known_paths`` need."""
    def declare(endpoint: Callable[..., Any]) -> Callable[..., Any]:
        ROUTES.append((method, path, endpoint, options))
        return endpoint
    return declare


def build_openai_app(engine: EngineClient, tokenizer: Any, *, model_name: str,
                     served_model_names: Sequence[str] | None = None,
                     more_models: Sequence[tuple[Sequence[str], EngineClient, Any]] = (),
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None,
                     api_keys: Iterable[ApiKey | Mapping[str, Any]] = (),
                     default_max_tokens: int = DEFAULT_MAX_TOKENS, return_spec_stats: bool = False,
                     metrics_require_key: bool = False, max_pending_requests: int | None = None,
                     request_timeout_s: float | None = None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                     send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
                     metrics_push_interval_s: float = PUSH_INTERVAL_S,
                     tool_call_parser: str = tools.DEFAULT_TOOL_CALL_PARSER,
                     chat_template: str | None = None) -> FastAPI:
    """The OpenAI-compatible app. ``tokenizer`` is the target's HF tokenizer (chat template).
    ``served_model_names``: the names a request may give the model by (vLLM's
    ``--served-model-name``; responses carry the first); default ``[model_name]``. ``more_models``:
    further models behind the same app, each (names, engine, tokenizer), chosen by a request's
    ``model`` (a request that names none gets the first model). ``api_key`` and ``api_keys``
    (``serve.guards.tenants``: each a tenant with its own limits) are the
    keys a request may carry; none: the app is open. ``return_spec_stats`` adds the
    ``cosine_ray`` stats block to every completion (otherwise only when a request asks with
    ``cosine_ray_stats``); ``metrics_require_key`` makes ``GET /metrics`` need a key too (by
    default it is public, like ``/health``). ``max_pending_requests`` bounds the generations in
    flight, shared fairly between keys (``serve.guards.admission``); ``request_timeout_s`` bounds one
    generation's wall time from its admission: past it the engine request is cancelled and the
    client gets 408 (before the first streamed byte) or an SSE error event with the 408 payload,
    then ``[DONE]``. ``body_timeout_s`` bounds the wait for a request's body (408), and
    ``send_timeout_s`` a stream's wait for its client to take bytes (dropped past it).
    ``metrics_push_interval_s``: how often at most HTTP counts are pushed to the engine.
    ``tool_call_parser``: the format of ``auto`` tool calls (``serve.text.tool_parsers``);
    ``chat_template``: a Jinja chat template used instead of the tokenizer's."""
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError("request_timeout_s must be > 0")
    if not send_timeout_s > 0:
        raise ValueError("send_timeout_s must be > 0")
    tool_call_parser = tools.tool_call_parser(tool_call_parser).name  # an unknown name: ValueError
    keys = key_ring(api_key, api_keys)
    models = served_models([(served_model_names or [model_name], engine, tokenizer), *more_models])
    first = models[0]
    admission = Admission(max_pending_requests)
    counts = HttpCounts(engine, extra=admission.metrics_totals, push_interval_s=metrics_push_interval_s)
    state = ServerState(engine=engine, tokenizer=tokenizer, model_name=first.names[0],
                        admission=admission, readiness=first.readiness,
                        http_counts=counts, default_max_tokens=default_max_tokens,
                        return_spec_stats=return_spec_stats, request_timeout_s=request_timeout_s,
                        send_timeout_s=send_timeout_s, max_token_chars=first.max_token_chars,
                        eos_token_ids=first.eos_token_ids, models=models,
                        tool_call_parser=tool_call_parser, chat_template=chat_template)
    app = FastAPI(title="cosine_ray", summary="OpenAI-compatible lossless speculative decoding",
                  responses={400: {"model": ErrorResponse}, 404: {"model": ErrorResponse},
                             429: {"model": ErrorResponse}, 503: {"model": ErrorResponse}})
    app.state.server = state
    for method, path, endpoint, options in ROUTES:
        app.add_api_route(path, endpoint, methods=[method], **options)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    if keys:  # outside the body limit: a request without a key is refused before its body is read
        public = PUBLIC_PATHS - {METRICS_PATH} if metrics_require_key else PUBLIC_PATHS
        app.add_middleware(ApiKeyMiddleware, keys=keys, public_paths=public)
    app.add_middleware(HeaderLimitMiddleware)  # added after (outside) the key check: runs first
    app.add_middleware(CatchAllMiddleware)
    known_paths = frozenset(getattr(r, "path", "") for r in app.routes)
    app.add_middleware(HttpMetricsMiddleware, counts=state.http_counts,  # outermost: counts 401/413/500
                       known_paths=lambda: known_paths)
    return app


def served_models(specs: Sequence[tuple[Sequence[str], EngineClient, Any]]) -> tuple[ServedModel, ...]:
    """(names, engine, tokenizer) of each model as ``ServedModel``s; ValueError for a model
    without a name or a name given twice."""
    models, seen = [], set()
    for names, engine, tokenizer in specs:
        names = tuple(str(n) for n in names)
        if not names or not all(names):
            raise ValueError("every served model needs a non-empty name")
        twice = sorted(seen & set(names)) or sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"model name {twice[0]!r} is given twice; each served name must be unique")
        seen.update(names)
        eos = getattr(tokenizer, "eos_token_id", None)
        models.append(ServedModel(names, engine, tokenizer, Readiness(engine), longest_token_chars(tokenizer),
                                  (eos,) if isinstance(eos, int) else ()))
    return tuple(models)


# ---- the routes ---------------------------------------------------------------------------------

@route("POST", "/v1/chat/completions", response_model=None, responses={200: {"model": ChatCompletionResponse}})
async def chat_completions(req: ChatCompletionRequest, request: Request, state: State) -> Any:
    state = state.for_model(req.model)
    await check_request(state, req, request)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    forced = tools.grammar(req)
    structured = req.structured or ((forced, "tools") if forced is not None else None)
    prompt_ids = await chat_prompt(state, req)
    choices = await start_choices(state, req, [prompt_ids], "messages", rid, tenant=tenant_of(request.scope),
                                  structured=structured, num_choices=req.n, num_logprobs=req.num_logprobs)
    await first_outputs(request, choices)
    now = int(time.time())
    logprobs = Logprobs(state.tokenizer)
    model_name = state.model_name

    def finish_reason(choice: Choice, has_calls: bool) -> str | None:
        return "tool_calls" if has_calls and choice.gen.finish_reason == "stop" or \
            has_calls and tools.mode(req) == "named" else choice.gen.finish_reason

    if not req.stream:
        await collect_all(request, choices)
        out = []
        for c in choices:
            content, calls = tools.parse(req, c.gen.text.text, state.tool_call_parser)
            out.append(ChatChoice(index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                                  finish_reason=finish_reason(c, bool(calls)),
                                  logprobs=logprobs.chat(c.gen.logprobs) if req.logprobs else None))
        body = ChatCompletionResponse(id=rid, created=now, model=model_name, usage=usage(choices), choices=out,
                                      cosine_ray=stats_block(state, req, choices),
                                      prompt_logprobs=logprobs.vllm_prompt(choices[0].gen.prompt_logprobs))
        return JSONResponse(body.model_dump(mode="json", exclude_none=True, by_alias=True),
                            headers=replica_header([c.gen for c in choices]))

    def chunk(choice: ChatChunkChoice | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, created=now, model=model_name, choices=[choice] if choice else [],
                                   usage=usage(choices) if req.continuous_usage else None)

    async def events() -> AsyncIterator[str]:
        streams = {c.index: ChatDeltas(req, state.tool_call_parser) for c in choices}
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
                    final.cosine_ray = stats_block(state, req, choices)
                yield sse(final)
        if req.include_usage:
            yield sse(ChatCompletionChunk(id=rid, created=now, model=model_name, choices=[], usage=usage(choices)))

    return SSEResponse(guarded_events(choices, events()), on_close=lambda: close_all(choices),
                       send_timeout_s=state.send_timeout_s, headers=replica_header([c.gen for c in choices]))


@route("POST", "/v1/completions", response_model=None, responses={200: {"model": CompletionResponse}})
async def completions(req: CompletionRequest, request: Request, state: State) -> Any:
    state = state.for_model(req.model)
    await check_request(state, req, request)
    rid = f"cmpl-{uuid.uuid4().hex}"
    prompts = await completion_prompts(state, req)
    k = req.num_logprobs
    per_prompt = req.num_generated
    ranked = per_prompt > req.n  # best_of: rank by the model's own log-probability
    num_logprobs = (k or 0) if ranked or k is not None else None
    if req.echo and k is not None and req.prompt_logprobs is None:
        req.prompt_logprobs = k
    choices = await start_choices(state, req, prompts, "prompt", rid, tenant=tenant_of(request.scope),
                                  structured=req.structured, num_choices=per_prompt, num_logprobs=num_logprobs)
    await first_outputs(request, choices)
    # only the first choice of each prompt asks for its log-probabilities (start_choices)
    firsts = {c.prompt: c.gen for c in choices if c.index % per_prompt == 0}
    now = int(time.time())
    logprobs = Logprobs(state.tokenizer)
    model_name = state.model_name
    prompt_texts = [(p if isinstance(p, str) else state.tokenizer.decode(ids)) if req.echo else ""
                    for p, ids in zip(req.prompts, prompts)]

    def prompt_logprobs(i: int) -> list:
        return list(firsts[i].prompt_logprobs or [None] * len(prompts[i]))

    def choice_logprobs(c: Choice, lps: list, token_ids: list[int], offset: int, with_prompt: bool):
        if k is None:
            return None
        if with_prompt and req.echo:
            return logprobs.completion(prompt_logprobs(c.prompt) + lps, prompts[c.prompt] + token_ids, 0)
        return logprobs.completion(lps, token_ids, offset)

    if not req.stream:
        await collect_all(request, choices)
        if ranked:  # each prompt's n most likely, in prompt order: choice j of prompt i is index i·n + j
            choices = [c for i in range(len(prompts)) for c in sorted(
                (c for c in choices if c.prompt == i), key=lambda c: -c.gen.cumulative_logprob)[:req.n]]
        out = [CompletionChoice(index=index, text=prompt_texts[c.prompt] + c.gen.text.text,
                                finish_reason=c.gen.finish_reason,
                                logprobs=choice_logprobs(c, c.gen.logprobs, c.gen.text.token_ids,
                                                         len(prompt_texts[c.prompt]), True),
                                prompt_logprobs=logprobs.vllm_prompt(firsts[c.prompt].prompt_logprobs))
               for index, c in enumerate(choices)]
        body = CompletionResponse(id=rid, created=now, model=model_name, usage=usage(choices), choices=out,
                                  cosine_ray=stats_block(state, req, choices))
        return JSONResponse(body.model_dump(mode="json", exclude_none=True),
                            headers=replica_header([c.gen for c in choices]))

    def chunk(choice: CompletionChoice | None, **extra: Any) -> CompletionResponse:
        return CompletionResponse(id=rid, created=now, model=model_name, choices=[choice] if choice else [],
                                  usage=usage(choices) if req.continuous_usage else None, **extra)

    async def events() -> AsyncIterator[str]:
        sent = {c.index: 0 for c in choices}
        if req.echo:
            for c in choices:
                yield sse(chunk(CompletionChoice(
                    index=c.index, text=prompt_texts[c.prompt],
                    logprobs=None if k is None else logprobs.completion(prompt_logprobs(c.prompt), prompts[c.prompt]),
                    prompt_logprobs=logprobs.vllm_prompt(firsts[c.prompt].prompt_logprobs))))
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
                                cosine_ray=stats_block(state, req, choices) if done else None))
        if req.include_usage:
            yield sse(CompletionResponse(id=rid, created=now, model=model_name, choices=[], usage=usage(choices)))

    return SSEResponse(guarded_events(choices, events()), on_close=lambda: close_all(choices),
                       send_timeout_s=state.send_timeout_s, headers=replica_header([c.gen for c in choices]))


@route("GET", "/v1/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    return ModelList(data=state.model_cards())


@route("GET", "/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, state: State) -> ModelCard:
    return state.for_model(model_id).model_card().model_copy(update={"id": model_id})


@route("POST", "/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(req: TokenizeRequest, state: State) -> TokenizeResponse:
    return await tokenization.tokenize(state.for_model(req.model), req)


@route("POST", "/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, state: State) -> DetokenizeResponse:
    return await tokenization.detokenize(state.for_model(req.model), req)


@route("GET", "/version")
async def version() -> dict[str, str]:
    return {"version": VERSION}


@route("GET", "/health")
async def health(state: State) -> Any:
    statuses = await asyncio.gather(*(m.readiness.status() for m in state.served))
    status = next((s for s in statuses if s != "ok"), "ok")  # every engine must be ready
    if status == "ok":
        return {"status": "ok"}
    body = {"status": status, **error_payload(503, f"engine status: {status}")}
    if len(statuses) > 1:
        body["models"] = {m.names[0]: s for m, s in zip(state.served, statuses)}
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


@route("GET", METRICS_PATH, include_in_schema=False)
async def metrics(state: State, model: str | None = None) -> Any:
    """The engine's registry (``?model=NAME``: that model's engine; the HTTP counts, which are
    the ingress's, go to the first model's)."""
    engine = state.for_model(model).engine
    return await metrics_response(engine, state.http_counts, with_http=engine is state.engine)


# ---- what the routes share ----------------------------------------------------------------------

async def check_request(state: ServerState, req: ChatCompletionRequest | CompletionRequest,
                        request: Request) -> None:
    """What a generation request must pass before any work (``state`` is already its model's):
    the supported fields and their bounds, token ids in the vocabulary, and no key given twice
    in ``logit_bias``."""
    req.check_supported()
    if req.logit_bias:  # the parsed body kept one value of a repeated key: look at the raw body
        check_duplicate_keys(await request.body())
    check_vocabulary(req, state.engine.vocab_size, state.eos_token_ids)


def stats_block(state: ServerState, req: ChatCompletionRequest | CompletionRequest, choices: list[Choice]) -> Any:
    """The ``cosine_ray`` stats block, when the server or the request asks for it."""
    return choices[0].gen.stats_block() if state.wants_stats(req) else None
