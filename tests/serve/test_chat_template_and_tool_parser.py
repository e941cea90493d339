"""The chat route with the server's chat template (``--chat-template``), the request's
``chat_template_kwargs`` and the server's tool-call parser (``--tool-call-parser``): over HTTP,
in-process, against an engine that writes a given text (byte tokens), streamed and not."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from cosine_ray.engine.request import RequestOutput
from cosine_ray.serve.openai_app import build_openai_app
from support.byte_tokenizer import SIMPLE_CHAT_TEMPLATE, byte_tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'


class WritingEngine:
    """An engine client that writes ``text`` (one byte token an output) and records the prompts."""

    model_name, max_model_len, vocab_size = "m", 4096, 256

    def __init__(self, text: str) -> None:
        self.ids = list(text.encode())
        self.prompts: list[list[int]] = []

    async def check_request(self, prompt_token_ids, params) -> None:
        return None

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        self.prompts.append(list(prompt_token_ids))
        for i, token in enumerate(self.ids):
            last = i == len(self.ids) - 1
            yield RequestOutput(request_id, [token], last, "stop" if last else None)

    async def abort(self, request_id) -> bool:
        return True

    async def finish(self, request_id) -> bool:
        return True

    async def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    async def metrics_snapshot(self, http=None) -> dict[str, Any]:
        from cosine_ray.metrics.registry import MetricsRegistry
        return MetricsRegistry().snapshot()

    def record_http(self, replica, totals) -> None:
        return None


def client(engine: WritingEngine, **app_args: Any) -> TestClient:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = SIMPLE_CHAT_TEMPLATE
    return TestClient(build_openai_app(engine, tokenizer, model_name="m", **app_args))


def chat(c: TestClient, **body: Any):
    return c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "weather in Paris?"}],
                                                "max_tokens": 200, **body})


def streamed(c: TestClient, **body: Any) -> tuple[str, list[dict]]:
    r = chat(c, stream=True, **body)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    return content, calls


@pytest.mark.parametrize("parser, text", [("llama3_json", LLAMA3_CALL), ("mistral", MISTRAL_CALL)])
def test_the_servers_tool_call_parser_reads_auto_calls(parser, text):
    with client(WritingEngine(text), tool_call_parser=parser) as c:
        body = chat(c, tools=[WEATHER]).json()
        (choice,) = body["choices"]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"].get("content")
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        content, calls = streamed(c, tools=[WEATHER])
        assert content == "" and [tc["function"]["name"] for tc in calls] == ["get_weather"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_the_default_hermes_parser_leaves_another_format_as_text():
    with client(WritingEngine(LLAMA3_CALL)) as c:
        (choice,) = chat(c, tools=[WEATHER]).json()["choices"]
        assert choice["message"]["content"] == LLAMA3_CALL and "tool_calls" not in choice["message"]
        assert streamed(c, tools=[WEATHER]) == (LLAMA3_CALL, [])


def test_an_unknown_tool_call_parser_is_refused_when_the_app_is_built():
    with pytest.raises(ValueError, match="unknown tool-call parser 'pythonic'"):
        build_openai_app(WritingEngine("x"), byte_tokenizer(), model_name="m", tool_call_parser="pythonic")


def test_chat_template_kwargs_reach_the_template_and_the_servers_template_replaces_the_tokenizers():
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if shout is defined and shout %}!!{% endif %}|")
    engine = WritingEngine("ok")
    with client(engine, chat_template=template) as c:
        assert chat(c).status_code == 200
        assert chat(c, chat_template_kwargs={"shout": True}).status_code == 200
    plain, shouted = (bytes(p).decode() for p in engine.prompts)
    assert plain == "weather in Paris?|" and shouted == "weather in Paris?!!|"
    engine = WritingEngine("ok")
    with client(engine) as c:  # the tokenizer's own template
        assert chat(c).status_code == 200
    assert bytes(engine.prompts[0]).decode() == "<user>weather in Paris?\n<assistant>"


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenize": False}, "chat_template_kwargs may not set 'tokenize'"),
    ({"chat_template": "{{ 1 }}"}, "chat_template_kwargs may not set 'chat_template'"),
    ({"messages": []}, "chat_template_kwargs may not set 'messages'"),
    ({"not a name": 1}, "is not a template variable name"),
    ({f"v{i}": i for i in range(33)}, "at most 32 template variables"),
    ({"deep": [[[[[[[[[1]]]]]]]]]}, "nested more than 8 deep"),
    ({"big": "x" * 20000}, "characters as JSON"),
])
def test_bad_chat_template_kwargs_are_a_400_naming_the_field(kwargs, message):
    engine = WritingEngine("ok")
    with client(engine) as c:
        r = chat(c, chat_template_kwargs=kwargs)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and "chat_template_kwargs" in (error.get("param") or error["message"])
    assert not engine.prompts
