"""The hostile requests, one ``Case`` each: what a careless or malicious client can send.

A case runs against ``Target`` (the client, the key, the model's name, vocabulary and context
size) and notes what came back in ``Seen``: each response's status (or ``closed``, ``no
answer``, ``unread`` for the raw-socket cases), and a failure when the case has a bar of its
own (a small request not served in 30 s beside 16 streams of ``n=16``; a server that waits
forever for a body sent a byte at a time; unauthenticated requests served). Every case is
bounded: the runner gives it a deadline, and the raw-socket cases stop by themselves after
``hold_s``. Bodies are written as JSON text where JSON objects cannot say it (duplicate keys,
``NaN``, a schema nested deeper than the encoder recurses).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import urlparse

import httpx

from loadgen.client import error_message

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SMALL_DEADLINE_S = 30.0
"""Beside 16 streams of n=16 from one client, a small request must be served within this."""


@dataclass
class Target:
    client: httpx.AsyncClient
    base_url: str
    api_key: str | None
    model: str | None
    vocab_size: int
    max_model_len: int
    hold_s: float = 60.0
    """How long the raw-socket cases keep their connection (a trickling body, an unread stream)."""
    flood: int = 2000
    other_api_key: str | None = None
    """A second key (another tenant): the bystander, the normal request after each case and the
    small request beside the 16 streams of ``n16-streams`` use it, so what they show is what one
    client does to another. None: they use ``api_key`` too."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def other_headers(self) -> dict[str, str]:
        """The headers of the other client (``other_api_key``, else the case's own key)."""
        return {"Authorization": f"Bearer {self.other_api_key}"} if self.other_api_key else self.headers


@dataclass
class Seen:
    statuses: list[Any] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    run: Callable[[Target, Seen], Awaitable[None]]
    needs_key: bool = False


def _body(target: Target, **fields: Any) -> dict[str, Any]:
    return {**({"model": target.model} if target.model else {}), "temperature": 0, **fields}


async def post(target: Target, seen: Seen, path: str, body: dict[str, Any] | str, *, headers: dict | None = None,
               timeout: float | None = None) -> int:
    """One request (a dict as JSON, or JSON text as it is); its status is noted, and the first
    error message of each status."""
    content = body if isinstance(body, str) else json.dumps(body)
    resp = await target.client.post(path, content=content.encode(), timeout=timeout,
                                    headers={"Content-Type": "application/json",
                                             **(target.headers if headers is None else headers)})
    seen.statuses.append(resp.status_code)
    if resp.status_code >= 400:
        note = f"{resp.status_code}: {error_message(resp.content)[:160]}"
        if note not in seen.notes:
            seen.notes.append(note)
    return resp.status_code


# ---- the cases ---------------------------------------------------------------------------------

async def big_schema_n(target: Target, seen: Seen) -> None:
    properties: dict[str, Any] = {}
    for i in range(300):
        kind = i % 3
        properties[f"field_{i}"] = ({"type": "string", "enum": [f"v{i}_{j}" for j in range(8)]} if kind == 0 else
                                    {"type": "integer", "minimum": -i, "maximum": 1000 + i} if kind == 1 else
                                    {"type": "string", "pattern": f"^[a-z]{{3,{12 + i % 5}}}$"})
    schema = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    await post(target, seen, CHAT, _body(target, messages=[{"role": "user", "content": "Fill in the form."}], n=4,
                                         max_tokens=64, response_format={"type": "json_schema", "json_schema": {
                                             "name": "form", "schema": schema}}))


async def n16_streams(target: Target, seen: Seen) -> None:
    streams: list[asyncio.Task] = []

    async def stream() -> None:
        body = _body(target, messages=[{"role": "user", "content": "Tell me a long story."}], n=16,
                     ignore_eos=True, max_tokens=256, stream=True)
        async with target.client.stream("POST", CHAT, json=body, headers=target.headers) as resp:
            seen.statuses.append(resp.status_code)
            async for _ in resp.aiter_raw():
                pass

    try:
        streams = [asyncio.ensure_future(stream()) for _ in range(16)]
        await asyncio.sleep(5.0)  # the 16 admitted (or refused) before the small request
        start = time.perf_counter()
        try:
            status = await post(target, seen, COMPLETIONS, _body(target, prompt="Hello", max_tokens=8),
                                timeout=SMALL_DEADLINE_S, headers=target.other_headers)
            key = "the other key" if target.other_api_key else "the same key"
            seen.notes.append(f"small request ({key}): {status} in {time.perf_counter() - start:.1f} s")
        except httpx.TimeoutException:
            seen.statuses.append("no answer")
            seen.failures.append(f"a small request beside them got no answer in {SMALL_DEADLINE_S:g} s")
    finally:
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)


async def many_messages(target: Target, seen: Seen) -> None:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(20_000)]
    await post(target, seen, CHAT, _body(target, messages=messages, max_tokens=8))


async def echo_logprobs_n4(target: Target, seen: Seen) -> None:
    length = max(16, min(3000, target.max_model_len - 64))
    rng = random.Random(0)
    prompt = [rng.randrange(100, max(101, target.vocab_size - 100)) for _ in range(length)]
    if length != 3000:
        seen.notes.append(f"prompt of {length} tokens (the model's context is {target.max_model_len})")
    await post(target, seen, COMPLETIONS, _body(target, prompt=prompt, echo=True, logprobs=5, n=4, max_tokens=16))


async def logit_bias_duplicates(target: Target, seen: Seen) -> None:
    entries = ", ".join(f'"{i % target.vocab_size}": -1, "0{i % target.vocab_size}": 1' for i in range(35_000))
    head = json.dumps(_body(target, prompt="Hello", max_tokens=8))[:-1]
    await post(target, seen, COMPLETIONS, f'{head}, "logit_bias": {{{entries}}}}}')


async def stop_ids_cover_vocab(target: Target, seen: Seen) -> None:
    await post(target, seen, COMPLETIONS, _body(target, prompt="Hello", max_tokens=8, min_tokens=4,
                                                stop_token_ids=list(range(target.vocab_size))))


async def deep_schema(target: Target, seen: Seen) -> None:
    depth = 950  # JSON levels: one per schema level (nested "items")
    schema = '{"type": "array", "items": ' * depth + '{"type": "string"}' + "}" * depth
    head = json.dumps(_body(target, messages=[{"role": "user", "content": "Answer."}], max_tokens=8))[:-1]
    await post(target, seen, CHAT, f'{head}, "response_format": {{"type": "json_schema", "json_schema": '
                                   f'{{"name": "deep", "schema": {schema}}}}}}}')


async def bad_numbers(target: Target, seen: Seen) -> None:
    model = f'"model": {json.dumps(target.model)}, ' if target.model else ""
    for fields in ('"max_tokens": 8, "temperature": NaN', '"max_tokens": 1000000000000000000000000000000',
                   '"max_tokens": 8, "temperature": 0, "top_p": -1'):
        await post(target, seen, COMPLETIONS, f'{{{model}"prompt": "Hello", {fields}}}')


async def many_stop_strings(target: Target, seen: Seen) -> None:
    rng = random.Random(1)
    stop = ["".join(rng.choice("abcdefghij ") for _ in range(40)) for _ in range(10_000)]
    await post(target, seen, COMPLETIONS, _body(target, prompt="Hello", max_tokens=8, stop=stop))


async def many_tools(target: Target, seen: Seen) -> None:
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "A tool.", "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}} for i in range(2000)]
    await post(target, seen, CHAT, _body(target, messages=[{"role": "user", "content": "Use a tool."}],
                                         tools=tools, max_tokens=8))


async def _raw(target: Target) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, str]:
    url = urlparse(target.base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    auth = f"Authorization: Bearer {target.api_key}\r\n" if target.api_key else ""
    return reader, writer, f"Host: {url.hostname}\r\n{auth}Content-Type: application/json\r\n"


async def _status_line(reader: asyncio.StreamReader) -> Any:
    line = await reader.readline()
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else "closed"


async def slow_body(target: Target, seen: Seen) -> None:
    reader, writer, headers = await _raw(target)
    try:
        writer.write(f"POST {COMPLETIONS} HTTP/1.1\r\n{headers}Content-Length: 100000\r\n\r\n".encode())
        answer = asyncio.ensure_future(_status_line(reader))
        start = time.perf_counter()
        while not answer.done() and time.perf_counter() - start < target.hold_s:
            try:
                writer.write(b" ")
                await writer.drain()
            except ConnectionError:
                break
            await asyncio.wait([answer], timeout=0.5)
        if answer.done():
            seen.statuses.append(answer.result())
            seen.notes.append(f"answered after {time.perf_counter() - start:.1f} s of a trickling body")
        else:
            answer.cancel()
            seen.statuses.append("no answer")
            seen.failures.append(f"still reading a body sent a byte every 0.5 s after {target.hold_s:g} s")
    finally:
        writer.close()


async def unread_stream(target: Target, seen: Seen) -> None:
    reader, writer, headers = await _raw(target)
    body = json.dumps(_body(target, prompt="Count to a million:", ignore_eos=True, max_tokens=4000, stream=True))
    try:
        writer.write(f"POST {COMPLETIONS} HTTP/1.1\r\n{headers}Content-Length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()
        await asyncio.sleep(min(target.hold_s, 30.0))  # never read: the server's sends pile up
        seen.statuses.append("unread")
    finally:
        writer.close()


async def unauthenticated_flood(target: Target, seen: Seen) -> None:
    gate = asyncio.Semaphore(64)
    body = _body(target, prompt="Hello", max_tokens=8)

    async def one() -> None:
        async with gate:
            try:
                await post(target, seen, COMPLETIONS, body, headers={})
            except httpx.HTTPError as exc:
                seen.statuses.append(type(exc).__name__)

    await asyncio.gather(*(one() for _ in range(target.flood)))
    served = sum(1 for s in seen.statuses if isinstance(s, int) and 200 <= s < 300)
    if served:
        seen.failures.append(f"{served} requests without the API key were served")


CASES = (
    Case("big-schema-n4", "a JSON schema of 300 fields with n=4", big_schema_n),
    Case("n16-streams", "16 streams of n=16 with ignore_eos, then a small request", n16_streams),
    Case("20k-messages", "a chat of 20,000 messages", many_messages),
    Case("echo-logprobs-n4", "a 3,000-token prompt with echo, logprobs=5, n=4", echo_logprobs_n4),
    Case("logit-bias-70k", "70,000 logit_bias entries, each id twice (\"1\" and \"01\")", logit_bias_duplicates),
    Case("stop-ids-vocab", "stop_token_ids covering the vocabulary, min_tokens=4", stop_ids_cover_vocab),
    Case("schema-950-deep", "a JSON schema nested 950 deep (array items)", deep_schema),
    Case("bad-numbers", "temperature NaN; max_tokens 10^30; top_p -1 (three requests)", bad_numbers),
    Case("10k-stop-strings", "10,000 stop strings of 40 characters", many_stop_strings),
    Case("2k-tools", "2,000 tools", many_tools),
    Case("slow-body", "a body of 100,000 bytes sent one byte every 0.5 s", slow_body),
    Case("unread-stream", "a stream of 4,000 tokens whose client never reads", unread_stream),
    Case("unauth-flood", "2,000 requests without the API key, 64 at a time", unauthenticated_flood, needs_key=True),
)
