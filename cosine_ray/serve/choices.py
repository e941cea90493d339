"""The choices of one API request: started together, run together, and the OpenAI shapes of
what they produced (text, log-probabilities, tool calls).

``start_choices`` checks a request with the engine and starts one generation per choice (each
admitted, with its own sampling key); ``first_outputs``, ``collect_all``, ``guarded_events`` and
``close_all`` run and end them as a group, and every engine iterator is closed on every path.
``interleave`` yields each step of any choice as it arrives (OpenAI interleaves streamed choices
by ``index``). ``Logprobs`` turns the engine's ``TokenLogprob``s into the chat, completions and
vLLM ``prompt_logprobs`` shapes. ``ChatDeltas`` is one streamed chat choice: content deltas, or
tool-call deltas when tools decide the output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

from fastapi import Request

from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.engine.request import SamplingParams, StructuredOutput, Tenant
from cosine_ray.serve.text import tools
from cosine_ray.serve.errors import EngineUnavailable, InvalidRequest, OpenAIError, error_payload
from cosine_ray.serve.generation import Generation, sse, unless_disconnected
from cosine_ray.serve.guards.limits import check_prompt_logprobs
from cosine_ray.serve.text.prediction import prediction_details, prediction_ids
from cosine_ray.serve.schemas import (ChatCompletionRequest, ChatDelta, ChatLogprobs, CompletionLogprobs,
                                      CompletionRequest, FunctionDelta, PromptTokensDetails, ToolCallDelta,
                                      TokenLogprobOut, TopLogprob, Usage)
from cosine_ray.serve.state import ServerState
from cosine_ray.serve.guards.tenants import ApiKey

log = logging.getLogger(__name__)

NOT_STREAMED_EVERY_S = 0.1
"""A response that is not streamed gets the engine's outputs merged to one per 0.1 s at most
(``EngineClient.stream``): each output crossing from the engine to the ingress costs both
processes CPU time that a small machine takes from the forward. A request with stop strings is
never merged: the ingress finds its stop string as soon as the engine produces it, ends it there
(no tokens generated past it) and the engine counts it as stopped, not as run to its length."""


STEPS_AHEAD = 4
"""Steps a streamed choice may run ahead of its client (``interleave``)."""


@dataclass(slots=True)
class Choice:
    index: int
    """Its place in the response: ``prompt × choices per prompt + its number within the prompt``."""
    gen: Generation
    first: str = ""
    """The text of its first engine output (awaited before the response starts)."""
    prompt: int = 0
    """Which of the request's prompts it continues (a batch has several)."""
    prediction: tuple[int, ...] = ()
    """The request's prediction as token ids (its usage counts them)."""


@dataclass(frozen=True, slots=True)
class _Planned:
    """One prompt of a request, checked: its tokens, engine parameters and refusal."""

    prompt_ids: list[int]
    params: SamplingParams
    refusal: Any


def _plan(state: ServerState, req: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int],
          prompt_param: str, structured: tuple[StructuredOutput, str] | None,
          num_logprobs: int | None, prediction: tuple[int, ...]) -> _Planned:
    """The context, max_tokens and prompt log-probability bounds of one prompt (400s), and its
    engine parameters."""
    engine = state.engine
    requested, max_tokens_param = req.requested_max_tokens
    room = engine.max_model_len - len(prompt_ids)
    if room < 1:
        raise InvalidRequest(f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                             f"{engine.max_model_len} tokens", param=prompt_param)
    if requested is not None and requested > room:
        raise InvalidRequest(f"{max_tokens_param}={requested} plus the prompt's {len(prompt_ids)} tokens "
                             f"exceeds the model's context of {engine.max_model_len}; use "
                             f"{max_tokens_param} <= {room}", param=max_tokens_param)
    if req.prompt_logprobs is not None:
        check_prompt_logprobs(len(prompt_ids), "echo" if getattr(req, "echo", False) else "prompt_logprobs")
    spec, spec_param = structured or (None, None)
    max_tokens = requested or min(state.default_max_tokens, room)
    params = sampling_params(req, max_tokens, num_logprobs, spec, prediction)
    refusal = functools.partial(engine_refusal, num_prompt_tokens=len(prompt_ids), max_tokens=max_tokens,
                                max_tokens_param=max_tokens_param, prompt_param=prompt_param, grammar=structured)
    return _Planned(prompt_ids, params, refusal)


async def start_choices(state: ServerState, req: ChatCompletionRequest | CompletionRequest,
                        prompts: Sequence[list[int]], prompt_param: str, request_id: str, *, tenant: ApiKey,
                        structured: tuple[StructuredOutput, str] | None, num_choices: int,
                        num_logprobs: int | None) -> list[Choice]:
    """Check the request with the engine and start ``num_choices`` generations per prompt (each its
    own engine request; choice j of a prompt samples with seed + j, as the same prompt alone
    would), all admitted together (every choice of every prompt holds a slot of ``tenant`` until
    closed). Prompt log-probabilities are the same for every choice of a prompt: only its first
    asks. Choice j of prompt i has index i·num_choices + j (OpenAI's order)."""
    engine = state.engine
    prediction = await prediction_ids(state, req)  # the request's, one for all its prompts
    planned = [_plan(state, req, ids, prompt_param, structured, num_logprobs, prediction) for ids in prompts]
    max_tokens_param = req.requested_max_tokens[1]
    # before any await: the counts are exact
    releases = state.admission.admit(
        tenant, [len(p.prompt_ids) + p.params.max_tokens for p in planned for _ in range(num_choices)],
        param=max_tokens_param)
    try:
        checked = await asyncio.gather(*(_check_with_engine(engine, p, request_id) for p in planned),
                                       return_exceptions=True)
        refused = next((r for r in checked if isinstance(r, BaseException)), None)
        if refused is not None:
            raise refused
    except BaseException:
        for release in releases:
            release()
        raise
    deadline = None if state.request_timeout_s is None else time.monotonic() + state.request_timeout_s
    owner = Tenant(tenant.name, req.user or "")  # the engine shares its slots between these
    choices = []
    for index, release in enumerate(releases):
        i, j = divmod(index, num_choices)
        prompt_ids, params, refusal = planned[i].prompt_ids, planned[i].params, planned[i].refusal
        seed = None if params.seed is None else (params.seed + j) % 2**64
        choice_params = dataclasses.replace(params, seed=seed, prompt_logprobs=None) if j else params
        rid = request_id if len(releases) == 1 else f"{request_id}-{index}"
        choices.append(Choice(index, Generation(engine, state.tokenizer, prompt_ids, choice_params, req.stop, rid,
                                                on_close=release, deadline=deadline,
                                                every_s=0.0 if req.stream or req.stop else NOT_STREAMED_EVERY_S,
                                                refusal=refusal, tenant=owner), prompt=i,
                              prediction=prediction))
    return choices


async def _check_with_engine(engine: Any, planned: _Planned, request_id: str) -> None:
    """The engine's own check of one prompt's request: its refusal as the client's 400, an
    engine that cannot answer as a 503."""
    try:
        await engine.check_request(planned.prompt_ids, planned.params)
    except ValueError as exc:
        log.info("engine refused %s: %s", request_id, exc)
        raise planned.refusal(exc) from None
    except Exception as exc:  # overloaded, engine down (a cancellation is no Exception: it passes)
        if isinstance(exc, OpenAIError):
            raise
        log.exception("engine.check_request failed")
        raise EngineUnavailable("the engine could not check the request; retry") from None


def sampling_params(req: ChatCompletionRequest | CompletionRequest, max_tokens: int, num_logprobs: int | None,
                    structured: StructuredOutput | None, prediction: tuple[int, ...] = ()) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
            seed=req.seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            logit_bias=tuple(req.logit_bias), logprobs=num_logprobs, prompt_logprobs=req.prompt_logprobs,
            structured=structured, prediction=prediction)
    except ValueError as exc:
        param = getattr(exc, "param", None) or ("min_tokens" if "min_tokens" in str(exc) else None)
        raise InvalidRequest(str(exc), param=param) from None


GRAMMAR_MESSAGES = ("the json schema", "the regex", "the choice", "the lark", "choice must", "unknown grammar")
"""How the engine's grammar refusals begin (``engine.owners.grammars``): the fallback for a
refusal that is not typed."""


def engine_refusal(exc: BaseException | str, *, num_prompt_tokens: int, max_tokens: int, max_tokens_param: str,
                   prompt_param: str, grammar: tuple[StructuredOutput, str] | None) -> InvalidRequest:
    """The client's 400 for an engine ValueError: a stable message naming the field and the
    bound, never the engine's own text (KV block counts, flag names, the grammar engine's words),
    which the ingress logs instead. A typed refusal (``engine.request.RequestRefused``, also
    when Ray wraps it) is mapped by its field and reason; any other by its opening words."""
    param, reason = getattr(exc, "param", None), getattr(exc, "reason", None)
    if reason is None:
        param, reason = refusal_of(str(exc), grammar is not None)
    what = None if grammar is None else {"json_schema": "JSON schema", "lark": "grammar"}.get(grammar[0].kind,
                                                                                              grammar[0].kind)
    if param in ("logit_bias", "stop_token_ids", "min_tokens", "prediction"):
        return InvalidRequest(f"{param} cannot be served by this model", param=param)
    if param == "structured" and grammar is not None:
        name = grammar[1]
        if reason == "unsupported":
            return InvalidRequest(f"{name}: structured outputs are not available on this server", param=name)
        if reason == "too_large":
            return InvalidRequest(f"{name}: the {what} is larger than the server's grammar engine compiles",
                                  param=name, code="grammar_too_large")
        if reason == "too_slow":
            return InvalidRequest(f"{name}: the {what} took longer to compile than the server allows",
                                  param=name, code="grammar_too_slow")
        return InvalidRequest(f"{name}: the {what} cannot be compiled by the server's grammar engine "
                              "(invalid, or a feature it does not support)", param=name)
    if reason == "kv_cache":
        return InvalidRequest(f"the prompt ({num_prompt_tokens} tokens) and {max_tokens_param}={max_tokens} do not "
                              f"fit the server's KV cache even alone; lower {max_tokens_param} or shorten the prompt",
                              param=max_tokens_param)
    if reason == "context":
        return InvalidRequest(f"the prompt ({num_prompt_tokens} tokens) and {max_tokens_param}={max_tokens} exceed "
                              "the model's context", param=max_tokens_param)
    return InvalidRequest("the engine cannot serve this request", param=prompt_param)


def refusal_of(message: str, has_grammar: bool) -> tuple[str | None, str]:
    """(param, reason) of an engine refusal that is not typed, from its opening words."""
    lowered = message.lower()
    for name in ("logit_bias", "stop_token_ids", "min_tokens", "prediction"):
        if lowered.startswith(name):
            return name, "invalid"
    if has_grammar and lowered.startswith("structured outputs"):
        return "structured", "unsupported"
    if has_grammar and lowered.startswith(GRAMMAR_MESSAGES):
        return "structured", "invalid"
    if "kv" in lowered:
        return "max_tokens", "kv_cache"
    if lowered.startswith(("max_tokens", "prompt (")):
        return "max_tokens", "context"
    return None, "invalid"


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
    """Summed over the choices; each prompt's tokens (and the most of them any of its choices
    found in the prefix cache) counted once. With a prediction, its accepted and rejected tokens
    once every choice is done (``serve.text.prediction``)."""
    n = sum(c.gen.num_tokens for c in choices)
    prompt_tokens: dict[int, int] = {}
    cached: dict[int, int] = {}
    for c in choices:
        prompt_tokens[c.prompt] = c.gen.num_prompt_tokens
        cached[c.prompt] = max(cached.get(c.prompt, 0), c.gen.usage().prompt_tokens_details.cached_tokens)
    prompt = sum(prompt_tokens.values())
    prediction = choices[0].prediction
    details = prediction_details(prediction, [c.gen.text.token_ids for c in choices]) \
        if prediction and all(c.gen.is_done for c in choices) else None
    return Usage(prompt_tokens=prompt, completion_tokens=n, total_tokens=prompt + n,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())),
                 completion_tokens_details=details)


async def interleave(choices: Sequence[Choice]) -> AsyncIterator[tuple[Choice, str, list[TokenLogprob], bool]]:
    """(choice, text delta, new log-probabilities, whether it was the choice's last) for every
    step of every choice, as they come; the first step of each is its ``first``. Errors of any
    choice are raised here. Backpressure: a choice runs at most ``STEPS_AHEAD`` steps ahead of
    the consumer (the client), so a slow reader leaves the engine's outputs unread instead of
    piling them up here."""
    queue: asyncio.Queue = asyncio.Queue()  # its data items are bounded by ``space``
    space = asyncio.Semaphore(STEPS_AHEAD * len(choices))

    async def run(choice: Choice) -> None:
        try:
            await space.acquire()
            queue.put_nowait((choice, choice.first, choice.gen.take_logprobs(), choice.gen.is_done))
            while not choice.gen.is_done:
                delta = await choice.gen.step()
                await space.acquire()
                queue.put_nowait((choice, delta, choice.gen.take_logprobs(), choice.gen.is_done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((choice, exc, None, True))
        finally:
            queue.put_nowait((choice, None, None, True))

    tasks = [asyncio.ensure_future(run(c)) for c in choices]
    remaining = len(tasks)
    try:
        while remaining:
            choice, delta, logprobs, last = await queue.get()
            if delta is None:
                remaining -= 1
            elif isinstance(delta, BaseException):
                raise delta
            else:
                space.release()
                yield choice, delta, logprobs, last
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Logprobs:
    """The OpenAI shapes of log-probabilities, with token texts from ``tokenizer``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat(self, logprobs: Sequence[TokenLogprob]) -> ChatLogprobs:
        out = []
        for lp in logprobs:
            token = self.text(lp.token_id)
            out.append(TokenLogprobOut(token=token, logprob=lp.logprob, bytes=list(token.encode()),
                                       top_logprobs=[TopLogprob(token=(t := self.text(i)), logprob=v,
                                                                bytes=list(t.encode())) for i, v in lp.top]))
        return ChatLogprobs(content=out)

    def completion(self, logprobs: Sequence[TokenLogprob | None], token_ids: Sequence[int],
                   offset: int = 0) -> CompletionLogprobs:
        """``token_ids`` are the tokens (the first prompt token has no log-probability: None);
        ``offset``: the text's length before them (``text_offset``)."""
        out = CompletionLogprobs()
        for token_id, lp in zip(token_ids, logprobs):
            token = self.text(token_id)
            out.tokens.append(token)
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {self.text(i): v for i, v in lp.top})
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def vllm_prompt(self, prompt_logprobs: Sequence[TokenLogprob | None] | None) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token {token id: {logprob, decoded_token}}."""
        if prompt_logprobs is None:
            return None
        out: list[dict | None] = []
        for lp in prompt_logprobs:
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): {"logprob": lp.logprob, "decoded_token": self.text(lp.token_id)}}
            for i, v in lp.top:
                entry.setdefault(str(i), {"logprob": v, "decoded_token": self.text(i)})
            out.append(entry)
        return out


@dataclass(slots=True)
class ChatDeltas:
    """One streamed chat choice's deltas under its tool mode (``serve.text.tools``)."""

    req: ChatCompletionRequest
    parser: str = tools.DEFAULT_TOOL_CALL_PARSER
    """The tool-call format ``auto`` looks for (``ServerState.tool_call_parser``)."""
    text: str = ""
    sent: int = 0
    """Characters of ``text`` sent as content."""
    calls: int = 0
    """Tool-call deltas sent."""
    in_call: bool = False
    has_calls: bool = field(default=False)

    def feed(self, delta: str) -> ChatDelta | None:
        kind = tools.mode(self.req)
        if kind == "none":  # plain content: nothing to look back at, so no text is kept
            return ChatDelta(content=delta) if delta else None
        self.text += delta
        if kind == "named":
            if not delta and self.calls:
                return None
            first = self.calls == 0
            self.calls, self.has_calls = 1, True
            name = self.req.tool_choice.function.name
            return ChatDelta(tool_calls=[ToolCallDelta(
                index=0, id=f"call_{id(self):x}" if first else None, type="function" if first else None,
                function=FunctionDelta(name=name if first else None, arguments=delta))])
        if kind == "required" or self.in_call:
            return None
        at = tools.call_start(self.text, self.sent, self.parser)  # auto
        if at >= 0:
            self.in_call = True
            return self._content(at)
        return self._content(len(self.text) - tools.held_back(self.text, self.parser))

    def _content(self, end: int) -> ChatDelta | None:
        if end <= self.sent:
            return None
        delta, self.sent = self.text[self.sent:end], end
        return ChatDelta(content=delta)

    def finish(self) -> list[ChatDelta]:
        """What is left at the end: the tool calls (``required``, ``auto``), or held-back text."""
        kind = tools.mode(self.req)
        if kind in ("none", "named"):
            return []
        content, calls = tools.parse(self.req, self.text, self.parser)
        if not calls:
            rest = self._content(len(self.text))
            return [rest] if rest else []
        self.has_calls = True
        out = []
        if kind == "auto" and content and not self.sent:
            out.append(ChatDelta(content=content))
        for i, call in enumerate(calls):
            out.append(ChatDelta(tool_calls=[ToolCallDelta(index=i, id=call.id, type="function", function=FunctionDelta(
                name=call.function.name, arguments=call.function.arguments))]))
        return out
