"""The engine refuses what it cannot serve with a typed ``RequestRefused``: the field at fault
and the reason, which the ingress maps to its own stable 400 (never the engine's words), and
which survive pickling (they cross Ray from the engine replica)."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.request import RequestRefused, SamplingParams, StructuredOutput

from support.factories import engine_config
from support.fakes import VOCAB, TableTarget
from support.grammar_tokenizer import EOS, grammar_tokenizer


def make(*, tokenizer=True, **config) -> EngineCore:
    return EngineCore(engine_config(num_speculative_tokens=4, **config), TableTarget(), [], vocab_size=VOCAB,
                      eos_token_ids=(EOS,), tokenizer=grammar_tokenizer() if tokenizer else None,
                      kv_num_blocks=8, seed=0)


@pytest.mark.parametrize("prompt, params, param, reason", [
    ([1, VOCAB], SamplingParams(), "prompt", "invalid"),
    ([1, 2], SamplingParams(max_tokens=200), "max_tokens", "kv_cache"),
    ([1, 2], SamplingParams(logit_bias=((VOCAB, 1.0),)), "logit_bias", "invalid"),
    ([1, 2], SamplingParams(stop_token_ids=(VOCAB + 3,)), "stop_token_ids", "invalid"),
    ([1, 2], SamplingParams(structured=StructuredOutput("regex", "a(b")), "structured", "invalid"),
    ([1, 2], SamplingParams(structured=StructuredOutput("lark", "start: nothing_here")), "structured", "invalid"),
])
def test_every_check_refuses_with_the_field_and_the_reason(prompt, params, param, reason):
    core = make()
    for check in (lambda: core.check_request(prompt, params),
                  lambda: asyncio.run(core.prepare_request(prompt, params))):
        with pytest.raises(RequestRefused) as refused:
            check()
        assert (refused.value.param, refused.value.reason) == (param, reason), refused.value
        copy = pickle.loads(pickle.dumps(refused.value))
        assert (type(copy), str(copy), copy.param, copy.reason) == (RequestRefused, str(refused.value), param, reason)


def test_the_context_and_a_grammar_without_a_tokenizer_are_refused_by_name():
    core = make(tokenizer=False, max_model_len=32)
    with pytest.raises(RequestRefused) as refused:
        core.check_request(list(range(20)), SamplingParams(max_tokens=20))
    assert (refused.value.param, refused.value.reason) == ("max_tokens", "context")
    with pytest.raises(RequestRefused) as refused:
        asyncio.run(core.prepare_request([1, 2], SamplingParams(max_tokens=4,
                                                                  structured=StructuredOutput("regex", "a"))))
    assert (refused.value.param, refused.value.reason) == ("structured", "unsupported")
    with pytest.raises(RequestRefused) as refused:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert refused.value.param == "min_tokens"
