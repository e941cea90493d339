"""GET /metrics, HTTP response counting, /metrics auth and the per-request stats block
(FastAPI app in-process over a fake engine that keeps a real MetricsRegistry)."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from cosine_ray.engine.request import RequestOutput, RequestStats
from cosine_ray.metrics.registry import MetricsRegistry
from cosine_ray.serve.openai_app import build_openai_app

COMP = "/v1/completions"
KEY = "sekret"


class MetricsEngine:
    """An engine that answers every request with tokens 7, 8 and the given stats."""

    model_name, max_model_len, vocab_size = "fake", 64, 100

    def __init__(self, stats: RequestStats | None = None) -> None:
        self.metrics = MetricsRegistry()
        self.stats = stats
        self.snapshot_error: Exception | None = None
        self.pushes: list[tuple[str, dict]] = []
        self.drop_pushes = False

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        yield RequestOutput(request_id, [7], False, None, len(prompt_token_ids), 1, self.stats)
        yield RequestOutput(request_id, [8], True, "length", len(prompt_token_ids), 2, self.stats)

    async def check_request(self, prompt_token_ids, params) -> None:
        pass

    async def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    async def metrics_snapshot(self, http=None) -> dict[str, Any]:
        if self.snapshot_error is not None:
            raise self.snapshot_error
        if http is not None:
            self.metrics.add_http_totals(*http)
        return self.metrics.snapshot()

    def record_http(self, replica: str, totals: dict) -> None:
        self.pushes.append((replica, totals))
        if not self.drop_pushes:
            self.metrics.add_http_totals(replica, totals)


class IdTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def app(engine, **kwargs) -> TestClient:
    return TestClient(build_openai_app(engine, IdTokenizer(), model_name="fake", **kwargs))


def scrape(client: TestClient, **kwargs) -> dict[tuple, float]:
    r = client.get("/metrics", **kwargs)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def http_count(samples, route: str, status: int) -> float:
    return samples.get(("cosine_ray:http_requests_total", (("route", route), ("status", str(status)))), 0.0)


def test_responses_are_counted_by_route_template_and_status():
    engine = MetricsEngine()
    client = app(engine)
    for _ in range(3):
        assert client.post(COMP, json={"prompt": [1, 2]}).status_code == 200
    assert client.post(COMP, json={"prompt": [1], "stream": True}).status_code == 200
    assert client.post(COMP, json={"prompt": [1], "max_tokens": 0}).status_code == 400
    assert client.post(COMP, json={"prompt": [1], "model": "other"}).status_code == 404
    assert client.get("/v1/models/fake").status_code == 200
    assert client.get("/v1/models/nope").status_code == 404
    assert client.get("/no/such/path").status_code == 404
    assert client.get("/health").status_code == 200
    samples = scrape(client)
    assert http_count(samples, COMP, 200) == 4
    assert http_count(samples, COMP, 400) == 1 and http_count(samples, COMP, 404) == 1
    assert http_count(samples, "/v1/models/{model_id:path}", 200) == 1
    assert http_count(samples, "/v1/models/{model_id:path}", 404) == 1
    assert http_count(samples, "unmatched", 404) == 1
    assert http_count(samples, "/health", 200) == 1
    assert http_count(samples, "/metrics", 200) == 0, "a scrape is counted after its own snapshot"
    assert http_count(scrape(client), "/metrics", 200) == 1
    # every series the exposition carries is one of ours
    assert {name.split("_bucket")[0] for name, _ in samples} and all(
        name.startswith("cosine_ray:") for name, _ in samples)


def test_metrics_is_public_by_default_and_keyed_on_request():
    engine = MetricsEngine()
    client = app(engine, api_key=KEY)
    assert client.post(COMP, json={"prompt": [1]}).status_code == 401
    samples = scrape(client)  # no key needed
    assert http_count(samples, COMP, 401) == 1, "responses refused before routing are counted too"
    keyed = app(engine, api_key=KEY, metrics_require_key=True)
    r = keyed.get("/metrics")
    assert r.status_code == 401 and r.json()["error"]["type"]
    assert keyed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert keyed.get("/health").status_code == 200


def test_engine_without_metrics_gives_503_not_500():
    engine = MetricsEngine()
    engine.snapshot_error = ConnectionError("engine gone")
    r = app(engine).get("/metrics")
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"


def test_server_flag_or_request_field_adds_the_stats_block():
    stats = RequestStats(num_verify_steps=2, num_draft_tokens=6, num_accepted_tokens=3,
                         drafted_by={"ngram": 4, "retrieval:code": 2, "idle": 0},
                         accepted_by={"ngram": 3}, domain="code",
                         pipedec_timesteps=5, pipedec_tokens=4, pipedec_hits=3)
    engine = MetricsEngine(stats)
    plain = app(engine)
    assert "cosine_ray" not in plain.post(COMP, json={"prompt": [1]}).json()
    asked = plain.post(COMP, json={"prompt": [1], "cosine_ray_stats": True}).json()["cosine_ray"]
    flagged_client = app(engine, return_spec_stats=True)
    flagged = flagged_client.post(COMP, json={"prompt": [1]}).json()["cosine_ray"]
    assert asked == flagged == {
        "num_draft_tokens": 6, "num_accepted_tokens": 3, "mean_accepted_length": 2.5, "num_verify_steps": 2,
        "drafted_by": {"ngram": 4, "retrieval:code": 2, "idle": 0}, "accepted_by": {"ngram": 3},
        "domain": "code", "drafters_used": ["ngram", "retrieval:code"],
        "pipedec_timesteps": 5, "pipedec_tokens": 4, "pipedec_hits": 3, "num_cached_tokens": 0,
        "num_preemptions": 0}
    chat = flagged_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    # IdTokenizer has no chat template: a 400, and no stats block on errors
    assert chat.status_code == 400 and "cosine_ray" not in chat.json()
    r = flagged_client.post(COMP, json={"prompt": [1], "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    with_stats = [e for e in events if e.get("cosine_ray")]
    assert len(with_stats) == 1 and with_stats[0]["choices"][0]["finish_reason"] == "length"
    assert with_stats[0]["cosine_ray"]["drafters_used"] == ["ngram", "retrieval:code"]


def test_lost_pushes_are_repaired_by_the_scrape_and_replicas_add_up():
    engine = MetricsEngine()
    engine.drop_pushes = True  # every fire-and-forget push is lost
    # two ingress replicas, one engine registry; every response pushes (no interval)
    first, second = app(engine, metrics_push_interval_s=0), app(engine, metrics_push_interval_s=0)
    for _ in range(2):
        assert first.post(COMP, json={"prompt": [1]}).status_code == 200
    assert second.post(COMP, json={"prompt": [1], "max_tokens": 0}).status_code == 400
    assert len(engine.pushes) == 3 and len({r for r, _ in engine.pushes}) == 2
    samples = scrape(first)  # the scrape carries this replica's own totals
    assert http_count(samples, COMP, 200) == 2 and http_count(samples, COMP, 400) == 0
    engine.drop_pushes = False
    for replica, totals in reversed(engine.pushes):  # late pushes, out of order: no double count
        engine.record_http(replica, totals)
    samples = scrape(second)
    assert http_count(samples, COMP, 200) == 2 and http_count(samples, COMP, 400) == 1
