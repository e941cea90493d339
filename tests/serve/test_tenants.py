"""Several API keys, each a tenant: the key file, per-key limits (429), admission shared fairly
between keys, and the per-key Prometheus series (serve/guards/tenants.py, serve/guards/admission.py).

In-process: the app over ``RecordingEngine`` (its streams wait for a gate, so "N in flight" is
exact), driven through httpx's ASGI transport in one event loop.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.serve_fakes import IdTokenizer, RecordingEngine

from cosine_ray.cli import serve as serve_cli
from cosine_ray.cli.args import CliError
from cosine_ray.serve.guards import tenants
from cosine_ray.serve.openai_app import build_openai_app
from cosine_ray.serve.guards.tenants import ApiKey, parse_key_file, read_key_file

COMP = "/v1/completions"
KEY_FILE = """
# tenants of this server
alice-0123456789 name=alice max_concurrent=2
bob-0123456789   name=bob   max_tokens_in_flight=100   # small jobs only

carol-0123456789
"""


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch):
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)
    monkeypatch.delenv("COSINE_RAY_API_KEY_FILE", raising=False)


def test_a_key_file_names_its_tenants_and_their_limits():
    alice, bob, carol = parse_key_file(KEY_FILE, "keys.txt")
    assert (alice.key, alice.name, alice.max_concurrent, alice.max_tokens_in_flight) == (
        "alice-0123456789", "alice", 2, None)
    assert (bob.name, bob.max_concurrent, bob.max_tokens_in_flight) == ("bob", None, 100)
    assert carol.name.startswith("key-") and "carol" not in carol.name  # unnamed: a hash, not the key
    assert "0123456789" not in repr(alice)  # the key never shows in a repr (logs, tracebacks)


@pytest.mark.parametrize("line, why", [
    ("k1 name=a max_concurrent=0", "max_concurrent must be an integer >= 1"),
    ("k1 name=a max_tokens_in_flight=lots", "max_tokens_in_flight must be an integer >= 1"),
    ("k1 nmae=a", "unknown setting 'nmae'"),
    ("k1 name", "'name' is not name=value"),
    ("name=a k1", "a line starts with the key"),
    ("k1 name=a name=b", "name is given twice"),
    ("k1 name=a/b", "name must be"),
])
def test_a_malformed_line_is_an_error_naming_the_line(tmp_path, line, why):
    path = tmp_path / "keys.txt"
    path.write_text(f"# first line\nk0 name=zero\n{line}\n")
    with pytest.raises(ValueError) as err:
        read_key_file(str(path))
    assert f"line 3: {why}" in str(err.value) and str(path) in str(err.value)
    # the CLI reads the file itself and stops with that one line (exit status 2)
    args = argparse.Namespace(api_key=None, api_key_file=str(path))
    with pytest.raises(CliError, match=f"line 3: {why}"):
        serve_cli._ingress_args(args, None)


def test_the_cli_passes_the_keys_not_the_path_and_reads_the_env_var(tmp_path, monkeypatch):
    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE)
    monkeypatch.setenv("COSINE_RAY_API_KEY_FILE", str(path))
    out = serve_cli._ingress_args(argparse.Namespace(api_key="solo-key", api_key_file=None), None)
    assert out["api_key"] == "solo-key" and "api_key_file" not in out
    assert [(k["name"], k["max_concurrent"]) for k in out["api_keys"]][:2] == [("alice", 2), ("bob", None)]
    missing = argparse.Namespace(api_key=None, api_key_file=str(tmp_path / "nope"))
    with pytest.raises(CliError, match="cannot read the API key file"):
        serve_cli._ingress_args(missing, None)
    with pytest.raises(ValueError, match="two API keys are named 'alice'"):
        tenants.key_ring(None, parse_key_file(KEY_FILE + "\nother-key name=alice\n", "f"))


@pytest.mark.parametrize("entry, why", [
    ({"key": "two words"}, "one word"),
    ({"key": "k", "max_concurrent": 0}, "max_concurrent must be an integer >= 1"),
    ({"key": "k", "limit": 3}, "unknown setting 'limit'"),
    ("k", "a mapping with a string `key`"),
])
def test_keys_given_in_a_config_file_are_checked_before_anything_starts(entry, why):
    config = serve_cli.ConfigFile(ingress={"api_keys": [entry]})
    with pytest.raises(CliError, match=why):
        serve_cli._ingress_args(argparse.Namespace(api_key=None, api_key_file=None), config)


def keyed_app(engine: RecordingEngine, **kwargs: Any):
    return build_openai_app(engine, IdTokenizer(), model_name="fake", api_keys=parse_key_file(KEY_FILE, "f"),
                            **kwargs)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def post(client: httpx.AsyncClient, key: str, **body: Any) -> httpx.Response:
    return await client.post(COMP, json={"prompt": [1, 2, 3], "max_tokens": 2, **body}, headers=auth(key))


def run(main, app) -> Any:
    async def wrapped():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app", timeout=30) as client:
            return await main(client)
    return asyncio.run(asyncio.wait_for(wrapped(), 60))


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_every_key_is_accepted_and_compared_in_constant_time(monkeypatch):
    compared = []
    real = tenants.hmac.compare_digest
    monkeypatch.setattr(tenants.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    engine = RecordingEngine()
    app = keyed_app(engine)

    async def main(client):
        out = [(await post(client, k)).status_code for k in ("alice-0123456789", "bob-0123456789",
                                                             "carol-0123456789", "alice-0123456789x", "")]
        return out

    assert run(main, app) == [200, 200, 200, 401, 401]
    # every request was compared against all three keys, whichever matched (or none)
    expected = [f"Bearer {k}-0123456789".encode() for k in ("alice", "bob", "carol")]
    assert compared == expected * 5


def test_a_key_over_its_own_limits_gets_429_and_other_keys_do_not():
    engine = RecordingEngine(gate=True)
    app = keyed_app(engine)

    async def main(client):
        held = [asyncio.ensure_future(post(client, "alice-0123456789")) for _ in range(2)]
        await until(lambda: engine.num_open == 2)
        third = await post(client, "alice-0123456789")  # max_concurrent=2
        bob_big = await post(client, "bob-0123456789", max_tokens=200)  # 203 tokens > 100, alone: never fits
        bob = asyncio.ensure_future(post(client, "bob-0123456789", max_tokens=40))  # 43 of 100
        await until(lambda: engine.num_open == 3)
        bob_over = await post(client, "bob-0123456789", max_tokens=60)  # 43 + 63 > 100
        carol = asyncio.ensure_future(post(client, "carol-0123456789"))
        await until(lambda: engine.num_open == 4)
        engine.gate.set()
        rest = await asyncio.gather(*held, bob, carol)
        again = await post(client, "alice-0123456789")  # its requests finished: room again
        return third, bob_big, bob_over, rest, again

    third, bob_big, bob_over, rest, again = run(main, app)
    for r, why in ((third, "max_concurrent=2"), (bob_over, "max_tokens_in_flight=100")):
        err = r.json()["error"]
        assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded") and why in err["message"]
    assert bob_big.status_code == 400 and bob_big.json()["error"]["param"] == "max_tokens"
    assert [r.status_code for r in rest] == [200] * 4 and again.status_code == 200


def test_one_key_filling_the_server_cannot_shut_out_another():
    """Key A's 16 requests of n=16 take all 256 slots; key B is still admitted, and A, beyond its
    fair share while B holds slots, gets 429 (not B)."""
    engine = RecordingEngine(gate=True)
    app = build_openai_app(engine, IdTokenizer(), model_name="fake", max_pending_requests=256,
                           api_keys=[ApiKey("key-a-0123456789", "a"), ApiKey("key-b-0123456789", "b")])

    async def main(client):
        flood = [asyncio.ensure_future(post(client, "key-a-0123456789", n=16, ignore_eos=True))
                 for _ in range(16)]
        await until(lambda: engine.num_open == 256)
        b_first = asyncio.ensure_future(post(client, "key-b-0123456789"))
        await until(lambda: engine.num_open == 257)  # B's request reached the engine
        a_more = await post(client, "key-a-0123456789")
        b_more = asyncio.ensure_future(post(client, "key-b-0123456789", n=4))
        await until(lambda: engine.num_open == 261)
        engine.gate.set()
        return a_more, await asyncio.gather(b_first, b_more, *flood)

    a_more, done = run(main, app)
    assert a_more.status_code == 429 and a_more.json()["error"]["code"] == "rate_limit_exceeded", a_more.text
    assert "fair share" in a_more.json()["error"]["message"] and a_more.headers["retry-after"] == "1"
    assert [r.status_code for r in done] == [200] * 18
    assert engine.num_closed == engine.num_open == 261


def scrape(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_per_key_series_are_exported_under_the_key_names():
    engine = RecordingEngine(gate=True)
    app = keyed_app(engine, metrics_push_interval_s=0)

    async def main(client):
        held = [asyncio.ensure_future(post(client, "alice-0123456789", max_tokens=10)) for _ in range(2)]
        await until(lambda: engine.num_open == 2)
        limited = await post(client, "alice-0123456789")
        during = (await client.get("/metrics")).text
        engine.gate.set()
        await asyncio.gather(*held)
        await post(client, "bob-0123456789")
        return limited, during, (await client.get("/metrics")).text

    limited, during, after = run(main, app)
    assert limited.status_code == 429
    alice = (("key", "alice"),)
    samples = scrape(during)
    assert samples[("cosine_ray:tenant_requests_in_flight", alice)] == 2
    assert samples[("cosine_ray:tenant_tokens_in_flight", alice)] == 2 * (3 + 10)  # n × (prompt + max_tokens)
    samples = scrape(after)
    assert samples[("cosine_ray:tenant_requests_total", (("key", "alice"), ("status", "200")))] == 2
    assert samples[("cosine_ray:tenant_requests_total", (("key", "alice"), ("status", "429")))] == 1
    assert samples[("cosine_ray:tenant_requests_total", (("key", "bob"), ("status", "200")))] == 1
    assert samples[("cosine_ray:tenant_rate_limited_total", (("key", "alice"), ("reason", "concurrency")))] == 1
    assert samples[("cosine_ray:tenant_tokens_in_flight", alice)] == 0
    assert samples[("cosine_ray:tenant_requests_in_flight", alice)] == 0
    assert "0123456789" not in during + after  # names, never keys


def test_the_serve_application_reads_the_key_file_where_it_is_built(tmp_path):
    """``serve deploy`` with ``api_key_file`` in the app's args: the file is read when the
    application is built, and the ingress replicas get its keys (they may run on other nodes)."""
    from cosine_ray.serve.app import CONTROL_HEADROOM, build_app

    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE)
    app = build_app({"model": "smollm2-135m", "api_key_file": str(path), "max_pending_requests": 10})
    ingress = app._bound_deployment
    assert [k["name"] for k in ingress.init_kwargs["api_keys"]][:2] == ["alice", "bob"]
    assert "api_key_file" not in ingress.init_kwargs
    assert ingress.max_ongoing_requests == 2 * 10 + CONTROL_HEADROOM  # room for fair admission's overcommit
    path.write_text("k1 max_concurrent=-1\n")
    with pytest.raises(ValueError, match="line 1: max_concurrent"):
        build_app({"model": "smollm2-135m", "api_key_file": str(path)})
