"""What the ingress tells the engine and what it makes of the engine's answers: each engine
request carries its tenant (the API key's name and OpenAI's ``user``); a typed engine refusal is
mapped by its field and reason (also as Ray wraps it, its text a remote traceback); a request the engine ended because its own rules left no token gets a 400, or an SSE
error event once streaming, and the other requests go on. In-process, over ``RecordingEngine``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient
from support.serve_fakes import IdTokenizer, RecordingEngine

from cosine_ray.engine.request import REFUSED, RequestOutput, RequestRefused, Tenant
from cosine_ray.serve.openai_app import build_openai_app
from cosine_ray.serve.guards.tenants import parse_key_file

COMP = "/v1/completions"
KEYS = "alice-0123456789 name=alice\nbob-0123456789 name=bob\n"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch):
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)
    monkeypatch.delenv("COSINE_RAY_API_KEY_FILE", raising=False)


def ray_wrapped(cause: BaseException) -> BaseException:
    """What Ray raises in the caller for an actor's exception: a class of both ``RayTaskError``
    and the cause's, whose text is the remote traceback."""
    from ray.exceptions import RayTaskError

    return RayTaskError("EngineServer.check_request", "Traceback (most recent call last):\n  File ...",
                        cause).as_instanceof_cause()


class RefusingEngine(RecordingEngine):
    def __init__(self, refusal: BaseException) -> None:
        super().__init__()
        self.exception = refusal

    async def check_request(self, prompt_token_ids, params) -> None:
        self.checked.append(params)
        raise self.exception


class MaskedEngine(RecordingEngine):
    """Each stream gives one token, then ends as the engine ends a request whose rules left no
    token (``REFUSED``); with ``only`` it does so for that request id alone."""

    def __init__(self, only: str | None = None) -> None:
        super().__init__()
        self.only = only

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        if self.only is not None and not request_id.endswith(self.only):
            async for out in super().stream(prompt_token_ids, params, request_id, every_s, tenant):
                yield out
            return
        self.num_open += 1
        try:
            yield RequestOutput(request_id, [5], False, None, 3, 1)
            yield RequestOutput(request_id, [], True, REFUSED, 3, 1,
                                error="no token is allowed after 1 output tokens: engine words 0x7f")
        finally:
            self.num_closed += 1


def client(engine: RecordingEngine, **kwargs: Any) -> TestClient:
    return TestClient(build_openai_app(engine, IdTokenizer(), model_name="fake", **kwargs))


def test_each_engine_request_carries_the_keys_name_and_the_user():
    engine = RecordingEngine()
    c = client(engine, api_keys=parse_key_file(KEYS, "f"))
    auth = {"Authorization": "Bearer bob-0123456789"}
    assert c.post(COMP, json={"prompt": [1, 2], "max_tokens": 2, "n": 2, "user": "u-7"}, headers=auth).status_code == 200
    assert c.post(COMP, json={"prompt": [1, 2], "max_tokens": 2},
                  headers={"Authorization": "Bearer alice-0123456789"}).status_code == 200
    assert engine.tenants == [Tenant("bob", "u-7"), Tenant("bob", "u-7"), Tenant("alice", "")]
    open_engine = RecordingEngine()
    assert client(open_engine).post(COMP, json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200
    assert open_engine.tenants == [Tenant("anonymous", "")]


@pytest.mark.parametrize("refusal, code, says", [
    (RequestRefused("engine words: grammar size 0x7f too big", "structured", "too_large"), "grammar_too_large",
     "larger than"),
    (RequestRefused("engine words: not within 10 s", "structured", "too_slow"), "grammar_too_slow", "longer to"),
    (RequestRefused("engine words: Invalid type 0x7f", "structured", "invalid"), None, "cannot be compiled"),
])
@pytest.mark.parametrize("wrapped", [False, True])
def test_a_typed_grammar_refusal_is_mapped_by_its_reason_to_the_requests_field(refusal, code, says, wrapped):
    c = client(RefusingEngine(ray_wrapped(refusal) if wrapped else refusal))
    body = {"prompt": [1, 2], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}
    r = c.post(COMP, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and err["code"] == code and says in err["message"], err
    assert "engine words" not in err["message"] and "0x7f" not in err["message"]


@pytest.mark.parametrize("wrapped", [False, True])
def test_a_typed_kv_refusal_names_max_tokens_whatever_its_words(wrapped):
    refusal = RequestRefused("engine words about blocks 0x7f", "max_tokens", "kv_cache")
    r = client(RefusingEngine(ray_wrapped(refusal) if wrapped else refusal)).post(
        COMP, json={"prompt": [1, 2], "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_tokens" and "KV cache" in err["message"], err


def test_a_request_the_engine_ended_for_its_own_rules_gets_a_400_not_a_503():
    c = client(MaskedEngine())
    r = c.post(COMP, json={"prompt": [1, 2], "max_tokens": 4, "min_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "no_token_allowed" and "0x7f" not in err["message"], err


def test_a_streamed_request_the_engine_ended_for_its_own_rules_gets_an_error_event():
    engine = MaskedEngine(only="-1")  # choice 1 of n=2 is refused; choice 0 runs to its end
    c = client(engine)
    with c.stream("POST", COMP, json={"prompt": [1, 2], "max_tokens": 3, "n": 2, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert [e["code"] for e in errors] == ["no_token_allowed"], events
    assert engine.num_open == engine.num_closed == 2
