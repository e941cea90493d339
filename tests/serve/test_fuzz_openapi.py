"""Fuzzing: schemathesis drives every operation of the served ``/openapi.json`` with schema-
conforming (positive) and schema-violating (negative) requests; the server never answers 5xx,
every 4xx is OpenAI-shaped, and afterwards the engine holds no request state and still gives
the same greedy text as before the fuzzing.

The app is the real one over a real ``LocalEngine`` (tiny random model, SmolLM2 tokenizer,
n-gram drafter) served by uvicorn on a thread; schemathesis loads the schema over HTTP and
calls the server over TCP. ``default_max_tokens`` is small and the example count bounded so
the module takes ~1 min on 2 cores; ``COSINE_RAY_FUZZ_EXAMPLES`` raises it by hand.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")

from cosine_ray.engine.client import LocalEngineClient  # noqa: E402
from cosine_ray.engine.config import EngineConfig, parse_drafters  # noqa: E402
from cosine_ray.engine.local import LocalEngine  # noqa: E402
from cosine_ray.serve.openai_app import build_openai_app  # noqa: E402

from support.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from support.uvicorn_thread import serve_in_thread  # noqa: E402

pytestmark = [pytest.mark.real_model, pytest.mark.full]  # a fuzzer; the embedded SmolLM2's tokenizer

EXAMPLES = int(os.environ.get("COSINE_RAY_FUZZ_EXAMPLES", "40"))
"""Examples per operation and generation mode."""
REFERENCE = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, real_checkpoint):
    ck = write_tiny_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny", tokenizer_from=real_checkpoint)
    engine = LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters("ngram")), checkpoint=ck)
    app = build_openai_app(LocalEngineClient(engine), engine.tokenizer, model_name="tiny",
                           default_max_tokens=4, max_pending_requests=64, request_timeout_s=30)
    url, stop = serve_in_thread(app)
    yield url, engine
    stop()


def _is_free(engine: LocalEngine) -> bool:
    core = engine.core
    return (not core.running and not core.waiting and engine.target.num_cached_requests() == 0
            and all(d.num_tracked_requests == 0 for d in engine.drafters))


def test_schemathesis_finds_no_server_errors(fuzzed):
    url, engine = fuzzed
    before = httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [op.ok() for op in schema.get_all_operations()]
    labels = sorted(op.label for op in operations)
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /health"} <= set(labels)
    counts: dict[tuple[int, str], int] = {}
    failures: list[str] = []
    no_negative: list[str] = []
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    start = time.perf_counter()
    for op in operations:
        for mode in modes:
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run_case(case) -> None:
                response = case.call(base_url=url, timeout=60)
                status = response.status_code
                key = (status // 100 * 100, f"{op.label} {mode.value}")
                counts[key] = counts.get(key, 0) + 1
                body = response.text
                if status >= 500:
                    failures.append(f"{op.label} [{mode.value}] -> {status}: {body[:300]}\n  "
                                    f"body={str(case.body)[:300]}")
                elif status >= 400 and case.method != "HEAD":
                    try:
                        err = json.loads(body)["error"]
                        assert set(err) == {"message", "type", "param", "code"} and err["message"]
                    except Exception:
                        failures.append(f"{op.label} [{mode.value}] -> {status} not OpenAI-shaped: {body[:200]}")
                if "Traceback" in body:
                    failures.append(f"{op.label} [{mode.value}] leaks a traceback")

            try:
                run_case()
            except Unsatisfiable:  # nothing to violate: an operation with no body or parameters
                assert mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() == "GET", op.label
                no_negative.append(op.label)
    elapsed = time.perf_counter() - start
    total = sum(counts.values())
    print(f"\n[fuzz] {total} requests over {len(operations)} operations x {len(modes)} modes in {elapsed:.1f} s; "
          f"by status class: { {k: sum(v for (c, _), v in counts.items() if c == k) for k in (200, 400, 500)} }",
          flush=True)
    assert not failures, "\n".join(failures[:20])
    for label in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert label not in no_negative and counts.get((400, f"{label} negative"), 0) > 0
    assert sum(v for (c, _), v in counts.items() if c == 200) > 0, "no request was ever accepted"
    deadline = time.monotonic() + 5
    while not _is_free(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _is_free(engine), "fuzzing left request state behind in the engine"
    after = httpx.post(f"{url}/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["text"]
    assert after == before
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(body=st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                             st.sampled_from(["messages", "prompt", "max_tokens", "temperature", "top_p",
                                              "top_k", "n", "stop", "stream", "seed", "role", "content",
                                              "model", "stream_options", "include_usage", "logprobs"]),
                             inner, max_size=5), max_leaves=12),
       path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
def test_arbitrary_json_never_gives_a_server_error(fuzzed, body, path):
    """Shapes the schema does not describe (any JSON at all), via hypothesis directly."""
    url, _ = fuzzed
    r = httpx.post(f"{url}{path}", content=json.dumps(body, allow_nan=True), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (body, r.text[:300])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
