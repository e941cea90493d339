"""A request whose own rules mask every token of a row ends alone, with a refusal, while the
request beside it in the same step goes on (fakes: ``TableTarget``; the grammar case with an
llguidance tokenizer of its vocabulary). Before, a greedy one took token 0 against its own
``min_tokens``, and a sampled one failed the whole step, every request in it with an error."""

from __future__ import annotations

import asyncio

import pytest

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.request import REFUSED, SamplingParams, StructuredOutput

from support.factories import engine_config
from support.fakes import VOCAB, AdversarialDrafter, TableTarget, drain
from support.grammar_tokenizer import EOS, grammar_tokenizer

EVERY_TOKEN = tuple(range(VOCAB))
PLAIN, MASKED = [3, 1, 4, 1, 5], [9, 2, 6]


def make(target, *, drafters=(), **config) -> EngineCore:
    return EngineCore(engine_config(**config), target, list(drafters), vocab_size=VOCAB, eos_token_ids=(EOS,),
                      tokenizer=grammar_tokenizer(), seed=0)


@pytest.mark.parametrize("masked", [
    SamplingParams(max_tokens=8, stop_token_ids=EVERY_TOKEN, min_tokens=3),
    SamplingParams(max_tokens=8, stop_token_ids=EVERY_TOKEN, min_tokens=3, temperature=0.8, seed=1),
    SamplingParams(max_tokens=8, logit_bias=tuple((t, -float("inf")) for t in range(VOCAB)), temperature=0.7),
], ids=["greedy-min-tokens", "sampled-min-tokens", "bias"])
@pytest.mark.parametrize("speculating", [False, True])
def test_a_request_with_every_token_masked_ends_alone_in_a_shared_step(masked, speculating):
    target = TableTarget()
    drafters = [AdversarialDrafter("adv", target, confidence=0.9)] if speculating else []
    core = make(target, drafters=drafters, num_speculative_tokens=3 if speculating else 0)
    core.add_request("plain", PLAIN, SamplingParams(max_tokens=12))
    core.add_request("masked", MASKED, masked)
    steps = []
    step, schedule = core.step, core.scheduler.schedule
    batches = []

    def scheduling(lane):
        batch = schedule(lane)
        batches.append(sorted(r.request_id for r in batch.requests))
        return batch

    async def watching(lane=None):
        outputs = await step(lane)
        steps.append((batches[-1], {o.request_id: o for o in outputs}))
        return outputs

    core.scheduler.schedule, core.step = scheduling, watching
    out, finals = asyncio.run(drain(core))
    ended = next(i for i, (_, outputs) in enumerate(steps) if "masked" in outputs)
    assert steps[ended][0] == ["masked", "plain"]  # both were in the step that ended it
    assert finals["masked"].finish_reason == REFUSED and not out.get("masked")
    assert "mask every token" in finals["masked"].error
    assert out["plain"] == target.greedy(PLAIN, 12) and finals["plain"].finish_reason == "length"
    assert finals["plain"].error is None
    assert core.num_tracked_requests == 0


def test_a_grammar_whose_tokens_are_all_stop_tokens_before_min_tokens_ends_that_request_alone():
    """The grammar allows "a" and "b" only, which are stop tokens held back by min_tokens."""
    target = TableTarget()
    core = make(target)
    core.add_request("plain", PLAIN, SamplingParams(max_tokens=10))
    core.add_request("grammar", MASKED, SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(10, 11),
                                                       structured=StructuredOutput("regex", "[ab]+")))
    out, finals = asyncio.run(drain(core))
    assert finals["grammar"].finish_reason == REFUSED and "after 0 output tokens" in finals["grammar"].error
    assert not out.get("grammar")
    assert out["plain"] == target.greedy(PLAIN, 10) and finals["plain"].finish_reason == "length"


@pytest.mark.parametrize("regex, stops, want, reason", [
    ("aabc", (12,), [10, 10, 11], REFUSED),  # only "c" may follow "aab": a stop token min_tokens holds back
    ("aabc", (), [10, 10, 11, 12], "stop"),  # the grammar ends at "c": the masked row after it is never used
])
def test_speculation_ends_a_request_with_a_masked_row_where_plain_decoding_does(regex, stops, want, reason):
    """The grammar forces its tokens into the draft tree, so the walk reaches the masked row in
    one step where plain decoding reaches it a token at a time: the same text, the same end."""
    ends = {}
    for speculating in (False, True):
        target = TableTarget()
        drafters = [AdversarialDrafter("adv", target, confidence=0.9)] if speculating else []
        core = make(target, drafters=drafters, num_speculative_tokens=4 if speculating else 0)
        core.add_request("plain", PLAIN, SamplingParams(max_tokens=10))
        core.add_request("g", MASKED, SamplingParams(max_tokens=8, min_tokens=6, stop_token_ids=stops,
                                                     structured=StructuredOutput("regex", regex)))
        out, finals = asyncio.run(drain(core))
        ends[speculating] = (out["g"], finals["g"].finish_reason, finals["g"].error)
        assert out["plain"] == target.greedy(PLAIN, 10)
    assert ends[False] == ends[True] and ends[True][:2] == (want, reason), ends
