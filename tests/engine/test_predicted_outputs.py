"""Predicted Outputs in the engine: a request's ``SamplingParams.prediction`` reaches the
prediction drafter, only requests with one are routed to it, and whatever it predicts (the
answer, an edited answer, random tokens) the text is plain greedy decoding's. Tiny random
model here; the real model in ``test_predicted_outputs_real.py``."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.drafters.prediction import PREDICTION
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams

MAX_TOKENS = 48
PROMPT_LENGTHS = (5, 13, 21, 34)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4321)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def plain(tiny_checkpoint, prompts) -> list[list[int]]:
    """Plain greedy decoding (no drafters) of every prompt."""
    outs = engine(tiny_checkpoint, "none").generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    return [o.new_token_ids for o in outs]


def engine(ckpt, drafters: str, **settings) -> LocalEngine:
    config = EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters)).replace(max_num_seqs=8, **settings)
    return LocalEngine(config, checkpoint=ckpt)


def edited(answer: list[int]) -> list[int]:
    """The answer with a token changed, a span deleted and tokens inserted: a client's stale copy."""
    out = list(answer)
    out[6] = (out[6] + 1) % 256
    del out[15:18]
    out[25:25] = [7, 7, 7, 7]
    return out


def noise(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


def generate(eng: LocalEngine, prompts, predictions):
    return eng.generate(prompts, [SamplingParams(max_tokens=MAX_TOKENS, prediction=tuple(p))
                                  for p in predictions])


@pytest.mark.parametrize("settings", [{}, {"adaptive": False, "num_speculative_tokens": 4},
                                      {"scheduler": "fcfs"}, {"fusion": "union"}],
                         ids=["cosine", "adaptive=false", "fcfs", "union"])
@pytest.mark.parametrize("kind", ["exact", "edited", "random", "none"])
def test_any_prediction_gives_plain_greedy_text(tiny_checkpoint, prompts, plain, kind, settings):
    predictions = {"exact": plain, "edited": [edited(a) for a in plain],
                   "random": [noise(MAX_TOKENS, i) for i in range(len(plain))], "none": [[] for _ in plain]}[kind]
    outs = generate(engine(tiny_checkpoint, "ngram", **settings), prompts, predictions)
    assert [o.new_token_ids for o in outs] == plain
    accepted = sum(o.stats.accepted_by.get(PREDICTION, 0) for o in outs)
    routed = sum(o.stats.routed_to.get(PREDICTION, 0) for o in outs)
    if kind == "none":
        assert routed == 0  # a request without a prediction never calls its drafter
    else:
        assert routed > 0
    if kind in ("exact", "edited"):
        assert accepted > 0.3 * len(plain) * MAX_TOKENS, accepted


def test_an_exact_prediction_commits_longer_than_gamma_max_a_step(tiny_checkpoint, prompts, plain):
    """With the price, a prediction the answer follows earns budgets past γ_max: fewer verify
    steps than γ_max-node trees could take, text unchanged."""
    eng = engine(tiny_checkpoint, "ngram", num_speculative_tokens=4, long_draft_tokens=32)
    outs = generate(eng, prompts, plain)
    assert [o.new_token_ids for o in outs] == plain
    fewest = math.ceil((MAX_TOKENS - 1) / (4 + 1))  # one token from the prefill, then γ_max + 1 a step
    assert min(o.stats.num_verify_steps for o in outs) < fewest, [o.stats.num_verify_steps for o in outs]
    assert eng.core.prediction.num_tracked_requests == 0  # released with their requests


def test_without_long_drafts_a_step_commits_at_most_gamma_max_plus_one(tiny_checkpoint, prompts, plain):
    eng = engine(tiny_checkpoint, "ngram", num_speculative_tokens=4, long_draft_tokens=0)
    outs = generate(eng, prompts, plain)
    assert [o.new_token_ids for o in outs] == plain
    assert all(o.stats.num_verify_steps >= math.ceil((MAX_TOKENS - 1) / 5) for o in outs)


def test_seeded_sampling_is_the_same_with_and_without_a_prediction(tiny_checkpoint, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=11)
    base = engine(tiny_checkpoint, "ngram").generate(prompts, params)
    predicted = engine(tiny_checkpoint, "ngram").generate(
        prompts, [dataclasses.replace(params, prediction=tuple(o.new_token_ids)) for o in base])
    assert [o.new_token_ids for o in predicted] == [o.new_token_ids for o in base]
    assert sum(o.stats.accepted_by.get(PREDICTION, 0) for o in predicted) > 0


def test_no_prediction_drafter_without_speculation(tiny_checkpoint, prompts, plain):
    for eng in (engine(tiny_checkpoint, "none"), engine(tiny_checkpoint, "ngram", num_speculative_tokens=0)):
        assert eng.core.prediction is None
        outs = generate(eng, prompts, plain)
        assert [o.new_token_ids for o in outs] == plain


def test_a_prediction_the_engine_cannot_take_is_refused(tiny_checkpoint, prompts):
    eng = engine(tiny_checkpoint, "ngram", max_model_len=128)
    with pytest.raises(ValueError, match="prediction token ids"):
        eng.core.check_request(prompts[0], SamplingParams(max_tokens=8, prediction=(1, 256)))
    with pytest.raises(ValueError, match="prediction has 129 tokens"):
        eng.core.check_request(prompts[0], SamplingParams(max_tokens=8, prediction=(1,) * 129))
    with pytest.raises(ValueError, match="prediction must be"):
        SamplingParams(prediction=(1, -2))
