"""A real Prometheus scrapes a real ``cosine-ray serve``; the dashboards' queries must all work.

Set-up: Debian's ``prometheus`` binary (install it with ``sudo bash
scripts/install_prometheus.sh``; .ci/run does, and sets COSINE_RAY_REQUIRE_PROMETHEUS=1; without
the binary the test is skipped, or fails when that variable is 1: it never installs anything
itself) runs on loopback with a 1 s scrape interval against the Serve port's ``/metrics``;
``cosine-ray serve --return-spec-stats`` runs on the session Ray cluster (2 stages, ngram +
retrieval drafters, SmolLM2-135M), with a key file of two tenants. Traffic, through the
official ``openai`` client: with tenant ``main``'s key a warm-up request, a 400 and a 404 (so
every per-request series exists before the main traffic and rates see it grow); tenant
``capped`` (``max_concurrent=1``) streams one request and has a second refused with a 429 (the
per-key series); then drafter 0 is killed (a drafter failure and a respawn), then concurrent chat
and completion requests, streaming and not.

Checks:
(a) every PromQL expression of ``dashboards/*.json`` goes through ``/api/v1/query`` and must be
    valid and return at least one series with a finite value (``$__rate_interval`` becomes a
    window covering the whole test);
(b) counters equal a client-side count exactly: finished requests by reason, prompt and
    generation tokens (from ``usage``), draft / accepted tokens (from the per-request
    ``cosine_ray`` blocks, in total, per drafter and per domain), HTTP responses by route and
    status, requests and 429s per key, the drafter restart.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from support.cli_server import free_port, stop_cli, wait_until_serving  # noqa: E402
from cosine_ray.runtime.cluster import actor_name  # noqa: E402
from support.engine_app import engine_actor, force_cleanup, our_actors  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model]

ROOT = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = ROOT / "scripts" / "install_prometheus.sh"
INSTALL_COMMAND = "sudo bash scripts/install_prometheus.sh"
REQUIRE_ENV = "COSINE_RAY_REQUIRE_PROMETHEUS"
READY_TIMEOUT_S = 360.0
REQUEST_TIMEOUT_S = 180.0
MAX_TOKENS = 16
RATE_WINDOW = "10m"
"""Stands in for Grafana's $__rate_interval: covers the whole test, so rates see all traffic."""
GRAFANA_VARIABLES = {"$__rate_interval": RATE_WINDOW, "${__rate_interval}": RATE_WINDOW,
                     "$__interval": "5s", "${__interval}": "5s", "$__range": RATE_WINDOW,
                     "${__range}": RATE_WINDOW}
API_KEY = "sk-prometheus-main-0123456789"
"""The key of the main traffic (tenant ``main``, no limits of its own)."""
CAPPED_KEY = "sk-prometheus-capped-0123456789"
"""A second tenant, ``capped``, with ``max_concurrent=1``: its second request while its first
streams is the 429 that the dashboards' per-key panels need."""
HELD_TOKENS = 128
"""Tokens of the capped tenant's held stream: seconds of decoding on 2 cores, while its second
request, sent right after the first chunk, is refused."""
CHAT_PROMPTS = ["Write a Python function that returns the factorial of n.",
                "What is 17 times 23? Explain step by step.",
                "Give three tips for a good night's sleep.",
                "Hi! How are you today?"]
COMPLETION_PROMPTS = ["def fibonacci(n):\n    ", "The capital of France is"]


def _log(msg: str) -> None:
    print(f"[prometheus-test] {msg}", flush=True)


def cleanup_leftovers(timeout_s: float = 30.0) -> None:
    """Whatever a killed CLI left in the session cluster (engine, stages, drafters, Serve)."""
    deadline = time.monotonic() + timeout_s
    while our_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    if our_actors():
        force_cleanup()


# ---- prometheus ---------------------------------------------------------------------------------

def prometheus_binary() -> str:
    """The ``prometheus`` on PATH. The test never installs a system package itself: without
    the binary it is skipped (the reason, in pytest's summary, names the install command), or
    it fails when ``COSINE_RAY_REQUIRE_PROMETHEUS=1`` (.ci/run sets it after running
    scripts/install_prometheus.sh, so CI can never skip it silently)."""
    exe = shutil.which("prometheus")
    if exe:
        return exe
    message = (f"prometheus is not installed: run `{INSTALL_COMMAND}` (Debian/Ubuntu, installs the "
               f"`prometheus` package), or put a prometheus binary on PATH")
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 and {message}", pytrace=False)
    pytest.skip(message)


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def query(self, expr: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=timeout_s)
        return r.json()

    def vector(self, expr: str) -> dict[tuple, float]:
        body = self.query(expr)
        assert body.get("status") == "success", f"{expr}: {body}"
        return {tuple(sorted(s["metric"].items())): float(s["value"][1]) for s in body["data"]["result"]}

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def start_prometheus(exe: str, tmp: Path, target_port: int) -> Prometheus:
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: cosine_ray\n    metrics_path: /metrics\n"
        "    scrape_interval: 1s\n    scrape_timeout: 1s\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")
    log_path = tmp / "prometheus.log"
    proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    return Prometheus(f"http://127.0.0.1:{port}", proc, log_path)


def wait_prometheus_ready(prom: Prometheus, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert prom.proc.poll() is None, f"prometheus exited:\n{prom.log_tail()}"
        try:
            if httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail(f"prometheus not ready after {timeout_s} s:\n{prom.log_tail()}")


def wait_for_scrape_after(prom: Prometheus, t_wall: float, timeout_s: float = 30.0) -> None:
    """Until Prometheus holds a sample of our target scraped after ``t_wall`` (unix time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = prom.vector('timestamp(up{job="cosine_ray"} == 1)')
        if got and max(got.values()) > t_wall:
            return
        time.sleep(0.3)
    pytest.fail(f"no successful scrape after {t_wall}: {prom.vector('up')}\n{prom.log_tail()}")


def wait_for_finished_count(prom: Prometheus, expected: int, timeout_s: float = 30.0) -> None:
    """Until the scraped finished-request count reaches the client's. A scrape that starts
    after the traffic can still serve a reading taken moments earlier (stage readings are
    refreshed in the background, see runtime/metrics_scrape.py); the exact comparisons in
    the tests run on the first scrape that has seen every request finish."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = sum(prom.vector("sum(cosine_ray:request_success_total)").values())
        if seen >= expected:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"Prometheus counted {seen} finished requests after {timeout_s} s; the clients "
                        f"saw {expected}\n{prom.log_tail()}")
        time.sleep(0.5)


# ---- the server and the traffic -----------------------------------------------------------------

@dataclass
class Ledger:
    """What the clients were told."""

    finish: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    blocks: list[dict[str, Any]] = field(default_factory=list)
    http: Counter = field(default_factory=Counter)

    def add(self, route: str, finish_reason: str, usage: Any, block: Any) -> None:
        usage = usage if isinstance(usage, dict) else usage.model_dump()
        assert block is not None, "--return-spec-stats must put a cosine_ray block on every completion"
        self.finish[finish_reason] += 1
        self.prompt_tokens += usage["prompt_tokens"]
        self.completion_tokens += usage["completion_tokens"]
        self.blocks.append(block)
        self.http[(route, "200")] += 1


def extra(obj: Any, name: str) -> Any:
    return (getattr(obj, "model_extra", None) or {}).get(name)


@dataclass
class Served:
    url: str
    model: str
    prom: Prometheus
    ledger: Ledger
    t_end: float


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


async def run_traffic(url: str, model: str, ledger: Ledger, *, warmup: bool) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0)

    async def chat(text: str) -> None:
        r = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                 max_tokens=MAX_TOKENS, temperature=0)
        ledger.add(CHAT, r.choices[0].finish_reason, r.usage, extra(r, "cosine_ray"))

    async def chat_stream(text: str) -> None:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True})
        finish, usage, block = None, None, None
        async for chunk in stream:
            usage = chunk.usage or usage
            block = extra(chunk, "cosine_ray") or block
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        ledger.add(CHAT, finish, usage, block)

    async def completion(text: str, stream: bool) -> None:
        if not stream:
            r = await client.completions.create(model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
            ledger.add(COMPLETIONS, r.choices[0].finish_reason, r.usage, extra(r, "cosine_ray"))
            return
        chunks = await client.completions.create(model=model, prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        finish, usage, block = None, None, None
        async for chunk in chunks:
            usage = chunk.usage or usage
            block = extra(chunk, "cosine_ray") or block
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        ledger.add(COMPLETIONS, finish, usage, block)

    if not warmup:
        await asyncio.gather(chat(CHAT_PROMPTS[1]), chat_stream(CHAT_PROMPTS[2]), chat_stream(CHAT_PROMPTS[3]),
                             completion(COMPLETION_PROMPTS[0], False), completion(COMPLETION_PROMPTS[1], True))
        return
    await chat(CHAT_PROMPTS[0])
    with pytest.raises(openai.BadRequestError):
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                             max_tokens=0, temperature=0)
    ledger.http[(CHAT, "400")] += 1
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model="no-such-model", prompt="x", max_tokens=4)
    ledger.http[(COMPLETIONS, "404")] += 1
    await capped_tenant_refused_once(url, model, ledger)


async def capped_tenant_refused_once(url: str, model: str, ledger: Ledger) -> None:
    """The capped tenant streams one request and, once its first chunk is in, sends a second:
    a 429 (its max_concurrent=1), counted per key; the held stream then finishes normally."""
    capped = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=CAPPED_KEY, timeout=REQUEST_TIMEOUT_S, max_retries=0)
    stream = await capped.completions.create(model=model, prompt=COMPLETION_PROMPTS[0], max_tokens=HELD_TOKENS,
                                             temperature=0, stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True})
    finish, usage, block = None, None, None
    refused = False
    async for chunk in stream:
        if not refused:
            with pytest.raises(openai.RateLimitError):
                await capped.completions.create(model=model, prompt="x", max_tokens=4)
            ledger.http[(COMPLETIONS, "429")] += 1
            refused = True
        usage = chunk.usage or usage
        block = extra(chunk, "cosine_ray") or block
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
    ledger.add(COMPLETIONS, finish, usage, block)


def kill_drafter0() -> None:
    """ray.kill (no restart) drafter 0 (ngram): the engine's next call to it fails and its slot
    spawns a new one (one drafter failure or more, exactly one restart)."""
    ray.kill(engine_actor(actor_name("drafter", 0)))


@pytest.mark.parametrize("required", [False, True])
def test_a_missing_prometheus_is_never_installed_by_the_test(monkeypatch, required):
    """No `apt-get install` from pytest: a missing binary skips (README command on a fresh
    machine) or, with COSINE_RAY_REQUIRE_PROMETHEUS=1 (.ci/run), fails; both name the command."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"the test ran {a}: it must not install"))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail(f"the test ran {a}: it must not install"))
    monkeypatch.setenv(REQUIRE_ENV, "1" if required else "0")
    expected = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(expected) as info:
        prometheus_binary()
    assert INSTALL_COMMAND in str(info.value) and len(str(info.value).splitlines()) == 1
    assert (ROOT / INSTALL_COMMAND.split()[-1]).is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"export {REQUIRE_ENV}=1" in ci and ci.index("install_prometheus.sh") < ci.index("python -m pytest")


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory, real_checkpoint) -> Served:
    prometheus = prometheus_binary()  # skips (or fails in CI) before anything starts
    tmp = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    exe = shutil.which("cosine-ray")
    key_file = tmp / "keys.txt"
    key_file.write_text(f"{API_KEY} name=main\n{CAPPED_KEY} name=capped max_concurrent=1\n")
    cmd = ([exe] if exe else [sys.executable, "-m", "cosine_ray.cli"]) + [
        "serve", "--port", str(port), "--address", ray_cluster, "--api-key-file", str(key_file),
        "--drafters", "ngram,retrieval",
        "--drafters-in-engine", "retrieval", "--stages", "2", "--return-spec-stats",  # ngram: an actor (killed)
        "--pearl", "auto"]  # PEARL through the Serve deployment: its steps feed a pipeline panel
    start = time.perf_counter()
    cli_log = tmp / "cli.log"
    log = open(cli_log, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    prom = start_prometheus(prometheus, tmp, port)  # scrapes fail until the server is up; that is fine
    try:
        wait_prometheus_ready(prom)
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(proc, cli_log, READY_TIMEOUT_S)
        _log(f"server ready after {time.perf_counter() - start:.1f} s")
        model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=30).json()["data"][0]["id"]
        ledger = Ledger()
        ledger.http[("/v1/models", "200")] += 1
        t0 = time.perf_counter()
        asyncio.run(asyncio.wait_for(run_traffic(url, model, ledger, warmup=True), REQUEST_TIMEOUT_S))
        wait_for_scrape_after(prom, time.time())
        kill_drafter0()
        asyncio.run(asyncio.wait_for(run_traffic(url, model, ledger, warmup=False), REQUEST_TIMEOUT_S))
        t_end = time.time()
        _log(f"traffic done in {time.perf_counter() - t0:.1f} s: {dict(ledger.finish)}")
        wait_for_scrape_after(prom, t_end + 0.2)
        wait_for_finished_count(prom, sum(ledger.finish.values()))
        yield Served(url, model, prom, ledger, t_end)
    finally:
        prom.proc.terminate()
        try:
            prom.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.proc.kill()
        rc = stop_cli(proc)
        log.close()
        cleanup_leftovers()
        noise = ("GET /metrics", "cancelling request", "Traceback", "^^^", "File \"")
        lines = [ln for ln in cli_log.read_text(errors="replace").splitlines()
                 if ln.strip() and not any(n in ln for n in noise)]
        _log("CLI log tail:\n" + "\n".join(lines[-25:]))
        _log(f"CLI stopped (exit {rc}); total {time.perf_counter() - start:.1f} s")


# ---- (b) counters equal the client-side count -----------------------------------------------------

def summed(prom: Prometheus, expr: str) -> float:
    values = prom.vector(f"sum({expr})")
    return next(iter(values.values()), 0.0)


def test_counters_equal_the_client_side_count(served):
    prom, ledger = served.prom, served.ledger
    assert sum(ledger.finish.values()) == 7
    reasons = {dict(k)["finished_reason"]: v for k, v in
               prom.vector("sum by (finished_reason) (cosine_ray:request_success_total)").items()}
    assert reasons == dict(ledger.finish)
    assert summed(prom, "cosine_ray:prompt_tokens_total") == ledger.prompt_tokens
    assert summed(prom, "cosine_ray:generation_tokens_total") == ledger.completion_tokens
    assert summed(prom, "cosine_ray:e2e_request_latency_seconds_count") == 7
    assert summed(prom, "cosine_ray:time_to_first_token_seconds_count") == 7

    blocks = ledger.blocks
    assert summed(prom, "cosine_ray:spec_decode_num_draft_tokens_total") == sum(b["num_draft_tokens"] for b in blocks)
    assert summed(prom, "cosine_ray:spec_decode_num_accepted_tokens_total") == sum(
        b["num_accepted_tokens"] for b in blocks)
    assert sum(b["num_draft_tokens"] for b in blocks) > 0, "nothing was drafted"
    drafted, accepted, domain_drafted = defaultdict(int), defaultdict(int), defaultdict(int)
    for b in blocks:
        for d, n in b["drafted_by"].items():
            drafted[d] += n
        for d, n in b["accepted_by"].items():
            accepted[d] += n
        domain_drafted[b["domain"]] += b["num_draft_tokens"]
    by = lambda label, name: {dict(k)[label]: v for k, v in  # noqa: E731
                              prom.vector(f"sum by ({label}) (cosine_ray:{name}_total)").items() if v}
    assert by("drafter", "spec_decode_num_draft_tokens") == {d: n for d, n in drafted.items() if n}
    assert by("drafter", "spec_decode_num_accepted_tokens") == {d: n for d, n in accepted.items() if n}
    assert by("domain", "spec_decode_num_draft_tokens") == {d: n for d, n in domain_drafted.items() if n}

    http = {(dict(k)["route"], dict(k)["status"]): v for k, v in
            prom.vector('sum by (route, status) (cosine_ray:http_requests_total{route=~"/v1/.*"})').items()}
    assert http == dict(ledger.http)
    tenants = {(dict(k)["key"], dict(k)["status"]): v for k, v in
               prom.vector("sum by (key, status) (cosine_ray:tenant_requests_total)").items()}
    assert {k: v for k, v in tenants.items() if k[0] == "capped"} == {("capped", "200"): 1, ("capped", "429"): 1}
    assert sum(v for (key, _), v in tenants.items() if key == "main") == sum(ledger.http.values()) - 2
    limited = {(dict(k)["key"], dict(k)["reason"]): v for k, v in
               prom.vector("sum by (key, reason) (cosine_ray:tenant_rate_limited_total)").items()}
    assert limited == {("capped", "concurrency"): 1}, limited
    restarts = by("drafter", "drafter_restarts")
    assert restarts == {"ngram": 1}, f"{actor_name('drafter', 0)} (ngram) was killed once: {restarts}"


# ---- (a) every dashboard expression works ---------------------------------------------------------

def dashboard_expressions() -> list[tuple[str, str, str]]:
    out = []
    for path in sorted((ROOT / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text(encoding="utf-8"))["panels"]:
            for target in panel.get("targets", []):
                out.append((path.stem, panel["title"], target["expr"]))
    return out


def grafana_to_promql(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unhandled Grafana variable in {expr}"
    return expr


def test_every_dashboard_expression_returns_data(served):
    exprs = dashboard_expressions()
    assert len(exprs) >= 30
    failures = []
    for board, title, expr in exprs:
        body = served.prom.query(grafana_to_promql(expr))
        if body.get("status") != "success":
            failures.append(f"[{board}] {title}: INVALID ({body.get('errorType')}: {body.get('error')})\n    {expr}")
            continue
        result = body["data"]["result"]
        values = [float(s["value"][1]) for s in result]
        if not result:
            failures.append(f"[{board}] {title}: NO SERIES\n    {expr}")
        elif not any(math.isfinite(v) for v in values):
            failures.append(f"[{board}] {title}: ONLY NaN/Inf ({len(values)} series)\n    {expr}")
    _log(f"{len(exprs) - len(failures)} of {len(exprs)} dashboard expressions returned data")
    assert not failures, "dashboard expressions without data:\n" + "\n".join(failures)
