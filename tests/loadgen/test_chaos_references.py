"""The chaos audit's two independent sources against the real OpenAI app (no Ray): greedy
references from transformers in fp32 (``loadgen/chaos/references.py``) equal what the server
answers for every unconstrained feature (plain, n > 1, stop strings, logprobs), and the
server's record of the request ids it answered (``serve/completion_ledger.py``, behind the API
key) agrees with the client's. A tiny random-weight model with SmolLM2's tokenizer, served by
uvicorn in a thread over a LocalEngine; a short chaos run without faults must pass the audit."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
from support.tiny_checkpoint import write_tiny_checkpoint
from support.uvicorn_thread import serve_in_thread

from cosine_ray.engine.client import LocalEngineClient
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.serve.completion_ledger import with_completion_ledger
from cosine_ray.serve.openai_app import build_openai_app
from loadgen.chaos import audit as audit_mod
from loadgen.chaos.references import hf_references
from loadgen.chaos.run import ChaosConfig, ChaosRun
from loadgen.chaos.shapes import FEATURES, build_shapes
from loadgen.chaos.traffic import Mix
from loadgen.workload import DEFAULT_DATASET_DIR, load_rows

pytestmark = pytest.mark.real_model  # the embedded SmolLM2's tokenizer

KEY = "chaos-key"


@pytest.fixture(scope="module")
def served(tmp_path_factory, real_checkpoint):
    ck = write_tiny_checkpoint(tmp_path_factory.mktemp("refs") / "tiny", tokenizer_from=real_checkpoint, seed=3)
    engine = LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters("ngram")), checkpoint=ck)
    app = with_completion_ledger(build_openai_app(LocalEngineClient(engine), engine.tokenizer, model_name="tiny",
                                                  api_key=KEY))
    url, stop = serve_in_thread(app)
    yield url, ck.path
    stop()


def test_the_admin_route_needs_the_key(served):
    url, _ = served
    assert httpx.get(f"{url}/admin/completions", timeout=10).status_code == 401
    page = httpx.get(f"{url}/admin/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert set(page) == {"replica", "oldest", "next", "entries", "dropped"}


def test_independent_references_agree_with_the_server_and_the_ledgers_match(served):
    url, model_dir = served
    rows = load_rows(DEFAULT_DATASET_DIR, "second-half")
    shapes = build_shapes(rows, 12, np.random.default_rng(4), max_tokens=10, seeded_fraction=0.25,
                          completions_fraction=0.5, features=FEATURES)
    refs, near_ties = hf_references(model_dir, shapes, log=print)
    independent = {s.feature for s in shapes if s.key in refs}
    assert independent == {"plain", "n", "stop", "logprobs"}, (independent, near_ties)
    assert all(not s.independent for s in shapes if s.feature in ("json", "tools"))
    cfg = ChaosConfig(duration_s=3.0, clients=2, max_kills=0, request_timeout_s=60, mix=Mix(0.5, 0.0),
                      memory_interval_s=60.0, idle_timeout_s=1.0, api_key=KEY, seed=2)
    result = asyncio.run(ChaosRun(cfg, url, shapes, find=lambda: [], injector=None, log=print,
                                  references=refs).main())
    verdict = audit_mod.audit(result.calls, result.ledger, result.references, result.faults, result.server,
                              shapes=shapes)
    print({k: verdict[k] for k in ("requests", "outcomes", "lost", "duplicated", "wrong_text", "server_ledger")})
    assert verdict["wrong_text"] == 0, verdict["problems"]  # the server's greedy answers are transformers' own
    assert verdict["ok"], verdict["problems"]
    assert verdict["server_ledger"]["entries"] == len(result.calls) and verdict["lost"] == verdict["duplicated"] == 0
    assert sorted(result.independent) == sorted(refs)
    features = {s.key: s.feature for s in shapes}
    completed = {features[c.shape] for c in result.calls if c.outcome == "ok" and c.shape in features}
    assert completed == set(FEATURES), completed
