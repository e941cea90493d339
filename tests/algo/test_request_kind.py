"""Request kinds for routing (``algo.request_kind``): the prompt's repetitiveness, the prior keys
of a kind, and expertise routing learning which expert wins for which kind of request of one
domain (``algo.routing``'s kind priors), apart from the domain's own prior."""

from __future__ import annotations

import pytest

from cosine_ray.algo.request_kind import REPETITIVE_SHARE, RequestKind, repeated_ngram_share
from cosine_ray.algo.routing import ExpertiseRouting, RoutingConfig


def test_repeated_ngram_share_counts_ngrams_seen_earlier_in_the_prompt():
    text = list(range(100))
    assert repeated_ngram_share(text) == 0.0
    assert repeated_ngram_share(text * 2) == pytest.approx(97 / 197)  # every 4-gram inside the second copy
    assert repeated_ngram_share(text * 4) == pytest.approx(297 / 397)  # about 1 - 1/r
    assert repeated_ngram_share([7] * 10) == pytest.approx(6 / 7)
    assert repeated_ngram_share([1, 2, 3, 4]) == 0.0 == repeated_ngram_share([])  # fewer than two n-grams
    assert repeated_ngram_share(text * 2, window=100) == 0.0  # only the last window is looked at
    with pytest.raises(ValueError):
        repeated_ngram_share(text, n=0)


def test_a_kind_names_its_features_and_its_priors_most_specific_first():
    assert RequestKind("code").prior_keys() == ()  # the domain's own prior is the fallback
    assert RequestKind("code", tenant="acme").prior_keys() == ("code@acme",)
    kind = RequestKind("code", grammar=True, repetitive=True, tenant="acme")
    assert kind.flags == "+grammar+repetitive"
    assert kind.prior_keys() == ("code+grammar+repetitive@acme", "code+grammar+repetitive")
    assert RequestKind("chat", prediction=True).prior_keys() == ("chat+prediction",)
    repeated = RequestKind.of("chat", list(range(50)) * 3, grammar=True)
    assert repeated.repetitive and repeated.grammar and not repeated.prediction
    assert not RequestKind.of("chat", list(range(150))).repetitive
    assert 0 < REPETITIVE_SHARE < 0.5  # a prompt that holds its context twice is repetitive


def test_routing_learns_which_expert_wins_for_which_kind_of_one_domain():
    routing = ExpertiseRouting(["copy", "retrieval"], RoutingConfig(prior_ema=0.5))
    json_kind, chat_kind = ("code+grammar",), ()
    for i in range(6):  # grammar requests are won by the copy expert, plain ones by retrieval
        routing.update(routing.start(f"j{i}", "code", json_kind), {"copy": 1.0, "retrieval": 0.0}, 3)
        routing.update(routing.start(f"c{i}", "code", chat_kind), {"copy": 0.0, "retrieval": 1.0}, 3)
    j, c = routing.start("j", "code", json_kind), routing.start("c", "code", chat_kind)
    assert routing.scores(j)["copy"] > 0.9 > 0.1 > routing.scores(j)["retrieval"]
    assert routing.scores(c)["retrieval"] > routing.scores(c)["copy"]  # the domain's prior: both kinds taught it
    assert routing.choose([j], k=1)["j"].drafters == ("copy",)
    assert routing.choose([c], k=1)["c"].drafters == ("retrieval",)
    assert routing.prior("code", json_kind) == routing.scores(j)
    assert routing.prior("code", ("code+grammar@new", "code+grammar")) == routing.scores(j)  # a new tenant
    assert routing.prior("code", ("code+prediction",)) == routing.prior("code")  # an unseen kind: the domain's


def test_a_kinds_prior_starts_from_its_domains_not_from_scratch():
    routing = ExpertiseRouting(["a"], RoutingConfig(prior_ema=0.5))
    for i in range(4):
        routing.update(routing.start(f"r{i}", "math"), {"a": 1.0}, 1)
    learned = routing.prior("math")["a"]  # 0.5 → 0.75 → 0.875 → 0.9375 → 0.96875
    assert learned == pytest.approx(0.96875)
    r = routing.start("k", "math", ("math+prediction",))
    assert routing.scores(r)["a"] == pytest.approx(learned)
    routing.update(r, {"a": 0.0}, 0)
    assert routing.prior("math", ("math+prediction",))["a"] == pytest.approx(learned / 2)


def test_kind_priors_are_bounded(monkeypatch):
    monkeypatch.setattr("cosine_ray.algo.routing.KIND_PRIORS_KEPT", 3)
    routing = ExpertiseRouting(["a"])
    for i in range(5):
        routing.update(routing.start(f"r{i}", "code", (f"code@t{i}",)), {"a": 1.0}, 1)
    assert list(routing._kind_priors) == ["code@t2", "code@t3", "code@t4"]
    old = routing.start("again", "code", ("code@t0",))  # dropped: starts from the domain's prior again
    assert routing.scores(old) == routing.prior("code")
