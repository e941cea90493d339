"""Reliability of the HTTP layer in-process (fast): auth on every route, bounded admission
(503 + Retry-After for exactly the excess), server-side timeout (408, engine work cancelled),
body limit (413), with rejection latencies measured.

Engines: ``GateEngine`` (a fake that holds every admitted request until the test opens a gate,
so "N in flight" is exact and deterministic) for admission counting, and a real ``LocalEngine``
(tiny random model, SmolLM2 tokenizer, n-gram drafter; its target slowed down past position
64, so a long request is long on any machine) behind uvicorn for the timeout: its engine core,
target KV and drafter state are read directly to prove the cancelled work is freed.
The same checks against the real ``cosine-ray serve`` on Ray are in test_reliability_serve.py.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient
from support.tiny_checkpoint import write_tiny_checkpoint
from support.uvicorn_thread import serve_in_thread

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import RequestOutput
from cosine_ray.serve.guards import tenants
from cosine_ray.serve.errors import OVERLOADED_CODE
from cosine_ray.serve.metrics_http import METRICS_PATH
from cosine_ray.serve.openai_app import PUBLIC_PATHS, build_openai_app

pytestmark = pytest.mark.real_model  # the embedded SmolLM2's tokenizer

API_KEY = "k3y-0123456789abcdef"
COMP = "/v1/completions"
ERROR_KEYS = {"message", "type", "param", "code"}


def report(label: str, values_s: list[float]) -> None:
    ms = sorted(v * 1000 for v in values_s)
    print(f"\n[reliability-app] {label}: n={len(ms)} median {statistics.median(ms):.1f} ms, "
          f"max {ms[-1]:.1f} ms", flush=True)


class _IdTokenizer:
    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class GateEngine:
    """EngineClient fake: each admitted request waits for ``gate`` then yields one token.
    ``num_streaming`` counts requests inside the engine; ``num_closed`` closed streams."""

    model_name, max_model_len, vocab_size = "gate", 64, 100

    def __init__(self) -> None:
        self.gate: asyncio.Event | None = None
        self.num_streaming = 0
        self.num_closed = 0

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        self.num_streaming += 1
        try:
            await self.gate.wait()
            yield RequestOutput(request_id, [7], True, "length")
        finally:
            self.num_streaming -= 1
            self.num_closed += 1

    async def check_request(self, prompt_token_ids, params) -> None:
        pass

    async def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    async def metrics_snapshot(self, http=None) -> dict[str, Any]:
        return {}


# ---- auth: every route in the app's own route table ----------------------------------------------

def _concrete(path: str) -> str:
    return path.replace("{model_id:path}", "gate")


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, read from its route table, so a route
    added later is swept automatically."""
    out = []
    for route in app.routes:
        for method in sorted(getattr(route, "methods", None) or ()):
            out.append((method, _concrete(route.path)))
    return out


@pytest.mark.parametrize("metrics_require_key", [False, True])
def test_api_key_guards_every_route_except_the_allowlist(monkeypatch, metrics_require_key):
    calls = []
    real_compare = tenants.hmac.compare_digest

    def counting_compare(a, b):
        calls.append((len(a), len(b)))
        return real_compare(a, b)

    monkeypatch.setattr(tenants.hmac, "compare_digest", counting_compare)
    engine = GateEngine()
    app = build_openai_app(engine, _IdTokenizer(), model_name="gate", api_key=API_KEY,
                           metrics_require_key=metrics_require_key)
    routes = _routes(app)
    paths = {p for _, p in routes}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/models/gate", "/health",
            METRICS_PATH, "/openapi.json", "/docs"} <= paths, paths
    public = PUBLIC_PATHS - ({METRICS_PATH} if metrics_require_key else set())
    client = TestClient(app)
    wrong_same_length = "Bearer " + "x" * len(API_KEY)
    failures = []
    for method, path in routes + [("GET", "/no/such/route"), ("POST", "/v1/embeddings")]:
        for label, headers in (("none", {}), ("wrong", {"Authorization": wrong_same_length}),
                               ("no-bearer", {"Authorization": API_KEY}),
                               ("lowercase-scheme", {"Authorization": f"bearer-{API_KEY}"})):
            r = client.request(method, path, headers=headers)
            expected_401 = path not in public
            if (r.status_code == 401) != expected_401:
                failures.append(f"{method} {path} key={label}: {r.status_code}")
            elif expected_401 and method != "HEAD":  # HEAD answers carry no body
                err = r.json()["error"]
                if set(err) != ERROR_KEYS or err["type"] != "authentication_error" \
                        or r.headers.get("WWW-Authenticate") != "Bearer":
                    failures.append(f"{method} {path}: not an OpenAI 401: {r.text[:200]}")
        if path.startswith("/v1/") and "/no/" not in path and "embeddings" not in path:
            r = client.request(method, path, headers={"Authorization": f"Bearer {API_KEY}"})
            if r.status_code == 401:
                failures.append(f"{method} {path}: the right key was refused")
    assert not failures, "\n".join(failures)
    assert calls and all(b == len(f"Bearer {API_KEY}") for _, b in calls), \
        "the key must be checked with hmac.compare_digest"
    ok = client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "gate"
    assert client.get("/health").status_code == 200
    print(f"\n[reliability-app] auth sweep: {len(routes)} (method, route) pairs from the route table, "
          f"public {sorted(public)}", flush=True)


# ---- overload: exactly the excess is rejected, at once ---------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_bounded_admission_rejects_exactly_the_excess(stream):
    max_pending, excess = 6, 4
    engine = GateEngine()
    app = build_openai_app(engine, _IdTokenizer(), model_name="gate", max_pending_requests=max_pending)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, dict[str, str], Any, float]:
        start = time.perf_counter()
        r = await client.post(COMP, json={"prompt": [1, 2, i % 50], "max_tokens": 2, "stream": stream})
        return r.status_code, dict(r.headers), r.text, time.perf_counter() - start

    async def main():
        engine.gate = asyncio.Event()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=30) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(max_pending + excess)]
            deadline = time.monotonic() + 10
            while (engine.num_streaming < max_pending or sum(t.done() for t in tasks) < excess) \
                    and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            held = engine.num_streaming
            rejected_early = [t.result() for t in tasks if t.done()]
            engine.gate.set()
            results = await asyncio.gather(*tasks)
            # every slot was given back: a full batch is admitted again
            again = await asyncio.gather(*(one(client, i) for i in range(max_pending)))
            return held, rejected_early, results, again

    held, rejected_early, results, again = asyncio.run(asyncio.wait_for(main(), 60))
    assert held == max_pending
    statuses = [r[0] for r in results]
    assert statuses.count(503) == excess and statuses.count(200) == max_pending, statuses
    assert sorted(r[0] for r in rejected_early) == [503] * excess  # rejected while the rest were held
    for status, headers, text, _ in results:
        if status == 503:
            assert headers["retry-after"] == "1"
            err = httpx.Response(503, text=text).json()["error"]
            assert set(err) == ERROR_KEYS and err["code"] == OVERLOADED_CODE
            assert err["type"] == "service_unavailable_error"
        elif stream:
            assert text.count("data: [DONE]") == 1
    assert [r[0] for r in again] == [200] * max_pending
    assert engine.num_streaming == 0 and engine.num_closed == 2 * max_pending
    report("503 rejection latency (in-process, queue full)", [r[3] for r in results if r[0] == 503])
    assert max(r[3] for r in results if r[0] == 503) < 2.0  # rejected at once (above: before any slot freed)


def test_body_limit_and_bad_json_are_rejected_fast():
    app = build_openai_app(GateEngine(), _IdTokenizer(), model_name="gate", max_body_bytes=1 << 16)
    client = TestClient(app)
    too_large, bad_json = [], []
    for _ in range(20):
        start = time.perf_counter()
        r = client.post(COMP, content=b" " * ((1 << 16) + 1), headers={"Content-Type": "application/json"})
        too_large.append(time.perf_counter() - start)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        start = time.perf_counter()
        r = client.post(COMP, content=b'{"prompt": [', headers={"Content-Type": "application/json"})
        bad_json.append(time.perf_counter() - start)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    report("413 rejection latency (in-process)", too_large)
    report("400 rejection latency (in-process, malformed JSON)", bad_json)
    assert statistics.median(too_large) < 0.1 and statistics.median(bad_json) < 0.1


# ---- timeout: 408 and the engine work is cancelled ---------------------------------------------------

TIMEOUT_S = 1.0
LONG_TOKENS = 1800
SLOW_FROM, SLOW_TOKEN_S = 64, 0.01
"""The target scores each token at position SLOW_FROM or later SLOW_TOKEN_S slower: a request
for LONG_TOKENS cannot end within 17 s, one for a few tokens runs at the tiny model's speed."""


class LateSlowTarget:
    """The verifier's target, slow past SLOW_FROM (each such token scored waits SLOW_TOKEN_S)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def score(self, items):
        await asyncio.sleep(SLOW_TOKEN_S * sum(len(i.token_ids) for i in items if i.start_position >= SLOW_FROM))
        return await self.inner.score(items)


class Served:
    def __init__(self, url: str, engine: LocalEngine) -> None:
        self.url, self.engine = url, engine

    def held_state(self) -> dict[str, int]:
        core = self.engine.core
        return {"running": len(core.running), "waiting": len(core.waiting),
                "kv_requests": self.engine.target.num_cached_requests(),
                "drafter_requests": sum(d.num_tracked_requests for d in self.engine.drafters)}

    def wait_free(self, timeout_s: float) -> tuple[dict[str, int], float]:
        start = time.monotonic()
        while True:
            state = self.held_state()
            if not any(state.values()) or time.monotonic() - start > timeout_s:
                return state, time.monotonic() - start
            time.sleep(0.01)


@pytest.fixture(scope="module")
def timed_server(tmp_path_factory, real_checkpoint):
    ck = write_tiny_checkpoint(tmp_path_factory.mktemp("timeout") / "tiny", tokenizer_from=real_checkpoint)
    engine = LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters("ngram")).replace(
            max_num_seqs=2), checkpoint=ck)
    engine.core.verifier.target = LateSlowTarget(engine.core.verifier.target)
    app = build_openai_app(_LocalClient(engine), engine.tokenizer, model_name="tiny",
                           request_timeout_s=TIMEOUT_S, max_pending_requests=8)
    url, stop = serve_in_thread(app)
    yield Served(url, engine)
    stop()


def _LocalClient(engine):
    from cosine_ray.engine.client import LocalEngineClient
    return LocalEngineClient(engine)


def test_request_timeout_gives_408_and_frees_engine_state(timed_server):
    long_body = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": LONG_TOKENS,
                 "temperature": 0}
    alone_s = SLOW_TOKEN_S * (LONG_TOKENS - SLOW_FROM)  # the least a long request takes by itself
    assert TIMEOUT_S + 2.0 + 10.0 < alone_s
    latencies, freed = [], []
    with httpx.Client(base_url=timed_server.url, timeout=30) as client:
        for stream in (False, True, False):
            start = time.perf_counter()
            r = client.post(COMP, json={**long_body, "stream": stream})
            elapsed = time.perf_counter() - start
            if stream:  # headers went out with the first token: the 408 is an SSE error event
                assert r.status_code == 200
                events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
                err = httpx.Response(408, text=events[-2]).json()["error"]
                assert err["type"] == "timeout_error" and err["code"] == "timeout", events[-2]
            else:
                assert r.status_code == 408, r.text
                err = r.json()["error"]
                assert set(err) == ERROR_KEYS and err["type"] == "timeout_error"
            latencies.append(elapsed - TIMEOUT_S)
            assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0
            state, took = timed_server.wait_free(10.0)  # still before it could have ended by itself
            assert not any(state.values()), f"cancelled request still holds state: {state}"
            freed.append(took)
        # a request inside the deadline is untouched, and the slots came back
        r = client.post(COMP, json={**long_body, "max_tokens": 8})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    report(f"408: time past the {TIMEOUT_S} s deadline until the response", latencies)
    report("408: state freed in the engine, KV and drafter after the response", freed)


def test_huge_headers_get_431_and_the_server_stays_healthy(timed_server):
    with httpx.Client(base_url=timed_server.url, timeout=30) as client:
        for headers in ({"X-Big": "a" * 100_000}, {f"X-H{i}": "a" * 20 for i in range(5000)}):
            start = time.perf_counter()
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 431, r.text[:200]
            err = r.json()["error"]
            assert set(err) == ERROR_KEYS and err["code"] == "headers_too_large"
            print(f"\n[reliability-app] 431 latency: {(time.perf_counter() - start) * 1000:.1f} ms", flush=True)
        assert client.get("/v1/models", headers={"X-Fine": "a" * 4000}).status_code == 200
        assert client.get("/health").json() == {"status": "ok"}


class TickEngine(GateEngine):
    """Yields one token every 10 ms until closed; records closes (the abort path). Like
    RayEngineClient, it waits for each output through its own ``asyncio.wait_for``, so a
    cancellation takes more than one loop turn to unwind."""

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        self.num_streaming += 1
        try:
            while True:
                await asyncio.wait_for(asyncio.sleep(0.01), timeout=10)
                yield RequestOutput(request_id, [7], False)
        finally:
            self.num_streaming -= 1
            self.num_closed += 1


def test_disconnect_mid_stream_with_a_request_deadline_closes_the_engine_stream(caplog):
    """Regression: with ``request_timeout_s`` set, the wait for the next token ran in a separate
    task (``asyncio.wait_for``); a client disconnect cancelled the handler while that task was
    still inside the engine iterator, so ``aclose()`` failed ("asynchronous generator is
    already running"), the request was never aborted and the response ended in a 500 path."""
    caplog.set_level("ERROR", logger="cosine_ray")
    engine = TickEngine()
    url, stop = serve_in_thread(build_openai_app(engine, _IdTokenizer(), model_name="gate",
                                                 request_timeout_s=60, max_pending_requests=4))
    try:
        for _ in range(3):
            with httpx.Client(base_url=url, timeout=30) as client:
                with client.stream("POST", COMP, json={"prompt": [1, 2], "max_tokens": 60, "stream": True}) as r:
                    lines = r.iter_lines()
                    assert sum(next(lines).startswith("data: ") for _ in range(6)) >= 3
            deadline = time.monotonic() + 2
            while engine.num_streaming and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.num_streaming == 0, "the engine stream was not closed after the disconnect"
        # every admission slot came back: 4 concurrent requests are admitted again
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(4):
                with client.stream("POST", COMP, json={"prompt": [1], "max_tokens": 60, "stream": True}) as r:
                    assert r.status_code == 200
        deadline = time.monotonic() + 2
        while engine.num_streaming and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.num_streaming == 0 and engine.num_closed == 7
    finally:
        stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= 40 and r.name.startswith("cosine_ray")]
    assert not errors, errors


@pytest.mark.parametrize("flags, message", [
    (["--max-pending-requests", "0"], "--max-pending-requests must be >= 1"),
    (["--request-timeout-s", "-1"], "--request-timeout-s must be > 0"),
])
def test_serve_rejects_bad_overload_flags_with_exit_2(capsys, flags, message):
    from cosine_ray.cli import main
    assert main(["serve", "--port", "8123", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
