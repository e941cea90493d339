"""The feature head over Ray: it lives in the last stage's actor, which computes its features
(``runtime.actors.StageHost``), and the engine reaches it as a drafter (``drafter_clients``, as
the Serve engine wires it). The head is the one ``cosine-ray distill`` trains in seconds on a
tiny target (tests/distill/test_distill_cli.py's fixtures)."""

from __future__ import annotations

import pytest

from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from distill.test_distill_cli import PROMPTS, distilled, tiny_target  # noqa: F401 (fixtures)

pytestmark = pytest.mark.real_model  # SmolLM2's tokenizer



@pytest.mark.ray
def test_the_head_drafts_beside_the_last_stage_actor(distilled, tiny_target, ray_cluster):
    """Greedy text equals plain decoding's, and the head did draft (without features it drafts
    nothing)."""
    import asyncio
    import uuid

    import ray

    from cosine_ray.engine.build import eos_token_ids
    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.engine.core import EngineCore
    from cosine_ray.engine.loop import EngineLoop
    from cosine_ray.runtime.clients import RayTargetClient, await_ref
    from cosine_ray.runtime.engine_server import drafter_clients, stage_slots

    head = f"head:{distilled / 'out' / 'head'}"
    config = config_from_dict({"model": str(tiny_target.path), "drafters": head, "num_stages": 2,
                               "cluster": {"num_cpus_per_actor": 0, "stage_deadline_s": 60.0},
                               "runtime": {"drafter_deadline_s": 30.0}}).resolved(
        context_len=tiny_target.config.max_position_embeddings, stages_in_process=False)
    plain = LocalEngine(EngineConfig(model=str(tiny_target.path), drafters=()))
    prompts = [plain.encode(p) for p in (PROMPTS["code"][1], PROMPTS["math"][2], "an unseen prompt")]
    expected = [o.new_token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=16))]

    async def main():
        namespace = f"test.head.{uuid.uuid4().hex[:6]}"
        slots = stage_slots(config, namespace)
        drafters = drafter_clients(config, slots, namespace)
        try:
            await asyncio.gather(*(await_ref(s.handle.ping.remote(), 300) for s in slots))
            assert [d.slot for d in drafters] == [slots[-1]]  # no actor of its own
            core = EngineCore(config, RayTargetClient(slots, deadline_s=60.0), drafters,
                              vocab_size=tiny_target.config.vocab_size, eos_token_ids=eos_token_ids(tiny_target, None))
            loop = EngineLoop(core)
            outs = await asyncio.gather(*(loop.generate_all(p, SamplingParams(max_tokens=16)) for p in prompts))
            await loop.shutdown()
            return outs
        finally:
            for s in slots:
                ray.kill(s.handle, no_restart=True)

    outs = asyncio.run(asyncio.wait_for(main(), 300))
    assert [o.new_token_ids for o in outs] == expected
    assert sum(o.stats.num_draft_tokens for o in outs) > 0



def test_the_head_drafts_beside_stages_in_the_engine(distilled, tiny_target):
    """``cluster.stages_in_engine``: the engine builds the stages and the head in its own process
    (``local_target``) and reaches the head as an in-process drafter; the text is plain
    decoding's and the head drafted."""
    import asyncio

    from cosine_ray.engine.build import eos_token_ids
    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.engine.core import EngineCore
    from cosine_ray.engine.loop import EngineLoop
    from cosine_ray.engine.owners.drafting import LocalDrafterClient
    from cosine_ray.runtime.engine_server import drafter_clients, local_target

    config = config_from_dict({"model": str(tiny_target.path), "drafters": f"head:{distilled / 'out' / 'head'}",
                               "num_stages": 2, "cluster": {"stages_in_engine": True}}).resolved(
        context_len=tiny_target.config.max_position_embeddings)
    plain = LocalEngine(EngineConfig(model=str(tiny_target.path), drafters=()))
    prompts = [plain.encode(p) for p in (PROMPTS["code"][1], PROMPTS["math"][2], "an unseen prompt")]
    expected = [o.new_token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=16))]
    target, head = local_target(config, tiny_target)
    drafters = drafter_clients(config, [], "unused", head=head)
    assert head is not None and [type(d) for d in drafters] == [LocalDrafterClient]

    async def main():
        core = EngineCore(config, target, drafters, vocab_size=tiny_target.config.vocab_size,
                          eos_token_ids=eos_token_ids(tiny_target, None), kv_num_blocks=await target.kv_capacity())
        loop = EngineLoop(core)
        outs = await asyncio.gather(*(loop.generate_all(p, SamplingParams(max_tokens=16)) for p in prompts))
        await loop.shutdown()
        return outs

    outs = asyncio.run(asyncio.wait_for(main(), 300))
    assert [o.new_token_ids for o in outs] == expected
    assert sum(o.stats.num_draft_tokens for o in outs) > 0
