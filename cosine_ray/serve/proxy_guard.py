"""An ASGI middleware for Ray Serve's HTTP proxy: a replica lost mid-request is a clean 503.

When the ingress replica dies while it holds a request, Serve's proxy answers nothing (its
client sees uvicorn's bare ``500 Internal Server Error``) or, if the response had begun, cuts
the connection mid-body. The guard watches what the proxy sends for each request and, when the
proxy finishes without having started a response, sends an OpenAI-shaped 503 with
``Retry-After``; when an event stream was cut before its end, it ends the stream the way the
ingress ends a failed one: an SSE error event (503), then ``data: [DONE]``. A client that left
first (the proxy's 499) gets nothing. A proxy just restarted serves HTTP before the controller
sent it the route table, and answers every path 404 (``Path ... not found``) meanwhile: the
guard asks the proxy's own ``/-/healthz`` and, while that says not ready, answers such a 404 as
a 503 with ``Retry-After`` (a 404 of a ready proxy, a path no route serves, passes).
``middlewares()`` is what Serve calls in every proxy (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``
= ``runtime.cluster.PROXY_CALLBACK``; ``runtime.cluster.connect`` sets it for the job, whose
Serve controller passes it to the proxies it starts). Standard library only: it is imported in
the proxy process.
"""

from __future__ import annotations

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

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


class ReplicaLossGuard:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "finished": False, "sse": False, "client_gone": False}
        held: list[Message] = []  # the proxy's own 404, until it is known whether it is ready

        async def watched_receive() -> Message:
            message = await receive()
            if message.get("type") == "http.disconnect":
                state["client_gone"] = True
            return message

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message.get("status") == 404 and not state["started"]:
                held.append(message)
                return
            if held and message["type"] == "http.response.body":
                start = held.pop()
                if (not message.get("more_body", False) and PROXY_NOT_FOUND in message.get("body", b"")
                        and not await self._proxy_ready(scope)):
                    state["started"] = state["finished"] = True
                    await _send_json(send, 503, NOT_READY)
                    return
                await forward(start)
            await forward(message)

        async def forward(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = dict(message.get("headers") or [])
                state["sse"] = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["finished"] = True
            await send(message)

        await self.app(scope, watched_receive, watched_send)
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


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def middlewares() -> list[Any]:
    """Serve's proxy callback: the middlewares it wraps its ASGI app in."""
    from starlette.middleware import Middleware
    return [Middleware(ReplicaLossGuard)]
