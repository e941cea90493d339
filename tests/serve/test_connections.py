"""Connections: a deadline on reading the body, no engine call for refused or unknown requests,
bounded streams (backpressure, and a client that cannot keep up is dropped with its work
cancelled), tokenization off the event loop, and the proxy's own answers in the OpenAI shape.

The app is driven at the ASGI level where a client's timing matters (a body that never arrives,
a client that stops reading): ``receive`` and ``send`` are the test's, so nothing depends on
socket buffer sizes. Time is bounded by events and deadlines, never measured against a budget.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
from starlette.testclient import TestClient
from support.serve_fakes import IdTokenizer, RecordingEngine

from cosine_ray.serve.openai_app import build_openai_app
from cosine_ray.serve.guards.proxy_guard import ReplicaLossGuard

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
KEY = "k3y-0123456789"


def scope(path: str = COMP, headers: list[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
            "server": ("app", 80)}


def request_body(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# ---- the body: a deadline, with or without a key --------------------------------------------------

def test_a_body_that_does_not_arrive_in_time_gets_408_and_frees_the_request():
    engine = RecordingEngine()
    app = build_openai_app(engine, IdTokenizer(), model_name="fake", body_timeout_s=0.2)
    sent: list[dict] = []
    chunks = [{"type": "http.request", "body": b'{"prompt": [1,', "more_body": True}]

    async def receive():
        if chunks:
            return chunks.pop()
        await asyncio.Event().wait()  # the rest of the body never comes, and the client never leaves

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope(), receive, send), 10))
    assert sent[0]["status"] == 408, sent
    err = json.loads(sent[1]["body"])["error"]
    assert err["code"] == "body_timeout" and err["type"] == "timeout_error" and not engine.checked


# ---- no engine work for refused or unknown requests ----------------------------------------------

def junk(client: TestClient, n: int) -> None:
    """n requests with a wrong key, n of unknown paths and n for an unknown model."""
    good = {"Authorization": f"Bearer {KEY}"}
    for i in range(n):
        assert client.post(COMP, json={"prompt": [1]}, headers={"Authorization": f"Bearer wrong{i}"}) \
            .status_code == 401
        assert client.get(f"/no/such/path/{i}", headers=good).status_code == 404
        assert client.post(COMP, json={"prompt": [1], "model": "other"}, headers=good).status_code == 404


def test_refused_and_unknown_requests_never_call_the_engine():
    engine = RecordingEngine()
    with TestClient(build_openai_app(engine, IdTokenizer(), model_name="fake", api_key=KEY)) as client:
        junk(client, 30)
    assert engine.pushes == [] and not engine.checked and not engine.snapshots, "junk became engine work"


def test_counts_are_pushed_at_most_once_an_interval_and_carry_the_junk():
    engine = RecordingEngine()
    app = build_openai_app(engine, IdTokenizer(), model_name="fake", api_key=KEY, metrics_push_interval_s=60)
    now = [1000.0]
    app.state.server.http_counts.clock = lambda: now[0]
    good = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as client:
        junk(client, 30)
        for _ in range(10):  # within one push interval: the first pushes at once, the rest wait
            assert client.post(COMP, json={"prompt": [1], "max_tokens": 2}, headers=good).status_code == 200
        assert len(engine.pushes) == 1
        replica, totals = engine.pushes[0]
        assert totals[(COMP, 401)] == 30 and totals[("unmatched", 404)] == 30  # carried, never pushed alone
        now[0] += 61.0  # the interval is over: the next response pushes everything
        assert client.post(COMP, json={"prompt": [1], "max_tokens": 2}, headers=good).status_code == 200
        assert len(engine.pushes) == 2 and engine.pushes[-1][1][(COMP, 200)] == 11
    assert app.state.server.http_counts.num_pushes == len(engine.pushes)


def test_concurrent_scrapes_share_one_engine_snapshot():
    class SlowSnapshots(RecordingEngine):
        async def metrics_snapshot(self, http=None):
            await asyncio.sleep(0.2)
            return await super().metrics_snapshot(http)

    engine = SlowSnapshots()
    app = build_openai_app(engine, IdTokenizer(), model_name="fake")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await asyncio.gather(*(client.get("/metrics") for _ in range(20)))

    responses = asyncio.run(main())
    assert [r.status_code for r in responses] == [200] * 20 and engine.snapshots == 1


# ---- streams: backpressure, and a client that cannot keep up is dropped ---------------------------

class StuckClient:
    """A client that reads the response start and ``num_read`` body chunks, then stops reading
    (its ``send`` never returns) and never disconnects."""

    def __init__(self, num_read: int = 2) -> None:
        self.num_read = num_read
        self.messages: list[dict] = []
        self.stuck = asyncio.Event()
        self.forever = asyncio.Event()
        self.body_sent = False

    async def receive(self):
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": request_body(self.body), "more_body": False}
        await self.forever.wait()

    async def send(self, message):
        self.messages.append(message)
        if len(self.messages) > self.num_read:
            self.stuck.set()
            await self.forever.wait()


def test_a_slow_reader_holds_up_its_engine_stream_instead_of_piling_up_outputs():
    engine = RecordingEngine(endless=True)
    app = build_openai_app(engine, IdTokenizer(), model_name="fake")
    client = StuckClient()
    client.body = {"prompt": [1, 2], "max_tokens": 4000, "stream": True, "n": 2}

    async def main():
        task = asyncio.ensure_future(app(scope(), client.receive, client.send))
        await asyncio.wait_for(client.stuck.wait(), 10)
        taken = engine.num_outputs
        for _ in range(2000):  # the engine could produce thousands of outputs meanwhile
            await asyncio.sleep(0)
        grown = engine.num_outputs - taken
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return grown

    grown = asyncio.run(main())
    assert grown <= 16, f"{grown} engine outputs were taken for a client that reads nothing"
    assert engine.num_closed == engine.num_open == 2


def test_a_client_that_cannot_keep_up_is_dropped_and_its_work_cancelled():
    engine = RecordingEngine(endless=True)
    app = build_openai_app(engine, IdTokenizer(), model_name="fake", send_timeout_s=0.3)
    client = StuckClient()
    client.body = {"prompt": [1, 2], "max_tokens": 4000, "stream": True}
    asyncio.run(asyncio.wait_for(app(scope(), client.receive, client.send), 20))  # returns: dropped
    assert engine.num_open == engine.num_closed == 1  # the engine stream was closed: the request aborted
    assert app.state.server.admission.num_pending == 0


# ---- tokenizing a large prompt does not stall other requests ------------------------------------

class BlockingChatTokenizer(IdTokenizer):
    """Its chat template takes until the test says so (a huge prompt being tokenized)."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.is_tokenizing = False
        self.was_released_by_test = False

    def apply_chat_template(self, messages, **kwargs):
        self.is_tokenizing = True
        self.entered.set()
        self.was_released_by_test = self.release.wait(timeout=10)
        self.is_tokenizing = False
        return [1] * 4


def test_a_prompt_being_tokenized_does_not_stall_another_stream():
    tokenizer = BlockingChatTokenizer()
    engine = RecordingEngine()
    app = build_openai_app(engine, tokenizer, model_name="fake")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=30) as client:
            big = asyncio.ensure_future(client.post(CHAT, json={
                "messages": [{"role": "user", "content": "x" * 100}] * 2000, "max_tokens": 2}))
            while not tokenizer.entered.is_set():
                await asyncio.sleep(0.01)
            other = await client.post(COMP, json={"prompt": [1, 2], "max_tokens": 20, "stream": True})
            finished_while_tokenizing = tokenizer.is_tokenizing
            tokenizer.release.set()
            return other, finished_while_tokenizing, await big

    other, finished_while_tokenizing, big = asyncio.run(asyncio.wait_for(main(), 60))
    assert other.status_code == 200 and other.text.count("data: ") == 22  # 20 tokens, the finish, [DONE]
    assert finished_while_tokenizing, "the stream had to wait for the other request's tokenization"
    assert tokenizer.was_released_by_test and big.status_code == 200


# ---- the proxy's own answers ---------------------------------------------------------------------

def guarded(inner, **kwargs) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    asyncio.run(asyncio.wait_for(ReplicaLossGuard(inner, **kwargs)({"type": "http", "path": COMP}, receive, send),
                                 10))
    return sent


def plain(status: int, text: bytes, headers=()):
    async def proxy(scope, receive, send):
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"), *headers]})
        await send({"type": "http.response.body", "body": text, "more_body": False})
    return proxy


def test_the_proxys_plain_text_errors_become_openai_errors_without_its_words():
    backpressure = plain(503, b"Request dropped due to backpressure (num_queued_requests=256, "
                              b"max_queued_requests=256).", [(b"retry-after", b"5")])
    start, body = guarded(backpressure)
    err = json.loads(body["body"])["error"]
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"5"
    assert (err["type"], err["code"]) == ("service_unavailable_error", "server_overloaded")
    assert "backpressure" not in err["message"] and "queued" not in err["message"]
    start, body = guarded(plain(500, b"Traceback ... RayTaskError(ValueError): /home/ray/secret.py line 3"))
    err = json.loads(body["body"])["error"]
    assert start["status"] == 500 and err["message"] == "internal server error" and b"secret" not in body["body"]
    start, body = guarded(plain(408, b"Request 1a2b timed out after 600.0s."))
    assert start["status"] == 408 and json.loads(body["body"])["error"]["code"] == "timeout"


def test_the_proxy_drops_a_client_that_takes_no_bytes_and_the_request_is_cancelled():
    """Behind Serve the replica's sends never block: the proxy is where a stuck client shows."""
    cancelled = asyncio.Event()

    async def proxy(scope, receive, send):  # Serve's proxy: streams, and cancels on a disconnect
        async def stream():
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            while True:
                await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
                await asyncio.sleep(0)

        task = asyncio.ensure_future(stream())
        while (await receive())["type"] != "http.disconnect":
            pass
        task.cancel()
        cancelled.set()

    stuck = asyncio.Event()
    num_sent = [0]

    async def main():
        async def receive():
            await asyncio.sleep(3600)

        async def send(message):
            num_sent[0] += 1
            if num_sent[0] > 3:
                await stuck.wait()  # the client stopped reading

        await ReplicaLossGuard(proxy, slow_client_s=0.2)({"type": "http", "path": COMP}, receive, send)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert cancelled.is_set() and num_sent[0] == 4
