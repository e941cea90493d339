"""The OpenAI HTTP layer against a real LocalEngine (tiny random model, SmolLM2 tokenizer).

Drafters: n-gram plus the target itself ("self": acceptance ~1, so the stats are non-trivial).
One uvicorn server in a background thread serves the app for the whole module (the engine's
step loop lives on that server's event loop); the official ``openai`` client and httpx talk to
it over TCP. References are the engine's own greedy outputs, computed before the server starts.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
from starlette.testclient import TestClient
from support.tiny_checkpoint import write_tiny_checkpoint
from support.uvicorn_thread import serve_in_thread

from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.engine.client import LocalEngineClient
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import RequestOutput, RequestStats, SamplingParams
from cosine_ray.serve.errors import EngineUnavailable
from cosine_ray.serve.generation import Generation, TextStream
from cosine_ray.serve.openai_app import build_openai_app

pytestmark = pytest.mark.real_model  # the embedded SmolLM2's tokenizer

MODEL = "tiny-smollm2"
CHAT_TEXT = "Write a haiku about the sea."
COMPLETION_TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MAX_TOKENS = 12
API_KEY = "sekrit-key"


class Served:
    def __init__(self, url: str, engine: LocalEngine, client: LocalEngineClient, refs: dict[str, list[int]]):
        self.url, self.engine, self.client, self.refs = url, engine, client, refs
        self.tok = engine.tokenizer

    def ref_text(self, name: str) -> str:
        return self.tok.decode(self.refs[name], skip_special_tokens=True)

    def is_idle(self) -> bool:
        core = self.engine.core
        return not core.running and not core.waiting


@pytest.fixture(scope="module")
def served(tmp_path_factory, real_checkpoint):
    ck = write_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", tokenizer_from=real_checkpoint)
    # the random tiny model's own probabilities are low: verify every draft it makes
    engine = LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters("ngram,self")).replace(
            min_tree_confidence=0.0, adaptive=False), checkpoint=ck)
    tok = engine.tokenizer
    prompts = {"chat": encode_prompt(tok, CHAT_TEXT),
               "completion": tok(COMPLETION_TEXT, add_special_tokens=True)["input_ids"]}
    outs = engine.generate(list(prompts.values()), SamplingParams(max_tokens=MAX_TOKENS))  # greedy
    refs = {name: out.new_token_ids for name, out in zip(prompts, outs)}
    client = LocalEngineClient(engine)
    app = build_openai_app(client, tok, model_name=MODEL)
    url, stop = serve_in_thread(app)
    yield Served(url, engine, client, refs)
    stop()


def oai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": CHAT_TEXT}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **kw}


def sse_lines(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


# ---- the openai client: text equals the engine's own greedy output --------------------------

def test_chat_and_completion_match_engine_greedy(served):
    client = oai(served)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": CHAT_TEXT}],
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert chat.id.startswith("chatcmpl-") and chat.object == "chat.completion" and chat.created > 0
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == served.ref_text("chat")
    assert chat.choices[0].finish_reason == ("length" if len(served.refs["chat"]) == MAX_TOKENS else "stop")
    n_prompt = len(encode_prompt(served.tok, CHAT_TEXT))
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (
        n_prompt, len(served.refs["chat"]), n_prompt + len(served.refs["chat"]))
    assert "cosine_ray" not in chat.to_dict()

    comp = client.completions.create(model=MODEL, prompt=COMPLETION_TEXT, max_tokens=MAX_TOKENS, temperature=0)
    assert comp.id.startswith("cmpl-") and comp.object == "text_completion"
    assert comp.choices[0].text == served.ref_text("completion")
    assert comp.usage.completion_tokens == len(served.refs["completion"])
    ids = served.tok(COMPLETION_TEXT, add_special_tokens=True)["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert by_ids.choices[0].text == comp.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]
    sampled = [client.completions.create(model=MODEL, prompt=COMPLETION_TEXT, max_tokens=MAX_TOKENS,
                                         temperature=1.0, seed=3).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]  # a seed makes sampling reproducible


def test_streaming_matches_engine_greedy(served):
    client = oai(served)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": CHAT_TEXT}], max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == served.ref_text("chat")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(served.refs["chat"])
    assert len({c.id for c in chunks}) == 1

    comp = list(client.completions.create(model=MODEL, prompt=COMPLETION_TEXT, max_tokens=MAX_TOKENS,
                                          temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in comp) == served.ref_text("completion")
    assert comp[-1].choices[0].finish_reason in ("length", "stop") and comp[-1].usage is None


def test_cosine_ray_stats_block(served):
    client = oai(served)
    resp = client.completions.create(model=MODEL, prompt=COMPLETION_TEXT, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body={"cosine_ray_stats": True}).to_dict()
    stats = resp["cosine_ray"]
    assert set(stats) == {"num_draft_tokens", "num_accepted_tokens", "mean_accepted_length",
                          "num_verify_steps", "drafted_by", "accepted_by", "domain", "drafters_used",
                          "pipedec_timesteps", "pipedec_tokens", "pipedec_hits", "num_cached_tokens",
                          "num_preemptions"}
    assert stats["pipedec_timesteps"] == stats["pipedec_tokens"] == 0  # lanes mode (the default)
    assert stats["drafters_used"] == sorted(d for d, n in stats["drafted_by"].items() if n > 0)
    assert isinstance(stats["domain"], str) and stats["domain"]
    assert stats["num_verify_steps"] >= 1 and 0 <= stats["num_accepted_tokens"] <= stats["num_draft_tokens"]
    assert stats["mean_accepted_length"] == pytest.approx(
        (stats["num_accepted_tokens"] + stats["num_verify_steps"]) / stats["num_verify_steps"])
    assert sum(stats["drafted_by"].values()) == stats["num_draft_tokens"]
    assert set(stats["drafted_by"]) <= {"ngram", "self"} and stats["accepted_by"].get("self", 0) > 0
    assert stats["num_verify_steps"] < MAX_TOKENS - 1  # the self-drafter's tokens were accepted
    r = httpx.post(f"{served.url}/v1/chat/completions", timeout=60,
                   json=chat_body(stream=True, cosine_ray_stats=True))
    events = [json.loads(e) for e in sse_lines(r.text)[:-1]]
    assert [("cosine_ray" in e) for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_stop_strings_truncate_output(served):
    full = served.ref_text("chat")
    stop = full[len(full) // 3: len(full) // 3 + 4]  # straddles token boundaries in general
    expected = full[:full.find(stop)]
    r = httpx.post(f"{served.url}/v1/chat/completions", json=chat_body(stop=[stop, "\u2603never"]), timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (expected, "stop")
    r = httpx.post(f"{served.url}/v1/chat/completions", json=chat_body(stop=stop, stream=True), timeout=60)
    events = [json.loads(e) for e in sse_lines(r.text)[:-1]]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert _wait_idle(served)


class _ByteTokenizer:
    """A byte-level tokenizer in miniature: ids 7 and 8 are the two UTF-8 bytes of "é"."""
    VOCAB = [b"a", b"b", b"c", b"ST", b"OP", b" ", b"x", b"\xc3", b"\xa9"]

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.VOCAB[i] for i in ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_partial_characters_and_stop_prefixes():
    ts = TextStream(_ByteTokenizer(), stop=["STOP"])
    assert [ts.add([i], is_final=False) for i in (0, 7, 8, 1)] == ["a", "", "\u00e9", "b"]
    assert ts.add([3], is_final=False) == ""  # "ST" could start "STOP"
    assert ts.add([2], is_final=False) == "STc"  # it did not
    assert ts.add([3, 4, 0], is_final=False) == "" and ts.is_stopped and ts.text == "a\u00e9bSTc"
    ts = TextStream(_ByteTokenizer(), stop=["ST"])
    assert ts.add([0, 3], is_final=True) == "a" and ts.is_stopped
    ts = TextStream(_ByteTokenizer(), stop=["STOP"])
    assert ts.add([0, 3], is_final=True) == "aST" and not ts.is_stopped
    assert TextStream(_ByteTokenizer()).add([0, 7], is_final=True) == "a\ufffd"  # final: nothing held


def test_text_stream_keeps_the_tokens_up_to_the_one_that_completed_a_stop_string():
    """An engine output may carry tokens past a stop string (a speculative step, or outputs merged
    for a response that is not streamed): they leave the completion, so usage counts none."""
    ts = TextStream(_ByteTokenizer(), stop=["STOP"])
    assert ts.add([0], is_final=False) == "a"
    assert ts.add([3, 4, 0, 1, 6], is_final=False) == "" and ts.is_stopped
    assert (ts.token_ids, ts.text) == ([0, 3, 4], "a")
    ts = TextStream(_ByteTokenizer(), stop=["\u00e9b"])  # the stop's first token holds half a character
    assert ts.add([0, 7, 8, 1, 2, 2], is_final=True) == "a" and ts.token_ids == [0, 7, 8, 1]
    ts = TextStream(_ByteTokenizer(), stop=["x"])
    assert ts.add([0, 1, 6], is_final=True) == "ab" and ts.token_ids == [0, 1, 6]  # the last token


def test_a_stopped_generation_counts_and_scores_only_the_tokens_up_to_the_stop():
    class MergedEngine:  # one output holding two steps, the second past the stop string
        async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
            ids = [0, 3, 4, 0, 1]
            yield RequestOutput(request_id, ids, False, logprobs=tuple(TokenLogprob(i, -0.5) for i in ids))

        async def finish(self, request_id):
            pass

    gen = Generation(MergedEngine(), _ByteTokenizer(), [1, 2], SamplingParams(max_tokens=9, logprobs=0),
                     ["STOP"], "r", every_s=0.1)
    assert asyncio.run(gen.collect()) == "a" and gen.finish_reason == "stop"
    assert (gen.usage().completion_tokens, [lp.token_id for lp in gen.take_logprobs()]) == (3, [0, 3, 4])


# ---- concurrency and disconnects ------------------------------------------------------------

def test_concurrent_streams_each_end_with_one_done(served):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, list[str]]:
        async with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        events = [line[6:] for line in lines]
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
        return text, events

    async def main() -> list[tuple[str, list[str]]]:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    results = asyncio.run(main())
    for text, events in results:
        assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
        assert text == served.ref_text("chat")
    assert _wait_idle(served)


def _wait_idle(served: Served, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if served.is_idle():
            return True
        time.sleep(0.02)
    return False


def test_client_disconnect_aborts_engine_request(served):
    with httpx.Client(base_url=served.url, timeout=60) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=2000, stream=True)) as r:
            it = r.iter_lines()
            assert next(it).startswith("data: ") and next(it) == "" and next(it).startswith("data: ")
            assert not served.is_idle()
    assert _wait_idle(served), "streaming request still running after the client left"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", timeout=0.5,
                   json={"prompt": COMPLETION_TEXT, "max_tokens": 2000, "temperature": 0})
    assert _wait_idle(served), "non-streaming request still running after the client left"


# ---- bad input: exact status and param; the server stays correct ----------------------------

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [  # (id, method, path, body, status, param); body: dict -> JSON, bytes -> raw
    ("malformed-json", "POST", CHAT, b'{"messages": [', 400, None),
    ("non-object-body", "POST", CHAT, b"[1, 2]", 400, None),
    ("string-body", "POST", CHAT, b'"hello"', 400, None),
    ("invalid-utf8", "POST", CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    ("deeply-nested", "POST", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("missing-messages", "POST", CHAT, {"max_tokens": 4}, 400, "messages"),
    ("empty-messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("bad-role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("bad-content", "POST", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ("bad-content-part", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content"),
    ("unknown-model", "POST", CHAT, {"model": "gpt-9", "messages": MSG}, 404, "model"),
    ("max-tokens-0", "POST", CHAT, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-neg", "POST", CHAT, {"messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    ("max-tokens-str", "POST", CHAT, {"messages": MSG, "max_tokens": "abc"}, 400, "max_tokens"),
    ("max-tokens-over-context", "POST", CHAT, {"messages": MSG, "max_tokens": 100_000}, 400, "max_tokens"),
    ("max-completion-tokens-over", "POST", CHAT, {"messages": MSG, "max_completion_tokens": 2048}, 400,
     "max_completion_tokens"),
    ("temperature-neg", "POST", CHAT, {"messages": MSG, "temperature": -0.1}, 400, "temperature"),
    ("temperature-high", "POST", CHAT, {"messages": MSG, "temperature": 2.5}, 400, "temperature"),
    ("temperature-nan-str", "POST", CHAT, {"messages": MSG, "temperature": "NaN"}, 400, "temperature"),
    ("temperature-nan", "POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     400, "temperature"),
    ("top-p-0", "POST", CHAT, {"messages": MSG, "top_p": 0}, 400, "top_p"),
    ("top-p-high", "POST", CHAT, {"messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("top-k-neg", "POST", CHAT, {"messages": MSG, "top_k": -2}, 400, "top_k"),
    ("n-17", "POST", CHAT, {"messages": MSG, "n": 17}, 400, "n"),
    ("presence-penalty-range", "POST", CHAT, {"messages": MSG, "presence_penalty": 3}, 400, "presence_penalty"),
    ("repetition-penalty-zero", "POST", CHAT, {"messages": MSG, "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("logprobs-str", "POST", CHAT, {"messages": MSG, "logprobs": "yes"}, 400, "logprobs"),
    ("top-logprobs-alone", "POST", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("top-logprobs-21", "POST", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("too-many-stops", "POST", CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("empty-stop", "POST", CHAT, {"messages": MSG, "stop": [""]}, 400, "stop"),
    ("stream-not-bool", "POST", CHAT, {"messages": MSG, "stream": "yes"}, 400, "stream"),
    ("stream-options-no-stream", "POST", CHAT, {"messages": MSG, "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("tools", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools[0].function"),
    ("tool-choice-unknown", "POST", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                          "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "tool_choice"),
    ("unknown-field", "POST", CHAT, {"messages": MSG, "frobnicate": 1}, 400, "frobnicate"),
    ("refused-field", "POST", CHAT, {"messages": MSG, "audio": {"voice": "x"}}, 400, "audio"),
    ("bad-json-schema", "POST", CHAT, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 400, "response_format"),
    ("bad-regex", "POST", COMP, {"prompt": "hi", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs"),
    ("two-constraints", "POST", COMP, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("min-tokens-over-max", "POST", COMP, {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("best-of-below-n", "POST", COMP, {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("logit-bias-oov", "POST", COMP, {"prompt": "hi", "logit_bias": {"49152": 1}}, 400, "logit_bias"),
    ("stop-token-oov", "POST", COMP, {"prompt": "hi", "stop_token_ids": [49152]}, 400, "stop_token_ids"),
    ("prompt-oov", "POST", COMP, {"prompt": [1, 49152]}, 400, "prompt"),
    ("prompt-negative-id", "POST", COMP, {"prompt": [-1]}, 400, "prompt"),
    ("prompt-empty", "POST", COMP, {"prompt": ""}, 400, "prompt"),
    ("prompt-empty-list", "POST", COMP, {"prompt": []}, 400, "prompt"),
    ("prompt-mixed-batch", "POST", COMP, {"prompt": [[1, 2], "b"]}, 400, "prompt"),  # a batch is of one kind
    ("prompt-fills-context", "POST", COMP, {"prompt": [5] * 2048}, 400, "prompt"),
    ("completion-logprobs", "POST", COMP, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("wrong-method", "GET", CHAT, None, 405, None),
    ("unknown-path", "POST", "/v1/embeddings", {"input": "x"}, 404, None),
    ("unknown-model-get", "GET", "/v1/models/gpt-9", None, 404, "model"),
    ("oversized-body", "POST", CHAT, b" " * ((1 << 20) + 1), 413, None),
    ("oversized-chunked-body", "POST", CHAT, iter([b" " * 65536] * 17), 413, None),
    ("max-tokens-float", "POST", CHAT, {"messages": MSG, "max_tokens": 1.5}, 400, "max_tokens"),
    ("max-tokens-bool", "POST", CHAT, {"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    ("messages-not-list", "POST", CHAT, {"messages": "hi"}, 400, "messages"),
    ("message-no-role", "POST", CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ("message-not-object", "POST", CHAT, {"messages": ["hi"]}, 400, "messages[0]"),
    ("seed-str", "POST", CHAT, {"messages": MSG, "seed": "x"}, 400, "seed"),
    ("seed-over-u64", "POST", CHAT, {"messages": MSG, "seed": 2**70}, 400, "seed"),
    ("temperature-inf", "POST", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
     400, "temperature"),
    ("top-p-null", "POST", CHAT, {"messages": MSG, "top_p": None}, 400, "top_p"),
    ("top-k-float", "POST", CHAT, {"messages": MSG, "top_k": 1.5}, 400, "top_k"),
    ("n-0", "POST", CHAT, {"messages": MSG, "n": 0}, 400, "n"),
    ("frequency-penalty-low", "POST", CHAT, {"messages": MSG, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("stop-not-string", "POST", CHAT, {"messages": MSG, "stop": 5}, 400, "stop"),
    ("stream-options-bad", "POST", CHAT, {"messages": MSG, "stream": True, "stream_options": {"include_usage": "y"}},
     400, "stream_options.include_usage"),
    ("logit-bias", "POST", CHAT, {"messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("logit-bias-range", "POST", CHAT, {"messages": MSG, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("model-not-string", "POST", CHAT, {"messages": MSG, "model": 5}, 400, "model"),
    ("empty-body", "POST", CHAT, b"", 400, None),
    ("prompt-float-ids", "POST", COMP, {"prompt": [1.5]}, 400, "prompt"),
    ("completion-suffix", "POST", COMP, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("wrong-method-put", "PUT", COMP, None, 405, None),
    ("keyed-missing-key", "POST", CHAT, {"messages": MSG}, 401, None),
    ("keyed-wrong-key", "GET", "/v1/models", None, 401, None),
]


def test_bad_inputs_exact_status_and_param(served):
    keyed = TestClient(build_openai_app(served.client, served.tok, model_name=MODEL, api_key=API_KEY))
    assert len(BAD_INPUTS) >= 60
    failures = []
    with httpx.Client(base_url=served.url, timeout=60) as http:
        for name, method, path, body, status, param in BAD_INPUTS:
            client = keyed if name.startswith("keyed") else http
            headers = {"Authorization": "Bearer wrong"} if name == "keyed-wrong-key" else {}
            if isinstance(body, dict):
                r = client.request(method, path, json=body, headers=headers)
            else:
                r = client.request(method, path, content=body, headers={"Content-Type": "application/json",
                                                                         **headers})
            err = r.json().get("error") if r.headers.get("content-type", "").startswith("application/json") else None
            if r.status_code != status or err is None or err.get("param") != param or not err.get("message"):
                failures.append(f"{name}: {r.status_code} {r.text[:200]}")
            elif "Traceback" in r.text or "File \"" in r.text:
                failures.append(f"{name}: leaks internals: {r.text[:200]}")
    assert not failures, "\n".join(failures)
    assert keyed.get("/health").status_code == 200  # the allowlisted route
    ok = keyed.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == MODEL
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    r = httpx.post(f"{served.url}/v1/chat/completions", json=chat_body(), timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == served.ref_text("chat")
    assert _wait_idle(served)


@pytest.mark.parametrize("path, body, param", [
    (COMP, r'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    (COMP, r'{"prompt": ["x\udfff"], "max_tokens": 2, "stream": true}', "prompt"),
    (COMP, r'{"prompt": "ok", "stop": ["fine", "\udc00"], "max_tokens": 2}', "stop"),
    (CHAT, r'{"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}', "messages[0].content"),
    (CHAT, r'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": '
           r'[{"type": "text", "text": "\ud83d"}]}], "max_tokens": 2, "stream": true}', "messages[1].content"),
])
def test_lone_surrogate_is_a_400_naming_the_field(served, path, body, param):
    """A lone UTF-16 surrogate escape (valid JSON, no character) is refused before the
    tokenizer sees it: an OpenAI-shaped 400 of our own naming the field, no tokenizer text."""
    r = httpx.post(f"{served.url}{path}", content=body.encode(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"].startswith(f"{param}: not valid Unicode: lone UTF-16 surrogate U+D"), err
    assert "TextEncodeInput" not in r.text and "Traceback" not in r.text and "template" not in r.text
    # a surrogate *pair* is one valid character: served normally
    ok = body.replace(r"\ud800", r"\ud83d\ude00").replace(r"\udfff", r"\ud83d\ude00").replace(
        r"\udc00", r"\ud83d\ude00").replace(r'"\ud83d"', r'"\ud83d\ude00"')
    r = httpx.post(f"{served.url}{path}", content=ok.encode(), timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 200, (ok, r.text)


def test_openapi_schema_lists_routes(served):
    schema = httpx.get(f"{served.url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])


# ---- engine failures (fake engine, in-process) ----------------------------------------------

class _FakeEngine:
    model_name, max_model_len, vocab_size = "fake", 64, 100

    def __init__(self, outputs: list[RequestOutput] | Exception, health: Any = None) -> None:
        self.outputs, self._health, self.closed = outputs, health, 0

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        try:
            if isinstance(self.outputs, Exception):
                raise self.outputs
            for out in self.outputs:
                yield out
        finally:
            self.closed += 1

    async def check_request(self, prompt_token_ids, params) -> None:
        pass

    async def health(self) -> dict[str, Any]:
        if isinstance(self._health, Exception):
            raise self._health
        return self._health or {"status": "ok"}


class _IdTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _fake_app(engine: _FakeEngine) -> TestClient:
    return TestClient(build_openai_app(engine, _IdTokenizer(), model_name="fake"))


def test_engine_errors_become_503_or_sse_error_events():
    stats = RequestStats()
    failing = [RequestOutput("r", [7], False, stats=stats), RequestOutput("r", [], True, "error", error="boom")]
    engine = _FakeEngine(failing)
    r = _fake_app(engine).post(COMP, json={"prompt": [1, 2]})
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert r.json()["error"]["type"] == "service_unavailable_error" and "boom" not in r.text
    r = _fake_app(engine).post(COMP, json={"prompt": [1, 2], "stream": True})
    events = sse_lines(r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert json.loads(events[0])["choices"][0]["text"] == "<7>"
    assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
    r = _fake_app(_FakeEngine(EngineUnavailable("stage 1 is recovering", retry_after=2.5))).post(
        COMP, json={"prompt": [1], "stream": True})
    assert r.status_code == 503 and r.headers["Retry-After"] == "3" and "recovering" in r.text
    assert engine.closed == 2


def test_health_reports_engine_state_and_unexpected_errors_are_opaque_500s():
    assert _fake_app(_FakeEngine([], {"status": "ok"})).get("/health").json() == {"status": "ok"}
    r = _fake_app(_FakeEngine([], {"status": "recovering"})).get("/health")
    assert r.status_code == 503 and r.json()["status"] == "recovering"
    assert _fake_app(_FakeEngine([], ConnectionError("engine gone"))).get("/health").status_code == 503

    class Broken(_IdTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            raise RuntimeError("secret internal detail")

    engine = _FakeEngine([RequestOutput("r", [7], True, "length")])
    r = TestClient(build_openai_app(engine, Broken(), model_name="fake")).post(COMP, json={"prompt": [1]})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text and engine.closed == 1


def test_disconnect_does_not_disturb_concurrent_requests(served):
    async def leave_early(client: httpx.AsyncClient) -> None:
        async with client.stream("POST", CHAT, json=chat_body(max_tokens=2000, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                    return  # first text delta: hang up mid-generation

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=served.url, timeout=60) as client:
            stayers = [asyncio.ensure_future(client.post(CHAT, json=chat_body(max_tokens=60))) for _ in range(2)]
            await asyncio.gather(*(leave_early(client) for _ in range(3)))
            return await asyncio.gather(*stayers)

    for r in asyncio.run(main()):
        assert r.status_code == 200, r.text
    assert _wait_idle(served)
