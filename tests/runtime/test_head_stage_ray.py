"""The feature head over Ray: it lives in the last stage's actor, which computes its features
(``runtime.actors.StageHost``), and the engine reaches it as a drafter (``runtime.backend``, as
the Serve engine builds it). The head is the one ``cosine-ray distill`` trains in seconds on a
tiny target (tests/distill/test_distill_cli.py's fixtures)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.prediction import PREDICTION
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from distill.test_distill_cli import PROMPTS, distilled, tiny_target  # noqa: F401 (fixtures)

pytestmark = pytest.mark.real_model  # SmolLM2's tokenizer


def _config(head: str, tiny_target, **cluster):
    from cosine_ray.engine.config import config_from_dict
    return config_from_dict({"model": str(tiny_target.path), "drafters": head, "num_stages": 2,
                             "cluster": {"num_cpus_per_actor": 0, "stage_deadline_s": 60.0, **cluster},
                             "runtime": {"drafter_deadline_s": 30.0}})


def _plain_greedy(tiny_target) -> tuple[list[list[int]], list[list[int]]]:
    plain = LocalEngine(EngineConfig(model=str(tiny_target.path), drafters=()))
    prompts = [plain.encode(p) for p in (PROMPTS["code"][1], PROMPTS["math"][2], "an unseen prompt")]
    return prompts, [o.new_token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=16))]


async def _generate(core, prompts):
    from cosine_ray.engine.loop import EngineLoop
    loop = EngineLoop(core)
    outs = await asyncio.gather(*(loop.generate_all(p, SamplingParams(max_tokens=16)) for p in prompts))
    await loop.shutdown()
    return outs


@pytest.mark.ray
def test_the_head_drafts_beside_the_last_stage_actor(distilled, tiny_target, ray_cluster):
    """Greedy text equals plain decoding's, and the head did draft (without features it drafts
    nothing)."""
    import ray

    from cosine_ray.engine.backend import build_engine
    from cosine_ray.runtime.backend import ActorBackend

    config = _config(f"head:{distilled / 'out' / 'head'}", tiny_target)
    prompts, expected = _plain_greedy(tiny_target)

    async def main():
        backend = ActorBackend(config, f"test.head.{uuid.uuid4().hex[:6]}", ready_timeout_s=300)
        try:
            core = await build_engine(config, backend, checkpoint=tiny_target)
            remote = [d for d in core.drafters if d.name != PREDICTION]  # the prediction drafter: in process
            assert [d.slot for d in remote] == [backend.stage_slots[-1]]  # no actor of its own
            assert backend.drafter_slots == []
            return await _generate(core, prompts)
        finally:
            for s in backend.stage_slots:
                ray.kill(s.handle, no_restart=True)

    outs = asyncio.run(asyncio.wait_for(main(), 300))
    assert [o.new_token_ids for o in outs] == expected
    assert sum(o.stats.num_draft_tokens for o in outs) > 0


def test_the_head_drafts_beside_stages_in_the_engine(distilled, tiny_target):
    """``cluster.stages_in_engine``: the engine builds the stages and the head in its own process
    (the Ray backend builds them as ``InProcess`` does; no actor starts) and reaches the head as
    an in-process drafter; the text is plain decoding's and the head drafted."""
    from cosine_ray.engine.backend import build_engine
    from cosine_ray.engine.worker.clients import LocalDrafterClient, LocalTargetClient
    from cosine_ray.runtime.backend import ActorBackend

    config = _config(f"head:{distilled / 'out' / 'head'}", tiny_target, stages_in_engine=True)
    prompts, expected = _plain_greedy(tiny_target)

    async def main():
        backend = ActorBackend(config, "unused")
        core = await build_engine(config, backend, checkpoint=tiny_target)
        assert [type(d) for d in core.drafters] == [LocalDrafterClient] * 2  # the head, then the prediction drafter
        assert core.drafters[-1].name == PREDICTION
        assert isinstance(core.target.inner, LocalTargetClient) and backend.stage_slots == []
        return await _generate(core, prompts)

    outs = asyncio.run(asyncio.wait_for(main(), 300))
    assert [o.new_token_ids for o in outs] == expected
    assert sum(o.stats.num_draft_tokens for o in outs) > 0
