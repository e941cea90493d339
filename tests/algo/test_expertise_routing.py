"""CoSine expertise routing (algo/routing.py): eq. 1-2 by hand, eq. 3 behaviour, priors.

Statistical checks use binomial / chi-square bounds wide enough (≥ 4 σ, p > 1e-4) that a
correct implementation fails them with negligible probability, while a wrong share (e.g.
exploration and exploitation swapped) misses by many σ.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chisquare

from cosine_ray.algo.routing import (ExpertiseRouting, RouteChoice, RoutingVector, RoutingConfig, drafter_scores,
                                     normalise_embeddings, routing_score, verification_accuracy)

POOL = ("ngram", "retrieval:code", "retrieval:math", "retrieval:instruction", "retrieval:chat")
DOMAINS = ("code", "math", "instruction", "chat")


def _within_binomial(successes: int, trials: int, p: float, sigmas: float = 4.5) -> bool:
    return abs(successes / trials - p) <= sigmas * math.sqrt(p * (1 - p) / trials)


# ---- eq. 1 ----------------------------------------------------------------------------------

@pytest.fixture
def unit_embeddings() -> torch.Tensor:
    # token 0 = (1,0), 1 = (0,1), 2 = (1,1)/√2, 3 = (-1,0), 4 = (3,0) (same direction as 0)
    raw = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [3.0, 0.0]])
    return normalise_embeddings(raw)


def test_normalise_embeddings_unit_rows_and_zero_row() -> None:
    out = normalise_embeddings(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    assert torch.allclose(out[0], torch.tensor([0.6, 0.8]))
    assert torch.equal(out[1], torch.zeros(2))
    with pytest.raises(ValueError, match="vocab, hidden"):
        normalise_embeddings(torch.zeros(3))


def test_eq1_hand_computed(unit_embeddings: torch.Tensor) -> None:
    # accepted = [0, 2] → L_acc = 2
    # i=0: cos(H0, H4) = cos((1,0),(1,0)) = 1 (same direction, different token)
    # i=1: cos(H2, H0) = 1/√2 ≈ 0.70711
    # i=2: beyond L_acc → 0 even though drafted == accepted-like token
    # i=3: None → 0
    d = verification_accuracy(unit_embeddings, accepted=[0, 2], drafted=[4, 0, 0, None])
    assert d == pytest.approx([1.0, 1 / math.sqrt(2), 0.0, 0.0], abs=1e-6)


def test_eq1_negative_cosine_clamped_and_none_inside_l_acc(unit_embeddings: torch.Tensor) -> None:
    # i=0: cos(H0, H3) = -1 → clamped to 0; i=1: None inside L_acc → 0;
    # i=2: cos(H1, H2) = 1/√2; i=3: cos(H1, H0) = 0 (orthogonal)
    d = verification_accuracy(unit_embeddings, accepted=[0, 1, 1, 1], drafted=[3, None, 2, 0])
    assert d == pytest.approx([0.0, 0.0, 1 / math.sqrt(2), 0.0], abs=1e-6)


def test_eq1_edge_cases(unit_embeddings: torch.Tensor) -> None:
    assert verification_accuracy(unit_embeddings, accepted=[], drafted=[0, 1]) == [0.0, 0.0]
    assert verification_accuracy(unit_embeddings, accepted=[0, 1, 2], drafted=[]) == []
    # bonus token beyond the draft: only the drafted positions are scored
    assert verification_accuracy(unit_embeddings, accepted=[0, 1, 2], drafted=[0]) == pytest.approx([1.0])
    with pytest.raises(ValueError, match="out of range"):
        verification_accuracy(unit_embeddings, accepted=[0], drafted=[5])
    with pytest.raises(ValueError, match="vocab, hidden"):
        verification_accuracy(torch.zeros(5), accepted=[0], drafted=[0])


# ---- eq. 2 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("c, d, expected", [
    (0.5, 0.5, 0.5),                 # 0.25 / (0.25 + 0.25)
    (0.8, 0.6, 0.48 / 0.56),         # 0.48 / (0.48 + 0.2·0.4) = 0.857142...
    (0.2, 0.9, 0.18 / 0.26),         # 0.18 / (0.18 + 0.8·0.1) = 0.692307...
    (0.9, 1.0, 1.0),                 # 0.9 / (0.9 + 0.1·0)     = 1
    (0.3, 0.0, 0.0),                 # 0 / (0 + 0.7·1)         = 0
    (1.0, 0.0, 0.0),                 # 0 / (0 + 0 + ε)         = 0 (ε keeps it finite)
])
def test_eq2_single_position(c: float, d: float, expected: float) -> None:
    assert routing_score([c], [d]) == pytest.approx(expected, abs=1e-5)


def test_eq2_mean_over_positions_and_missing_confidence() -> None:
    # mean of the terms above: (0.5 + 0.857142857 + 0.692307692 + 0) / 4 = 0.512362637
    assert routing_score([0.5, 0.8, 0.2, 0.3], [0.5, 0.6, 0.9, 0.0]) == pytest.approx(0.512362637, abs=1e-5)
    # the drafter proposed only position 0; position 1 counts as c = 0: (0.857142857 + 0) / 2
    assert routing_score([0.8], [0.6, 1.0]) == pytest.approx(0.428571429, abs=1e-5)
    assert routing_score([0.8, None], [0.6, 1.0]) == pytest.approx(0.428571429, abs=1e-5)
    assert routing_score([], []) == 0.0
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        routing_score([1.5], [0.5])


# ---- config and lifecycle ---------------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [dict(drafters_per_request=-1), dict(explore_random_share=1.5),
                                    dict(score_ema=0.0), dict(prior_ema=2.0), dict(load_weight=-1.0),
                                    dict(mode="greedy"), dict(tau=math.inf)])
def test_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        RoutingConfig(**kwargs)


def test_update_errors_and_fresh_scores() -> None:
    routing = ExpertiseRouting(POOL)
    r = r = routing.start("r", "code")
    assert routing.scores(r) == {name: 0.5 for name in POOL}
    with pytest.raises(ValueError, match="\\[0, 1\\]"):
        routing.update(r, {"ngram": 1.2}, accepted_len=1)
    with pytest.raises(ValueError, match="accepted_len"):
        routing.update(r, {"ngram": 0.2}, accepted_len=-1)
    with pytest.raises(ValueError, match="already in the pool"):
        ExpertiseRouting(["a", "a"])


def _routing_with_scores(scores: dict[str, float], **cfg) -> tuple[ExpertiseRouting, RoutingVector]:
    """One request "r" whose M_r equals ``scores`` exactly (score_ema = 1)."""
    seed = cfg.pop("seed", 0)
    routing = ExpertiseRouting(list(scores), RoutingConfig(score_ema=1.0, **cfg), seed=seed)
    r = r = routing.start("r", "code")
    routing.update(r, scores, accepted_len=5)
    assert routing.scores(r) == pytest.approx(scores)
    return routing, r


def test_update_is_an_ema_of_observed_scores() -> None:
    routing = ExpertiseRouting(["a", "b"], RoutingConfig(score_ema=0.5, prior_ema=0.1))
    r = routing.start("r", "math")
    routing.update(r, {"a": 1.0}, accepted_len=2)       # a: 0.5 + 0.5·(1 − 0.5) = 0.75
    routing.update(r, {"a": 0.25}, accepted_len=2)      # a: 0.75 + 0.5·(0.25 − 0.75) = 0.5
    routing.update(r, {"b": 0.0}, accepted_len=2)       # b: 0.5 → 0.25
    assert routing.scores(r) == pytest.approx({"a": 0.5, "b": 0.25})
    # priors: a: 0.5 → 0.55 → 0.52; b: 0.5 → 0.45
    assert routing.prior("math") == pytest.approx({"a": 0.52, "b": 0.45})
    # an unseen domain falls back to the global prior; a new request starts from it
    assert routing.prior("code") == pytest.approx({"a": 0.52, "b": 0.45})
    s = routing.start("s", "math")
    assert routing.scores(s) == pytest.approx({"a": 0.52, "b": 0.45})


# ---- eq. 3: modes, top-scoring, random share ------------------------------------------------------

def test_mode_switches_at_tau() -> None:
    routing = ExpertiseRouting(POOL, RoutingConfig(tau=2.0))
    r = routing.start("r", "code")
    assert routing.mode_of(r) == "exploit"  # fresh: routed from the prior
    for accepted_len, mode in [(1, "explore"), (2, "exploit"), (0, "explore"), (7, "exploit")]:
        routing.update(r, {}, accepted_len=accepted_len)
        assert routing.mode_of(r) == mode
        assert routing.choose([r])["r"].mode == mode


def test_exploitation_picks_top_scoring_drafters() -> None:
    scores = {"a": 0.2, "b": 0.9, "c": 0.4, "d": 0.7, "e": 0.1}
    routing, r = _routing_with_scores(scores, exploit_random_share=0.0)
    for k, expected in [(1, ("b",)), (2, ("b", "d")), (3, ("b", "d", "c"))]:
        choice = routing.choose([r], k=k)["r"]
        assert choice == RouteChoice(expected, "exploit", 0)
    assert routing.choose([r], k=9)["r"].drafters == ("b", "d", "c", "a", "e")  # capped by pool
    assert routing.choose([r], k=0)["r"].drafters == ()


def test_ties_broken_by_pool_order() -> None:
    routing = ExpertiseRouting(["z", "y", "x"], RoutingConfig(exploit_random_share=0.0, load_weight=0.0))
    r = routing.start("r", "code")
    assert routing.choose([r], k=2)["r"].drafters == ("z", "y")


@pytest.mark.parametrize("accepted_len, share", [(0, 0.5), (3, 0.1)])
def test_random_share_per_mode(accepted_len: int, share: float) -> None:
    # k = 1 among 5 drafters, "a" clearly best: a non-top pick happens only when the slot is
    # random AND the uniform draw misses "a": P = share · 4/5 (explore 0.4, exploit 0.08)
    scores = {"a": 0.9, "b": 0.3, "c": 0.3, "d": 0.2, "e": 0.1}
    trials, misses, random_slots = 3000, 0, 0
    for seed in range(trials):
        routing, r = _routing_with_scores(scores, seed=seed, explore_random_share=0.5, exploit_random_share=0.1)
        routing.update(r, {}, accepted_len=accepted_len)
        choice = routing.choose([r], k=1)["r"]
        assert choice.mode == ("explore" if accepted_len < 1 else "exploit")
        misses += choice.drafters != ("a",)
        random_slots += choice.num_random
    assert _within_binomial(misses, trials, share * 4 / 5), misses / trials
    assert _within_binomial(random_slots, trials, share), random_slots / trials


def test_exploration_with_two_slots_keeps_top_often_but_not_always() -> None:
    # P(top "a" missing) = P(slot 1 random, not a) · P(slot 2 random, not a) = (0.5·4/5)·(0.5·3/4) = 0.15
    scores = {"a": 0.9, "b": 0.3, "c": 0.3, "d": 0.2, "e": 0.1}
    trials = 3000
    missing = 0
    for seed in range(trials):
        routing, r = _routing_with_scores(scores, seed=seed, explore_random_share=0.5)
        routing.update(r, {}, accepted_len=0)
        missing += "a" not in routing.choose([r], k=2)["r"].drafters
    assert _within_binomial(missing, trials, 0.15), missing / trials


# ---- load, availability, pool changes ----------------------------------------------------------------

def test_load_spreads_a_batch_over_tied_drafters() -> None:
    routing = ExpertiseRouting(POOL, RoutingConfig(exploit_random_share=0.0))
    ids = [f"r{i}" for i in range(10)]
    vectors = [routing.start(request_id, "chat") for request_id in ids]
    for k, per_drafter in [(1, 2), (2, 4)]:
        counts = {name: 0 for name in POOL}
        for choice in routing.choose(vectors, k=k).values():
            assert len(set(choice.drafters)) == k
            for name in choice.drafters:
                counts[name] += 1
        assert counts == {name: per_drafter for name in POOL}


def test_load_penalty_is_soft_and_external_loads_count() -> None:
    scores = {"a": 0.9, "b": 0.3, "c": 0.3}
    routing, r = _routing_with_scores(scores, exploit_random_share=0.0, load_weight=0.1)
    # a big score gap beats the in-batch load; an external queue on "a" does not
    assert routing.choose([r], k=1)["r"].drafters == ("a",)
    assert routing.choose([r], k=1, loads={"a": 7.0})["r"].drafters == ("b",)  # 0.9 − 0.1·7 = 0.2
    assert routing.choose([r], k=1, loads={"a": 5.0})["r"].drafters == ("a",)  # 0.9 − 0.5 = 0.4


def test_unavailable_drafters_are_never_chosen() -> None:
    routing = ExpertiseRouting(POOL, RoutingConfig(explore_random_share=1.0), seed=3)
    r = routing.start("r", "math")
    routing.update(r, {"retrieval:math": 1.0, "ngram": 0.9}, accepted_len=0)  # explore, all random
    available = {"retrieval:code", "retrieval:chat", "not-in-pool"}
    seen = set()
    for _ in range(200):
        choice = routing.choose([r], k=3, available=available)["r"]
        assert len(choice.drafters) == 2  # k capped by the two pool drafters available
        seen.update(choice.drafters)
    assert seen == {"retrieval:code", "retrieval:chat"}
    assert routing.choose([r], available=[])["r"].drafters == ()


def test_add_and_remove_drafter() -> None:
    routing = ExpertiseRouting(["a", "b"], RoutingConfig(exploit_random_share=0.0, score_ema=1.0))
    r = routing.start("r", "code")
    routing.update(r, {"a": 0.2, "b": 0.3}, accepted_len=3)
    routing.add_drafter("c")  # joins live requests at its prior (never observed → 0.5)
    assert routing.scores(r)["c"] == pytest.approx(0.5)
    assert routing.choose([r], k=1)["r"].drafters == ("c",)
    routing.remove_drafter("c")
    assert "c" not in routing.scores(r) and routing.drafters == ("a", "b")
    assert routing.choose([r], k=3)["r"].drafters == ("b", "a")
    with pytest.raises(KeyError):
        routing.remove_drafter("c")
    routing.update(r, {"c": 0.9}, accepted_len=1)  # a late score of a removed drafter is ignored
    assert "c" not in routing.scores(r)


# ---- random mode (routing off) and determinism ------------------------------------------------------

def test_random_mode_is_uniform_over_pairs() -> None:
    routing = ExpertiseRouting(POOL, RoutingConfig(mode="random"), seed=11)
    r = routing.start("r", "code")
    routing.update(r, {"ngram": 1.0}, accepted_len=5)  # scores must not matter
    counts: dict[frozenset, int] = {}
    trials = 3000
    for _ in range(trials):
        choice = routing.choose([r], k=2)["r"]
        assert choice.mode == "random" and len(set(choice.drafters)) == 2
        key = frozenset(choice.drafters)
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 10  # C(5, 2)
    assert chisquare(list(counts.values())).pvalue > 1e-4


def test_seeded_routing_replays_its_choices() -> None:
    def run(seed: int) -> list[tuple[str, ...]]:
        routing = ExpertiseRouting(POOL, seed=seed)
        rng = random.Random(99)  # the same simulated feedback for every run
        out = []
        vectors = {request_id: routing.start(request_id, "code") for request_id in ("r0", "r1", "r2")}
        for _ in range(40):
            choices = routing.choose(list(vectors.values()))
            for request_id, choice in choices.items():
                out.append(choice.drafters)
                routing.update(vectors[request_id], {n: rng.random() for n in choice.drafters}, rng.randrange(3))
        return out

    assert run(5) == run(5)
    assert run(5) != run(6)


# ---- priors learn domain expertise -------------------------------------------------------------------

def _simulated_m(domain: str, drafter: str, rng: random.Random) -> float:
    """retrieval:D is the expert on domain D; ngram is mediocre everywhere."""
    if drafter == f"retrieval:{domain}":
        base = 0.8
    elif drafter == "ngram":
        base = 0.35
    else:
        base = 0.15
    return min(max(base + rng.uniform(-0.1, 0.1), 0.0), 1.0)


def test_priors_learn_domain_experts_from_a_request_stream() -> None:
    routing = ExpertiseRouting(POOL, seed=0)
    rng = random.Random(1)
    warmup, measured, steps, batch = 120, 200, 6, 4
    exploit_total = {d: 0 for d in DOMAINS}
    exploit_with_expert = {d: 0 for d in DOMAINS}
    for wave in range((warmup + measured) // batch):
        ids = [f"w{wave}-{j}" for j in range(batch)]
        vectors = {request_id: routing.start(request_id, rng.choice(DOMAINS)) for request_id in ids}
        for _ in range(steps):
            for request_id, choice in routing.choose(list(vectors.values())).items():
                domain = vectors[request_id].domain
                m = {n: _simulated_m(domain, n, rng) for n in choice.drafters}
                expert_used = f"retrieval:{domain}" in choice.drafters
                if wave * batch >= warmup and choice.mode == "exploit":
                    exploit_total[domain] += 1
                    exploit_with_expert[domain] += expert_used
                routing.update(vectors[request_id], m, accepted_len=3 if expert_used else 0)
    for domain in DOMAINS:
        share = exploit_with_expert[domain] / exploit_total[domain]
        assert exploit_total[domain] >= 50 and share >= 0.9, (domain, share, exploit_total[domain])
        prior = routing.prior(domain)
        assert max(prior, key=prior.get) == f"retrieval:{domain}", prior
        assert prior[f"retrieval:{domain}"] > 0.7


def test_drafter_scores_combines_eq1_and_eq2(unit_embeddings: torch.Tensor) -> None:
    # accepted [0, 2]: drafter "x" drafted [0, 0] with c [0.8, 0.5] → d = [1, 1/√2]
    #   terms: 0.8·1/(0.8 + 0) = 1;  0.5·0.7071/(0.35355 + 0.5·0.29289) = 0.35355/0.5 = 0.70711
    # drafter "y" drafted [3] (cos −1 → d 0) → m = 0; drafter "z" has no confidences → c = 0 → m = 0
    m = drafter_scores(unit_embeddings, [0, 2], {"x": [0, 0], "y": [3], "z": [0, 2]},
                       {"x": [0.8, 0.5], "y": [0.9]})
    assert m == pytest.approx({"x": (1.0 + 1 / math.sqrt(2)) / 2, "y": 0.0, "z": 0.0}, abs=1e-5)
