"""An ASGI middleware for Ray Serve's HTTP proxy: a replica lost mid-request is a clean 503.

When the ingress replica dies while it holds a request, Serve's proxy answers nothing (its
client sees uvicorn's bare ``500 Internal Server Error``) or, if the response had begun, cuts
the connection mid-body. The guard watches what the proxy sends for each request and, when the
proxy finishes without having started a response, sends an OpenAI-shaped 503 with
``Retry-After``; when an event stream was cut before its end, it ends the stream the way the
ingress ends a failed one: an SSE error event (503), then ``data: [DONE]``. A client that left
first (the proxy's 499) gets nothing. ``middlewares()`` is what Serve calls in every proxy
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`` = ``PROXY_CALLBACK``; ``runtime.cluster.connect``
sets it for the job, whose Serve controller passes it to the proxies it starts). Standard
library only: it is imported in the proxy process.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, Awaitable, Callable

PROXY_CALLBACK = "cosine_ray.serve.proxy_guard.middlewares"
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
MESSAGE = "the server replica handling this request was lost; retry"
ERROR = {"error": {"message": MESSAGE, "type": "service_unavailable_error", "param": None,
                   "code": "replica_unavailable"}}

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


class ReplicaLossGuard:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        state = {"started": False, "finished": False, "sse": False, "client_gone": False}

        async def watched_receive() -> Message:
            message = await receive()
            if message.get("type") == "http.disconnect":
                state["client_gone"] = True
            return message

        async def watched_send(message: Message) -> None:
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
                body = json.dumps(ERROR).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body, "more_body": False})
            elif state["sse"]:
                tail = f"data: {json.dumps(ERROR)}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})


def middlewares() -> list[Any]:
    """Serve's proxy callback: the middlewares it wraps its ASGI app in."""
    from starlette.middleware import Middleware
    return [Middleware(ReplicaLossGuard)]
