"""The proxy guard (serve/guards/proxy_guard.py) in-process: what a client gets when the app behind
Serve's proxy ends a request without an answer, or cuts an event stream, and that a whole
answer and a departed client pass untouched. The real proxy, with a killed ingress replica, is
exercised by the chaos test (tests/loadgen/test_chaos_serve.py)."""

from __future__ import annotations

import asyncio
import json

from cosine_ray.runtime.cluster import PROXY_CALLBACK
from cosine_ray.serve.guards.proxy_guard import ERROR, ReplicaLossGuard, middlewares


def run_guarded(inner, *, disconnect: bool = False) -> list[dict]:
    """Messages the client side receives from the guard around ``inner``."""
    sent: list[dict] = []

    async def receive():
        if disconnect:
            return {"type": "http.disconnect"}
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(ReplicaLossGuard(inner)({"type": "http", "path": "/v1/completions"}, receive, send))
    return sent


async def lost_before_answer(scope, receive, send):
    """Serve's proxy when the replica died before answering (its 500 path sends nothing)."""


async def lost_mid_stream(scope, receive, send):
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
    await send({"type": "http.response.body", "body": b'data: {"choices": [{"text": "Hi"}]}\n\n', "more_body": True})


async def whole_answer(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def client_left(scope, receive, send):
    assert (await receive())["type"] == "http.disconnect"  # the proxy reads the disconnect, answers nothing


def test_no_answer_becomes_an_openai_503_with_retry_after():
    start, body = run_guarded(lost_before_answer)
    headers = dict(start["headers"])
    assert start["status"] == 503 and headers[b"retry-after"] == b"1"
    err = json.loads(body["body"])["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "service_unavailable_error"
    assert body["more_body"] is False


def test_a_cut_event_stream_ends_with_an_error_event_and_done():
    start, first, tail = run_guarded(lost_mid_stream)
    assert start["status"] == 200 and first["more_body"] is True
    events = [e for e in tail["body"].decode().split("\n\n") if e]
    assert events == [f"data: {json.dumps(ERROR)}", "data: [DONE]"] and tail["more_body"] is False


def test_whole_answers_and_departed_clients_pass_untouched():
    assert [m["type"] for m in run_guarded(whole_answer)] == ["http.response.start", "http.response.body"]
    assert run_guarded(client_left, disconnect=True) == []


def test_serve_finds_the_callback():
    module, name = PROXY_CALLBACK.rsplit(".", 1)
    assert module == ReplicaLossGuard.__module__ and name == middlewares.__name__
    (mw,) = middlewares()
    assert mw.cls is ReplicaLossGuard


def not_ready_proxy(routes_ready: bool):
    """Serve's proxy: ``/-/healthz`` 200 once it has its route table (else 503), and its own 404
    for a path no route serves (every path, while it has no routes)."""
    async def proxy(scope, receive, send):
        if scope["path"] == "/-/healthz":
            status, body = (200, b"success") if routes_ready else (503, b"Route table is not populated yet.")
        else:
            status = 404
            body = f"Path '{scope['path']}' not found. Ping http://.../-/routes for available routes.".encode()
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
    return proxy


async def model_not_found(scope, receive, send):
    """The ingress's own OpenAI 404 (an unknown model): never the proxy's."""
    await send({"type": "http.response.start", "status": 404, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"error": {"code": "model_not_found"}}', "more_body": False})


def test_a_proxy_without_routes_answers_503_and_a_ready_proxys_404_is_openai_shaped():
    start, body = run_guarded(not_ready_proxy(routes_ready=False))
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"1"
    assert json.loads(body["body"])["error"]["code"] == "proxy_not_ready"
    start, body = run_guarded(not_ready_proxy(routes_ready=True))  # a path no route serves
    err = json.loads(body["body"])["error"]
    assert start["status"] == 404 and (err["type"], err["code"]) == ("not_found_error", "not_found")
    assert b"for available routes" not in body["body"] and dict(start["headers"])[b"content-type"] == \
        b"application/json"
    start, body = run_guarded(model_not_found)
    assert start["status"] == 404 and b"model_not_found" in body["body"]
