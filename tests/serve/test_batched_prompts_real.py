"""A batch of prompts and vLLM's tokenization routes on the embedded SmolLM2-135M-Instruct over
HTTP: one ``/v1/completions`` request whose ``prompt`` is three token-id lists, with ``echo``,
``logprobs: 1`` and ``max_tokens: 1``, gives three choices whose prompt log-probabilities equal
those of the three prompts sent one at a time; ``/tokenize`` then ``/detokenize`` round-trips a
prompt with the model's own tokenizer.

The engine runs in process (``LocalEngine``, n-gram drafter) behind the real app on uvicorn.
"""

from __future__ import annotations

import httpx
import pytest
from support.uvicorn_thread import serve_in_thread

from cosine_ray.engine.client import LocalEngineClient
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.serve.openai_app import build_openai_app

pytestmark = [pytest.mark.real_model, pytest.mark.full]

MODEL = "smol"
TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "def add(a, b):\n    return a + b",
         "In 1492, Columbus sailed across the Atlantic Ocean and"]


@pytest.fixture(scope="module")
def server(real_checkpoint):
    engine = LocalEngine(EngineConfig(model="smollm2-135m", drafters=parse_drafters("ngram")),
                         checkpoint=real_checkpoint)
    url, stop = serve_in_thread(build_openai_app(LocalEngineClient(engine), engine.tokenizer, model_name=MODEL))
    with httpx.Client(base_url=url, timeout=300) as client:
        yield client, engine.tokenizer
    stop()


def complete(client: httpx.Client, prompt) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1,
                                             "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_batch_of_token_id_lists_scores_each_prompt_as_alone(server):
    client, tokenizer = server
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    batch = complete(client, prompts)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, batch["choices"]):
        alone = complete(client, prompt)["choices"][0]
        got, want = choice["logprobs"], alone["logprobs"]
        assert got["tokens"] == want["tokens"] and len(got["tokens"]) == len(prompt) + 1
        assert got["token_logprobs"][0] is None and want["token_logprobs"][0] is None
        # the prompt's log-probabilities (and the one generated token's), as the prompt alone gets them
        diffs = [abs(a - b) for a, b in zip(got["token_logprobs"][1:], want["token_logprobs"][1:])]
        assert max(diffs) < 1e-5, diffs
        for top_got, top_want in zip(got["top_logprobs"][1:], want["top_logprobs"][1:]):
            assert top_got.keys() == top_want.keys()
        assert choice["text"] == alone["text"] and choice["text"].startswith(tokenizer.decode(prompt))
    # three different prompts, three different scores: a batch answering one prompt thrice would fail
    assert len({tuple(c["logprobs"]["token_logprobs"][1:4]) for c in batch["choices"]}) == 3
    assert batch["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert batch["usage"]["completion_tokens"] == 3


def test_tokenize_then_detokenize_round_trips_a_prompt(server):
    client, tokenizer = server
    text = TEXTS[1]
    r = client.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == client.get("/v1/models").json()["data"][0]["max_model_len"]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "Hi"}]
    chat = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)  # transformers 5: a BatchEncoding
    assert client.get("/version").json()["version"]
