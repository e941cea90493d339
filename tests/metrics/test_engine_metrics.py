"""The real engine loop and core on a tiny model, served in-process: what /metrics exports
equals what the clients were told (usage, finish reasons, per-request stats blocks)."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from cosine_ray.engine.client import LocalEngineClient
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.serve.openai_app import build_openai_app

MAX_TOKENS = 10
PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [11, 12, 13, 14], [40, 41, 40, 41, 40, 41, 40], [90] * 6, [3, 1, 4, 1, 5]]


class IdTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram,self"), num_stages=2).replace(
            min_tree_confidence=0.0),
                       checkpoint=tiny_checkpoint)


def scrape(client) -> dict[tuple, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples}


def total(samples, name: str, **match: str) -> float:
    want = set(match.items())
    return sum(v for (n, labels), v in samples.items() if n == name and want <= set(labels))


def test_exported_counters_equal_the_client_side_count(engine):
    app = build_openai_app(LocalEngineClient(engine), IdTokenizer(), model_name="tiny", return_spec_stats=True)
    usage, reasons, blocks = [], Counter(), []
    with TestClient(app) as client:
        for i, prompt in enumerate(PROMPTS):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            if i % 2:
                body.update(stream=True, stream_options={"include_usage": True})
                r = client.post("/v1/completions", json=body)
                events = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
                usage.append(next(e["usage"] for e in events if e.get("usage")))
                reasons.update(c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason"))
                blocks.append(next(e["cosine_ray"] for e in events if e.get("cosine_ray")))
            else:
                data = client.post("/v1/completions", json=body).json()
                usage.append(data["usage"])
                reasons.update(c["finish_reason"] for c in data["choices"])
                blocks.append(data["cosine_ray"])
        assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 0}).status_code == 400
        samples = scrape(client)

    assert {labels[0][1]: v for (n, labels), v in samples.items()
            if n == "cosine_ray:request_success_total"} == dict(reasons) == {"length": len(PROMPTS)}
    assert total(samples, "cosine_ray:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usage)
    assert total(samples, "cosine_ray:generation_tokens_total") == sum(u["completion_tokens"] for u in usage)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds",
                 "request_queue_time_seconds"):
        assert total(samples, f"cosine_ray:{name}_count") == len(PROMPTS), name
    assert total(samples, "cosine_ray:inter_token_latency_seconds_count") == sum(
        u["completion_tokens"] - 1 for u in usage)

    # speculation counters vs the per-request blocks
    assert sum(b["num_draft_tokens"] for b in blocks) > 0, "the self drafter must have drafted"
    assert total(samples, "cosine_ray:spec_decode_num_draft_tokens_total") == sum(b["num_draft_tokens"] for b in blocks)
    assert total(samples, "cosine_ray:spec_decode_num_accepted_tokens_total") == sum(
        b["num_accepted_tokens"] for b in blocks)
    drafted, accepted, by_domain = defaultdict(int), defaultdict(int), defaultdict(int)
    for b in blocks:
        for d, n in b["drafted_by"].items():
            drafted[d] += n
        for d, n in b["accepted_by"].items():
            accepted[d] += n
        by_domain[b["domain"]] += b["num_draft_tokens"]
        assert b["drafters_used"] == sorted(d for d, n in b["drafted_by"].items() if n > 0)
    for d, n in drafted.items():
        assert total(samples, "cosine_ray:spec_decode_num_draft_tokens_total", drafter=d) == n, d
    for d, n in accepted.items():
        assert total(samples, "cosine_ray:spec_decode_num_accepted_tokens_total", drafter=d) == n, d
    for domain, n in by_domain.items():
        assert total(samples, "cosine_ray:spec_decode_num_draft_tokens_total", domain=domain) == n, domain

    # HTTP edge and the scrape-time stage readings
    assert total(samples, "cosine_ray:http_requests_total", route="/v1/completions", status="200") == len(PROMPTS)
    assert total(samples, "cosine_ray:http_requests_total", route="/v1/completions", status="400") == 1
    for stage in ("0", "1"):
        busy = total(samples, "cosine_ray:stage_busy_seconds_total", stage=stage)
        idle = total(samples, "cosine_ray:stage_idle_seconds_total", stage=stage)
        assert busy > 0 and idle >= 0, stage
    assert total(samples, "cosine_ray:num_requests_running") == 0
