"""What a chaos run sends: request shapes, and one call → one ``Call`` with exactly one outcome.

A **shape** is a request that always has the same answer on a lossless server: a prompt from
the packaged domains, an endpoint, ``max_tokens`` and either greedy decoding or sampling with a
fixed ``seed`` (sampling noise is keyed by seed and position, so a seeded answer is
reproducible too). Before the chaos, a warm-up pass asks every shape once: its answer is the
**reference**. Each call then picks a shape and a manner: streaming or not, and some callers
disconnect early (a stream closed after a few chunks, or a non-streaming call given up after
a second or two).

Outcomes: ``ok`` (200, the whole answer, one ``[DONE]`` for a stream), ``failed`` (the client
saw an error: ``http`` status, ``sse_error`` event, ``connect`` refused, ``broken``
connection, ``no_done`` (a stream that ended without ``[DONE]``), ``malformed``),
``disconnected`` (the caller left on purpose), ``hung`` (no outcome by the per-request
deadline). ``send`` never raises and sets the outcome exactly once.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping, Sequence

import httpx
import numpy as np

from loadgen.client import decode_event, error_message
from loadgen.workload import PromptRow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SEEDED_TEMPERATURE = 0.8
PROBE_PROMPT = "The capital of France is"


@dataclass(frozen=True, slots=True)
class Shape:
    key: str
    domain: str
    path: str
    prompt: str
    max_tokens: int
    seed: int | None = None
    """None: greedy; else sampled at SEEDED_TEMPERATURE with this seed."""

    def body(self, model: str | None, *, stream: bool, request_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "stream": stream, "user": request_id,
                                "temperature": 0.0 if self.seed is None else SEEDED_TEMPERATURE}
        if self.seed is not None:
            body["seed"] = self.seed
        if model:
            body["model"] = model
        if self.path == CHAT:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body


def probe_shape(max_tokens: int = 4) -> Shape:
    return Shape("probe", "probe", COMPLETIONS, PROBE_PROMPT, max_tokens)


def build_shapes(rows: Mapping[str, Sequence[PromptRow]], num_shapes: int, rng: np.random.Generator, *,
                 max_tokens: int, seeded_fraction: float, completions_fraction: float) -> list[Shape]:
    """``num_shapes`` shapes, domains in turn, prompts drawn without replacement per domain."""
    domains = sorted(d for d, r in rows.items() if r)
    if not domains:
        raise ValueError("no prompt rows to build requests from")
    order = {d: list(rng.permutation(len(rows[d]))) for d in domains}
    shapes = []
    for i in range(num_shapes):
        domain = domains[i % len(domains)]
        if not order[domain]:
            order[domain] = list(rng.permutation(len(rows[domain])))
        row = rows[domain][order[domain].pop()]
        seeded = rng.random() < seeded_fraction
        path = COMPLETIONS if rng.random() < completions_fraction else CHAT
        shapes.append(Shape(f"s{i:03d}", domain, path, row.turns[0], max_tokens,
                            int(rng.integers(1, 2**31)) if seeded else None))
    return shapes


@dataclass
class Call:
    request_id: str
    shape: str
    kind: str
    """load | probe | warmup."""
    stream: bool
    disconnect_after: float | None = None
    """Streams: leave after this many content chunks; non-streaming: after this many seconds."""
    client: int = -1
    sent_t: float | None = None
    first_t: float | None = None
    end_t: float | None = None
    outcome: str | None = None
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    error_type: str | None = None
    """OpenAI ``error.type`` of an error body or SSE error event (``service_unavailable_error`` = 503)."""
    text: str = ""
    num_done: int = 0
    response_id: str | None = None
    output_tokens: int | None = None
    num_chunks: int = 0

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:  # keep the first cause
            self.error_kind, self.error = kind, message.splitlines()[0][:300] if message else kind

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


class _Leave(Exception):
    """The caller disconnects on purpose (enough chunks seen)."""


async def send(client: httpx.AsyncClient, shape: Shape, call: Call, *, model: str | None, timeout_s: float,
               clock: Callable[[], float] = time.perf_counter, headers: Mapping[str, str] | None = None) -> Call:
    """One request; fills ``call`` (also returned) with exactly one outcome."""
    call.sent_t = clock()
    body = shape.body(model, stream=call.stream, request_id=call.request_id)
    hdrs = {**(headers or {}), "X-Request-Id": call.request_id}
    try:
        async with asyncio.timeout(timeout_s):
            if call.stream:
                await _stream(client, shape, call, body, hdrs, clock)
            elif call.disconnect_after is not None:
                try:
                    async with asyncio.timeout(call.disconnect_after):
                        await _unary(client, shape, call, body, hdrs)
                except TimeoutError:
                    call.outcome = "disconnected"
            else:
                await _unary(client, shape, call, body, hdrs)
    except _Leave:
        call.outcome = "disconnected"
    except TimeoutError:
        call.outcome = "hung"
        call.fail("timeout", f"no complete answer within {timeout_s:g} s")
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        call.fail("connect", f"cannot connect: {exc or type(exc).__name__}")
    except httpx.TransportError as exc:
        call.fail("broken", f"connection broke: {type(exc).__name__}: {exc}")
    call.end_t = clock()
    if call.outcome is None:
        call.outcome = "failed" if call.error_kind else "ok"
    return call


async def _unary(client: httpx.AsyncClient, shape: Shape, call: Call, body: dict, headers: dict) -> None:
    resp = await client.post(shape.path, json=body, headers=headers)
    call.http_status = resp.status_code
    if resp.status_code != 200:
        call.error_type = _error_type(resp.content)
        call.fail("http", f"HTTP {resp.status_code}: {error_message(resp.content)}")
        return
    try:
        data = resp.json()
        choice = data["choices"][0]
        call.text = choice["message"]["content"] if shape.path == CHAT else choice["text"]
        call.response_id = data.get("id")
        call.output_tokens = (data.get("usage") or {}).get("completion_tokens")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        call.fail("malformed", f"unexpected response body: {type(exc).__name__}")


async def _stream(client: httpx.AsyncClient, shape: Shape, call: Call, body: dict, headers: dict,
                  clock: Callable[[], float]) -> None:
    async with client.stream("POST", shape.path, json=body, headers=headers) as resp:
        call.http_status = resp.status_code
        if resp.status_code != 200:
            content = await resp.aread()
            call.error_type = _error_type(content)
            call.fail("http", f"HTTP {resp.status_code}: {error_message(content)}")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                call.num_done += 1
                continue
            if call.num_done:
                call.fail("malformed", "data after [DONE]")
                continue
            _read_event(shape, call, data, clock)
            if call.disconnect_after is not None and call.num_chunks >= call.disconnect_after:
                raise _Leave()
    if call.num_done == 0:
        call.fail("no_done", "the stream ended without data: [DONE]")


def _error_type(body: bytes) -> str | None:
    try:
        err = json.loads(body).get("error")
        return str(err.get("type")) if isinstance(err, dict) else None
    except (ValueError, AttributeError):
        return None


def _read_event(shape: Shape, call: Call, data: str, clock: Callable[[], float]) -> None:
    event, malformed = decode_event(data)
    if event is None:
        call.fail("malformed", malformed or "")
        return
    if "error" in event:
        err = event["error"] if isinstance(event["error"], dict) else {}
        call.error_type = str(err.get("type") or "unknown")
        call.fail("sse_error", f"error event ({call.error_type}/{err.get('code')}): {error_message(data.encode())}")
        return
    call.response_id = call.response_id or event.get("id")
    for choice in event.get("choices") or []:
        delta = ((choice.get("delta") or {}).get("content") if shape.path == CHAT else choice.get("text")) or ""
        if delta:
            call.first_t = call.first_t or clock()
            call.num_chunks += 1
            call.text += delta
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        call.output_tokens = usage["completion_tokens"]


@dataclass(frozen=True, slots=True)
class Mix:
    """How each load call is made (fractions of calls)."""

    stream_fraction: float = 0.5
    disconnect_fraction: float = 0.1
    """Callers that leave early: a stream after 1-4 chunks, a non-streaming call after 1-3 s."""

    def draw(self, rng: np.random.Generator) -> tuple[bool, float | None]:
        stream = bool(rng.random() < self.stream_fraction)
        if rng.random() >= self.disconnect_fraction:
            return stream, None
        return stream, float(rng.integers(1, 5)) if stream else float(rng.uniform(1.0, 3.0))


@dataclass
class References:
    """Each shape's answer before the chaos (warm-up), and the problems of getting them."""

    texts: dict[str, str] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
