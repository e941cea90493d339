"""``cosine_ray.bench.replay``: the drafting ceiling's offline replay of drafter policies against
known outputs (real suffix and n-gram drafters, and a fake one, on made-up token streams)."""

from __future__ import annotations

import random

import pytest

from cosine_ray.algo.scheduling.latency_model import LatencyModel
from cosine_ray.bench.replay import DecodedTurn, choose, replay
from cosine_ray.engine.drafters.lookup.ngram import NgramConfig, NgramDrafter
from cosine_ray.engine.drafters.lookup.suffix import SuffixConfig, SuffixDrafter


def stream(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(100, 5000) for _ in range(n))


def experts(*domains: str) -> dict[str, SuffixDrafter]:
    return {f"suffix:{d}": SuffixDrafter(SuffixConfig(use_local=False), name=f"suffix:{d}", domain=d)
            for d in domains}


def test_plain_replay_commits_one_token_a_step_and_every_token_once():
    turns = [DecodedTurn("code", stream(1, 12), stream(2, 30)), DecodedTurn("math", stream(3, 9), stream(4, 17))]
    r = replay([], turns, {}, "all", budget=8, latency=LatencyModel.default())
    assert r.tokens == 29 + 16 and r.steps == r.tokens and r.nodes == 0
    figures = r.figures()
    assert figures["tokens_per_step"] == 1.0
    assert figures["projected_speedup"] == pytest.approx(1.0)  # the same steps as plain decoding


def test_tokens_a_step_are_also_counted_by_the_turns_domain():
    """A code expert that saw the code turn drafts it whole; the math turn, unseen, gets nothing."""
    code, math = DecodedTurn("code", stream(7, 10), stream(8, 40)), DecodedTurn("math", stream(9, 10), stream(10, 30))
    r = replay([code], [code, math], experts("code"), "all", budget=8)
    by = r.figures()["tokens_per_step_by_domain"]
    assert by["math"] == 1.0 and by["code"] == 39 / 5  # 8 drafted + 1 bonus a step
    assert sum(steps for steps, _ in r.domains.values()) == r.steps
    assert sum(tokens for _, tokens in r.domains.values()) == r.tokens


def test_an_identical_request_is_drafted_from_the_first_ones_output():
    prompt, output = stream(5, 20), stream(6, 60)
    warm, measured = [DecodedTurn("code", prompt, output)], [DecodedTurn("code", prompt, output)]
    suffix = replay(warm, measured, {"suffix": SuffixDrafter()}, "all", budget=8,
                            latency=LatencyModel.default())
    ngram = replay(warm, measured, {"ngram": NgramDrafter(NgramConfig())}, "all", budget=8)
    assert suffix.tokens == ngram.tokens == 59
    # 8 drafted + 1 bonus a step: 59 tokens in 7 steps (the last one shorter)
    assert suffix.steps == 7
    assert ngram.figures()["tokens_per_step"] < 1.5  # the output never repeats its own context
    f = suffix.figures()
    assert 1 < f["projected_speedup"] <= f["oracle_speedup"]


def test_own_routing_beats_a_wrong_expert_where_only_the_own_one_saw_the_text():
    prompt, output = stream(7, 20), stream(8, 50)
    warm = [DecodedTurn("code", prompt, output), DecodedTurn("math", stream(9, 20), stream(10, 50))]
    measured = [DecodedTurn("code", prompt, output)]
    own = replay(warm, measured, experts("code", "math"), "own", budget=8)
    wrong = replay(warm, measured, experts("code", "math"), "wrong", budget=8)
    assert own.figures()["tokens_per_step"] > 5 > 1.2 > wrong.figures()["tokens_per_step"]


def test_the_tree_budget_keeps_the_most_confident_nodes_only():
    prompt, output = stream(11, 20), stream(12, 40)
    warm, measured = [DecodedTurn("chat", prompt, output)], [DecodedTurn("chat", prompt, output)]
    capped = replay(warm, measured, {"suffix": SuffixDrafter()}, "all", budget=8, tree_budget=2)
    assert capped.nodes <= 2 * capped.steps
    assert 2.5 < capped.figures()["tokens_per_step"] <= 3.0


class TwoBranches:
    """A fake drafter: two one-token branches, the true next token the less confident one."""

    name = "two"

    def __init__(self, prompt_len: int, truth: tuple[int, ...]) -> None:
        self.prompt_len, self.truth = prompt_len, truth

    def propose(self, inputs):
        from cosine_ray.engine.drafters.base import DraftProposal
        out = []
        for item in inputs:
            pos = len(item.context_token_ids) - self.prompt_len
            right = self.truth[pos]
            out.append(DraftProposal(item.request_id, [[right + 1], [right]], [[0.9], [0.3]], self.name))
        return out

    def release(self, request_id):
        pass


def test_the_tree_budget_ranks_nodes_by_confidence():
    prompt, output = stream(13, 10), stream(14, 21)  # 20 tokens after the prefill's: 10 steps of 2
    fake = TwoBranches(len(prompt), output)
    turns = [DecodedTurn("code", prompt, output)]
    union = replay([], turns, {"two": fake}, "all", budget=8)
    capped = replay([], turns, {"two": fake}, "all", budget=8, tree_budget=1)
    assert union.figures()["tokens_per_step"] == 2.0 and union.nodes == 2 * union.steps
    assert capped.figures()["tokens_per_step"] == 1.0 and capped.nodes == capped.steps  # kept the wrong 0.9


class RecordingLatency:
    """Records the cached context lengths and new tokens it is asked to price (1 s each)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def predict_llm(self, context_lens, num_new_tokens):
        self.calls.append((context_lens[0], num_new_tokens[0]))
        return 1.0


def test_steps_are_priced_at_the_context_cached_before_their_root():
    prompt, output = stream(15, 10), stream(16, 5)
    latency = RecordingLatency()
    replay([], [DecodedTurn("math", prompt, output)], {}, "all", budget=8, latency=latency)
    plain = [(10, 1), (11, 1), (12, 1), (13, 1)]  # the prompt and k - 1 output tokens cached
    # per drafted step: verify with every node, then with the accepted ones (none drafted here)
    drafted = [c for l in (10, 11, 12, 13) for c in ((l, 1), (l, 1))]
    assert latency.calls == plain + drafted


def test_routes_choose_the_experts_they_name():
    names = ["ngram", "suffix:code", "suffix:math", "suffix:chat"]
    rng = random.Random(0)
    assert choose(names, "own", "math", rng) == ["ngram", "suffix:math"]
    assert choose(names, "all", "math", rng) == names
    for _ in range(20):
        wrong = choose(names, "wrong", "math", rng)
        assert wrong[0] == "ngram" and len(wrong) == 2 and wrong[1] in ("suffix:code", "suffix:chat")
        both = choose(names, "own+random1", "code", rng)
        assert both[:2] == ["ngram", "suffix:code"] and both[2] in ("suffix:math", "suffix:chat")
        assert len(set(choose(names, "random2", "code", rng)[1:])) == 2
    with pytest.raises(ValueError, match="route must be one of"):
        choose(names, "best", "code", rng)
