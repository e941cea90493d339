"""The pipeline modes over real stage actors on the Ray runtime. PipeDec
(``--pipeline-mode pipedec``): every stage works on its own tree layer at once, hidden states
move actor to actor as ObjectRefs, and a prune travels as an ordered actor call. PEARL
(``step.pearl``): the target's drafter runs in its own actor and drafts ahead while the stages
verify. Tiny random model (no near-ties: exact comparison with HF greedy); the engine core runs
in the test's event loop over ``RayTargetClient``, as the Serve deployment runs it. A stage
killed mid-request: Ray restarts it, the engine re-prefills and goes on, and the text is
unchanged; a drafter actor killed mid-request changes nothing either.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import torch

ray = pytest.importorskip("ray")

from cosine_ray.engine.build import make_drafter_worker  # noqa: E402
from cosine_ray.engine.config import config_from_dict  # noqa: E402
from cosine_ray.engine.core import EngineCore  # noqa: E402
from cosine_ray.engine.worker.clients import LocalDrafterClient  # noqa: E402
from cosine_ray.engine.loop import EngineLoop  # noqa: E402
from cosine_ray.engine.request import SamplingParams  # noqa: E402
from cosine_ray.models.loader import eos_token_ids  # noqa: E402
from cosine_ray.runtime.actors import DrafterActor  # noqa: E402
from cosine_ray.runtime.clients import ActorSlot, RayDrafterClient, RayTargetClient, await_ref  # noqa: E402
from cosine_ray.runtime.backend import stage_slots  # noqa: E402
from cosine_ray.runtime.placement import actor_options  # noqa: E402
from support.hf_reference import hf_greedy  # noqa: E402

pytestmark = [pytest.mark.ray]

MAX_TOKENS = 24
LONG_MAX_TOKENS = 120


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 15)] + [list(range(40, 50)) * 3]


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return tiny_checkpoint.load_hf_model()


PIPEDEC = {"pipeline_mode": "pipedec", "pipedec_width": 2, "pipedec_guard": False}
PEARL = {"pearl": "on"}


class StageEngine:
    """EngineCore + EngineLoop over ``num_stages`` stage actors; drafters in this process, or
    the model drafters (``self``) in actors of their own."""

    def __init__(self, ckpt, num_stages: int, drafters: str = "self,ngram", *, mode: dict = PIPEDEC,
                 drafter_actors: bool = False) -> None:
        self.config = config_from_dict({
            "model": str(ckpt.path), "drafters": drafters, "num_stages": num_stages,
            "scheduler": {"num_lanes": num_stages}, "runtime": {"stage_recovery_s": 120.0},
            "cluster": {"num_cpus_per_actor": 0, "stage_deadline_s": 30.0}}).replace(**mode).resolved(
            context_len=ckpt.config.max_position_embeddings, stages_in_process=False)
        self.namespace = f"test.pipemodes.{uuid.uuid4().hex[:6]}"
        self.slots = stage_slots(self.config, self.namespace)
        self.drafter_slots: dict[str, ActorSlot] = {}
        if drafter_actors:
            for i, spec in enumerate(self.config.drafters):
                if spec.kind == "self":
                    options = {**actor_options("drafter", i, self.config), "namespace": self.namespace}
                    self.drafter_slots[spec.name] = ActorSlot(
                        f"test-drafter-{i}", lambda o=options, sp=spec: DrafterActor.options(**o).remote(self.config, sp),
                        namespace=self.namespace)
        self.ckpt = ckpt

    async def start(self) -> "StageEngine":
        slots = [*self.slots, *self.drafter_slots.values()]
        await asyncio.gather(*(await_ref(s.handle.ping.remote(), 300) for s in slots))
        # a respawned drafter's first call waits for the new actor to start: as long as that takes
        drafters = [RayDrafterClient(self.drafter_slots[spec.name], spec.name, deadline_s=300.0)
                    if spec.name in self.drafter_slots else LocalDrafterClient(make_drafter_worker(spec, self.config))
                    for spec in self.config.drafters]
        self.core = EngineCore(self.config, RayTargetClient(self.slots, deadline_s=30.0),
                               drafters, vocab_size=self.ckpt.config.vocab_size,
                               eos_token_ids=eos_token_ids(self.ckpt, None))
        self.loop = EngineLoop(self.core)
        return self

    async def kv_usage(self, timeout_s: float = 10.0) -> list[dict[str, int]]:
        """Each stage's KV once nothing is held (a finished request is released by the next
        step, its release reaches the stages as a fire-and-forget call), or as it is then."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            usage = await self.core.target.inner.kv_usage()
            if all(u["requests"] == 0 for u in usage) or asyncio.get_running_loop().time() > deadline:
                return usage
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.loop.shutdown()
        for s in [*self.slots, *self.drafter_slots.values()]:
            ray.kill(s.handle, no_restart=True)


def run(coro, timeout_s: float):
    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)
    return asyncio.run(bounded())


@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipedec_on_stage_actors_equals_hf_greedy(ray_cluster, tiny_checkpoint, hf, prompts, num_stages):
    async def main():
        engine = await StageEngine(tiny_checkpoint, num_stages).start()
        try:
            outs = [await engine.loop.generate_all(p, SamplingParams(max_tokens=MAX_TOKENS)) for p in prompts]
            return outs, await engine.kv_usage()
        finally:
            await engine.close()

    outs, kv = run(main(), 300)
    assert [o.new_token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert all(o.stats.pipedec_timesteps >= MAX_TOKENS - 1 and o.stats.num_verify_steps == 0 for o in outs)
    assert sum(o.stats.pipedec_hits for o in outs) > 0
    assert kv == [{"requests": 0, "tokens": 0}] * num_stages


def test_a_second_request_ends_the_session_between_timesteps(ray_cluster, tiny_checkpoint, hf, prompts):
    """Two lanes: the first request runs alone in PipeDec on its lane; a second arrives on the
    other lane, whose steps (its prefill) run while the first lane's timesteps are in flight.
    Only the session's own lane ends it, between timesteps; both texts are HF greedy."""
    async def main():
        engine = await StageEngine(tiny_checkpoint, 2).start()
        try:
            second: list[asyncio.Task] = []

            async def first():
                tokens, last = [], None
                async for out in engine.loop.generate(prompts[2], SamplingParams(max_tokens=LONG_MAX_TOKENS)):
                    tokens += out.new_token_ids
                    last = out
                    if len(tokens) == 10:
                        second.append(asyncio.ensure_future(
                            engine.loop.generate_all(prompts[0], SamplingParams(max_tokens=MAX_TOKENS))))
                return tokens, last

            a = await first()
            return a, await second[0], await engine.kv_usage()
        finally:
            await engine.close()

    (tokens, last), other, kv = run(main(), 300)
    assert tokens == hf_greedy(hf, prompts[2], LONG_MAX_TOKENS) and last.error is None
    assert other.new_token_ids == hf_greedy(hf, prompts[0], MAX_TOKENS)
    assert last.stats.pipedec_timesteps > 0 and last.stats.num_verify_steps > 0  # both modes ran
    assert kv == [{"requests": 0, "tokens": 0}] * 2


def test_stage_killed_mid_pipedec_request_recovers(ray_cluster, tiny_checkpoint, hf, prompts):
    """Stage 1 dies after a few PipeDec timesteps: the timestep fails, the engine waits for
    Ray to restart the stage, drops every request's KV, re-prefills (lanes), and the request
    goes on in PipeDec with the same greedy text."""
    async def main():
        engine = await StageEngine(tiny_checkpoint, 2).start()
        try:
            tokens, last = [], None
            old = await await_ref(engine.slots[1].handle.ping.remote(), 30)
            async for out in engine.loop.generate(prompts[2], SamplingParams(max_tokens=LONG_MAX_TOKENS)):
                tokens += out.new_token_ids
                last = out
                if len(tokens) == 8:
                    ray.kill(engine.slots[1].handle, no_restart=False)
            new = await await_ref(engine.slots[1].handle.ping.remote(), 60)
            return tokens, last, old != new, await engine.kv_usage()
        finally:
            await engine.close()

    tokens, last, restarted, kv = run(main(), 400)
    assert restarted, "the stage was not restarted"
    assert last.finish_reason == "length" and last.error is None
    assert tokens == hf_greedy(hf, prompts[2], LONG_MAX_TOKENS)
    assert last.stats.pipedec_timesteps > 8
    assert kv == [{"requests": 0, "tokens": 0}] * 2


# ---- PEARL: the drafter actor drafts ahead while the stages verify ------------------------------

@pytest.mark.parametrize("num_stages", [2, 3])
def test_pearl_on_stage_actors_equals_hf_greedy(ray_cluster, tiny_checkpoint, hf, prompts, num_stages):
    """All prompts at once over S lanes; the target's own drafter in an actor (always right:
    after each request's first decode step, every tree was drafted during a verification)."""
    async def main():
        engine = await StageEngine(tiny_checkpoint, num_stages, "self", mode=PEARL, drafter_actors=True).start()
        try:
            outs = await asyncio.gather(*(engine.loop.generate_all(p, SamplingParams(max_tokens=MAX_TOKENS))
                                          for p in prompts))
            return outs, engine.core.pearl.stats, await engine.kv_usage()
        finally:
            await engine.close()

    outs, stats, kv = run(main(), 300)
    assert [o.new_token_ids for o in outs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert stats.post_verify > 0 and stats.pre_verify >= len(prompts)
    assert all(o.stats.num_accepted_tokens > 0 for o in outs)
    assert kv == [{"requests": 0, "tokens": 0}] * num_stages


@pytest.mark.parametrize("victim", ["drafter", "stage"])
def test_actor_killed_mid_pearl_request(ray_cluster, tiny_checkpoint, hf, prompts, victim):
    """The drafter actor is killed for good (its slot spawns a new one; meanwhile steps verify
    their roots), or stage 1 is killed (Ray restarts it, the request re-prefills): the text
    is HF greedy, and PEARL drafts ahead again afterwards."""
    async def main():
        engine = await StageEngine(tiny_checkpoint, 2, "self", mode=PEARL, drafter_actors=True).start()
        try:
            tokens, last, at_kill = [], None, None
            slot = engine.drafter_slots["self"] if victim == "drafter" else engine.slots[1]
            async for out in engine.loop.generate(prompts[2], SamplingParams(max_tokens=LONG_MAX_TOKENS)):
                tokens += out.new_token_ids
                last = out
                if at_kill is None and len(tokens) >= 8:
                    at_kill = engine.core.pearl.stats.post_verify
                    ray.kill(slot.handle, no_restart=victim == "drafter")
            return tokens, last, at_kill, engine.core.pearl.stats.post_verify, await engine.kv_usage()
        finally:
            await engine.close()

    tokens, last, at_kill, post_verify, kv = run(main(), 400)
    assert at_kill is not None and last.finish_reason == "length" and last.error is None
    assert tokens == hf_greedy(hf, prompts[2], LONG_MAX_TOKENS)
    assert post_verify > at_kill  # drafting ahead came back after the kill
    assert kv == [{"requests": 0, "tokens": 0}] * 2
