"""vLLM's ``/tokenize``, ``/detokenize`` and ``/version``, and several models (or names) behind
one app: request and response shapes, the API key, the bounds, tokenization off the event loop,
and each request reaching its own model's engine.

A real Hugging Face tokenizer built in code (byte-level, with a plain chat template) and engine
fakes: no model is loaded. The round trip through the embedded SmolLM2's tokenizer is in
tests/serve/test_batched_prompts_real.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from starlette.testclient import TestClient
from support.byte_tokenizer import SIMPLE_CHAT_TEMPLATE, byte_tokenizer
from support.serve_fakes import PromptEngine, RecordingEngine

from cosine_ray.serve.openai_app import VERSION, build_openai_app

KEY = {"Authorization": "Bearer k"}


def chat_tokenizer():
    tok = byte_tokenizer()
    tok.chat_template = SIMPLE_CHAT_TEMPLATE
    return tok


def app(engine: Any = None, **kw: Any) -> TestClient:
    return TestClient(build_openai_app(engine or PromptEngine(), chat_tokenizer(), model_name="table",
                                       api_key="k", **kw))


def test_tokenize_a_prompt_and_detokenize_it_back_in_vllms_shapes():
    client = app()
    r = client.post("/tokenize", json={"model": "table", "prompt": "Hi sea"}, headers=KEY)
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 6, "max_model_len": PromptEngine.max_model_len, "tokens": list(b"Hi sea")}
    r = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}, headers=KEY)
    assert r.json()["token_strs"] == ["a", "b"]
    r = client.post("/detokenize", json={"model": "table", "tokens": list(b"Hi sea")}, headers=KEY)
    assert r.status_code == 200 and r.json() == {"prompt": "Hi sea"}


def test_tokenize_messages_through_the_chat_template():
    client = app()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.post("/tokenize", json={"messages": messages}, headers=KEY)
    assert r.status_code == 200, r.text
    assert bytes(r.json()["tokens"]).decode() == "<system>Be brief.\n<user>Hi\n<assistant>"
    r = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}, headers=KEY)
    assert bytes(r.json()["tokens"]).decode() == "<system>Be brief.\n<user>Hi\n"
    r = client.post("/tokenize", json={"messages": messages, "continue_final_message": True}, headers=KEY)
    assert bytes(r.json()["tokens"]).decode() == "<system>Be brief.\n<user>Hi"  # the last message left open
    # the same ids the chat route would send to the engine
    engine = PromptEngine()
    chat = app(engine)
    assert chat.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1},
                     headers=KEY).status_code == 200
    tokens = chat.post("/tokenize", json={"messages": messages}, headers=KEY).json()["tokens"]
    assert engine.streams[0][0] == tokens


def test_the_routes_need_the_key_and_version_answers():
    client = app()
    for method, path, body in (("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [97]}),
                               ("GET", "/version", None)):
        assert client.request(method, path, json=body).status_code == 401
    r = client.get("/version", headers=KEY)
    assert r.status_code == 200 and r.json() == {"version": VERSION} and VERSION != "unknown"


@pytest.mark.parametrize("path,body,param,message", [
    ("/tokenize", {}, "prompt", "give prompt or messages"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt", "applies to messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True,
                   "add_generation_prompt": True}, "continue_final_message", "cannot both be true"),
    ("/tokenize", {"prompt": "a", "chat_template": "{{ x }}"}, "chat_template", "not supported"),
    ("/tokenize", {"prompt": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens", "Extra inputs"),
    ("/tokenize", {"prompt": "a" * (PromptEngine.max_model_len + 1)}, "prompt", "more than the model's context"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}] * 2049}, "messages", "at most 2048"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", "valid boolean"),
    ("/detokenize", {"tokens": [PromptEngine.vocab_size]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": [1] * (PromptEngine.max_model_len + 1)}, "tokens", "more than the model's context"),
    ("/detokenize", {"tokens": ["1"]}, "tokens[0]", "valid integer"),
    ("/detokenize", {"tokens": [1], "model": "other"}, "model", "does not exist"),
])
def test_bad_input_is_a_400_naming_the_field(path, body, param, message):
    r = app().post(path, json=body, headers=KEY)
    expected = 404 if param == "model" else 400
    assert r.status_code == expected, r.text
    err = r.json()["error"]
    assert err["param"] == param and message.lower() in err["message"].lower(), err


def test_tokenization_runs_off_the_event_loop():
    seen = []

    class Recording(type(chat_tokenizer())):
        def __call__(self, *args, **kwargs):
            seen.append(threading.current_thread().name)
            return super().__call__(*args, **kwargs)

    tok = Recording(tokenizer_object=byte_tokenizer().backend_tokenizer)
    client = TestClient(build_openai_app(PromptEngine(), tok, model_name="table"))
    assert client.post("/tokenize", json={"prompt": "abc"}).json()["tokens"] == list(b"abc")
    assert seen and all(name.startswith("cosine_ray-tokenize") for name in seen), seen


class Engine(RecordingEngine):
    """A RecordingEngine with its own context, health and a record of its metrics snapshots."""

    def __init__(self, max_model_len: int, status: str = "ok") -> None:
        super().__init__()
        self.max_model_len, self.status, self.http = max_model_len, status, []

    async def health(self) -> dict[str, Any]:
        return {"status": self.status}

    async def metrics_snapshot(self, http=None) -> dict[str, Any]:
        self.http.append(http)
        return await super().metrics_snapshot(http)


def two_models(**kw: Any) -> tuple[TestClient, Engine, Engine]:
    a, b = Engine(1024), Engine(2048, **kw)
    tok = chat_tokenizer()
    client = TestClient(build_openai_app(a, tok, model_name="ckpt", served_model_names=["a", "a-alias"],
                                         more_models=[(["b"], b, tok)]))
    return client, a, b


def test_each_name_reaches_its_own_models_engine():
    client, a, b = two_models()
    cards = client.get("/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"], c["root"]) for c in cards] == [
        ("a", 1024, "fake"), ("a-alias", 1024, "fake"), ("b", 2048, "fake")]
    assert client.get("/v1/models/b").json()["max_model_len"] == 2048
    assert client.get("/v1/models/a-alias").json()["id"] == "a-alias"
    for model, engine, answered in (("b", b, "b"), ("a-alias", a, "a"), (None, a, "a")):
        before = len(engine.streamed)
        body = {"prompt": [1, 2], "max_tokens": 2, **({"model": model} if model else {})}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["model"] == answered  # responses carry the first name
        assert len(engine.streamed) == before + 1
    assert client.post("/tokenize", json={"model": "b", "prompt": "x"}).json()["max_model_len"] == 2048
    # a prompt fits one model's context and not the other's
    long = {"prompt": [1] * 1500, "max_tokens": 1}
    assert client.post("/v1/completions", json={**long, "model": "b"}).status_code == 200
    assert client.post("/v1/completions", json={**long, "model": "a"}).status_code == 400
    r = client.post("/v1/chat/completions", json={"model": "c", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404 and "'a', 'a-alias', 'b'" in r.json()["error"]["message"]


def test_health_waits_for_every_engine_and_metrics_name_the_model():
    client, a, b = two_models(status="starting")
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["models"] == {"a": "ok", "b": "starting"}
    b.status = "ok"
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/metrics").status_code == 200 and a.http and a.http[-1] is not None
    assert client.get("/metrics?model=b").status_code == 200 and b.http == [None]  # HTTP counts: the first's
    assert client.get("/metrics?model=zz").status_code == 404


def test_a_name_given_twice_is_refused_when_the_app_is_built():
    tok = chat_tokenizer()
    with pytest.raises(ValueError, match="'a' is given twice"):
        build_openai_app(Engine(8), tok, model_name="x", served_model_names=["a"], more_models=[(["a"], Engine(8), tok)])
    with pytest.raises(ValueError, match="'a' is given twice"):
        build_openai_app(Engine(8), tok, model_name="x", served_model_names=["a", "a"])
