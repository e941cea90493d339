"""Which client request ids this ingress replica answered, and how: the server's half of a
ledger a client (``cosine-loadgen chaos``) checks its own against.

``CompletionRecorder`` (ASGI, outermost) notes every POST that carries ``X-Request-Id``
once its response is over: the status, and the outcome: ``ok`` (status 200, the last body
message handed to the server, no SSE error event), ``error`` (another status, or an error
event), ``incomplete`` (the response never ended: the client left, the task was cancelled).
``GET /admin/completions?replica=R&after=N`` returns the entries after sequence number N
(all kept ones when R is not this replica's id), behind the API key like every non-public
route. The ledger is in memory and bounded (``MAX_ENTRIES``, oldest dropped first, and
counted): a restarted replica starts a new one under a new id.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ADMIN_PATH = "/admin/completions"
HEADER = b"x-request-id"
MAX_ENTRIES = 100_000
MAX_PAGE = 5_000
MAX_ID_CHARS = 200
"""Longer ids are cut: a client's header must not grow the ledger without bound."""
ERROR_EVENT = b'data: {"error"'


class CompletionLedger:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.replica = uuid.uuid4().hex
        self.entries: deque[dict[str, Any]] = deque(maxlen=max_entries)
        self.next_seq = 0

    def record(self, request_id: str, path: str, status: int | None, outcome: str) -> None:
        self.entries.append({"seq": self.next_seq, "request_id": request_id[:MAX_ID_CHARS], "path": path,
                             "status": status, "outcome": outcome, "t": round(time.time(), 3)})
        self.next_seq += 1

    def page(self, replica: str | None, after: int, limit: int = MAX_PAGE) -> dict[str, Any]:
        """Entries with ``seq > after`` (every kept entry when ``replica`` is not ours)."""
        start = after + 1 if replica == self.replica else 0
        oldest = self.entries[0]["seq"] if self.entries else self.next_seq
        skip = max(0, start - oldest)
        out = [self.entries[i] for i in range(skip, min(len(self.entries), skip + max(1, min(limit, MAX_PAGE))))]
        return {"replica": self.replica, "oldest": oldest, "next": self.next_seq, "entries": out,
                "dropped": max(0, oldest - start)}


class CompletionRecorder:
    def __init__(self, app: ASGIApp, *, ledger: CompletionLedger) -> None:
        self.app = app
        self.ledger = ledger

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rid = dict(scope.get("headers") or []).get(HEADER) if scope["type"] == "http" else None
        if rid is None or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        seen: dict[str, Any] = {"status": None, "ended": False, "error": False}

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body":
                seen["error"] = seen["error"] or ERROR_EVENT in message.get("body", b"")
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                seen["ended"] = True

        try:
            await self.app(scope, receive, watch)
        finally:
            ok = seen["status"] == 200 and seen["ended"] and not seen["error"]
            outcome = "ok" if ok else "error" if seen["ended"] else "incomplete"
            self.ledger.record(rid.decode("latin-1"), scope.get("path", ""), seen["status"], outcome)


def with_completion_ledger(app: FastAPI) -> FastAPI:
    """``app`` recording its completions, with the admin route that reads them."""
    ledger = CompletionLedger()
    app.add_middleware(CompletionRecorder, ledger=ledger)

    async def completions(after: int = -1, replica: str | None = None, limit: int = MAX_PAGE) -> dict[str, Any]:
        return ledger.page(replica, after, limit)

    app.add_api_route(ADMIN_PATH, completions, methods=["GET"], include_in_schema=False)
    return app
