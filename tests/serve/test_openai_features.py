"""The OpenAI API as clients use it, with the official ``openai`` client over HTTP: log-probabilities,
``n``/``best_of``, structured outputs, tools, the sampling fields, every field honoured or refused,
and ``/health`` while the engine starts.

Two servers on one tiny random model with SmolLM2's tokenizer: one with drafters (n-gram and the
target drafting for itself, every draft verified: deep trees) and one without. Greedy text is the
same on both for every feature; log-probabilities equal HF transformers' ``log_softmax``.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import torch
from starlette.testclient import TestClient
from support.penalties import penalized_greedy
from support.tiny_checkpoint import write_tiny_checkpoint
from support.uvicorn_thread import serve_engines

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.serve.text import tools
from cosine_ray.serve.fields import FIELDS, fields_table
from cosine_ray.serve.openai_app import build_openai_app
from cosine_ray.serve.schemas import ChatCompletionRequest

pytestmark = pytest.mark.real_model

MODEL = "tiny"
MSG = [{"role": "user", "content": "Tell me about the sea."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "kind": {"enum": ["a", "b"]},
                                           "n": {"type": "array", "items": {"type": "integer", "maximum": 9,
                                                                            "minimum": 0}, "maxItems": 2}},
          "required": ["city", "kind", "n"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def ck(tmp_path_factory, real_checkpoint):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("features") / "tiny", tokenizer_from=real_checkpoint)


@pytest.fixture(scope="module")
def servers(ck):
    engines = {name: LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters(drafters)).replace(
        min_tree_confidence=0.0, adaptive=False), checkpoint=ck) for name, drafters in (("spec", "ngram,self"),
                                                                                        ("plain", "none"))}
    with serve_engines(engines, MODEL) as served:
        yield served


def clients(servers) -> dict[str, openai.OpenAI]:
    return {name: openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
            for name, (url, _) in servers.items()}


def both(servers, route: str, **kw):
    """The same request to the server with drafters and the one without."""
    out = {}
    for name, client in clients(servers).items():
        create = client.chat.completions.create if route == "chat" else client.completions.create
        out[name] = create(model=MODEL, **kw)
    return out["spec"], out["plain"]


def chat_text(resp) -> list:
    return [c.message.content for c in resp.choices]


def hf_logprobs(ck, ids: list[int]) -> torch.Tensor:
    hf = ck.load_hf_model()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_chat_logprobs_equal_hf_with_and_without_drafters(servers, ck):
    spec, plain = both(servers, "chat", messages=MSG, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    assert chat_text(spec) == chat_text(plain)
    tok = servers["plain"][1].tokenizer
    prompt = tok.apply_chat_template(MSG, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    content = spec.choices[0].logprobs.content
    ids = [tok.convert_tokens_to_ids(tok.tokenize(c.token))[0] for c in content]
    assert tok.decode(ids) == spec.choices[0].message.content
    lp = hf_logprobs(ck, prompt + ids)
    for j, (a, b) in enumerate(zip(content, plain.choices[0].logprobs.content)):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
        assert len(a.top_logprobs) == 3 and a.top_logprobs[0].logprob >= a.top_logprobs[-1].logprob
    want = [lp[len(prompt) - 1 + j].max().item() for j in range(len(ids))]  # greedy: the chosen token is the top one
    assert max(abs(c.logprob - w) for c, w in zip(content, want)) < 1e-4
    stream = clients(servers)["spec"].chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3, stream=True)
    streamed = [t for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for t in chunk.choices[0].logprobs.content]
    # the streamed request finds the prompt in the prefix cache and computes only its last tokens:
    # the same tokens, log-probabilities within fp32 rounding (not to 4 decimals, which a 1e-6
    # difference can flip at a rounding boundary)
    assert [t.token for t in streamed] == [t.token for t in content]
    assert max(abs(s.logprob - c.logprob) for s, c in zip(streamed, content)) < 1e-4


def test_completion_echo_with_prompt_logprobs(servers, ck):
    prompt = "The quick brown fox jumps"
    spec, plain = both(servers, "completions", prompt=prompt, max_tokens=8, temperature=0, logprobs=2, echo=True)
    assert spec.choices[0].text == plain.choices[0].text and spec.choices[0].text.startswith(prompt)
    lps = spec.choices[0].logprobs
    tok = servers["plain"][1].tokenizer
    ids = tok(prompt)["input_ids"]
    assert lps.token_logprobs[0] is None and len(lps.tokens) == len(ids) + 8
    lp = hf_logprobs(ck, ids)
    want = [lp[j - 1, ids[j]].item() for j in range(1, len(ids))]
    assert max(abs(a - w) for a, w in zip(lps.token_logprobs[1:len(ids)], want)) < 1e-4
    assert lps.text_offset[0] == 0 and "".join(lps.tokens[:len(ids)]) == prompt


def test_n_choices_share_the_prompt_and_keep_their_own_seeds(servers):
    client = clients(servers)["spec"]
    long_msg = [{"role": "user", "content": "A long question about the history of ships and the sea. " * 3}]
    first = client.chat.completions.create(model=MODEL, messages=long_msg, max_tokens=10, temperature=1.0,
                                           seed=7, n=3)
    again = client.chat.completions.create(model=MODEL, messages=long_msg, max_tokens=10, temperature=1.0,
                                           seed=7, n=3)
    assert [c.index for c in first.choices] == [0, 1, 2] and chat_text(first) == chat_text(again)
    assert len(set(chat_text(first))) > 1  # each choice its own key
    single = [client.chat.completions.create(model=MODEL, messages=long_msg, max_tokens=10, temperature=1.0,
                                             seed=7 + i).choices[0].message.content for i in range(3)]
    assert single == chat_text(first)  # choice i is the request with seed + i
    plain = clients(servers)["plain"].chat.completions.create(model=MODEL, messages=long_msg, max_tokens=10,
                                                              temperature=1.0, seed=7, n=3)
    assert chat_text(plain) == chat_text(first)
    assert first.usage.prompt_tokens_details.cached_tokens > 0  # the choices after the first took its blocks
    stream = client.chat.completions.create(model=MODEL, messages=long_msg, max_tokens=10, temperature=1.0,
                                            seed=7, n=3, stream=True)
    texts = {0: "", 1: "", 2: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[i] for i in range(3)] == chat_text(first)


def test_best_of_returns_the_most_likely_choice(servers):
    client = clients(servers)["spec"]
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=3)
    all3 = client.completions.create(n=3, logprobs=0, **kw)
    best = client.completions.create(n=1, best_of=3, **kw)
    sums = [sum(c.logprobs.token_logprobs) for c in all3.choices]
    assert len(best.choices) == 1 and best.choices[0].text == all3.choices[sums.index(max(sums))].text
    assert best.choices[0].logprobs is None


PENALTY_PROMPT = "The sea, the sea, the sea. Ships on the sea, and the ships"


@pytest.mark.parametrize("penalty", [{"presence_penalty": 1.5}, {"frequency_penalty": 1.0},
                                     {"repetition_penalty": 1.5}], ids=["presence", "frequency", "repetition"])
def test_penalties_equal_an_independent_reference(servers, ck, penalty):
    """Each penalty over HTTP, with drafters and without, equals greedy decoding over HF's logits
    with the penalty computed apart from the engine (``support/penalties.py``), and changes the
    text: a penalty the server dropped, or one both engines ignored, fails here. The random model
    never repeats itself, so a bias on " sea" (a prompt token) makes it repeat: " sea sea sea
    ..." without a penalty."""
    tok = servers["plain"][1].tokenizer
    ids, sea = tok(PENALTY_PROMPT)["input_ids"], tok.convert_tokens_to_ids("\u0120sea")
    kw = dict(prompt=ids, max_tokens=12, temperature=0, logit_bias={str(sea): 6.0})
    spec, plain = both(servers, "completions", **kw, **{k: v for k, v in penalty.items() if k != "repetition_penalty"},
                       extra_body={"ignore_eos": True, **{k: v for k, v in penalty.items() if k == "repetition_penalty"}})
    want = penalized_greedy(ck.load_hf_model(), ids, 12, presence=penalty.get("presence_penalty", 0.0),
                            frequency=penalty.get("frequency_penalty", 0.0),
                            repetition=penalty.get("repetition_penalty", 1.0), logit_bias={sea: 6.0})
    assert spec.choices[0].text == plain.choices[0].text == tok.decode(want)
    unpenalized = both(servers, "completions", **kw, extra_body={"ignore_eos": True})[1].choices[0].text
    assert unpenalized.startswith(" sea sea") and unpenalized != tok.decode(want)  # premise: the penalty tells


def test_sampling_fields_are_honoured_and_lossless(servers):
    base = dict(messages=MSG, max_tokens=12, temperature=0)
    spec, plain = both(servers, "chat", **base, logit_bias={"28": 100})
    assert chat_text(spec) == chat_text(plain)
    assert chat_text(spec) != chat_text(both(servers, "chat", **base)[1])  # the bias changed the text
    eos_first = {"logit_bias": {"2": 100}}  # EOS (id 2) first, unless held back
    spec, plain = both(servers, "completions", prompt="Hello", max_tokens=9, temperature=0, **eos_first)
    assert spec.usage.completion_tokens == 1 and spec.choices[0].finish_reason == "stop"
    for extra, n in (({"ignore_eos": True}, 9), ({"min_tokens": 4}, 5)):
        spec, plain = both(servers, "completions", prompt="Hello", max_tokens=9, temperature=0, **eos_first,
                           extra_body=extra)
        assert spec.usage.completion_tokens == plain.usage.completion_tokens == n, extra
        assert spec.choices[0].text == plain.choices[0].text
    stopped = clients(servers)["spec"].completions.create(model=MODEL, prompt="Hello", max_tokens=9, temperature=0,
                                                         extra_body={"stop_token_ids": [28]},
                                                         logit_bias={"28": 100})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"


def test_developer_role_and_accepted_fields_change_nothing(servers):
    client = clients(servers)["spec"]
    system = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                            messages=[{"role": "system", "content": "Be brief."}, *MSG])
    developer = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, user="u1",
                                               metadata={"a": "b"}, store=False, service_tier="auto",
                                               messages=[{"role": "developer", "content": "Be brief."}, *MSG])
    assert chat_text(system) == chat_text(developer)


def test_structured_outputs_parse_validate_and_are_lossless(servers):
    rf = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}
    for temperature, seed in ((0, None), (0.8, 5)):
        spec, plain = both(servers, "chat", messages=MSG, max_tokens=60, temperature=temperature, seed=seed,
                           response_format=rf)
        assert chat_text(spec) == chat_text(plain)
        jsonschema.validate(json.loads(spec.choices[0].message.content), SCHEMA)
    # json_object: the random model writes an endless key, so its answer is cut; what is there is
    # the start of an object all the same.
    cut = clients(servers)["spec"].chat.completions.create(model=MODEL, messages=MSG, max_tokens=20, temperature=0,
                                                           response_format={"type": "json_object"})
    assert cut.choices[0].message.content.startswith("{")
    # With quotes and braces made the model's first choice wherever the grammar allows them, the
    # object closes within a few tokens, far below max_tokens: the whole answer must parse as an
    # object. (Without the grammar the same bias writes '""""...', which is no object.)
    tok = servers["plain"][1].tokenizer
    close = {str(tok.convert_tokens_to_ids('"')): 100, str(tok.convert_tokens_to_ids("}")): 90}
    spec, plain = both(servers, "chat", messages=MSG, max_tokens=40, temperature=0, logit_bias=close,
                       response_format={"type": "json_object"})
    assert chat_text(spec) == chat_text(plain)
    assert spec.choices[0].finish_reason == "stop" and spec.usage.completion_tokens < 40
    assert isinstance(json.loads(spec.choices[0].message.content), dict)
    for so, check in (({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                      ({"regex": "[a-c]{4}"}, lambda t: len(t) == 4 and set(t) <= set("abc")),
                      ({"grammar": 'start: "x" ("y" | "z")'}, lambda t: t in ("xy", "xz"))):
        spec, plain = both(servers, "completions", prompt="Answer:", max_tokens=10, temperature=0,
                           extra_body={"structured_outputs": so})
        assert spec.choices[0].text == plain.choices[0].text and check(spec.choices[0].text), so


def test_tools_named_required_none_and_streamed(servers):
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec, plain = both(servers, "chat", messages=MSG, max_tokens=60, temperature=0, tools=[WEATHER, TIME],
                       tool_choice=named)
    call = spec.choices[0].message.tool_calls[0]
    assert spec.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert call.function.arguments == plain.choices[0].message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    stream = clients(servers)["spec"].chat.completions.create(model=MODEL, messages=MSG, max_tokens=60,
                                                              temperature=0, tools=[WEATHER, TIME],
                                                              tool_choice=named, stream=True)
    args = "".join(tc.function.arguments or "" for chunk in stream if chunk.choices
                   for tc in (chunk.choices[0].delta.tool_calls or []))
    assert args == call.function.arguments
    # "required" with one call: the schemas bound the answer to under 200 characters (a list of
    # one call, get_weather's city at most 10 characters, each at most a 6-character escape), so
    # 200 tokens cannot cut it: it must end as a call.
    required = clients(servers)["spec"].chat.completions.create(model=MODEL, messages=MSG, max_tokens=200,
                                                                temperature=0, tools=[WEATHER, TIME],
                                                                tool_choice="required", parallel_tool_calls=False)
    calls = required.choices[0].message.tool_calls
    assert required.choices[0].finish_reason == "tool_calls" and len(calls) == 1, required.choices[0]
    schema = {"get_weather": SCHEMA, "get_time": TIME["function"]["parameters"]}[calls[0].function.name]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)
    none = clients(servers)["spec"].chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0,
                                                            tools=[WEATHER], tool_choice="none")
    assert chat_text(none) == chat_text(both(servers, "chat", messages=MSG, max_tokens=8, temperature=0)[0])
    # a conversation with an earlier call and its result renders through the template
    history = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    later = clients(servers)["spec"].chat.completions.create(model=MODEL, messages=history, max_tokens=4,
                                                             temperature=0, tools=[WEATHER])
    assert later.choices[0].message.content is not None or later.choices[0].message.tool_calls


def test_auto_tool_calls_are_parsed_from_the_models_text():
    req = ChatCompletionRequest(messages=MSG, tools=[WEATHER, TIME])
    text = 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    content, calls = tools.parse(req, text)
    assert content == "Sure." and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {"zone": "utc"}
    assert tools.parse(req, "no calls here") == ("no calls here", None)
    assert tools.parse(req, '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] is None
    assert tools.held_back("hello <tool_") == len("<tool_") and tools.held_back("hello") == 0


def test_continuous_usage_stats_on_every_chunk(servers):
    url = servers["spec"][0]
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert all("usage" in e for e in events)
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 5


def test_every_openai_field_is_in_the_field_table():
    import typing

    from openai.types import completion_create_params as completions
    from openai.types.chat import completion_create_params as chat

    ours = {(f.name, route) for f in FIELDS for route in ("chat", "completions") if f.applies_to(route)}
    for route, params in (("chat", chat.CompletionCreateParamsBase), ("completions", completions.CompletionCreateParamsBase)):
        missing = [name for name in typing.get_type_hints(params) if (name, route) not in ours]
        assert not missing, f"{route}: OpenAI fields not in serve/fields.py: {missing}"
    for model, route in ((ChatCompletionRequest, "chat"),):
        typed = [name for name in model.model_fields if (name, route) not in ours]
        assert not typed, typed
    assert "| `logprobs` |" in fields_table()


class SlowStartEngine:
    """An engine client whose ``health`` hangs until ``ready`` is set (an engine loading)."""

    model_name, max_model_len, vocab_size = MODEL, 64, 10

    def __init__(self) -> None:
        self.ready = False

    async def health(self):
        while not self.ready:
            await asyncio.sleep(0.05)
        return {"status": "ok"}

    async def metrics_snapshot(self, http=None):
        from cosine_ray.metrics.registry import MetricsRegistry
        registry = MetricsRegistry()
        if http is not None:
            registry.add_http_totals(*http)
        return registry.snapshot()


def test_health_answers_at_once_while_the_engine_starts():
    engine = SlowStartEngine()
    app = build_openai_app(engine, tokenizer=None, model_name=MODEL)
    with TestClient(app) as client:
        starting = client.get("/health")
        assert starting.status_code == 503 and starting.json()["status"] == "starting"
        assert starting.headers["Retry-After"] == "1"
        engine.ready = True
        for _ in range(50):
            if client.get("/health").status_code == 200:
                break
        assert client.get("/health").json() == {"status": "ok"}
        metrics = client.get("/metrics").text
    lines = [line for line in metrics.splitlines() if "/health" in line and not line.startswith("#")]
    assert any('code="503"' in line or 'status="503"' in line for line in lines), lines
    assert any('"200"' in line for line in lines) and not any('"500"' in line for line in lines)


def test_health_probes_warn_only_once_the_engine_has_answered(monkeypatch, caplog):
    """Probes that time out while the engine starts are its start (debug), not failures; once it
    has answered, a failed probe is a warning that says why and /health reads ``unreachable``."""
    from cosine_ray.serve import generation

    monkeypatch.setattr(generation, "HEALTH_PROBE_TIMEOUT_S", 0.05)

    class Engine:
        answer: object = "hang"

        async def health(self):
            if self.answer == "hang":
                await asyncio.sleep(10)
            if isinstance(self.answer, Exception):
                raise self.answer
            return {"status": self.answer}

    async def run() -> list[str]:
        engine = Engine()
        readiness = generation.Readiness(engine)
        seen = []
        for answer in ("hang", "hang", "ok", "hang", ConnectionError("stage gone"), "ok"):
            engine.answer = answer
            await readiness._ask()
            seen.append(readiness.last)
        return seen

    with caplog.at_level("DEBUG", logger=generation.log.name):
        seen = asyncio.run(run())
    assert seen == ["starting", "starting", "ok", "unreachable", "unreachable", "ok"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == ["health check failed: no answer within 0.05 s",
                        "health check failed: ConnectionError: stage gone"]
    debug = [r.getMessage() for r in caplog.records if r.levelname == "DEBUG" and "still starting" in r.getMessage()]
    assert len(debug) == 2
