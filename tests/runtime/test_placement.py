"""Placement of the engine's actors on a cluster's nodes (runtime/placement.py), without Ray:
what each actor asks, the greedy packing, and the messages for what cannot be placed. The real
two-node cluster is in test_placement_cluster.py."""

from __future__ import annotations

import pytest

from cosine_ray.engine.config import config_from_dict
from cosine_ray.runtime.placement import (PlacementError, actor_asks, check_placement, engine_actor_options,
                                          plan_placement, without_drafters)

FIVE_DRAFTERS = "ngram,suffix:code,suffix:math,suffix:instruction,suffix:chat"
HEAD = {"CPU": 2.0, "datacenter_gpu": 2.0, "memory": 8e9, "object_store_memory": 2e9, "node:10.0.0.1": 1.0}
WORKER = {"CPU": 2.0, "consumer_gpu": 8.0, "memory": 8e9, "node:10.0.0.2": 1.0}


def config(drafters: str = FIVE_DRAFTERS, **cluster):
    return config_from_dict({"num_stages": 2, "drafters": drafters,
                             "cluster": {"use_resources": True, "drafters_in_engine": "none", **cluster}})


def test_every_actor_asks_its_cpus_and_its_role_resource():
    asks = actor_asks(config())
    assert [a.name for a in asks] == [f"cosine_ray:stage:{i}" for i in range(2)] + \
        [f"cosine_ray:drafter:{i}" for i in range(5)]
    assert asks[0].resources == {"CPU": 0.5, "datacenter_gpu": 1.0}
    assert asks[2].resources == {"CPU": 0.5, "consumer_gpu": 1.0} and asks[2].drafter_index == 0
    # drafters that run inside the engine process ask nothing
    assert [a.what for a in actor_asks(config(drafters_in_engine="ngram"))][2:] == [
        "drafter suffix:code", "drafter suffix:math", "drafter suffix:instruction", "drafter suffix:chat"]


def test_stages_in_the_engine_make_the_engine_ask_what_a_stage_would():
    """``cluster.stages_in_engine``: no stage actor; the engine replica asks a stage's resources
    (Serve places it), and a cluster without them is an error before anything starts."""
    assert engine_actor_options(config()) == {"num_cpus": 0}
    in_engine = config(stages_in_engine=True)
    assert engine_actor_options(in_engine) == {"num_cpus": 0.5, "resources": {"datacenter_gpu": 1}}
    asks = actor_asks(in_engine)
    assert [a.name for a in asks] == ["cosine_ray_engine"] + [f"cosine_ray:drafter:{i}" for i in range(5)]
    assert asks[0].resources == {"CPU": 0.5, "datacenter_gpu": 1.0} and asks[0].drafter_index is None
    with pytest.raises(PlacementError, match=r"the engine with its stages \(cosine_ray_engine\) asks CPU 0.5, "
                                             r"datacenter_gpu 1: no node has enough datacenter_gpu"):
        check_placement(in_engine, [WORKER])
    cuda = config_from_dict({"device": "cuda", "cluster": {"stages_in_engine": True}})
    assert engine_actor_options(cuda) == {"num_cpus": 0.5, "num_gpus": 1}
    with pytest.raises(ValueError, match="stages_in_engine must be true or false"):
        config(stages_in_engine="yes")


def test_the_two_node_scenario_leaves_out_one_drafter_and_says_why():
    """Head: 2 CPUs + datacenter_gpu 2; worker: 2 CPUs + consumer_gpu 8; five drafters asking 0.5
    CPU each: four fit the worker's 2 CPUs, the fifth can never start."""
    (ask, why), = check_placement(config(), [HEAD, WORKER])
    assert ask.name == "cosine_ray:drafter:4" and ask.what == "drafter suffix:chat"
    assert "asks CPU 0.5, consumer_gpu 1" in why and "left: node 2: CPU 0, consumer_gpu 4" in why
    assert "node 1: CPU 2, datacenter_gpu 2; node 2: CPU 2, consumer_gpu 8" in why  # what the cluster offers
    assert "memory" not in why and "node:" not in why
    kept = without_drafters(config(), [ask.drafter_index])
    assert [s.name for s in kept.drafters] == ["ngram", "suffix:code", "suffix:math", "suffix:instruction"]
    assert check_placement(kept, [HEAD, WORKER]) == []


def test_a_stage_that_cannot_be_placed_is_an_error_naming_it():
    with pytest.raises(PlacementError) as err:
        check_placement(config(), [WORKER, WORKER])
    msg = str(err.value)
    assert "stage 0 (cosine_ray:stage:0) asks CPU 0.5, datacenter_gpu 1: no node has enough datacenter_gpu" in msg
    assert "the cluster offers node 1: CPU 2, consumer_gpu 8; node 2: CPU 2, consumer_gpu 8" in msg
    with pytest.raises(PlacementError, match="stage 0 .* asks CPU 3, datacenter_gpu 1: no node has enough CPU"):
        check_placement(config(num_cpus_per_actor=3), [HEAD, WORKER])


def test_packing_puts_each_actor_where_there_is_most_room():
    asks = actor_asks(config(drafters="ngram,suffix:code", use_resources=False))
    plan = plan_placement(asks, [{"CPU": 1.0}, {"CPU": 2.0}])
    assert not plan.unplaceable and sorted(plan.placed.values()) == [0, 1, 1, 1]
    assert plan_placement(asks, [{"CPU": 1.5}]).unplaceable[0][0].name == "cosine_ray:drafter:1"
    assert check_placement(config(use_resources=False), [{"CPU": 4.0}]) == []  # 7 actors x 0.5 CPU fit 4 CPUs
    assert [a.name for a, _ in check_placement(config(use_resources=False), [{"CPU": 3.0}])] == ["cosine_ray:drafter:4"]
