"""One route at a time: a route of the OpenAI app is a module-level function of its request and
the one ``ServerState``, so it runs alone (on a bare FastAPI app holding only that route, or
called directly) over a state whose engine is a fake.

The fake engine decodes greedily from ``support.fakes.TableTarget`` one token per output, so
the expected text is the table's own greedy continuation, computed independently of the route.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient
from support.fakes import VOCAB, TableTarget

from cosine_ray.engine.request import RequestOutput
from cosine_ray.serve import openai_app
from cosine_ray.serve.errors import OVERLOADED_CODE, NotFound, install_error_handlers
from cosine_ray.serve.guards.admission import Admission
from cosine_ray.serve.generation import Readiness
from cosine_ray.serve.metrics_http import HttpCounts
from cosine_ray.serve.state import ServerState

PROMPT = [3, 1, 4, 1, 5]
COMP = "/v1/completions"


class TableEngine:
    """EngineClient fake: greedy decoding of a ``TableTarget``, one token per output; records the
    sampling parameters it was given and counts the streams opened and closed."""

    model_name, max_model_len, vocab_size = "table", 64, VOCAB

    def __init__(self) -> None:
        self.target = TableTarget()
        self.params: list[Any] = []
        self.num_open = 0
        self.num_closed = 0

    async def check_request(self, prompt_token_ids, params) -> None:
        self.params.append(params)

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        self.num_open += 1
        out: list[int] = []
        try:
            while len(out) < params.max_tokens:
                out.append(self.target.next_token(list(prompt_token_ids) + out))
                done = len(out) == params.max_tokens
                yield RequestOutput(request_id, [out[-1]], done, "length" if done else None)
        finally:
            self.num_closed += 1


class IdTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def table_state(engine: TableEngine, **limits: Any) -> ServerState:
    return ServerState(engine=engine, tokenizer=IdTokenizer(), model_name="table",
                       admission=Admission(limits.pop("max_pending", None)), readiness=Readiness(engine),
                       http_counts=HttpCounts(engine), **limits)


def completions_alone(state: ServerState) -> TestClient:
    """A bare app serving only ``/v1/completions`` over ``state`` (no middleware, no other route)."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_api_route(COMP, openai_app.completions, methods=["POST"])
    app.state.server = state
    return TestClient(app)


def expected_text(engine: TableEngine, max_tokens: int) -> str:
    return IdTokenizer().decode(engine.target.greedy(PROMPT, max_tokens))


def test_the_completions_route_alone_serves_the_engine_greedy_text_within_the_state_limits():
    engine = TableEngine()
    state = table_state(engine, default_max_tokens=3)
    client = completions_alone(state)

    r = client.post(COMP, json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "table" and body["id"].startswith("cmpl-") and "cosine_ray" not in body
    assert body["choices"][0]["text"] == expected_text(engine, 6)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == len(PROMPT) and body["usage"]["completion_tokens"] == 6

    # no max_tokens: the state's default_max_tokens decides
    r = client.post(COMP, json={"prompt": PROMPT, "temperature": 0})
    assert r.json()["choices"][0]["text"] == expected_text(engine, 3)
    assert [p.max_tokens for p in engine.params] == [6, 3]

    # streamed: the same text in chunks, then [DONE]
    r = client.post(COMP, json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True})
    lines = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "[DONE]"
    assert "".join(c["text"] for e in lines[:-1] for c in json.loads(e)["choices"]) == expected_text(engine, 6)

    # every engine stream was closed, every admission slot given back
    assert engine.num_open == engine.num_closed == 3 and state.admission.num_pending == 0


def test_the_route_reads_the_state_it_is_given():
    engine = TableEngine()
    client = completions_alone(table_state(engine, max_pending=1, return_spec_stats=True))
    state = client.app.state.server

    r = client.post(COMP, json={"prompt": PROMPT, "max_tokens": 2, "n": 2})  # two slots, the state has one
    assert r.status_code == 503 and r.json()["error"]["code"] == OVERLOADED_CODE
    assert state.admission.num_rejected == 1 and state.admission.num_pending == 0 and engine.num_open == 0

    r = client.post(COMP, json={"prompt": PROMPT, "max_tokens": 2, "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

    r = client.post(COMP, json={"prompt": [VOCAB], "max_tokens": 2})  # outside the engine's vocabulary
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

    r = client.post(COMP, json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and "cosine_ray" in r.json()  # return_spec_stats: every response
    assert r.json()["choices"][0]["text"] == expected_text(engine, 2)


def test_a_route_is_a_plain_function_of_its_arguments_and_the_state():
    engine = TableEngine()
    state = table_state(engine)
    card = asyncio.run(openai_app.get_model("table", state))
    assert (card.id, card.max_model_len, card.created) == ("table", engine.max_model_len, state.created)
    assert [m.id for m in asyncio.run(openai_app.list_models(state)).data] == ["table"]
    with pytest.raises(NotFound):
        asyncio.run(openai_app.get_model("other", state))
