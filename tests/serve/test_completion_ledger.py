"""The server's record of the client request ids it answered (``serve/completion_ledger.py``):
what counts as answered, what does not, reading it page by page, and its bound. On a small
FastAPI app with the real API-key middleware; the OpenAI app with it is exercised end to end
in tests/loadgen/test_chaos_references.py."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.testclient import TestClient

from cosine_ray.serve.completion_ledger import ADMIN_PATH, CompletionLedger, with_completion_ledger
from cosine_ray.serve.guards.tenants import ApiKeyMiddleware, key_ring

KEY = {"Authorization": "Bearer k"}


def app_and_client() -> tuple[FastAPI, TestClient]:
    app = FastAPI()

    @app.post("/ok")
    async def ok() -> dict:
        return {"text": "hi"}

    @app.post("/bad")
    async def bad() -> JSONResponse:
        return JSONResponse({"error": {"message": "no"}}, status_code=400)

    @app.post("/stream-error")
    async def stream_error() -> StreamingResponse:
        async def events():
            yield 'data: {"choices": []}\n\n'
            yield 'data: {"error": {"message": "engine gone", "type": "service_unavailable_error"}}\n\n'
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/cancelled")
    async def cancelled() -> dict:
        raise asyncio.CancelledError()  # what a client that leaves does to its handler

    app.add_middleware(ApiKeyMiddleware, keys=key_ring("k", ()), public_paths=frozenset())
    app = with_completion_ledger(app)
    return app, TestClient(app, raise_server_exceptions=False)


def entries(client: TestClient, **params) -> dict:
    resp = client.get(ADMIN_PATH, params=params, headers=KEY)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_each_answer_is_recorded_with_its_outcome():
    _, client = app_and_client()
    for path, rid in (("/ok", "a"), ("/bad", "b"), ("/stream-error", "c"), ("/ok", "a")):
        client.post(path, headers={**KEY, "X-Request-Id": rid})
    client.post("/ok", headers=KEY)  # no id: nothing to match, nothing kept
    client.post("/ok", headers={"X-Request-Id": "no-key"})  # 401: recorded, not answered
    try:
        client.post("/cancelled", headers={**KEY, "X-Request-Id": "gone"})
    except BaseException:  # the test client may surface the cancellation
        pass
    page = entries(client)
    got = [(e["request_id"], e["status"], e["outcome"]) for e in page["entries"]]
    assert got[:5] == [("a", 200, "ok"), ("b", 400, "error"), ("c", 200, "error"), ("a", 200, "ok"),
                       ("no-key", 401, "error")]
    assert got[5:] == [("gone", None, "incomplete")]
    assert client.get(ADMIN_PATH).status_code == 401  # behind the API key


def test_pages_follow_a_cursor_per_replica_and_the_bound_is_counted():
    ledger = CompletionLedger(max_entries=3)
    for i in range(5):
        ledger.record(f"r{i}", "/p", 200, "ok")
    page = ledger.page(None, -1)  # another replica's cursor: all that is kept, and what was dropped
    assert [e["seq"] for e in page["entries"]] == [2, 3, 4] and page["dropped"] == 2
    assert [e["seq"] for e in ledger.page(ledger.replica, 3)["entries"]] == [4]
    assert ledger.page(ledger.replica, 0)["dropped"] == 1  # seq 1 went before it was read
    assert [e["seq"] for e in ledger.page(ledger.replica, 2, limit=1)["entries"]] == [3]
    ledger.record("x" * 1000, "/p", 200, "ok")
    assert len(ledger.entries[-1]["request_id"]) == 200
