"""``/v1/completions`` with a batch in ``prompt`` (several strings or token-id lists), over an
engine fake whose answer is a fixed function of the prompt: every choice of a batch equals the
same prompt sent alone, choices are indexed as OpenAI does (prompt i, choice j: i·n + j), usage
is summed, streaming included, and admission counts every choice of every prompt.

The real-model version of the central claim (prompt log-probabilities of a batch equal those of
separate requests) is ``test_a_batch_of_token_id_lists_scores_each_prompt_as_alone`` in
tests/serve/test_batched_prompts_real.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient
from support.byte_tokenizer import byte_tokenizer
from support.serve_fakes import PromptEngine

from cosine_ray.serve.guards.limits import MAX_PROMPT_GENERATIONS
from cosine_ray.serve.openai_app import build_openai_app

PROMPTS = [[10, 11, 12], [40, 41], [99, 5, 6, 7]]
COMP = "/v1/completions"


def served(engine: PromptEngine | None = None, **kw: Any) -> tuple[TestClient, PromptEngine]:
    engine = engine or PromptEngine()
    app = build_openai_app(engine, byte_tokenizer(), model_name="table", **kw)
    return TestClient(app), engine


def post(client: TestClient, **body: Any) -> Any:
    r = client.post(COMP, json={"max_tokens": 3, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def events(client: TestClient, **body: Any) -> list[dict]:
    r = client.post(COMP, json={"max_tokens": 3, "temperature": 0, "stream": True, **body})
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_each_choice_of_a_batch_is_its_prompt_alone_indexed_i_n_plus_j():
    client, engine = served()
    alone = [post(client, prompt=p, n=2) for p in PROMPTS]
    batch = post(client, prompt=PROMPTS, n=2)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for i, one in enumerate(alone):
        for j in range(2):
            assert batch["choices"][2 * i + j]["text"] == one["choices"][j]["text"]
    # the texts are the prompts' own (the fake answers each prompt differently)
    tok = byte_tokenizer()
    assert [batch["choices"][2 * i]["text"] for i in range(3)] == [tok.decode(engine.answer(p, 3)) for p in PROMPTS]
    assert len({c["text"] for c in batch["choices"]}) == 3
    usage = batch["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in PROMPTS)  # each prompt once, not once per choice
    assert usage["completion_tokens"] == 6 * 3 and usage["total_tokens"] == usage["prompt_tokens"] + 18
    assert sum(u["usage"]["prompt_tokens"] for u in alone) == usage["prompt_tokens"]
    # every choice an engine request of its own prompt; every stream closed
    streams = engine.streams[-6:]
    assert [s[0] for s in streams] == [p for p in PROMPTS for _ in range(2)]
    assert len({s[2] for s in streams}) == 6 and engine.num_closed == len(engine.streams)


def test_a_batch_of_strings_is_tokenized_as_each_string_alone():
    client, engine = served()
    texts = ["The sea", "A fox jumps", "x"]
    batch = post(client, prompt=texts)
    for i, text in enumerate(texts):
        assert batch["choices"][i]["text"] == post(client, prompt=text)["choices"][0]["text"]
        assert engine.streams[i][0] == list(text.encode())  # byte tokenizer: token = byte
    assert batch["usage"]["prompt_tokens"] == sum(len(t) for t in texts)
    # a batch of one (what evaluation harnesses send) is that prompt
    assert post(client, prompt=[PROMPTS[0]])["choices"] == post(client, prompt=PROMPTS[0])["choices"]
    assert post(client, prompt=["The sea"])["choices"] == post(client, prompt="The sea")["choices"]


def test_echo_with_logprobs_gives_each_choice_its_own_prompt_and_log_probabilities():
    client, engine = served()
    body = dict(echo=True, logprobs=1, max_tokens=1)
    batch = post(client, prompt=PROMPTS, **body)
    tok = byte_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        alone = post(client, prompt=prompt, **body)["choices"][0]
        choice = batch["choices"][i]
        assert choice["logprobs"] == alone["logprobs"] and choice["text"] == alone["text"]
        assert choice["text"] == tok.decode(prompt) + tok.decode(engine.answer(prompt, 1))
        lps = choice["logprobs"]["token_logprobs"]
        assert lps[0] is None and lps[1:len(prompt)] == [
            pytest.approx(engine.prompt_logprob(t, j)) for j, t in enumerate(prompt[1:], 1)]
    # only the first choice of each prompt asked the engine for the prompt's log-probabilities
    batch = post(client, prompt=PROMPTS, n=2, **body)
    asked = [s[0] for s in engine.streams[-6:] if s[1].prompt_logprobs is not None]
    assert asked == PROMPTS
    for i in range(3):
        assert batch["choices"][2 * i]["logprobs"] == batch["choices"][2 * i + 1]["logprobs"]


def test_a_streamed_batch_carries_each_choices_index_and_the_summed_usage():
    client, _ = served()
    plain = post(client, prompt=PROMPTS, n=2)
    chunks = events(client, prompt=PROMPTS, n=2, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished = []
    for chunk in chunks[:-1]:
        for c in chunk["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c.get("finish_reason"):
                finished.append(c["index"])
    assert sorted(finished) == list(range(6))
    assert texts == {c["index"]: c["text"] for c in plain["choices"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    echoed = events(client, prompt=PROMPTS, echo=True)
    tok = byte_tokenizer()
    firsts = {c["index"]: c["text"] for c in (ch["choices"][0] for ch in echoed[:3])}
    assert firsts == {i: tok.decode(p) for i, p in enumerate(PROMPTS)}


def test_best_of_ranks_within_each_prompt():
    client, _ = served()
    batch = post(client, prompt=PROMPTS, n=1, best_of=2, logprobs=0)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for i, prompt in enumerate(PROMPTS):
        assert batch["choices"][i]["text"] == post(client, prompt=prompt, best_of=2, logprobs=0)["choices"][0]["text"]


def test_admission_counts_every_choice_of_every_prompt():
    client, engine = served(max_pending_requests=5)
    r = client.post(COMP, json={"prompt": PROMPTS, "n": 2, "max_tokens": 3})  # 6 choices, 5 slots
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_overloaded"
    assert engine.streams == [] and client.app.state.server.admission.num_pending == 0
    post(client, prompt=PROMPTS[:2], n=2)  # 4 choices fit
    assert client.app.state.server.admission.num_pending == 0

    keyed, engine = served(api_keys=[{"key": "k", "name": "t", "max_tokens_in_flight": 20}])
    claim = sum(2 * (len(p) + 3) for p in PROMPTS)  # n × (prompt + max_tokens), every prompt
    r = keyed.post(COMP, json={"prompt": PROMPTS, "n": 2, "max_tokens": 3}, headers={"Authorization": "Bearer k"})
    assert r.status_code == 400 and f"claims {claim} tokens" in r.json()["error"]["message"]
    assert engine.streams == []


def test_one_refused_prompt_refuses_the_batch_and_frees_every_slot():
    engine = PromptEngine(refuse=(tuple(PROMPTS[1]),))
    client, _ = served(engine)
    r = client.post(COMP, json={"prompt": PROMPTS, "n": 2, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert engine.streams == [] and client.app.state.server.admission.num_pending == 0


@pytest.mark.parametrize("prompt,n,message", [
    ([[1, 2]] * (MAX_PROMPT_GENERATIONS + 1), 1, f"at most {MAX_PROMPT_GENERATIONS} prompts"),
    ([[1, 2]] * 20, 16, f"320 generations; a request may ask for at most {MAX_PROMPT_GENERATIONS}"),
    ([[1, 2], "text"], 1, "one kind"),
    ([[1, 2], []], 1, "one kind"),
    (["a", ""], 1, "must not be empty"),
    ([[1, 2], [3, 256]], 1, "token id 256 is outside the vocabulary"),
    ([[1] * 600, [2]], 1, "the prompt is 600 tokens"),
])
def test_a_batch_beyond_its_bounds_is_a_400_naming_prompt(prompt, n, message):
    client, engine = served()
    r = client.post(COMP, json={"prompt": prompt, "n": n, "max_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and message in err["message"], err
    assert engine.streams == []
