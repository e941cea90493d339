"""``DraftRouting`` alone: a request's start (domain, routing vector), which requests of a
batch get a route, the k routed drafters best-scoring first plus the shared ones, the
ablations (single, random) and the adaptive k."""

from __future__ import annotations

from collections import Counter

from cosine_ray.algo.adaptive import ParticipationController
from cosine_ray.engine.types import StepBatch

from support.factories import make_request, make_routing


class FirstTokenClassifier:
    """The prompt's first token names its domain."""

    def classify(self, token_ids):
        return ("code", "math")[token_ids[0] % 2], 1.0


def started(routing, *requests):
    for r in requests:
        routing.start(r)
    return list(requests)


def test_start_classifies_the_domain_and_starts_the_routing_vector_from_its_prior():
    routing = make_routing(domain_classifier=FirstTokenClassifier())
    math, = started(routing, make_request("m", (1, 2)))
    assert math.domain == math.stats.domain == "math"
    assert math.routing.request_id == "m" and math.routing.domain == "math"
    assert set(math.routing.scores) == {"a", "b", "c"}  # the shared ngram is not routed
    routing.update(math, {"a": 1.0, "b": 0.0}, accepted_len=2)
    assert math.routing.scores["a"] > math.routing.scores["c"] > math.routing.scores["b"]
    assert math.routing.last_accepted_len == 2
    newcomer, = started(routing, make_request("n", (3,)))
    assert newcomer.routing.scores["a"] > newcomer.routing.scores["b"]  # the math prior learned
    assert routing.priors([newcomer]) == {"math": routing.expertise.prior("math")}
    plain, = started(make_routing(), make_request("p", (1,)))
    assert plain.domain == "other"  # no classifier


def test_only_decoding_requests_with_a_budget_and_no_twin_are_routed():
    routing = make_routing()
    prefill, decode, no_budget, twin = started(routing, make_request("prefill"), *(
        make_request(rid, output=(4,)) for rid in ("decode", "no_budget", "twin")))
    batch = StepBatch([prefill, decode, no_budget, twin], budgets={"decode": 3, "no_budget": 0, "twin": 3},
                      twins={"twin": (5, 6, 7)})
    routes = routing.route(batch)
    assert list(routes) == ["decode"]
    assert decode.stats.num_routed_steps == 1 and twin.stats.num_routed_steps == 0
    assert make_routing(()).route(batch) == {}  # no drafters at all


def test_k_routed_drafters_best_scoring_first_then_the_shared_ones():
    routing = make_routing(("ngram", "a", "b", "c"), drafters_per_request=2)
    r, = started(routing, make_request(output=(4,)))
    r.routing.scores.update({"a": 0.2, "b": 0.9, "c": 0.6})
    route = routing.route(StepBatch([r], budgets={"r0": 4}))["r0"]
    assert route.drafters == ("b", "c", "ngram") and route.num_shared == 1
    assert route.mode in ("explore", "exploit") and route.mode_of("ngram") == "shared"
    assert route.mode_of("b") == route.mode
    assert r.stats.routed_to == {"b": 1, "c": 1, "ngram": 1}
    routing.route(StepBatch([r], budgets={"r0": 4}))
    assert r.stats.num_routed_steps == 2 and r.stats.routed_to["ngram"] == 2


def test_single_fusion_routes_one_drafter_and_the_shared_ones_compete_for_it():
    routing = make_routing(("ngram", "a", "b"), fusion="single", drafters_per_request=2)
    assert routing.shared == () and routing.drafters_per_request == 1
    r, = started(routing, make_request(output=(4,)))
    r.routing.scores.update({"ngram": 0.9, "a": 0.1, "b": 0.2})
    route = routing.route(StepBatch([r], budgets={"r0": 4}))["r0"]
    assert len(route.drafters) == 1 and route.num_shared == 0


def test_random_routing_draws_k_experts_uniformly_listed_best_scoring_first():
    routing = make_routing(("ngram", "a", "b", "c"), routing="random", drafters_per_request=2)
    r, = started(routing, make_request(output=(4,)))
    r.routing.scores.update({"a": 0.9, "b": 0.5, "c": 0.1})  # expertise would always pick a and b
    picks = Counter()
    for _ in range(300):
        route = routing.route(StepBatch([r], budgets={"r0": 4}))["r0"]
        assert route.mode == "random" and route.drafters[-1] == "ngram" and len(route.drafters) == 3
        first, second = route.drafters[:2]
        assert r.routing.scores[first] > r.routing.scores[second]  # fusion's tie order
        picks.update((first, second))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 120


def test_adaptive_participation_sets_k():
    participation = ParticipationController(min_drafters=1, max_drafters=3, initial=3)
    routing = make_routing(("a", "b", "c"), participation=participation, shared_drafters=())
    r, = started(routing, make_request(output=(4,)))
    assert len(routing.route(StepBatch([r], budgets={"r0": 4}))["r0"].drafters) == 3
    participation.current = 1
    assert len(routing.route(StepBatch([r], budgets={"r0": 4}))["r0"].drafters) == 1


def test_a_requests_kind_names_its_grammar_prediction_repetition_and_tenant():
    from cosine_ray.engine.request import StructuredOutput, Tenant
    routing = make_routing(domain_classifier=FirstTokenClassifier())
    plain, = started(routing, make_request("p", (2, 5, 6, 7, 8, 9)))
    assert plain.routing.kinds == ()  # the domain's prior alone
    json_req = make_request("j", (2, 5, 6, 7, 8, 9), structured=StructuredOutput("json_schema", "{}"))
    json_req.tenant = Tenant("acme")
    edit = make_request("e", (1,) + (5, 6, 7, 8) * 4, prediction=(5, 6, 7))
    started(routing, json_req, edit)
    assert json_req.routing.kinds == ("code+grammar@acme", "code+grammar")
    assert edit.routing.kinds == ("math+prediction+repetitive",)
    routing.update(json_req, {"a": 1.0, "b": 0.0}, accepted_len=3)
    routing.update(plain, {"a": 0.0}, accepted_len=0)  # the same domain without a grammar: a loses
    later, = started(routing, make_request("k", (2, 4), structured=StructuredOutput("json_schema", "{}")))
    assert later.routing.scores["a"] > routing.expertise.prior("code")["a"]  # its kind's prior, not the domain's
    assert started(make_routing(()), make_request("n", (2, 5)))[0].routing.kinds == ()  # no drafters: no kind
