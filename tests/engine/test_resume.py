"""A request resumed from the tokens it already produced (``resume_token_ids``: what the ingress
sends a live engine replica when the one that served the request died) goes on with exactly the
tokens an uninterrupted run gives: greedy, seeded sampling (noise keyed by absolute position),
with penalties and min_tokens counted over the whole output, with speculation; nothing of the
resumed part is streamed again. Tiny random model."""

from __future__ import annotations

import asyncio
import json

import pytest

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import NO_TENANT, RequestRefused, SamplingParams, StructuredOutput
from support.tiny_checkpoint import write_tiny_checkpoint

PROMPT = [5, 17, 3, 99, 42, 8, 61, 7, 23]
MAX_TOKENS = 20
CASES = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=40, seed=11, ignore_eos=True),
    "penalties": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=3, frequency_penalty=1.5,
                                presence_penalty=0.5, repetition_penalty=1.3, ignore_eos=True),
    "min_tokens": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=5, min_tokens=MAX_TOKENS - 2),
}


@pytest.fixture(scope="module", params=["none", "ngram"])
def engine(request, tiny_checkpoint) -> LocalEngine:
    config = EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters(request.param)).replace(
        num_speculative_tokens=4, min_tree_confidence=0.0, adaptive=False)
    return LocalEngine(config, checkpoint=tiny_checkpoint)


def run(engine: LocalEngine, params: SamplingParams, resume: list[int] = ()) -> tuple[list[int], int]:
    """The new tokens of one request, and its last output's count of output tokens."""
    async def main():
        tokens, count = [], 0
        try:
            async for out in engine.loop.generate(PROMPT, params, None, NO_TENANT, resume):
                tokens += out.new_token_ids
                count = out.num_output_tokens
        finally:
            await engine.loop.shutdown()
        return tokens, count

    return asyncio.run(main())


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("cut", [1, 7, MAX_TOKENS - 1])
def test_a_resumed_request_ends_with_the_uninterrupted_text(engine, case, cut):
    whole, _ = run(engine, CASES[case])
    assert len(whole) == MAX_TOKENS
    rest, count = run(engine, CASES[case], whole[:cut])
    assert whole[:cut] + rest == whole  # nothing repeated, nothing lost, the same tokens
    assert count == MAX_TOKENS  # the resumed tokens count as its output (max_tokens, usage)


@pytest.mark.real_model
def test_a_resumed_request_replays_its_grammar(tmp_path_factory, real_checkpoint):
    ck = write_tiny_checkpoint(tmp_path_factory.mktemp("resume") / "tiny", tokenizer_from=real_checkpoint, seed=3)
    grammared = LocalEngine(EngineConfig(model=str(ck.path), drafters=parse_drafters("ngram")), checkpoint=ck)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=2, structured=StructuredOutput(
        "json_schema", json.dumps({"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                                                     "n": {"type": "integer"}},
                                   "required": ["kind", "n"], "additionalProperties": False})))
    whole, _ = run(grammared, params)
    assert len(whole) > 4
    for cut in (1, 4):
        rest, _ = run(grammared, params, whole[:cut])
        assert whole[:cut] + rest == whole
    forbidden = grammared.tokenizer("zzz", add_special_tokens=False)["input_ids"]
    with pytest.raises(RequestRefused, match="grammar"):  # tokens the grammar does not allow: refused
        run(grammared, params, forbidden)


def test_resume_tokens_that_leave_no_room_or_leave_the_vocabulary_are_refused(engine):
    with pytest.raises(RequestRefused):
        run(engine, SamplingParams(max_tokens=3), [1, 2, 3])
    with pytest.raises(RequestRefused):
        run(engine, SamplingParams(max_tokens=8), [10 ** 9])
