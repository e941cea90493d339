"""A request the HTTP layer ends because a stop string appeared is a normal completion in the
serving metrics: ``request_success{finished_reason="stop"}`` (not ``abort``) and its latency in
the histograms. The real engine loop on a tiny model, served
in-process; a client that goes away is still an abort."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from cosine_ray.engine.client import LocalEngineClient
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from cosine_ray.serve.openai_app import build_openai_app

MAX_TOKENS = 240
"""Far more than the engine reaches in the steps the ingress takes to see the stop string (long
drafts on this repetitive prompt run ~30 tokens a step): a request the engine finishes before
the ingress cuts it is counted with the engine's reason, the race every ingress-side stop has."""
PROMPT = [5, 6, 7, 5, 6, 7, 5, 6]
LATENCY = ("e2e_request_latency_seconds", "time_per_output_token_seconds")


class IdTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram,self")).replace(
            min_tree_confidence=0.0), checkpoint=tiny_checkpoint)


def counts(engine) -> dict[str, float]:
    m = engine.core.metrics
    out = {reason: m.get("cosine_ray:request_success", finished_reason=reason) for reason in ("stop", "length", "abort")}
    for name in LATENCY:
        h = m.get(f"cosine_ray:{name}")
        out[name] = h.count if h is not None else 0
    return out


def test_a_stop_string_cut_counts_as_stop_with_its_latency(engine):
    (ref,) = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS))  # greedy; no EOS: runs to the end
    ids = ref.new_token_ids
    k = next(i for i in range(3, 10) if ids[i] not in ids[:i])  # a token whose first occurrence is i
    stop = f"<{ids[k]}>"
    app = build_openai_app(LocalEngineClient(engine), IdTokenizer(), model_name="tiny")
    before = counts(engine)
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": stop}
    with TestClient(app) as client:
        data = client.post("/v1/completions", json=body).json()
        assert data["choices"][0]["finish_reason"] == "stop", data
        assert data["choices"][0]["text"] == IdTokenizer().decode(ids[:k])
        assert data["usage"]["completion_tokens"] < MAX_TOKENS, "the engine must still have been generating"
        r = client.post("/v1/completions", json={**body, "stream": True})
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")] == ["stop"]
    after = counts(engine)
    delta = {key: after[key] - before[key] for key in after}
    assert delta == {"stop": 2, "length": 0, "abort": 0, **{name: 2 for name in LATENCY}}, delta
    assert engine.loop.num_streams == 0 and not engine.loop._finished_by_caller


def test_a_caller_that_leaves_is_still_an_abort(engine):
    before = counts(engine)

    async def leave_after_first_output():
        agen = LocalEngineClient(engine).stream(PROMPT, SamplingParams(max_tokens=MAX_TOKENS), "leaver")
        await agen.__anext__()
        await agen.aclose()
        await engine.loop.shutdown()

    asyncio.run(leave_after_first_output())
    after = counts(engine)
    assert {key: after[key] - before[key] for key in after} == {
        "stop": 0, "length": 0, "abort": 1, **{name: 0 for name in LATENCY}}
    assert engine.loop.finish("no-such-request") is False
