"""``cosine_ray.bench.figures``: mean accepted length, acceptance rate and routing shares from
requests' stats, on hand-made stats."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cosine_ray.bench.figures import mean_accepted_length, routing_shares, spec_figures


def stats(steps: int, accepted: int, drafted: int) -> SimpleNamespace:
    return SimpleNamespace(num_verify_steps=steps, num_accepted_tokens=accepted, num_draft_tokens=drafted)


def test_mean_accepted_length_counts_the_bonus_token():
    assert mean_accepted_length(30, 10) == 4.0  # 3 drafted tokens accepted + the bonus, a step
    assert mean_accepted_length(0, 10) == 1.0  # plain decoding
    assert mean_accepted_length(0, 0) == 0.0  # no step at all


def test_spec_figures_pool_the_requests_and_skip_missing_stats():
    got = spec_figures([stats(10, 10, 40), None, stats(5, 20, 20)])
    assert got == {"mean_accepted_length": pytest.approx(45 / 15), "acceptance_rate": pytest.approx(30 / 60),
                   "verify_steps": 15}
    assert spec_figures([]) == {"mean_accepted_length": 0.0, "acceptance_rate": 0.0, "verify_steps": 0}


def test_routing_shares_per_domain_in_the_order_asked():
    records = [("math", {"suffix:math": 6, "ngram": 2}, 8), ("code", {"suffix:code": 1}, 3),
               ("math", {"suffix:math": 1, "suffix:code": 1}, 4), ("chat", {}, 0)]
    shares = routing_shares(records, ["math", "code", "chat", "instruction"])
    assert list(shares) == ["math", "code"]  # chat had no routed step, instruction no request
    assert shares["math"] == {"ngram": round(2 / 12, 3), "suffix:code": round(1 / 12, 3),
                              "suffix:math": round(7 / 12, 3)}
    assert list(shares["math"]) == sorted(shares["math"])  # drafters by name
    assert shares["code"] == {"suffix:code": 0.333}  # a share of the steps routed, not of the drafters asked
    assert list(routing_shares(records, ["code", "math"])) == ["code", "math"]
