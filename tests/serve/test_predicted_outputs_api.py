"""Predicted Outputs over HTTP (OpenAI's ``prediction``), with the official ``openai`` client:
honoured on chat and completions, never changing the greedy text, with
``usage.completion_tokens_details`` counting the accepted and rejected prediction tokens, for
every choice of ``n``; malformed or oversized predictions are 400s naming the field.

Two servers on one tiny random model with SmolLM2's tokenizer: one with the n-gram drafter
(so the engine has a prediction drafter) and one without drafters.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.tiny_checkpoint import write_tiny_checkpoint
from support.uvicorn_thread import serve_engines

from cosine_ray.algo.subsequence import common_subsequence_length
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams

pytestmark = pytest.mark.real_model  # the embedded SmolLM2's tokenizer

MODEL = "tiny"
MSG = [{"role": "user", "content": "Rewrite the function below."}]
PROMPT = "def add(a, b):\n    return a + b\n\n"
MAX_TOKENS = 40
SEED = 5


@pytest.fixture(scope="module")
def servers(tmp_path_factory, real_checkpoint):
    """name → (url, engine); "ref" → the completion token ids the plain engine gives the chat
    message (greedy) and the completion prompt (seeds 5 and 6), computed before the servers run."""
    ck = write_tiny_checkpoint(tmp_path_factory.mktemp("predicted") / "tiny", tokenizer_from=real_checkpoint)
    engines = {name: LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters(drafters)).replace(
        max_model_len=512), checkpoint=ck) for name, drafters in (("spec", "ngram"), ("plain", "none"))}
    plain = engines["plain"]
    chat_ids = plain.tokenizer.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    completion_ids = plain.tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    params = [SamplingParams(max_tokens=MAX_TOKENS)] + [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=SEED + i) for i in range(2)]
    outs = plain.generate([list(chat_ids), completion_ids, completion_ids], params)
    ref = {"chat": outs[0].new_token_ids, "completions": [o.new_token_ids for o in outs[1:]]}
    with serve_engines(engines, MODEL) as served:
        yield {**served, "ref": ref}


def client(servers, name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{servers[name][0]}/v1", api_key="x", max_retries=0, timeout=120)


def chat(servers, name: str, **kw):
    return client(servers, name).chat.completions.create(model=MODEL, messages=MSG, max_tokens=MAX_TOKENS,
                                                         temperature=0, **kw)


def tokens(servers, text: str) -> list[int]:
    return servers["plain"][1].tokenizer(text, add_special_tokens=False)["input_ids"]


def test_a_chat_prediction_drafts_and_never_changes_the_text(servers):
    plain = chat(servers, "plain").choices[0].message.content
    edited = plain[: len(plain) // 2] + " something else " + plain[len(plain) // 2:]
    for prediction in (plain, edited, "lorem ipsum dolor sit amet " * 4):
        spec = chat(servers, "spec", prediction={"type": "content", "content": prediction},
                    extra_body={"cosine_ray_stats": True})
        assert spec.choices[0].message.content == plain
        details = spec.usage.completion_tokens_details
        predicted = tokens(servers, prediction)
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == len(predicted)
        completion = servers["ref"]["chat"]  # the completion's own tokens (its text may encode to others)
        assert details.accepted_prediction_tokens == common_subsequence_length(predicted, completion)
        if prediction == plain:
            stats = spec.model_extra["cosine_ray"]
            assert stats["accepted_by"].get("prediction", 0) > MAX_TOKENS // 2, stats


def test_no_prediction_no_details_and_the_plain_server_counts_too(servers):
    assert chat(servers, "spec").usage.completion_tokens_details is None
    plain = chat(servers, "plain")
    text = plain.choices[0].message.content
    again = chat(servers, "plain", prediction={"type": "content", "content": [{"type": "text", "text": text[:5]},
                                                                            {"type": "text", "text": text[5:]}]})
    assert again.choices[0].message.content == text  # text parts are concatenated
    details = again.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == common_subsequence_length(tokens(servers, text),
                                                                           servers["ref"]["chat"]) > 0


def test_completions_honour_it_and_every_choice_uses_it(servers):
    base = client(servers, "plain").completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                        temperature=0.7, seed=SEED, n=2)
    texts = [c.text for c in sorted(base.choices, key=lambda c: c.index)]
    spec = client(servers, "spec").completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                       temperature=0.7, seed=SEED, n=2,
                                                       extra_body={"prediction": {"type": "content",
                                                                                  "content": texts[0]}})
    assert [c.text for c in sorted(spec.choices, key=lambda c: c.index)] == texts  # seeded: lossless per choice
    details = spec.usage.completion_tokens_details
    predicted = tokens(servers, texts[0])
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == 2 * len(predicted)
    assert details.accepted_prediction_tokens == sum(
        common_subsequence_length(predicted, ids) for ids in servers["ref"]["completions"])


def test_the_streamed_usage_carries_the_details(servers):
    """Only the final usage, once every choice is done (the count is over whole completions)."""
    url = servers["spec"][0]
    text = chat(servers, "plain").choices[0].message.content
    r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": MSG, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "prediction": {"type": "content", "content": text}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == text
    details = events[-1]["usage"]["completion_tokens_details"]
    predicted = tokens(servers, text)
    assert details["accepted_prediction_tokens"] == common_subsequence_length(predicted, servers["ref"]["chat"])
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] == len(predicted)
    assert all("completion_tokens_details" not in (e.get("usage") or {}) for e in events[:-1])


@pytest.mark.parametrize("prediction, says", [
    ({"type": "text", "content": "x"}, "prediction"),
    ({"type": "content"}, "prediction"),
    ({"type": "content", "content": 3}, "prediction"),
    ({"type": "content", "content": [{"type": "image", "url": "x"}]}, "prediction"),
    ({"type": "content", "content": "x", "extra": 1}, "prediction"),
    ({"type": "content", "content": "word " * 600}, "at most the model's context of 512"),
])
def test_a_bad_prediction_is_a_400_naming_it(servers, prediction, says):
    r = httpx.post(f"{servers['spec'][0]}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": MSG, "max_tokens": 4, "prediction": prediction})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and (error["param"] or "").startswith("prediction"), error
