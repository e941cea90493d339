"""An ASGI middleware for Ray Serve's HTTP proxy: the proxy's own answers are OpenAI-shaped, a
replica lost mid-request is a clean 503, and a client that cannot keep up is dropped.

A replica that dies holding a request leaves the proxy answering nothing (uvicorn's bare 500) or
cutting a stream mid-body: the guard then sends an OpenAI 503 with ``Retry-After``, or ends the
stream as the ingress ends a failed one (an SSE error event, then ``data: [DONE]``). A client
that left first (the proxy's 499) gets nothing. The proxy's own plain-text errors (its
backpressure 503, its 404 for a path no route serves, its timeouts, a 500 with an exception's
text) become the OpenAI error of their status with a fixed message, ``Retry-After`` kept. A
proxy just restarted answers every path 404 until it has its route table: while its
``/-/healthz`` says not ready, such a 404 becomes a 503 with ``Retry-After``.

Slow clients: behind Serve the replica's sends never block (the proxy buffers), so a client that
stops reading would pile up its tokens here. Each send to the client is bounded by
``slow_client_s``; past it the client is dropped: the proxy's next ``receive`` says it
disconnected, which cancels the request in the replica and the engine. ``middlewares()`` is what
Serve calls in every proxy (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` = ``PROXY_CALLBACK``,
set by ``runtime.cluster.connect``; the constant lives there). Standard library only: it is imported in
the proxy process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any, Awaitable, Callable

MESSAGE = "the server replica handling this request was lost; retry"
ERROR = {"error": {"message": MESSAGE, "type": "service_unavailable_error", "param": None,
                   "code": "replica_unavailable"}}
NOT_READY = {"error": {"message": "the HTTP proxy is starting and has no routes yet; retry",
                       "type": "service_unavailable_error", "param": None, "code": "proxy_not_ready"}}
PROXY_NOT_FOUND = b"for available routes"
"""The end of the 404 body Serve's proxy sends for a path no route serves."""
HEALTH_PATH = "/-/healthz"
SLOW_CLIENT_S = 30.0
"""Longest one send to the client may wait (it stopped reading): then it is dropped."""
MAX_HELD_BODY = 64 << 10
"""A plain-text error body is read whole before it is replaced, up to this many bytes."""
PROXY_ERRORS = {
    404: ("not_found_error", "not_found", "unknown path {path}"),
    408: ("timeout_error", "timeout", "the request timed out in the server's proxy; retry"),
    429: ("rate_limit_error", "server_overloaded", "the server is overloaded; retry later"),
    499: ("invalid_request_error", "client_closed", "the client closed the request"),
    503: ("service_unavailable_error", "server_overloaded", "the server is overloaded or starting; retry later"),
}
"""The OpenAI error sent for each status the proxy answers itself (any other: a 500)."""
DISCONNECT = {"type": "http.disconnect"}

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


def openai_error(status: int, path: str) -> tuple[int, dict[str, Any]]:
    """(status, body) replacing the proxy's own plain-text answer of ``status``."""
    if status in PROXY_ERRORS:
        kind, code, message = PROXY_ERRORS[status]
    elif status < 500:
        kind, code, message = "invalid_request_error", "invalid_request", "the request was refused"
    else:
        status, kind, code, message = 500, "server_error", "internal_error", "internal server error"
    return status, {"error": {"message": message.format(path=path[:200]), "type": kind, "param": None, "code": code}}


def _is_plain_error(message: Message) -> bool:
    """A response start that is an error whose body is not JSON: one of the proxy's own."""
    if message.get("status", 200) < 400:
        return False
    content_type = dict(message.get("headers") or []).get(b"content-type", b"")
    return not content_type.startswith((b"application/json", b"text/event-stream"))


class ReplicaLossGuard:
    def __init__(self, app: Any, *, slow_client_s: float = SLOW_CLIENT_S) -> None:
        self.app = app
        self.slow_client_s = slow_client_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "finished": False, "sse": False, "client_gone": False}
        dropped = asyncio.Event()
        held: list[Message] = []  # a plain-text error's start and body, until the body is whole

        async def watched_receive() -> Message:
            if dropped.is_set():
                return DISCONNECT
            message_task = asyncio.ensure_future(receive())
            drop_task = asyncio.ensure_future(dropped.wait())
            try:
                await asyncio.wait({message_task, drop_task}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                drop_task.cancel()
                if not message_task.done():
                    message_task.cancel()
                    message_task = None
            if message_task is None:  # dropped while waiting for the client
                return DISCONNECT
            message = message_task.result()
            if message.get("type") == "http.disconnect":
                state["client_gone"] = True
            return message

        async def watched_send(message: Message) -> None:
            if dropped.is_set():
                return
            if message["type"] == "http.response.start" and not state["started"] and _is_plain_error(message):
                held.append(message)
                return
            if held and message["type"] == "http.response.body":
                held.append(message)
                size = sum(len(m.get("body", b"")) for m in held[1:])
                if message.get("more_body", False) and size < MAX_HELD_BODY:
                    return
                await replace(held)
                return
            await forward(message)

        async def replace(parts: list[Message]) -> None:
            start, body = parts[0], b"".join(m.get("body", b"") for m in parts[1:])
            parts.clear()
            state["started"] = state["finished"] = True
            status = start["status"]
            if status == 404 and PROXY_NOT_FOUND in body and not await self._proxy_ready(scope):
                return await _send_json(send, 503, NOT_READY)
            status, payload = openai_error(status, str(scope.get("path", "")))
            retry_after = dict(start.get("headers") or []).get(b"retry-after")
            if retry_after is None and status in (429, 503):
                retry_after = b"1"
            await _send_json(send, status, payload, retry_after=retry_after)

        async def forward(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = dict(message.get("headers") or [])
                state["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["finished"] = True
            try:
                async with asyncio.timeout(self.slow_client_s):
                    await send(message)
            except TimeoutError:  # the client takes nothing: drop it, and tell the proxy it left
                state["client_gone"] = True
                dropped.set()

        await self.app(scope, watched_receive, watched_send)
        if held:  # the proxy ended without finishing its error body
            await replace(held)
        if state["client_gone"] or state["finished"]:
            return
        with contextlib.suppress(Exception):  # the connection may be gone too
            if not state["started"]:
                await _send_json(send, 503, ERROR)
            elif state["sse"]:
                tail = f"data: {json.dumps(ERROR)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})

    async def _proxy_ready(self, scope: dict[str, Any]) -> bool:
        """Whether the proxy answers its ``/-/healthz`` with 200 (it has its routes); True when
        the question itself fails, so that a 404 passes as it was."""
        status: dict[str, int] = {}

        async def receive() -> Message:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]

        health = {**scope, "method": "GET", "path": HEALTH_PATH, "raw_path": HEALTH_PATH.encode(),
                  "query_string": b"", "headers": []}
        try:
            await self.app(health, receive, send)
        except Exception:
            return True
        return status.get("code", 200) == 200


async def _send_json(send: Send, status: int, payload: dict[str, Any], *, retry_after: bytes | None = b"1") -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if retry_after is not None:
        headers.append((b"retry-after", retry_after))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list[Any]:
    """Serve's proxy callback: the middlewares it wraps its ASGI app in."""
    from starlette.middleware import Middleware
    return [Middleware(ReplicaLossGuard)]
