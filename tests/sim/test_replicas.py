"""Engine replicas in the simulator: routing, the prefix cache behind it, failover (sim.replicas)."""

from __future__ import annotations

import copy

import pytest

from cosine_ray.sim.runner import simulate
from cosine_ray.sim.scenario import ScenarioError
from test_simulate import SMALL, scenario, timings

SHARED = copy.deepcopy(SMALL)
SHARED["workload"] = {"num_requests": 32, "domains": {"code": 1, "math": 1}, "input_len": 300, "output_len": 24,
                      "range_ratio": 0.25, "arrival": {"request_rate": 4},
                      "shared_prefix": {"groups": 8, "tokens": 200}}
"""Chat behind 8 system prompts of 200 tokens, arriving faster than one replica serves them."""


def test_one_replica_is_the_deployment_without_the_key():
    plain = simulate(scenario(SMALL))
    one = simulate(scenario(SMALL, replicas={"count": 1, "routing": "prefix"}))
    assert timings(one) == timings(plain)
    assert one.summary()["served_share"] == [1.0]


def test_two_replicas_share_the_load_and_finish_sooner():
    one = simulate(scenario(SHARED)).summary()
    two = simulate(scenario(SHARED, replicas={"count": 2, "routing": "least_loaded"})).summary()
    assert min(two["served_share"]) >= 0.3
    assert two["throughput_tok_s"] > 1.3 * one["throughput_tok_s"]
    assert two["ttft_mean_s"] < one["ttft_mean_s"]
    assert two["resubmissions"] == 0


def test_prefix_routing_keeps_more_of_the_cache_than_round_robin():
    rates = {routing: simulate(scenario(SHARED, replicas={"count": 4, "routing": routing})).summary()
             for routing in ("prefix", "round_robin")}
    assert rates["prefix"]["prefix_hit_rate"] > rates["round_robin"]["prefix_hit_rate"]
    assert rates["prefix"]["prefix_hit_rate"] > 0.2


def test_a_killed_replica_s_requests_finish_elsewhere_with_the_oracle_s_text():
    # simulate() checks every output against the oracle: a failover that lost or repeated a
    # token would raise instead of returning
    result = simulate(scenario(SHARED, replicas={"count": 2, "failures": [{"replica": 0, "at_s": 2.0,
                                                                          "restart_s": 4.0}]}))
    s = result.summary()
    assert s["requests"] == 32 and s["output_tokens"] == sum(r.request.output_len for r in result.requests)
    assert s["resubmissions"] > 0
    assert any(name.endswith("@0") for name in s["utilisation"])


def test_with_one_replica_requests_wait_for_its_replacement():
    result = simulate(scenario(SHARED, replicas={"count": 1, "failures": [{"replica": 0, "at_s": 2.0,
                                                                          "restart_s": 5.0}]}))
    assert result.resubmissions > 0
    moved = [r for r in result.requests if r.request.arrival_s < 2.0 < r.start_s + r.e2e_s]
    assert moved and all(r.start_s + r.e2e_s >= 7.0 for r in moved)


def test_bad_replicas_keys_name_themselves():
    with pytest.raises(ScenarioError, match="replicas.failures.0.replica"):
        scenario(SHARED, replicas={"count": 2, "failures": [{"replica": 2, "at_s": 1.0}]})
    with pytest.raises(ScenarioError, match="replicas.routing"):
        scenario(SHARED, replicas={"count": 2, "routing": "nearest"})


def test_the_h100_replicas_scenario_loads_and_runs_lossless():
    from pathlib import Path

    from cosine_ray.sim.scenario import Scenario, load, validate
    base = load(Path(__file__).resolve().parents[2] / "deploy" / "sim" / "h100-replicas.yaml")
    data = copy.deepcopy(base.data)
    data["workload"].update(num_requests=12, input_len=256, output_len=16)
    data["workload"]["shared_prefix"]["tokens"] = 128
    data["replicas"]["count"] = 2
    validate(data)
    s = simulate(Scenario(data, base.base_dir)).summary()
    assert s["requests"] == 12 and len(s["served_share"]) == 2
