"""Every request field that costs the server work is bounded, with a 400 naming the field before
any engine call (serve/guards/limits.py); a request whose end tokens would mask the whole vocabulary is
refused up front; the engine's own refusals reach the client as stable messages without the
engine's words; prompt log-probabilities are asked for once per request, not once per choice.

In-process, over ``RecordingEngine`` (it records every ``check_request``: a bound that held
never reached it).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient
from support.serve_fakes import IdTokenizer, RecordingEngine

from cosine_ray.serve.openai_app import build_openai_app

COMP, CHAT = "/v1/completions", "/v1/chat/completions"
VOCAB = RecordingEngine.vocab_size


class limits:  # noqa: N801 - the documented bounds (docs/api.md), checked against serve.guards.limits below
    MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS = 4, 256, 256, 1024
    MAX_MESSAGES, MAX_TOOLS, MAX_SCHEMA_CHARS, MAX_SCHEMA_DEPTH = 2048, 128, 64 << 10, 64
    MAX_GRAMMAR_CHARS, MAX_CHOICE_STRINGS, MAX_PROMPT_LOGPROBS_TOKENS, MAX_USER_CHARS = 64 << 10, 256, 1024, 256

    @staticmethod
    def json_depth(value: Any) -> int:
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        return 0 if children is None else 1 + max((limits.json_depth(c) for c in children), default=0)


def test_the_documented_bounds_are_the_servers():
    from cosine_ray.serve.guards import limits as served
    names = [n for n in vars(limits) if n.startswith("MAX_")]
    assert {n: getattr(served, n) for n in names} == {n: getattr(limits, n) for n in names}


class ChatTokenizer(IdTokenizer):
    """A chat template that joins the contents; each character of the text is one token."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kwargs):
        return [ord(c) % VOCAB for m in messages for c in m["content"]] or [1]

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) % VOCAB for c in text]}


def client(engine: RecordingEngine | None = None, **kwargs: Any) -> tuple[TestClient, RecordingEngine]:
    engine = engine or RecordingEngine()
    return TestClient(build_openai_app(engine, ChatTokenizer(), model_name="fake", **kwargs)), engine


def completion(**kw: Any) -> dict[str, Any]:
    return {"prompt": [1, 2, 3], "max_tokens": 2, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def nested(depth: int) -> dict[str, Any]:
    """A JSON schema whose objects nest ``depth`` deep (arrays of arrays of ... strings)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    assert limits.json_depth(schema) == depth
    return schema


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 60}
                                               for i in range(limits.MAX_SCHEMA_CHARS // 80)}}
CASES = [  # (route, body, the param the 400 names)
    (COMP, completion(stop=["x" * (limits.MAX_STOP_CHARS + 1)]), "stop"),
    (COMP, completion(stop=["a", "b", "c", "d", "e"]), "stop"),
    (COMP, completion(stop_token_ids=list(range(limits.MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
    (COMP, completion(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (COMP, completion(logit_bias={str(i): 1 for i in range(limits.MAX_LOGIT_BIAS + 1)}), "logit_bias"),
    (COMP, completion(logit_bias={"1": 5, "01": -5}), "logit_bias"),
    (COMP, completion(logit_bias={str(VOCAB): 5}), "logit_bias"),
    (CHAT, chat(messages=[{"role": "user", "content": "x"}] * (limits.MAX_MESSAGES + 1)), "messages"),
    (CHAT, chat(tools=[tool(f"f{i}") for i in range(limits.MAX_TOOLS + 1)]), "tools"),
    (CHAT, chat(tools=[tool("deep", nested(limits.MAX_SCHEMA_DEPTH + 1))]), "tools"),
    (CHAT, chat(tools=[tool("big", BIG_SCHEMA)]), "tools"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": BIG_SCHEMA}}),
     "response_format"),
    (CHAT, chat(response_format={"type": "json_schema",
                                 "json_schema": {"name": "r", "schema": nested(limits.MAX_SCHEMA_DEPTH + 1)}}),
     "response_format"),
    (COMP, completion(structured_outputs={"json": json.dumps(nested(limits.MAX_SCHEMA_DEPTH + 1))}),
     "structured_outputs"),
    (COMP, completion(structured_outputs={"choice": [f"c{i}" for i in range(limits.MAX_CHOICE_STRINGS + 1)]}),
     "structured_outputs.choice"),
    (COMP, completion(structured_outputs={"choice": ["x" * (limits.MAX_GRAMMAR_CHARS // 2)] * 3}),
     "structured_outputs"),
    (COMP, completion(structured_outputs={"regex": "a" * (limits.MAX_GRAMMAR_CHARS + 1)}), "structured_outputs"),
    (COMP, completion(n=17), "n"),
    (COMP, completion(logprobs=21), "logprobs"),
    (CHAT, chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (COMP, completion(user="u" * (limits.MAX_USER_CHARS + 1)), "user"),
    (COMP, completion(prompt=[1] * (limits.MAX_PROMPT_LOGPROBS_TOKENS + 1), echo=True, logprobs=1), "echo"),
    (COMP, completion(prompt=[1] * (limits.MAX_PROMPT_LOGPROBS_TOKENS + 1), prompt_logprobs=1), "prompt_logprobs"),
    (COMP, completion(prompt=[1] * RecordingEngine.max_model_len), "prompt"),
]


@pytest.mark.parametrize("route, body, param", CASES, ids=[f"{i}-{c[2]}" for i, c in enumerate(CASES)])
def test_each_bound_is_a_400_naming_its_field_before_any_engine_call(route, body, param):
    c, engine = client()
    r = c.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert not engine.checked and not engine.num_open


def test_the_bounds_themselves_are_served():
    c, engine = client()
    at_limits = [
        (COMP, completion(stop=["x" * limits.MAX_STOP_CHARS] * limits.MAX_STOP_STRINGS)),
        (COMP, completion(stop_token_ids=list(range(8)))),
        (COMP, completion(logit_bias={"1": 5, "2": -5})),
        (CHAT, chat(tools=[tool("f", nested(limits.MAX_SCHEMA_DEPTH))], tool_choice="none")),
        (COMP, completion(prompt=[1] * limits.MAX_PROMPT_LOGPROBS_TOKENS, echo=True, logprobs=1)),
    ]
    for route, body in at_limits:
        r = c.post(route, json=body)
        assert r.status_code == 200, (body, r.text)
    assert len(engine.checked) == len(at_limits)


def test_a_key_repeated_in_the_raw_logit_bias_object_is_refused():
    """JSON parsing keeps the last of a repeated key, so the first bias would vanish silently."""
    c, engine = client()
    body = b'{"prompt": [1, 2], "max_tokens": 2, "logit_bias": {"5": 100, "7": 1, "5": -100}}'
    r = c.post(COMP, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "'5' twice" in r.json()["error"]["message"] and not engine.checked
    many = {str(i): 1 for i in range(70_000)}
    r = c.post(COMP, json=completion(logit_bias=many))
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_end_tokens_that_mask_every_token_are_refused_up_front():
    c, engine = client()
    every = list(range(VOCAB))
    r = c.post(COMP, json=completion(stop_token_ids=every[1:], min_tokens=1))  # EOS (0) is the rest
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    r = c.post(COMP, json=completion(stop_token_ids=every, min_tokens=1, ignore_eos=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"
    assert not engine.checked
    # without min_tokens the tokens only end the request; with EOS ignored one token is left
    assert c.post(COMP, json=completion(stop_token_ids=every)).status_code == 200
    assert c.post(COMP, json=completion(stop_token_ids=every[1:], min_tokens=1, ignore_eos=True)).status_code == 200


@pytest.mark.parametrize("refusal, param, hidden", [
    ("the prompt (3 tokens) + max_tokens (2) need 9 KV blocks of 16 tokens; the KV cache holds 4 "
     "(raise --kv-cache-memory or lower max_tokens)", "max_tokens", ("--kv-cache-memory", "blocks")),
    ("the json schema cannot be compiled: Unimplemented keys: [\"patternProperties\"] at llg::json", "response_format",
     ("patternProperties", "llg")),
    ("something new deep in the engine: <internal state 0x7f>", "prompt", ("0x7f", "internal state")),
])
def test_engine_refusals_reach_the_client_without_the_engines_words(refusal, param, hidden):
    c, _ = client(RecordingEngine(refusal=refusal))
    body = completion(response_format={"type": "json_object"}) if param == "response_format" else completion()
    r = c.post(COMP, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and not any(h in err["message"] for h in hidden), err


def test_prompt_logprobs_are_asked_for_once_per_request_not_per_choice():
    c, engine = client()
    r = c.post(COMP, json=completion(echo=True, logprobs=2, n=4))
    assert r.status_code == 200, r.text
    asked = [p.prompt_logprobs for p in engine.streamed]
    assert asked == [2, None, None, None], asked


@pytest.mark.real_model
def test_a_real_engine_never_sees_end_tokens_that_cover_the_vocabulary(tmp_path, real_checkpoint):
    """Every token id as a stop token, with min_tokens: no token could be sampled. Refused with a
    400 before any work (the engine would find a row with nothing to sample)."""
    import httpx
    from support.tiny_checkpoint import write_tiny_checkpoint
    from support.uvicorn_thread import serve_in_thread

    from cosine_ray.engine.client import LocalEngineClient
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.local import LocalEngine

    ck = write_tiny_checkpoint(tmp_path / "tiny", tokenizer_from=real_checkpoint)
    engine = LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters("ngram")), checkpoint=ck)
    client = LocalEngineClient(engine)
    url, stop = serve_in_thread(build_openai_app(client, engine.tokenizer, model_name="tiny"))
    try:
        body = {"prompt": "Hello", "max_tokens": 4, "min_tokens": 2,
                "stop_token_ids": list(range(client.vocab_size))}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text  # and the server serves the next request
    finally:
        stop()
