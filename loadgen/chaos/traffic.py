"""One chaos call → one ``Call`` with exactly one outcome, and the callers' mix.

Each call picks a shape (``shapes.py``) and a manner: streaming or not, and some callers
disconnect early (a stream closed after a few chunks, or a non-streaming call given up after
a second or two). Every call sends its own id as ``X-Request-Id``: the server's record of the
ids it answered is what the audit checks the client's against (``server_ledger.py``).

Outcomes: ``ok`` (200, the whole answer, one ``[DONE]`` for a stream), ``failed`` (the client
saw an error: ``http`` status, ``sse_error`` event, ``connect`` refused, ``broken``
connection, ``no_done`` (a stream that ended without ``[DONE]``), ``malformed``),
``disconnected`` (the caller left on purpose), ``hung`` (no outcome by the per-request
deadline). ``send`` never raises and sets the outcome exactly once. A call keeps each
choice's text (a named tool call's arguments count as its text), finish reason, and the
number of log-probability entries it got.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import httpx
import numpy as np

from loadgen.chaos.shapes import CHAT, Shape
from loadgen.client import decode_event, error_message


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
    texts: list[str] = field(default_factory=list)
    """Each choice's text, by index."""
    finish_reasons: dict[int, str] = field(default_factory=dict)
    logprob_entries: int = 0
    num_done: int = 0
    response_id: str | None = None
    output_tokens: int | None = None
    num_chunks: int = 0

    @property
    def text(self) -> str:
        return self.texts[0] if self.texts else ""

    def add_text(self, index: int, delta: str) -> None:
        if not 0 <= index < 64:
            self.fail("malformed", f"choice index {index}")
            return
        while len(self.texts) <= index:
            self.texts.append("")
        self.texts[index] += delta

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:  # keep the first cause
            self.error_kind, self.error = kind, message.splitlines()[0][:300] if message else kind

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["finish_reasons"] = {str(k): v for k, v in self.finish_reasons.items()}
        return row


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
        for choice in data["choices"]:
            _read_choice(shape, call, choice, choice["message"] if shape.path == CHAT else choice)
        call.response_id = data.get("id")
        call.output_tokens = (data.get("usage") or {}).get("completion_tokens")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
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


def _read_choice(shape: Shape, call: Call, choice: Mapping[str, Any], message: Mapping[str, Any]) -> None:
    """One choice of a response (``message``: the chat message or delta, or the completion
    choice itself): its text (content, then a tool call's arguments), finish reason and
    log-probability entries."""
    index = int(choice.get("index", 0))
    text = (message.get("content") if shape.path == CHAT else message.get("text")) or ""
    for tool_call in message.get("tool_calls") or []:
        text += (tool_call.get("function") or {}).get("arguments") or ""
    call.add_text(index, text)
    if choice.get("finish_reason"):
        call.finish_reasons[index] = choice["finish_reason"]
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        entries = logprobs.get("content") if shape.path == CHAT else logprobs.get("tokens")
        call.logprob_entries += len(entries or [])


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
        chars = sum(len(t) for t in call.texts)
        try:
            _read_choice(shape, call, choice, (choice.get("delta") or {}) if shape.path == CHAT else choice)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            call.fail("malformed", f"unexpected stream event: {type(exc).__name__}")
            continue
        if sum(len(t) for t in call.texts) > chars:
            call.first_t = call.first_t or clock()
            call.num_chunks += 1
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

