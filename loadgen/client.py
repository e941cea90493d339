"""One streamed OpenAI request → one ``RequestRecord``.

Timing (all ``clock()`` seconds relative to the run's start ``t0``):

    sent_s ── POST ──▶ first non-empty content delta (first_token_s) ── … chunk k … ──▶ end_s
    TTFT = first_token_s − sent_s        E2EL = end_s − sent_s (end = the ``[DONE]`` line)
    ITL  = gaps between consecutive non-empty content chunks (one chunk may carry several
           tokens when speculation accepts drafts; the gaps are per chunk, as in vllm)
    TPOT = (E2EL − TTFT) / (output_tokens − 1), only when output_tokens > 1

``output_tokens`` comes from the ``usage`` chunk (we always ask ``stream_options.include_usage``);
a server that sends none falls back to the number of content chunks (``output_tokens_source``
says which). With ``cosine_ray_stats`` the server adds a ``cosine_ray`` block (the final chunk);
its known fields are read into typed columns, unknown ones kept as JSON in ``stats_extra``.

Every failure is recorded, never raised: ``error_kind`` is one of ``connect`` (refused or
unresolvable: the server is not there), ``http`` (a non-200 status), ``sse_error`` (an error
event inside the stream), ``malformed`` (bad JSON, no ``[DONE]``, data after ``[DONE]``),
``transport`` (the connection broke mid-response), ``timeout`` (``timeout_s`` for the whole
request passed), ``cancelled`` (the runner stopped it: a second Ctrl-C).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

KNOWN_STATS = ("num_draft_tokens", "num_accepted_tokens", "mean_accepted_length", "num_verify_steps",
               "drafted_by", "accepted_by")
ERROR_KINDS = ("connect", "http", "sse_error", "malformed", "transport", "timeout", "cancelled")


@dataclass(slots=True)
class RequestSpec:
    request_id: str
    conversation_id: str
    turn: int
    domain: str
    source_id: str
    path: str
    """``/v1/chat/completions`` or ``/v1/completions``."""
    body: dict[str, Any]
    scheduled_s: float = 0.0


@dataclass(slots=True)
class RequestRecord:
    """One row of ``requests.parquet``: everything measured about one request."""

    request_id: str
    conversation_id: str
    turn: int
    domain: str
    source_id: str
    status: str = "not_sent"
    """ok | failed | not_sent."""
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    scheduled_s: float | None = None
    queued_s: float | None = None
    """Time waiting for a --max-concurrency slot (not part of the latencies)."""
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    ttft_s: float | None = None
    e2el_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_s: list[float] = field(default_factory=list)
    """Arrival time of each non-empty content chunk (run clock)."""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    output_tokens_source: str | None = None
    num_done_markers: int = 0
    response_id: str | None = None
    finish_reason: str | None = None
    output_text: str = ""
    has_stats: bool = False
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    mean_accepted_length: float | None = None
    num_verify_steps: int | None = None
    acceptance_rate: float | None = None
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)
    stats_extra: str | None = None

    @classmethod
    def for_spec(cls, spec: RequestSpec) -> "RequestRecord":
        return cls(spec.request_id, spec.conversation_id, spec.turn, spec.domain, spec.source_id,
                   scheduled_s=spec.scheduled_s)

    def fail(self, kind: str, message: str) -> None:
        assert kind in ERROR_KINDS, kind
        if self.status != "failed":  # keep the first cause
            self.status, self.error_kind, self.error = "failed", kind, message.splitlines()[0][:300]

    def as_row(self) -> dict[str, Any]:
        return asdict(self)

    def read_stats(self, block: Any) -> None:
        """Fill the speculation columns from a ``cosine_ray`` block, tolerating missing fields."""
        if not isinstance(block, dict):
            return
        self.has_stats = True

        def num(name: str, kind: type) -> Any:
            value = block.get(name)
            return kind(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

        self.num_draft_tokens = num("num_draft_tokens", int)
        self.num_accepted_tokens = num("num_accepted_tokens", int)
        self.mean_accepted_length = num("mean_accepted_length", float)
        self.num_verify_steps = num("num_verify_steps", int)
        for name in ("drafted_by", "accepted_by"):
            value = block.get(name)
            if isinstance(value, dict):
                setattr(self, name, {str(k): int(v) for k, v in value.items() if isinstance(v, (int, float))})
        if self.num_draft_tokens and self.num_accepted_tokens is not None:
            self.acceptance_rate = self.num_accepted_tokens / self.num_draft_tokens
        extra = {k: v for k, v in block.items() if k not in KNOWN_STATS}
        self.stats_extra = json.dumps(extra, sort_keys=True) if extra else None


def error_message(body: bytes) -> str:
    """The OpenAI error message of a response body, or its first line."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        message = err.get("message") if isinstance(err, dict) else None
        if message:
            return str(message)
    except (json.JSONDecodeError, AttributeError):
        pass
    return (text.splitlines() or ["(empty body)"])[0][:200]


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, record: RequestRecord, *,
                       t0: float, timeout_s: float, clock: Callable[[], float] = time.perf_counter,
                       headers: dict[str, str] | None = None) -> RequestRecord:
    """POST ``spec`` with streaming, filling ``record`` in place (also returned)."""
    record.sent_s = clock() - t0
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, spec, record, t0=t0, clock=clock, headers=headers or {})
    except TimeoutError:
        record.fail("timeout", f"no complete answer within {timeout_s:g} s")
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        record.fail("connect", f"cannot connect to {client.base_url}: {exc or type(exc).__name__}")
    except httpx.TransportError as exc:
        record.fail("transport", f"connection broke: {type(exc).__name__}: {exc}")
    record.end_s = record.end_s if record.end_s is not None else clock() - t0
    if record.status != "failed":
        _finish_ok(record)
    return record


async def _stream(client: httpx.AsyncClient, spec: RequestSpec, record: RequestRecord, *, t0: float,
                  clock: Callable[[], float], headers: dict[str, str]) -> None:
    is_chat = spec.path.endswith("chat/completions")
    async with client.stream("POST", spec.path, json=spec.body,
                             headers={**headers, "X-Request-Id": spec.request_id}) as resp:
        record.http_status = resp.status_code
        if resp.status_code != 200:
            record.fail("http", f"HTTP {resp.status_code}: {error_message(await resp.aread())}")
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event:/id: fields
            data = line[5:].strip()
            now = clock() - t0
            if record.num_done_markers:
                record.num_done_markers += data == "[DONE]"
                record.fail("malformed", "data after [DONE]")
                continue
            if data == "[DONE]":
                record.num_done_markers = 1
                record.end_s = now
                continue
            _read_event(data, record, now, is_chat)
    if not record.num_done_markers:
        record.fail("malformed", "the stream ended without data: [DONE]")


def decode_event(data: str) -> tuple[dict[str, Any] | None, str | None]:
    """An SSE ``data:`` payload as a JSON object, or (None, why it is malformed)."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        return None, f"an SSE event is not JSON: {data[:80]!r}"
    if not isinstance(event, dict):
        return None, f"an SSE event is not a JSON object: {data[:80]!r}"
    return event, None


def _read_event(data: str, record: RequestRecord, now: float, is_chat: bool) -> None:
    event, malformed = decode_event(data)
    if event is None:
        record.fail("malformed", malformed or "")
        return
    if "error" in event:
        record.fail("sse_error", f"error event: {error_message(data.encode())}")
        return
    record.response_id = record.response_id or event.get("id")
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            record.fail("malformed", "a choice is not an object")
            return
        delta = (choice.get("delta") or {}).get("content") if is_chat else choice.get("text")
        if delta:
            if record.first_token_s is None:
                record.first_token_s = now
            else:
                record.itl_s.append(now - record.chunk_s[-1])
            record.chunk_s.append(now)
            record.output_text += delta
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    usage = event.get("usage")
    if isinstance(usage, dict):
        record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens, record.output_tokens_source = usage["completion_tokens"], "usage"
    if "cosine_ray" in event:
        record.read_stats(event["cosine_ray"])


def _finish_ok(record: RequestRecord) -> None:
    record.status = "ok"
    if record.output_tokens is None:
        record.output_tokens, record.output_tokens_source = len(record.chunk_s), "chunks"
    if record.first_token_s is not None:
        record.ttft_s = record.first_token_s - record.sent_s
    record.e2el_s = record.end_s - record.sent_s
    if record.ttft_s is not None and record.output_tokens > 1:
        record.tpot_s = (record.e2el_s - record.ttft_s) / (record.output_tokens - 1)
