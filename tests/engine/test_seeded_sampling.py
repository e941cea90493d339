"""Seeded sampling through the engine: the same prompt, sampling parameters
and seed give the same tokens alone or in any batch, with any drafters (none included), and on
every run; other seeds and unseeded requests differ. The engine samples with
``algo.sampling.sample_keyed`` / ``algo.verify.verify_keyed`` (noise keyed by seed and position).

Tiny random model for everything but one real-model check (SmolLM2-135M, ``real_model``).
"""

from __future__ import annotations

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.drafters.lookup.datastore import Datastore
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import SamplingParams

MAX_TOKENS = 24
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=123)
# the other requests of a batch: greedy, another seed with filters, unseeded
OTHERS = [SamplingParams(max_tokens=MAX_TOKENS),
          SamplingParams(max_tokens=MAX_TOKENS - 4, temperature=1.0, top_k=20, top_p=0.9, seed=7),
          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8)]
SPECULATE = dict(num_speculative_tokens=4, min_tree_confidence=0.0, adaptive=False)
"""A fixed γ with no confidence cut: every step verifies a tree (the tiny model is unsure)."""


def make_engine(ckpt, drafters: str, **step) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters)).replace(
            **step), checkpoint=ckpt)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (11, 6, 17, 9)]


@pytest.fixture(scope="module")
def plain_engine(tiny_checkpoint) -> LocalEngine:
    return make_engine(tiny_checkpoint, "none")


@pytest.fixture(scope="module")
def reference(plain_engine, prompts) -> list[int]:
    """The seeded request alone, without speculation."""
    out = plain_engine.generate([prompts[0]], SEEDED)[0]
    assert len(out.new_token_ids) == MAX_TOKENS and out.finish_reason == "length"
    return out.new_token_ids


@pytest.fixture(scope="module")
def other_seeded_reference(plain_engine, prompts) -> list[int]:
    """OTHERS[1] (seed 7, top-k/top-p) alone, without speculation."""
    return plain_engine.generate([prompts[2]], OTHERS[1])[0].new_token_ids


@pytest.fixture(scope="module")
def oracle_datastore(tmp_path_factory, prompts, reference, other_seeded_reference):
    """prompt + seeded continuation as a retrieval datastore: drafts that are (almost) all right."""
    store = Datastore.from_sequences([prompts[0] + reference, prompts[2] + other_seeded_reference],
                                     domain="code", model_name="tiny", vocab_size=256)
    return store.save(tmp_path_factory.mktemp("seeded") / "oracle.parquet")


def test_alone_twice_and_duplicated_in_one_batch(plain_engine, prompts, reference):
    assert plain_engine.generate([prompts[0]], SEEDED)[0].new_token_ids == reference
    twins = plain_engine.generate([prompts[0], prompts[0]], SEEDED)
    assert [o.new_token_ids for o in twins] == [reference, reference]


@pytest.mark.parametrize("drafters", ["none", "ngram", "self", "oracle", "ngram,self+cosine"])
def test_same_tokens_in_a_batch_with_any_drafters(tiny_checkpoint, prompts, reference, other_seeded_reference,
                                                  oracle_datastore, drafters):
    """The seeded request among 3 others (greedy, another seed, unseeded), each drafter set."""
    if drafters == "oracle":
        engine = make_engine(tiny_checkpoint, f"retrieval:{oracle_datastore}", **SPECULATE)
    elif drafters == "ngram,self+cosine":  # full CoSine: routing, fusion, LP, adaptive γ
        engine = make_engine(tiny_checkpoint, "ngram,self", num_speculative_tokens=4)
    else:
        engine = make_engine(tiny_checkpoint, drafters, **SPECULATE)
    outs = engine.generate(prompts, [SEEDED, *OTHERS])
    assert outs[0].new_token_ids == reference
    assert outs[2].new_token_ids == other_seeded_reference
    stats = outs[0].stats
    if drafters == "none":
        assert stats.num_draft_tokens == 0
    elif drafters == "self":  # greedy drafts: trees were verified every step
        assert stats.num_draft_tokens > 0 and stats.num_verify_steps < MAX_TOKENS
    elif drafters == "oracle":  # the datastore holds this very continuation: nearly all accepted
        assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens > 0
        assert stats.num_verify_steps <= MAX_TOKENS // 2
    # the same request again on the same engine, alone: still the same
    assert engine.generate([prompts[0]], SEEDED)[0].new_token_ids == reference


def test_other_seeds_and_unseeded_requests_differ(plain_engine, prompts, reference):
    other = plain_engine.generate([prompts[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=124))
    assert other[0].new_token_ids != reference
    unseeded = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8)
    a, b = plain_engine.generate([prompts[0], prompts[0]], unseeded)
    c = plain_engine.generate([prompts[0]], unseeded)[0]
    assert len({tuple(a.new_token_ids), tuple(b.new_token_ids), tuple(c.new_token_ids)}) == 3


@pytest.mark.real_model
def test_real_model_seeded_text_is_the_same_with_and_without_speculation(real_checkpoint):
    """SmolLM2-135M, temperature 0.8, seed 123: the default drafters (n-gram + retrieval) and no
    drafters give the identical text (the issue's six-identical-requests report)."""
    tokenizer = real_checkpoint.load_tokenizer()
    prompt = encode_prompt(tokenizer, "Write a Python function that returns the n-th Fibonacci number.")
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=123)
    outs = {}
    for drafters in ("none", "default"):
        engine = LocalEngine(EngineConfig(model="smollm2-135m", drafters=parse_drafters(drafters)),
                             checkpoint=real_checkpoint)
        outs[drafters] = engine.generate([prompt, prompt], params)
    texts = {d: [tokenizer.decode(o.new_token_ids) for o in out] for d, out in outs.items()}
    assert texts["default"] == texts["none"], texts
    assert texts["none"][0] == texts["none"][1]
    assert outs["default"][0].stats.num_draft_tokens > 0  # speculation really ran
