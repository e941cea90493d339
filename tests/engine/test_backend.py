"""``build_engine`` (``engine/backend.py``): one builder for every backend. In process it runs
from synchronous code and from inside an event loop; the Ray backend with the stages in the
engine builds the same engine without starting an actor; the stages come from
``models.loader.load_target`` in one call."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cosine_ray.engine.backend import InProcess, StartedTarget, build_engine, build_local_engine
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.worker.clients import LocalDrafterClient, LocalTargetClient
from cosine_ray.models.loader import build_stages, load_target

PROMPTS = [[5, 17, 42, 9], list(range(30, 50)), [7] * 12]
PARAMS = SamplingParams(max_tokens=12)


def generate(core, prompts=PROMPTS) -> list[list[int]]:
    async def run():
        loop = EngineLoop(core)
        try:
            return await asyncio.gather(*(loop.generate_all(p, PARAMS) for p in prompts))
        finally:
            await loop.shutdown()
    return [o.new_token_ids for o in asyncio.run(run())]


def config_of(ckpt, drafters: str = "ngram,self", **settings) -> EngineConfig:
    return EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters), num_stages=2).replace(**settings)


def test_the_in_process_engine_builds_without_an_event_loop_and_inside_one(tiny_checkpoint):
    config = config_of(tiny_checkpoint)
    outside = build_local_engine(config, checkpoint=tiny_checkpoint)

    async def inside():
        return build_local_engine(config, checkpoint=tiny_checkpoint)

    core = asyncio.run(inside())
    plain = build_local_engine(config_of(tiny_checkpoint, "none"), checkpoint=tiny_checkpoint)
    assert generate(outside) == generate(core) == generate(plain)
    assert isinstance(core.target.inner, LocalTargetClient) and len(core.target.inner.worker.stages) == 2
    # the configured drafters, then the prediction drafter every speculating engine has
    assert [type(d) for d in core.drafters] == [LocalDrafterClient] * 3 and core.drafters[-1].name == "prediction"
    # resolved once for this model and the stages in process: one lane, the CPU's batch
    assert core.config.is_resolved and core.config.scheduler.num_lanes == 1
    assert core.config.scheduler.max_num_seqs == 8
    assert core.config.scheduler.max_model_len == min(8192, tiny_checkpoint.config.max_position_embeddings)


class WaitingBackend(InProcess):
    async def ready(self) -> None:
        await asyncio.sleep(0)


def test_building_in_process_refuses_a_backend_that_waits(tiny_checkpoint, monkeypatch):
    import cosine_ray.engine.backend as backend_module

    monkeypatch.setattr(backend_module, "InProcess", WaitingBackend)
    with pytest.raises(RuntimeError, match="waited"):
        build_local_engine(config_of(tiny_checkpoint, "none"), checkpoint=tiny_checkpoint)


def test_the_ray_backend_with_stages_in_the_engine_starts_no_actor(tiny_checkpoint):
    """The Serve engine's build with ``cluster.stages_in_engine`` and every drafter kind in the
    engine: no Ray cluster is needed, and the text is the in-process engine's."""
    pytest.importorskip("ray")
    from cosine_ray.runtime.backend import ActorBackend

    config = config_of(tiny_checkpoint, stages_in_engine=True, drafters_in_engine="ngram,self")
    backend = ActorBackend(config, "unused")
    core = asyncio.run(build_engine(config, backend, checkpoint=tiny_checkpoint))
    assert backend.stage_slots == [] and backend.drafter_slots == []
    assert isinstance(core.target.inner, LocalTargetClient)
    # the configured drafters, then the prediction drafter every speculating engine has
    assert [type(d) for d in core.drafters] == [LocalDrafterClient] * 3 and core.drafters[-1].name == "prediction"
    assert core.config.scheduler.num_lanes == 1
    assert generate(core) == generate(build_local_engine(config, checkpoint=tiny_checkpoint))


def test_a_ray_backend_resolves_one_lane_per_stage_actor(tiny_checkpoint):
    """What the builder resolves for stage actors (no actor is started: the config alone)."""
    config = config_of(tiny_checkpoint).resolved(stages_in_process=False)
    assert config.scheduler.num_lanes == 2
    assert config_of(tiny_checkpoint, num_lanes=3).resolved(stages_in_process=False).scheduler.num_lanes == 3


def test_load_target_builds_the_stages_in_one_call(tiny_checkpoint):
    whole = load_target(tiny_checkpoint, num_stages=2)
    assert [(s.layer_start, s.layer_end) for s in whole.stages] == [(0, 2), (2, 4)]
    (last,) = load_target(str(tiny_checkpoint.path), num_stages=2, stage_index=1).stages
    assert (last.layer_start, last.layer_end) == (2, 4) and last.is_last
    (one,) = build_stages(whole.checkpoint, whole.weights, dtype=torch.float32)
    assert (one.layer_start, one.layer_end) == (0, tiny_checkpoint.config.num_layers)


def test_a_started_target_without_weights_reads_the_embeddings_from_the_checkpoint(tiny_checkpoint):
    """A backend whose stages run elsewhere hands back no weights: the builder reads the
    embedding table itself and the engine is the same."""
    class RemoteLike(InProcess):
        def target(self, config, checkpoint) -> StartedTarget:
            return StartedTarget(super().target(config, checkpoint).client)

    config = config_of(tiny_checkpoint, "ngram")
    core = asyncio.run(build_engine(config, RemoteLike(), checkpoint=tiny_checkpoint))
    reference = build_local_engine(config, checkpoint=tiny_checkpoint)
    assert torch.equal(core.learner.unit_embeddings, reference.learner.unit_embeddings)
    assert generate(core) == generate(reference)
