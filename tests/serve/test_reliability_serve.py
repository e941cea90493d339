"""Reliability of the real ``cosine-ray serve`` on the session Ray cluster.

One server for the module: the CLI joins the session cluster with a tiny random-weight model
that has SmolLM2's tokenizer (the claims here are about the serving layer, and a tiny model
keeps 2 CPU cores responsive under 16 clients), 2 pipeline stages, the n-gram drafter,
``--max-batch-size 4`` (so requests queue in the engine), ``--max-pending-requests 20`` and the
API key from the environment (``COSINE_RAY_API_KEY``). References are transformers' greedy
decoding of the same tiny checkpoint.

In file order:

* auth from the env var, and a handful of bad inputs through the real proxy (exact status);
* disconnects (queued, after the first token, mid-stream, non-streaming) abort the request
  and free its state in the engine, every stage's KV and every drafter within 10 s
  (``EngineServer.stats``), long before it could have ended by itself;
* overload: 20 + 5 concurrent long requests → exactly 5 answered 503 + Retry-After;
  a flood with a 0.5 s client timeout leaves nothing behind;
* soak: 16 concurrent clients (mixed streaming / non-streaming) for ``--soak-seconds``
  (default 420): no 5xx, one ``[DONE]`` per stream, every text equal to the reference, the
  server's HTTP counters equal to the client ledger, nothing in flight 5 s after, and the
  resident memory of every actor flat after warm-up (slope reported, bound asserted), and every
  actor's C heap in use no higher idle after the soak than under load after warm-up (bound 8 MiB);
* faults under concurrent load, each with a client-side ledger (lost = duplicated = hung = 0):
  a drafter killed (``ray.kill``, then SIGKILL of its process: a hard exit), a stage killed
  while a stream is mid-answer (SIGKILL; Ray restarts it, the engine re-prefills), the engine
  replica killed (``ray.kill``, then SIGKILL): in-flight requests end with an error within 10 s
  and new requests succeed once Serve has started a new engine (with new stages and drafters).

The server-side request timeout (408) is tested in-process against a real LocalEngine
(test_reliability_app.py): a timeout short enough to test here would also cut the soak.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import shutil
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
import torch

ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402

from cosine_ray.engine.request import SamplingParams  # noqa: E402
from cosine_ray.runtime.cluster import actor_name  # noqa: E402
from cosine_ray.runtime.engine_client import RayEngineClient  # noqa: E402
from cosine_ray.runtime.engine_client import ENGINE_DEPLOYMENT  # noqa: E402
from cosine_ray.runtime.memory import resident_mib  # noqa: E402

from support.cli_server import free_port, log_tail, wait_until_serving  # noqa: E402
from support.engine_app import (APP_NAME, engine_actor, engine_call, engine_handle,  # noqa: E402
                                engine_replicas, stop_and_clean)
from support.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model]

API_KEY = "reliability-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_PENDING = 20
MAX_BATCH = 4
READY_TIMEOUT_S = 300.0
SHORT_TOKENS = 16
"""Soak and fault-load requests: short, so 2 cores serve 16 clients."""
LONG_TOKENS = 1500
"""Requests that must still be running when the test acts on them (~40 s each here)."""
FREE_WITHIN_S = 10.0
"""Far below what a LONG_TOKENS request takes by itself; the engine's counters show each was aborted."""
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a small village,",
           "def fibonacci(n):", "Water boils at 100 degrees Celsius because", "one two three four five six",
           "The capital of France is", "In 1969, astronauts", "Lists: apples, pears, plums,"]
STAGES = [actor_name("stage", 0), actor_name("stage", 1)]
DRAFTER = actor_name("drafter", 0)


def note(msg: str) -> None:
    print(f"[reliability] {msg}", flush=True)


# ---- the server --------------------------------------------------------------------------------

@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log_path: Path
    prompt_ids: list[list[int]]
    refs: list[str]
    """Greedy text of each prompt, SHORT_TOKENS tokens."""
    long_refs: list[str]
    """Greedy text of each prompt, FAULT_TOKENS tokens."""
    model: str = ""

    def log_tail(self, n: int = 40) -> str:
        return log_tail(self.log_path, n)


FAULT_TOKENS = 48


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory, real_checkpoint):
    root = tmp_path_factory.mktemp("reliability")
    ckpt = write_tiny_checkpoint(root / "tiny-smollm2", tokenizer_from=real_checkpoint, seed=7)
    port = free_port()
    log_path = root / "cli.log"
    exe = shutil.which("cosine-ray")
    cmd = ([exe] if exe else [sys.executable, "-m", "cosine_ray.cli"]) + [
        "serve", "--port", str(port), "--address", ray_cluster, "--model", str(ckpt.path),
        "--drafters", "ngram", "--drafters-in-engine", "none", "--stages", "2", "--max-batch-size", str(MAX_BATCH),
        "--max-pending-requests", str(MAX_PENDING), "--request-timeout-s", "300"]
    start = time.perf_counter()
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "COSINE_RAY_API_KEY": API_KEY})
    srv = None
    try:
        tok = ckpt.load_tokenizer()
        hf = ckpt.load_hf_model()
        prompt_ids = [[int(t) for t in tok(p, add_special_tokens=True)["input_ids"]] for p in PROMPTS]
        refs, long_refs = [], []
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=FAULT_TOKENS, do_sample=False, num_beams=1, temperature=None,
                              top_p=None, top_k=None, pad_token_id=0)[0, len(ids):].tolist()
            assert len(out) == FAULT_TOKENS, "premise: the tiny model's greedy text never hits EOS"
            refs.append(tok.decode(out[:SHORT_TOKENS], skip_special_tokens=True))
            long_refs.append(tok.decode(out, skip_special_tokens=True))
        srv = Server(f"http://127.0.0.1:{port}", proc, log_path, prompt_ids, refs, long_refs)
        wait_until_serving(proc, log_path, READY_TIMEOUT_S)
        note(f"server ready in {time.perf_counter() - start:.1f} s")
        srv.model = httpx.get(f"{srv.url}/v1/models", headers=AUTH, timeout=30).json()["data"][0]["id"]
        yield srv
    finally:
        rc, left = stop_and_clean(proc, log)
        note(f"CLI stopped (exit {rc}); log tail:\n{srv.log_tail(10) if srv else ''}")
        assert not left, f"actors still alive after cleanup: {left}"


def engine_replica():
    """The engine deployment's replica actor (what a fault test kills)."""
    replicas = engine_replicas()
    assert len(replicas) == 1, replicas
    return ray.get_actor(replicas[0], namespace="serve")


def stats(timeout_s: float = 30.0) -> dict[str, Any]:
    return engine_call("stats", timeout_s=timeout_s)


def endings() -> dict[str, float]:
    """Requests the engine ended, by finish reason (``cosine_ray:request_success``)."""
    snapshot = engine_call("metrics_snapshot")
    return {dict(k)["finished_reason"]: v for k, v in snapshot.get("cosine_ray:request_success", {}).items()}


def held(s: dict[str, Any]) -> dict[str, int]:
    """Request state held anywhere (0 everywhere = idle)."""
    out = {"running": s["running"], "waiting": s["waiting"], "streams": s["streams"],
           "to_release": s["to_release"]}
    for name, kv in zip(STAGES, s["kv"]):
        out[f"kv:{name}"] = kv["requests"]
        out[f"kv_tokens:{name}"] = kv["tokens"]
    for name, d in s["drafters"].items():
        out[f"drafter:{name}"] = d.get("requests", -1)
    return out


def wait_free(timeout_s: float) -> tuple[dict[str, int], float]:
    """Poll the engine's stats until nothing is held; (last state, seconds waited)."""
    start = time.monotonic()
    while True:
        state = held(stats())
        if not any(state.values()) or time.monotonic() - start > timeout_s:
            return state, time.monotonic() - start
        time.sleep(0.05)


def body(i: int, *, max_tokens: int = SHORT_TOKENS, stream: bool = False, cid: str | None = None) -> dict:
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, "user": cid or uuid.uuid4().hex}


# ---- the ledger --------------------------------------------------------------------------------

@dataclass
class Record:
    cid: str
    prompt: int
    stream: bool
    status: int
    """HTTP status; 0 = the client saw no response (connection error); -1 = hung (client deadline)."""
    text: str = ""
    num_done: int = 0
    error: str | None = None
    start: float = 0.0
    end: float = 0.0
    first_text: float = 0.0
    """When the first streamed text arrived (0: none yet)."""


@dataclass
class Ledger:
    started: dict[str, float] = field(default_factory=dict)
    records: dict[str, list[Record]] = field(default_factory=dict)
    open: dict[str, Record] = field(default_factory=dict)
    """Requests in flight, as far as they have got."""

    def add(self, record: Record) -> None:
        self.open.pop(record.cid, None)
        self.records.setdefault(record.cid, []).append(record)

    def all(self) -> list[Record]:
        return [r for rs in self.records.values() for r in rs]

    def summary(self) -> dict[str, int]:
        return {"requests": len(self.started),
                "lost": sum(1 for c in self.started if c not in self.records),
                "duplicated": sum(1 for rs in self.records.values() if len(rs) > 1),
                "hung": sum(1 for r in self.all() if r.status == -1),
                "ok": sum(1 for r in self.all() if r.status == 200 and r.error is None),
                "errors": sum(1 for r in self.all() if r.status != 200 or r.error is not None)}


async def one_request(client: httpx.AsyncClient, ledger: Ledger, i: int, *, stream: bool,
                      max_tokens: int, deadline_s: float) -> Record:
    """One request; always records exactly one terminal line (never raises)."""
    cid = uuid.uuid4().hex
    ledger.started[cid] = time.monotonic()
    rec = Record(cid, i % len(PROMPTS), stream, 0, start=time.monotonic())
    ledger.open[cid] = rec
    try:
        async with asyncio.timeout(deadline_s):
            if not stream:
                r = await client.post("/v1/completions", json=body(i, max_tokens=max_tokens, cid=cid))
                rec.status = r.status_code
                if r.status_code == 200:
                    rec.text = r.json()["choices"][0]["text"]
                else:
                    rec.error = r.text[:300]
            else:
                async with client.stream("POST", "/v1/completions",
                                         json=body(i, max_tokens=max_tokens, stream=True, cid=cid)) as r:
                    rec.status = r.status_code
                    if r.status_code != 200:
                        rec.error = (await r.aread()).decode(errors="replace")[:300]
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            data = line[6:]
                            if data == "[DONE]":
                                rec.num_done += 1
                                continue
                            event = json.loads(data)
                            if "error" in event:
                                rec.error = json.dumps(event["error"])[:300]
                            else:
                                rec.text += "".join(c["text"] for c in event["choices"])
                                rec.first_text = rec.first_text or (time.monotonic() if rec.text else 0.0)
    except TimeoutError:
        rec.status, rec.error = -1, "hung: no terminal answer by the client deadline"
    except (httpx.HTTPError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.end = time.monotonic()
    ledger.add(rec)
    return rec


async def run_load(url: str, *, clients: int, stop: asyncio.Event, ledger: Ledger, max_tokens: int,
                   deadline_s: float = 90.0, pause_s: float = 0.0) -> None:
    """``clients`` loops, each sending one request after another (every other one streaming)
    until ``stop`` is set."""
    async def worker(w: int) -> None:
        n = 0
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=None) as client:
            while not stop.is_set():
                await one_request(client, ledger, w + n, stream=(w + n) % 2 == 0, max_tokens=max_tokens,
                                  deadline_s=deadline_s)
                n += 1
                if pause_s:
                    await asyncio.sleep(pause_s)

    await asyncio.gather(*(worker(w) for w in range(clients)))


def check_texts(records: list[Record], refs: list[str]) -> list[str]:
    """Problems: a 200 whose text differs from the reference, a stream without exactly one
    [DONE], an error whose partial text is not a prefix of the reference (a duplicated or
    wrong token), any 5xx other than a clean 503."""
    problems = []
    for r in records:
        ref = refs[r.prompt]
        if r.status == 200 and r.stream and r.num_done != 1:
            problems.append(f"{r.cid}: stream with {r.num_done} [DONE]")
        if r.status == 200 and r.error is None and r.text != ref:
            problems.append(f"{r.cid}: text differs from the reference: {r.text!r} vs {ref!r}")
        if r.error is not None and not ref.startswith(r.text):
            problems.append(f"{r.cid}: partial text is not a prefix of the reference: {r.text!r}")
        if r.status >= 500 and r.status != 503:
            problems.append(f"{r.cid}: status {r.status}: {r.error}")
    return problems


# ---- auth and bad input through the real proxy ----------------------------------------------------

def test_api_key_from_env_guards_the_real_server(server):
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # allowlisted
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/openapi.json"),
                         ("GET", "/docs")):
        r = httpx.request(method, f"{server.url}{path}", timeout=30, json={"prompt": "x"} if method == "POST" else None)
        assert r.status_code == 401, (path, r.status_code)
        assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.request(method, f"{server.url}{path}", timeout=30, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_bad_inputs_through_the_real_server(server):
    cases = [  # (name, method, path, content or json, extra headers, status, param)
        ("malformed-json", "POST", "/v1/completions", b'{"prompt": [', {}, 400, None),
        ("max-tokens-0", "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, {}, 400, "max_tokens"),
        ("temperature-nan", "POST", "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', {}, 400, "temperature"),
        ("prompt-oov", "POST", "/v1/completions", {"prompt": [10**9]}, {}, 400, "prompt"),
        ("context-overflow", "POST", "/v1/completions", {"prompt": [5] * 5000}, {}, 400, "prompt"),
        ("unknown-model", "POST", "/v1/completions", {"prompt": "hi", "model": "gpt-9"}, {}, 404, "model"),
        ("wrong-method", "GET", "/v1/completions", None, {}, 405, None),
        ("unknown-path", "POST", "/v1/embeddings", {"input": "x"}, {}, 404, None),
        ("oversized-body", "POST", "/v1/completions", b" " * ((1 << 20) + 1), {}, 413, None),
        ("huge-header", "GET", "/v1/models", None, {"X-Big": "a" * 100_000}, 431, None),
    ]
    latencies: dict[str, float] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for name, method, path, payload, headers, status, param in cases:
            kwargs: dict[str, Any] = {"headers": {**AUTH, **headers}}
            if isinstance(payload, dict):
                kwargs["json"] = payload
            elif payload is not None:
                kwargs["content"] = payload
                kwargs["headers"]["Content-Type"] = "application/json"
            start = time.perf_counter()
            r = client.request(method, path, **kwargs)
            latencies[name] = time.perf_counter() - start
            assert r.status_code == status, (name, r.status_code, r.text[:200])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (name, err)
            assert "Traceback" not in r.text
        r = client.post("/v1/completions", json=body(0), headers=AUTH)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.refs[0]
    note("4xx latency through Serve (ms): " + ", ".join(f"{k} {v * 1000:.0f}" for k, v in latencies.items()))
    assert held(stats())["running"] == 0


# ---- disconnects ---------------------------------------------------------------------------------

async def _open_stream(client: httpx.AsyncClient, i: int, max_tokens: int = LONG_TOKENS):
    """Enter a streaming request; returns (context manager, response) still open."""
    cm = client.stream("POST", "/v1/completions", json=body(i, max_tokens=max_tokens, stream=True))
    return cm, await cm.__aenter__()


async def _wait_engine(predicate: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        s = await asyncio.to_thread(stats)
        if predicate(s):
            return s
        assert time.monotonic() < deadline, f"engine never reached the state: {held(s)}"
        await asyncio.sleep(0.05)


async def _measure_free(label: str, results: dict[str, float]) -> None:
    state, took = await asyncio.to_thread(wait_free, FREE_WITHIN_S)
    assert not any(state.values()), f"{label}: state still held {took:.1f} s after the disconnect: {state}"
    results[label] = took


def test_disconnects_free_state_on_engine_stages_and_drafters(server):
    results: dict[str, float] = {}
    before = endings()

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client:
            # (1) queued: the batch is full of long streams; a 5th request waits in the engine
            opened = await asyncio.gather(*(_open_stream(client, i) for i in range(MAX_BATCH)))
            queued = asyncio.ensure_future(client.post("/v1/completions", json=body(5, max_tokens=LONG_TOKENS)))
            await _wait_engine(lambda s: s["running"] == MAX_BATCH and s["waiting"] == 1)
            queued.cancel()  # the client goes away while its request is queued
            await asyncio.gather(queued, return_exceptions=True)
            await _wait_engine(lambda s: s["waiting"] == 0, FREE_WITHIN_S)
            results["queued (engine queue empty)"] = 0.0
            for cm, _ in opened:
                await cm.__aexit__(None, None, None)
            await _measure_free("queued + 4 open streams closed", results)

            # (2) after the first token
            # (breaking out of ``async for`` would let the dropped line iterator close the
            # response in the background: iterate by hand and keep it alive)
            cm, r = await _open_stream(client, 1)
            lines = r.aiter_lines()
            while not ((line := await lines.__anext__()).startswith("data: ")
                       and json.loads(line[6:])["choices"][0]["text"]):
                pass
            assert held(await asyncio.to_thread(stats))["running"] == 1
            await cm.__aexit__(None, None, None)
            await _measure_free("after the first token", results)

            # (3) mid-stream, with both KV and the drafter holding state
            cm, r = await _open_stream(client, 2)
            lines, n = r.aiter_lines(), 0
            while n < 30:
                n += (await lines.__anext__()).startswith("data: ")
            s = held(await asyncio.to_thread(stats))
            assert s["running"] == 1 and all(s[f"kv:{name}"] == 1 for name in STAGES), s
            await cm.__aexit__(None, None, None)
            await _measure_free("mid-stream", results)

            # (4) non-streaming: the client times out while the server generates
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body(3, max_tokens=LONG_TOKENS), timeout=2.0)
            await _measure_free("non-streaming", results)

    asyncio.run(asyncio.wait_for(main(), 300))
    note("state freed after disconnect (s): " + ", ".join(f"{k} {v:.2f}" for k, v in results.items()))
    after = endings()
    # all 8 requests (4 streams + the queued one, then one per case) were aborted, none ran to its end
    assert {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)} == {"abort": 8}
    r = httpx.post(f"{server.url}/v1/completions", json=body(0), headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.refs[0]


# ---- overload --------------------------------------------------------------------------------------

def test_overload_rejects_exactly_the_excess_with_retry_after(server):
    """MAX_PENDING + 5 long streams at once: exactly 5 are answered 503 + Retry-After at once
    while the MAX_PENDING admitted ones stay in flight (4 running, 16 queued in the engine)."""
    excess = 5
    rejected: list[tuple[int, dict, str, float]] = []
    probes: list[tuple[int, float]] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        start = time.perf_counter()
        async with client.stream("POST", "/v1/completions",
                                 json=body(i, max_tokens=LONG_TOKENS, stream=True)) as r:
            if r.status_code != 200:
                rejected.append((r.status_code, dict(r.headers), (await r.aread()).decode(),
                                 time.perf_counter() - start))
                return
            async for _ in r.aiter_lines():  # admitted: hold the slot until cancelled
                pass

    async def main():
        limits = httpx.Limits(max_connections=MAX_PENDING + excess + 5)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=300, limits=limits) as client:
            tasks = [asyncio.ensure_future(one(client, i)) for i in range(MAX_PENDING + excess)]
            try:
                s = await _wait_engine(lambda s: s["running"] + s["waiting"] == MAX_PENDING, 60)
            except AssertionError as exc:  # say where the others went: refused (how), or still open
                refused = [(status, text[:160]) for status, _, text, _ in rejected]
                raise AssertionError(f"{exc}; {len(refused)} refused: {refused}; "
                                     f"{sum(not t.done() for t in tasks)} client tasks still open") from None
            deadline = time.monotonic() + 30
            while len(rejected) < excess and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # Every request is accounted for: `excess` rejected and MAX_PENDING held by the engine
            # (re-read after the rejections). None is left that a later rejection could hit.
            s = held(await asyncio.to_thread(stats))
            finished = sum(t.done() for t in tasks)
            # while full: one request at a time, the steady-state rejection latency
            for i in range(10):
                start = time.perf_counter()
                r = await client.post("/v1/completions", json=body(i))
                probes.append((r.status_code, time.perf_counter() - start))
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return finished, s

    finished, during = asyncio.run(asyncio.wait_for(main(), 240))
    assert len(rejected) == excess and finished == excess, (len(rejected), finished)
    assert during["running"] + during["waiting"] == MAX_PENDING, during
    for status, headers, text, _ in rejected:
        assert status == 503 and headers.get("retry-after") == "1", (status, headers)
        err = json.loads(text)["error"]
        assert err["code"] == "server_overloaded" and err["type"] == "service_unavailable_error"
    lat = sorted(r[3] * 1000 for r in rejected)
    note(f"503 latency through Serve in the burst of {MAX_PENDING + excess}: median {lat[len(lat) // 2]:.0f} ms, "
         f"max {lat[-1]:.0f} ms (includes admitting the other {MAX_PENDING} on 2 cores)")
    assert [status for status, _ in probes] == [503] * len(probes)
    lat = sorted(t * 1000 for _, t in probes)
    note(f"503 latency through Serve while full (one at a time): median {lat[len(lat) // 2]:.0f} ms, "
         f"max {lat[-1]:.0f} ms")
    assert lat[len(lat) // 2] < 2000, "a full server must reject at once, not after a slot frees"
    state, took = wait_free(10.0)
    assert not any(state.values()), state
    note(f"overload: {MAX_PENDING} streams closed, state freed in {took:.2f} s")


def test_flood_with_short_client_timeouts_leaves_nothing_behind(server):
    """60 long requests from clients that give up after 0.5 s; then a fresh request
    completes within 15 s and no state is left anywhere."""
    async def impatient(client: httpx.AsyncClient, i: int) -> str:
        try:
            if i % 2:
                async with client.stream("POST", "/v1/completions",
                                         json=body(i, max_tokens=LONG_TOKENS, stream=True)) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                await client.post("/v1/completions", json=body(i, max_tokens=LONG_TOKENS))
            return "finished"
        except httpx.TimeoutException:
            return "timeout"

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=0.5,
                                     limits=httpx.Limits(max_connections=100)) as client:
            return await asyncio.gather(*(impatient(client, i) for i in range(60)))

    outcomes = asyncio.run(asyncio.wait_for(main(), 120))
    # premise: the flood left admitted, abandoned requests behind (the rest got 503 at once);
    # MAX_PENDING are admitted at most, fewer when slots of the previous test's closed streams
    # are still being released by the ingress (19 of 20 seen once)
    assert outcomes.count("timeout") >= MAX_PENDING // 2, outcomes
    start = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/completions", json=body(4), headers=AUTH, timeout=15)
    took = time.perf_counter() - start
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.refs[4]
    state, freed = wait_free(5.0)
    assert not any(state.values()), state
    note(f"flood of 60 (0.5 s client timeout): fresh request answered in {took:.2f} s; idle after {freed:.2f} s")


# ---- soak ----------------------------------------------------------------------------------------

def slope_mib_per_min(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB) samples, in MiB per minute."""
    ts = torch.tensor([t for t, _ in samples], dtype=torch.float64)
    ys = torch.tensor([y for _, y in samples], dtype=torch.float64)
    tc = ts - ts.mean()
    return float((tc * (ys - ys.mean())).sum() / (tc * tc).sum()) * 60.0


async def ask_actors(actors: dict[str, Any], method: str) -> dict[str, Any]:
    """Each actor's answer to ``method`` (no arguments), all asked at once (name -> actor handle);
    actors that answer None are left out."""
    calls = (getattr(a, method).remote() for a in actors.values())
    values = await asyncio.wait_for(asyncio.gather(*calls), 30)
    return {n: v for n, v in zip(actors, values) if v is not None}


async def actors_held(actors: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each actor's resident memory right after a heap trim, between two of its calls
    (``runtime.memory.held_mib``)."""
    return await ask_actors(actors, "held_mib")


async def actors_heap_in_use(actors: dict[str, Any]) -> dict[str, float]:
    """Each actor's C heap in use (MiB), asked of the actors themselves (None off glibc: left out)."""
    return await ask_actors(actors, "malloc_in_use_mib")


def http_counts(url: str) -> dict[tuple[str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "cosine_ray:http_requests_total":
                out[(s.labels["route"], s.labels["status"])] = s.value
    return out


SOAK_CLIENTS = 16
RSS_SLOPE_BOUND_MIB_PER_MIN = 2.0
"""The guide's target is < 1 MiB/min over 10 min; the 5-minute default run fits its line to
the last 180 s of samples and asserts 2 MiB/min (a real per-request leak of even 1 KiB at ~10
requests/s would show as ~0.6 MiB/min). The window was 90 s (a 3-minute run) until steps of
3-4 MiB in the engine's private RSS, with its C heap in use and live objects falling, gave
fitted slopes of 0.64, 0.65, 1.66 and 2.81 MiB/min in four runs of the same code: a step
weighs half as much on a window twice as long. --soak-seconds 600 checks 1 MiB/min after a
2-minute warm-up."""
PYTHON_OBJECTS_BOUND = 2000
"""Live Python objects the engine may hold more, idle after the soak, than under load at the end
of warm-up (noise: ±300 of ~420,000): a request leaked in the engine leaves a dozen objects or
more (request, token lists, stats), so even one in three of ~600 requests leaked would fail it."""
MALLOC_IN_USE_BOUND_MIB = 8.0
"""Bytes in use in the engine's C heap, idle after the soak vs under load after warm-up (noise
about ±1 MiB): a native per-request leak of 8 KiB over ~1,000 requests would fail it."""


def test_soak_sixteen_clients(server, request):
    """Before the engine trimmed its heap (runtime/memory.py) its RSS rose in steps for the
    first 3.5 minutes (+20 MiB, all in glibc thread arenas, then flat for 400 s and 3,000
    requests) while its C heap in use, Python heap and live-object count stayed flat: a
    3-minute fit of that gave 2.1-4.4 MiB/min. With the trim, a 300-s soak fitted after 120 s
    still saw that warm-up once (+3.0 MiB/min: private RSS 383 -> 391 MiB in one step at
    ~240 s, while live objects fell 4559 -> 806 and C heap in use 219.2 -> 214.9 MiB), so the
    line is fitted over the second half of a 420-s soak, to private memory (RssAnon: the shared
    object-store pages a process touches are bounded by the store); and the engine's live
    Python objects and C heap in use, which a per-request leak would raise, are compared
    between the end of warm-up and idle.

    The stage and drafter actors are sampled by a call that trims their heap and then reads
    their RSS (``held_mib``), so a sample falls between two of their forwards and holds no
    pages glibc merely kept since its last trim. Read from outside, the last stage's private
    RSS jumped by ±10 MiB from one 30-s sample to the next (244.3, 254.8, 255.7, 244.9, 251.3)
    while its C heap in use stayed at 162.9 -> 162.7 MiB; in another run, probed through
    /proc/PID/smaps, every change of the stages' private memory was in the main arena's
    ``[heap]`` mapping, none in thread arenas or other mappings. Most likely freed step
    buffers (its logits are the largest) caught before the 5-s trimmer ran. Those jumps fitted
    2.67 and 5.04 MiB/min in two of three runs of unchanged code. Memory a leak holds is not
    trimmed and still shows; both series are printed."""
    duration = float(request.config.getoption("--soak-seconds"))
    warmup = min(240.0, duration / 2)
    bound = RSS_SLOPE_BOUND_MIB_PER_MIN if duration < 600 else 1.0
    pids = engine_call("actor_pids")
    assert set(pids) == {"engine", *STAGES, DRAFTER}, pids
    counts_before = http_counts(server.url)
    actors = {name: engine_actor(name) for name in (*STAGES, DRAFTER)}
    samples: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in pids}
    raw: dict[str, list[float]] = {name: [] for name in actors}
    """An actor's private RSS read from outside at the same moments, whatever its allocator keeps."""
    memory: dict[str, Any] = {}
    ledger = Ledger()

    async def main() -> float:
        stop = asyncio.Event()
        load = asyncio.ensure_future(run_load(server.url, clients=SOAK_CLIENTS, stop=stop, ledger=ledger,
                                              max_tokens=SHORT_TOKENS, deadline_s=120.0))
        start = time.monotonic()
        while time.monotonic() - start < duration:
            now = time.monotonic() - start
            for name in actors:  # first from outside, as the allocator left it
                raw[name].append(resident_mib(pids[name])["RssAnon"])
            held = await actors_held(actors)  # stages and drafter: after a trim, between two calls
            for name, pid in pids.items():
                samples[name].append((now, held.get(name) or resident_mib(pid)))
            if now >= warmup and "warm" not in memory:
                memory["warm"] = await engine_handle().memory_stats.remote()
                memory["served_at_warm"] = ledger.summary()["requests"]
                memory["actors_warm"] = await actors_heap_in_use(actors)
            await asyncio.sleep(5.0)
        stop.set()
        await load
        return time.monotonic() - start

    elapsed = asyncio.run(main())
    stopped = time.monotonic()
    state, _ = wait_free(5.0)
    idle_after = time.monotonic() - stopped
    memory["idle"] = engine_call("memory_stats", timeout_s=60)
    actors_idle = asyncio.run(actors_heap_in_use(actors))
    summary = ledger.summary()
    records = ledger.all()
    tokens = sum(SHORT_TOKENS for r in records if r.status == 200 and r.error is None)
    note(f"soak: {elapsed:.0f} s, {SOAK_CLIENTS} clients: {summary}; {summary['requests'] / elapsed:.2f} req/s, "
         f"{tokens / elapsed:.1f} tokens/s; idle {idle_after:.2f} s after the load stopped")
    slopes = {}
    for name, pts in samples.items():
        post = [(t, m["RssAnon"]) for t, m in pts if t >= warmup]
        slopes[name] = slope_mib_per_min(post)
        total = slope_mib_per_min([(t, m["VmRSS"]) for t, m in pts if t >= warmup])
        note(f"  RSS {name}: {pts[0][1]['VmRSS']:.0f} -> {pts[-1][1]['VmRSS']:.0f} MiB (shared "
             f"{pts[-1][1]['RssShmem']:.0f}); slope after {warmup:.0f} s warm-up: private {slopes[name]:+.2f} MiB/min, "
             f"all {total:+.2f} ({len(post)} samples); private every 30 s: "
             + " ".join(f"{m['RssAnon']:.1f}" for t, m in pts[::6])
             + ("; read from outside, untrimmed: " + " ".join(f"{m:.1f}" for m in raw[name][::6]) if raw.get(name) else ""))
    for name, at_warm in memory["actors_warm"].items():
        note(f"  {name}: C heap in use {at_warm:.1f} MiB under load after warm-up -> {actors_idle[name]:.1f} idle")
    warm, idle = memory["warm"], memory["idle"]
    grown = int(idle["python_objects"] - warm["python_objects"])
    heap_grown = idle.get("malloc_in_use_mib", 0.0) - warm.get("malloc_in_use_mib", 0.0)
    note(f"  engine after warm-up (under load) -> idle after {summary['requests'] - memory['served_at_warm']} more "
         f"requests: live Python objects {warm['python_objects']:.0f} -> {idle['python_objects']:.0f} ({grown:+d}); "
         f"C heap in use {warm.get('malloc_in_use_mib', float('nan')):.1f} -> "
         f"{idle.get('malloc_in_use_mib', float('nan')):.1f} MiB ({heap_grown:+.2f})")
    assert summary["lost"] == summary["duplicated"] == summary["hung"] == 0, summary
    assert summary["errors"] == 0, [r for r in records if r.error][:5]
    assert summary["requests"] >= SOAK_CLIENTS * 3
    assert grown < PYTHON_OBJECTS_BOUND, f"the engine holds {grown} more Python objects after the soak"
    assert heap_grown < MALLOC_IN_USE_BOUND_MIB, f"the engine's C heap in use grew {heap_grown:.1f} MiB"
    problems = check_texts(records, server.refs)
    assert not problems, problems[:10]
    assert not any(state.values()), f"state held 5 s after the load stopped: {state}"
    # the server's counters equal the ledger exactly
    counts_after = http_counts(server.url)
    served = counts_after.get(("/v1/completions", "200"), 0) - counts_before.get(("/v1/completions", "200"), 0)
    assert served == summary["ok"], (served, summary)
    assert all(not status.startswith("5") or counts_after[(route, status)] == counts_before.get((route, status), 0)
               for route, status in counts_after), "the server counted 5xx responses during the soak"
    for name, slope in slopes.items():
        assert slope < bound, f"{name}: private RSS grows {slope:.2f} MiB/min after warm-up (bound {bound})"
    for name, at_warm in memory["actors_warm"].items():
        assert actors_idle[name] - at_warm < MALLOC_IN_USE_BOUND_MIB, \
            f"{name}: C heap in use grew {actors_idle[name] - at_warm:.1f} MiB after warm-up"


# ---- faults under load ---------------------------------------------------------------------------

def actor_pid(name: str) -> int:
    return engine_call("actor_pids")[name]


def ping_actor(name: str) -> str | None:
    try:
        return ray.get(engine_actor(name).ping.remote(), timeout=5)
    except Exception:
        return None


@dataclass
class FaultRun:
    ledger: Ledger
    kill_time: float
    in_flight_at_kill: list[str]
    first_ok_after_kill: float | None
    """Seconds from the kill to the first 200 of a request started after the kill."""
    landed: float = 0.0
    """When ``inject`` returned: the kill had landed."""

    def mid_stream_at_kill(self) -> list[Record]:
        """Streams that had received text before the kill and had not ended when it landed."""
        return [r for r in self.ledger.all() if r.stream and 0 < r.first_text < self.kill_time and r.end > self.landed]


def early_in_a_stream(server: Server) -> Callable[[Ledger], bool]:
    """A stream in flight has received text, less than half of its answer."""
    return lambda ledger: any(r.stream and r.text and len(r.text) < len(server.long_refs[r.prompt]) / 2
                              for r in list(ledger.open.values()))


def fault_under_load(server: Server, inject: Callable[[], None], *, clients: int = 6,
                     min_after_s: float = 8.0, max_after_s: float = 240.0, settle_s: float = 3.0,
                     ready: Callable[[Ledger], bool] | None = None) -> FaultRun:
    """Load from ``clients`` loops; ``inject`` after ``settle_s`` and, with ``ready``, once
    ``ready(ledger)`` holds (checked every few milliseconds, for at most 60 s); keep loading until
    ``min_after_s`` have passed and 3 requests started after the kill have succeeded."""
    ledger = Ledger()

    async def main() -> FaultRun:
        stop = asyncio.Event()
        load = asyncio.ensure_future(run_load(server.url, clients=clients, stop=stop, ledger=ledger,
                                              max_tokens=FAULT_TOKENS, deadline_s=120.0, pause_s=0.05))
        await asyncio.sleep(settle_s)
        waited = time.monotonic()
        while ready is not None and not ready(ledger) and time.monotonic() - waited < 60.0:
            await asyncio.sleep(0.002)
        in_flight = [c for c in ledger.started if c not in ledger.records]
        kill_time = time.monotonic()
        await asyncio.to_thread(inject)
        landed = time.monotonic()
        while True:
            after = [r for r in ledger.all() if r.start > kill_time and r.status == 200 and r.error is None]
            waited = time.monotonic() - kill_time
            if (waited >= min_after_s and len(after) >= 3) or waited > max_after_s:
                break
            await asyncio.sleep(0.2)
        stop.set()
        await load
        first = min((r.end - kill_time for r in ledger.all()
                     if r.start > kill_time and r.status == 200 and r.error is None), default=None)
        return FaultRun(ledger, kill_time, in_flight, first, landed)

    return asyncio.run(asyncio.wait_for(main(), max_after_s + 200))


def check_ledger(run: FaultRun, server: Server, label: str) -> dict[str, int]:
    summary = run.ledger.summary()
    note(f"{label}: ledger {summary}; first success after the kill: "
         f"{run.first_ok_after_kill if run.first_ok_after_kill is None else round(run.first_ok_after_kill, 2)} s")
    assert summary["lost"] == summary["duplicated"] == summary["hung"] == 0, summary
    problems = check_texts(run.ledger.all(), server.long_refs)
    assert not problems, problems[:10]
    assert run.first_ok_after_kill is not None, f"{label}: no request succeeded after the kill"
    return summary


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_drafter_killed_under_load_never_fails_a_request(server, how):
    old = ping_actor(DRAFTER)
    pid = actor_pid(DRAFTER)
    before = stats()

    def inject() -> None:
        if how == "ray.kill":
            ray.kill(engine_actor(DRAFTER))  # for good: the engine's slot respawns it
        else:
            os.kill(pid, signal.SIGKILL)  # a hard process exit: Ray restarts it (max_restarts)

    run = fault_under_load(server, inject)
    summary = check_ledger(run, server, f"drafter {how}")
    assert summary["errors"] == 0, [r for r in run.ledger.all() if r.error][:3]  # never fails a request
    start = time.monotonic()
    while (inc := ping_actor(DRAFTER)) in (None, old):
        assert time.monotonic() - start < 180, "the drafter did not come back"
        time.sleep(0.5)
    note(f"drafter {how}: back {time.monotonic() - run.kill_time:.1f} s after the kill")
    after = stats()
    if how == "ray.kill":
        assert after["respawns"][DRAFTER] == before["respawns"][DRAFTER] + 1
    state, _ = wait_free(5.0)
    assert not any(state.values()), state


def test_stage_killed_under_load_recovers_or_fails_cleanly(server):
    name = STAGES[1]
    old = ping_actor(name)
    pid = actor_pid(name)

    def inject() -> None:
        os.kill(pid, signal.SIGKILL)  # hard exit; Ray restarts it and the engine re-prefills

    run = fault_under_load(server, inject, min_after_s=5.0, ready=early_in_a_stream(server))
    summary = check_ledger(run, server, f"stage {name} SIGKILL")
    mid = run.mid_stream_at_kill()
    assert mid, "no stream had received text and was still open when the kill landed"
    note(f"stage SIGKILL: {len(mid)} streams mid-answer at the kill: "
         f"{sum(r.status == 200 and r.error is None for r in mid)} completed, {sum(r.error is not None for r in mid)} "
         "ended with a clean error")
    statuses = {r.status for r in run.ledger.all()}
    assert statuses <= {200, 503}, statuses  # recovered, or a clean 503 / SSE error: never 500
    assert ping_actor(name) not in (None, old), "the stage was not replaced"
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    state, _ = wait_free(5.0)
    assert not any(state.values()), f"orphaned state after the stage restart: {state}"
    note(f"stage SIGKILL: {summary['ok']} ok, {summary['errors']} clean errors")


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL"])
def test_engine_killed_under_load_fails_fast_then_serves(server, how):
    pid = engine_call("actor_pids")["engine"]
    replica = engine_replica()

    def inject() -> None:
        if how == "ray.kill":
            ray.kill(replica, no_restart=True)  # Serve notices and starts a new engine replica
        else:
            os.kill(pid, signal.SIGKILL)

    run = fault_under_load(server, inject, min_after_s=5.0, settle_s=4.0)
    summary = check_ledger(run, server, f"engine {how}")
    by_cid = {r.cid: r for r in run.ledger.all()}
    in_flight = [by_cid[c] for c in run.in_flight_at_kill if c in by_cid]
    assert in_flight, "no request was in flight at the kill"
    ended = [r.end - run.kill_time for r in in_flight]
    note(f"engine {how}: {len(in_flight)} in flight at the kill ended within {max(ended):.2f} s "
         f"({sum(r.error is not None for r in in_flight)} with an error); new requests served "
         f"{run.first_ok_after_kill:.1f} s after the kill")
    assert max(ended) <= 10.0, f"in-flight requests took {max(ended):.1f} s to end (at most 10 s)"
    assert {r.status for r in run.ledger.all()} <= {200, 503}
    r = httpx.post(f"{server.url}/v1/completions", json=body(0), headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == server.refs[0]
    state, _ = wait_free(10.0)
    assert not any(state.values()), state


def test_a_call_made_while_no_engine_replica_is_up_ends_within_seconds(server):
    """In-flight requests end within seconds with the kill landing between a request's checks and its generate call (CI saw it
    once, under load): Serve holds a call while no engine replica is RUNNING, so it waited for
    the new replica (15-21 s after the kill here) before the engine's ACCEPTED bounded that wait."""
    ray.kill(engine_replica(), no_restart=True)
    start = time.monotonic()
    while True:
        states = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT].replica_states
        if not states.get("RUNNING"):
            break
        assert time.monotonic() - start < 30, f"Serve still counts a running engine replica: {states}"
        time.sleep(0.05)
    # A 1-s call deadline (the server's is 5 s): the new replica cannot come up inside it, so a
    # call that ends in time is one that was cut at the deadline, whatever this machine's speed.
    client = RayEngineClient(engine_handle(), model_name="m", max_model_len=512, vocab_size=49152,
                             call_timeout_s=1.0)

    async def call() -> tuple[list[Any], float]:
        began = time.monotonic()
        outs = [o async for o in client.stream([1, 2, 3], SamplingParams(max_tokens=4), uuid.uuid4().hex)]
        return outs, time.monotonic() - began

    outs, waited = asyncio.run(asyncio.wait_for(call(), 120))
    note(f"a call made {time.monotonic() - start - waited:.2f} s after the kill, while no engine replica "
         f"ran: ended in {waited:.2f} s ({outs[-1].finish_reason}, error {outs[-1].error!r})")
    # ended by the client, with no token: not served by the new replica
    assert [(o.new_token_ids, o.finished, o.finish_reason) for o in outs] == [([], True, "error")]
    assert outs[0].error.startswith("engine unavailable: "), outs[0].error
    # The client's call deadline, not the new replica's start (without ACCEPTED: 10.9 s here)
    assert waited <= client.call_timeout_s + 5.0, f"the call waited {waited:.1f} s for a new engine replica"
    while (r := httpx.post(f"{server.url}/v1/completions", json=body(0), headers=AUTH, timeout=60)).status_code != 200:
        assert r.status_code == 503, r.text
        assert time.monotonic() - start < 180, "the engine did not come back"
        time.sleep(0.5)
    assert r.json()["choices"][0]["text"] == server.refs[0]
    state, _ = wait_free(10.0)
    assert not any(state.values()), state
