"""The engine's config tree (``engine/config.py``): a key of an older config is refused with the
key that replaced it, the defaults that depend on the device and deployment are filled in by
``EngineConfig.resolved`` alone, and a config survives ``config_to_dict`` / ``config_from_dict``."""

from __future__ import annotations

import dataclasses

import pytest

from cosine_ray.engine.config import (CPU_MAX_NUM_BATCHED_TOKENS, CPU_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS,
                                      CUDA_MAX_NUM_SEQS, SECTIONS, SETTING_PATHS, EngineConfig, SchedulerConfig,
                                      config_from_dict, config_to_dict, parse_drafters)


@pytest.mark.parametrize("data, message", [
    ({"max_batch_size": 4}, "'max_batch_size' was renamed: use 'scheduler.max_num_seqs'"),
    ({"max_num_seqs": 4}, "'max_num_seqs' moved: use 'scheduler.max_num_seqs'"),
    ({"num_speculative_tokens": 4}, "'num_speculative_tokens' moved: use 'speculation.num_speculative_tokens'"),
    ({"runner": "eager"}, "'runner' moved: use 'runtime.runner'"),
    ({"suffix_index_tokens": 10}, "'suffix_index_tokens' moved: use 'runtime.suffix_index_tokens'"),
    ({"experiments": {"num_lanes": 2}}, "'experiments.num_lanes' moved: use 'scheduler.num_lanes'"),
    ({"experiments": {"stage_recovery_s": 9.0}}, "'experiments.stage_recovery_s' moved: use 'runtime.stage_recovery_s'"),
    ({"experiments": {"pearl": "on"}}, "'experiments.pearl' moved: use 'speculation.pearl'"),
    ({"step": {"max_batch_size": 4}}, "'step.max_batch_size' was renamed: use 'scheduler.max_num_seqs'"),
    ({"router": {"drafter_deadline_s": 1.0}}, "'router.drafter_deadline_s' moved: use 'runtime.drafter_deadline_s'"),
    ({"step": 5}, "'step' was split: its keys are under scheduler, speculation, runtime, cluster, experiments"),
    ({"cluster": {"drafters_in_router": "none"}},
     "'cluster.drafters_in_router' was renamed: use 'cluster.drafters_in_engine'"),
    ({"speculation": {"max_num_seqs": 4}}, "'speculation.max_num_seqs' moved: use 'scheduler.max_num_seqs'"),
])
def test_an_old_key_is_one_error_naming_its_new_key(data, message):
    with pytest.raises(ValueError) as info:
        config_from_dict(data)
    assert message in str(info.value) and len(str(info.value).splitlines()) == 1


def test_every_old_key_of_a_file_is_named_in_the_one_error():
    with pytest.raises(ValueError) as info:
        config_from_dict({"max_batch_size": 4, "runner": "eager", "experiments": {"num_lanes": 2}})
    text = str(info.value)
    assert "'max_batch_size' was renamed" in text and "'runner' moved" in text
    # the top level is read first; the parts' old keys follow once it is clean
    with pytest.raises(ValueError, match="'experiments.num_lanes' moved"):
        config_from_dict({"experiments": {"num_lanes": 2}})


def test_a_key_that_is_nowhere_is_unknown_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown key\(s\) bogus in scheduler; known: .*max_num_seqs"):
        config_from_dict({"scheduler": {"bogus": 1}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) bogus in the config"):
        config_from_dict({"bogus": 1})
    with pytest.raises(ValueError, match="'step.bogus' is no setting"):
        config_from_dict({"step": {"bogus": 1}})


def test_resolved_fills_the_device_defaults_and_keeps_what_is_set():
    cpu = EngineConfig().resolved()
    assert (cpu.scheduler.max_num_seqs, cpu.scheduler.max_num_batched_tokens) == (CPU_MAX_NUM_SEQS,
                                                                                   CPU_MAX_NUM_BATCHED_TOKENS)
    cuda = EngineConfig(device="cuda").resolved()
    assert (cuda.scheduler.max_num_seqs, cuda.scheduler.max_num_batched_tokens) == (CUDA_MAX_NUM_SEQS,
                                                                                    CUDA_MAX_NUM_BATCHED_TOKENS)
    assert not EngineConfig().is_resolved and cpu.is_resolved and cuda.is_resolved
    given = EngineConfig(device="cuda").replace(max_num_seqs=3, max_num_batched_tokens=7, num_lanes=5).resolved()
    assert (given.scheduler.max_num_seqs, given.scheduler.max_num_batched_tokens, given.scheduler.num_lanes) == (3, 7, 5)
    # a batch larger than the device's token budget raises the budget: every request needs a token a step
    big = EngineConfig().replace(max_num_seqs=1000).resolved()
    assert big.scheduler.max_num_batched_tokens == 1000
    assert big.resolved() == big  # resolving twice changes nothing


def test_resolved_lanes_follow_where_the_stages_run():
    config = EngineConfig(num_stages=3)
    assert config.resolved(stages_in_process=True).scheduler.num_lanes == 1
    assert config.resolved(stages_in_process=False).scheduler.num_lanes == 3


def test_resolved_caps_the_model_length_at_the_context():
    assert EngineConfig().resolved(context_len=2048).scheduler.max_model_len == 2048
    assert EngineConfig().replace(max_model_len=100).resolved(context_len=2048).scheduler.max_model_len == 100
    assert EngineConfig().resolved().scheduler.max_model_len == SchedulerConfig().max_model_len


def test_the_engine_core_refuses_a_config_not_resolved():
    from cosine_ray.engine.core import EngineCore
    from support.fakes import VOCAB, TableTarget

    with pytest.raises(ValueError, match="resolved"):
        EngineCore(EngineConfig(), TableTarget(), [], vocab_size=VOCAB)


def test_a_batch_larger_than_its_token_budget_is_refused():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(4\) must be at least max_num_seqs \(8\)"):
        config_from_dict({"scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 4}})


def test_config_round_trips_through_plain_data():
    config = config_from_dict({
        "model": "smollm2-135m", "drafters": "ngram,suffix:code,retrieval:math", "num_stages": 2,
        "kv_cache_memory": "1GiB",
        "scheduler": {"max_num_seqs": 4, "num_lanes": 2, "kv_budget_bytes": 1e9, "drain_pricing": False},
        "speculation": {"num_speculative_tokens": 5, "shared_drafters": ["ngram"], "pearl": True},
        "runtime": {"runner": "static", "drafter_deadline_s": 1.5, "suffix_index_tokens": 1000},
        "cluster": {"drafters_in_engine": "ngram", "stages_in_engine": True},
        "experiments": {"routing": "random", "scheduler": "fcfs", "adaptive": False}})
    assert config_from_dict(config_to_dict(config)) == config
    assert config_from_dict(config_to_dict(EngineConfig())) == EngineConfig()
    resolved = config.resolved(context_len=1024)
    assert config_from_dict(config_to_dict(resolved)) == resolved
    data = config_to_dict(config)
    assert set(data) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert data["speculation"]["pearl"] == "on" and data["kv_cache_memory"] == 2**30


def test_replace_takes_each_setting_by_its_own_name():
    assert set(SETTING_PATHS) == {f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
    config = EngineConfig().replace(max_num_seqs=3, pearl="auto", runner="eager", stages_in_engine=True,
                                    scheduler="fcfs", model="x", drafters=parse_drafters("ngram"))
    assert (config.scheduler.max_num_seqs, config.speculation.pearl, config.runtime.runner) == (3, "auto", "eager")
    assert config.cluster.stages_in_engine and config.experiments.scheduler == "fcfs" and config.model == "x"
    with pytest.raises(ValueError, match="unknown setting"):
        EngineConfig().replace(max_batch_size=3)
    with pytest.raises(ValueError, match="scheduler must be a SchedulerConfig"):
        EngineConfig(scheduler="fcfs")
