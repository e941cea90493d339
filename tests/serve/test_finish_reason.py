"""``finish_reason`` and ``usage`` at the max_tokens boundary, with the real SmolLM2 over HTTP:
a request that reaches max_tokens reports ``length``, even when the next token would have been
end-of-text.

The semantics (OpenAI: ``length`` when max_tokens cut the output, ``stop`` when the model ended
it; vLLM the same since vllm-project/vllm#27555, which moved its V1 engine's EOS check before
the length check, as V0 had it): the end-of-text token is a generated token, counted in
``completion_tokens`` and in max_tokens (not shown in the text). For a prompt whose greedy
answer is n tokens, the n-th being EOS:

* max_tokens = n - 1: the answer is cut before its EOS, ``length``, n - 1 tokens (the text
  may look complete, but the model had not ended it);
* max_tokens = n: the EOS is the n-th and last token, ``stop``, n tokens (the model ended on
  its own, within the budget);
* max_tokens > n: ``stop``, n tokens.

``engine/request.py: Request.append`` checks a token for EOS/stop before it checks the
length, token by token, so a speculative step that verifies several tokens at once (EOS
inside the run) ends exactly as a one-token step would. Checked with and without
speculation, chat and completions, streaming and not.
"""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from cosine_ray.engine.client import LocalEngineClient
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from cosine_ray.serve.openai_app import build_openai_app

pytestmark = pytest.mark.real_model

QUESTION = "What is the capital of France?"
"""SmolLM2-135M-Instruct answers "The capital of France is Paris." and ends: 8 tokens, EOS last."""


@pytest.mark.parametrize("drafters", ["default", "none"])
def test_finish_reason_at_the_max_tokens_boundary(real_checkpoint, drafters):
    engine = LocalEngine(EngineConfig(drafters=parse_drafters(drafters)), checkpoint=real_checkpoint)
    prompt = engine.encode(QUESTION)
    (ref,) = engine.generate([prompt], SamplingParams(max_tokens=64))  # greedy, to the model's own end
    ids, eos = ref.new_token_ids, set(engine.eos_token_ids())
    assert ref.finish_reason == "stop" and ids[-1] in eos and not eos & set(ids[:-1]), ref
    n = len(ids)
    full_text = engine.decode(ids)
    assert full_text == engine.decode(ids[:-1])  # the EOS shows no text

    app = build_openai_app(LocalEngineClient(engine), engine.tokenizer, model_name="m")
    seen = []
    with TestClient(app) as client:
        for max_tokens, reason, tokens in ((n - 1, "length", n - 1), (n, "stop", n), (n + 1, "stop", n)):
            text = engine.decode(ids[:tokens])
            chat = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens, "temperature": 0}
            data = client.post("/v1/chat/completions", json=chat).json()
            got = (data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"],
                   data["choices"][0]["message"]["content"])
            seen.append(("chat", max_tokens, got))
            assert got == (reason, tokens, text), (max_tokens, data)

            data = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0}).json()
            got = (data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"], data["choices"][0]["text"])
            assert got == (reason, tokens, text), (max_tokens, data)

            r = client.post("/v1/chat/completions", json={**chat, "stream": True,
                                                          "stream_options": {"include_usage": True}})
            events = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            reasons = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
            usage = [e["usage"] for e in events if e.get("usage")]
            streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            assert (reasons, usage[-1]["completion_tokens"], streamed) == ([reason], tokens, text), (max_tokens, r.text)
    assert [s[2][0] for s in seen] == ["length", "stop", "stop"], seen


@pytest.mark.parametrize("max_tokens, run, reason, kept", [
    (4, [10, 11, 12, 2], "stop", [10, 11, 12, 2]),        # EOS is the max_tokens-th token: the model ended
    (3, [10, 11, 12, 2], "length", [10, 11, 12]),         # cut one token before the EOS
    (8, [10, 2, 11, 12], "stop", [10, 2]),                # EOS inside a verified run: the rest is dropped
    (2, [10, 2, 11], "stop", [10, 2]),
    (1, [10, 2], "length", [10]),
])
def test_a_verified_run_ends_like_single_tokens(max_tokens, run, reason, kept):
    """One speculative step appends several verified tokens: EOS is checked before the length,
    token by token, so the run ends where single-token decoding would."""
    from cosine_ray.engine.request import Request

    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens), eos_token_ids=(2,))
    assert request.append(run) == kept and request.output_token_ids == kept
    assert request.finish_reason == reason
