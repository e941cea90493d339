"""The engine shares its running slots fairly between tenants (API keys), then between the users
of one tenant: waiting requests are admitted in turn, and a tenant that waits while another runs
more than its share preempts one of the other's requests, which resumes with the same text
(fakes only, ``tests/support/fakes.py``)."""

from __future__ import annotations

import asyncio
import random

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.owners.pool import MIN_STEPS_BEFORE_FAIR_PREEMPTION
from cosine_ray.engine.request import SamplingParams, Tenant

from support.factories import engine_config, make_pool, make_request
from support.fakes import VOCAB, AdversarialDrafter, TableTarget

A, B = Tenant("key-a"), Tenant("key-b")


def make(target, *, drafters=None, **config) -> EngineCore:
    drafters = [AdversarialDrafter("adv", target, confidence=0.6)] if drafters is None else drafters
    return EngineCore(engine_config(**config), target, drafters, vocab_size=VOCAB, seed=0)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


class Watch:
    """Steps the core one at a time, collecting every request's tokens and the step at which
    each request got its first one; checks every fair preemption against the churn bound, and
    notes the running requests of each tenant after each admission (``shares``)."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.steps = core, 0
        self.tokens: dict[str, list[int]] = {}
        self.first_at: dict[str, int] = {}
        self.finals = {}
        self.too_early: list[str] = []
        self.shares: list[tuple[int, int]] = []
        preempt, admit = core.scheduler.preempt, core.scheduler._admit

        def admitting():
            admit()
            names = [r.tenant.name for r in core.running.values()]
            self.shares.append((names.count(A.name), names.count(B.name)))

        core.scheduler._admit = admitting

        def checked(request, *, fair=False):
            if fair and request.num_decode_steps - request.decode_steps_at_admission < MIN_STEPS_BEFORE_FAIR_PREEMPTION:
                self.too_early.append(request.request_id)
            preempt(request, fair=fair)

        core.scheduler.preempt = checked

    async def step(self) -> None:
        self.steps += 1
        assert self.steps < 5_000, "stalled"
        for out in await self.core.step():
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.new_token_ids:
                self.first_at.setdefault(out.request_id, self.steps)
            if out.finished:
                self.finals[out.request_id] = out

    async def until_done(self) -> None:
        while self.core.has_work:
            await self.step()


def test_a_second_tenant_is_served_at_once_beside_one_that_queued_a_lot():
    """Key A queues 24 long requests (three times the batch) before key B's two short ones
    arrive: B's run within a few steps (A's running requests are preempted down to A's share)
    where first come first served kept them waiting until A's had finished. Every text is the
    target's, the preempted ones' included."""
    target = TableTarget()
    core = make(target, max_num_seqs=8, num_speculative_tokens=3)
    prompts = {f"a{i}": tokens(12, seed=i) for i in range(24)} | {f"b{i}": tokens(9, seed=100 + i) for i in range(2)}
    watch = Watch(core)

    async def go():
        for rid, prompt in prompts.items():
            if rid.startswith("a"):
                core.add_request(rid, prompt, SamplingParams(max_tokens=40), A)
        for _ in range(6):  # A fills the batch and runs
            await watch.step()
        arrived = watch.steps
        for rid in ("b0", "b1"):
            core.add_request(rid, prompts[rid], SamplingParams(max_tokens=8), B)
        while "b0" not in watch.finals or "b1" not in watch.finals:
            await watch.step()
        await watch.step()
        shares = sorted(r.tenant.name for r in core.running.values())
        await watch.until_done()
        return arrived, shares

    arrived, shares = asyncio.run(go())
    waited = max(watch.first_at["b0"], watch.first_at["b1"]) - arrived
    assert waited <= MIN_STEPS_BEFORE_FAIR_PREEMPTION + 2, waited  # first come first served: ~80 steps
    assert core.scheduler.num_fair_preemptions >= 2 and not watch.too_early
    assert watch.tokens == {rid: target.greedy(p, 40 if rid.startswith("a") else 8) for rid, p in prompts.items()}
    assert sum(f.stats.num_preemptions for f in watch.finals.values()) == \
        core.scheduler.num_fair_preemptions + core.scheduler.num_preemptions
    assert all(f.finish_reason == "length" for f in watch.finals.values())
    assert core.num_tracked_requests == 0 and shares.count("key-a") == 8  # B done: A has the batch again


def test_two_tenants_with_long_queues_share_the_batch_evenly():
    target = TableTarget()
    core = make(target, max_num_seqs=6, num_speculative_tokens=0, drafters=[])
    watch = Watch(core)

    async def go():
        for i in range(12):
            core.add_request(f"a{i}", tokens(8, seed=i), SamplingParams(max_tokens=30), A)
        for _ in range(8):
            await watch.step()
        for i in range(12):
            core.add_request(f"b{i}", tokens(8, seed=50 + i), SamplingParams(max_tokens=30), B)
        for _ in range(2 * MIN_STEPS_BEFORE_FAIR_PREEMPTION + 4):
            await watch.step()
        start = len(watch.shares)
        for _ in range(40):
            await watch.step()
        await watch.until_done()
        return watch.shares[start:start + 40]

    shares = asyncio.run(go())
    assert all(a + b == 6 and abs(a - b) <= 1 for a, b in shares), shares  # A alone had all six
    assert not watch.too_early
    assert all(watch.tokens[rid] == target.greedy(tokens(8, seed=int(rid[1:]) + (50 if rid[0] == "b" else 0)), 30)
               for rid in watch.tokens)


def test_seeded_text_is_the_same_when_preempted_for_another_tenant():
    target = TableTarget()
    seeded = SamplingParams(max_tokens=40, temperature=0.9, seed=11)
    prompt = tokens(10, seed=3)
    alone = make(TableTarget(), num_speculative_tokens=3)
    watch_alone = Watch(alone)

    async def run_alone():
        alone.add_request("s", prompt, seeded, A)
        await watch_alone.until_done()

    asyncio.run(run_alone())
    core = make(target, max_num_seqs=4, num_speculative_tokens=3)
    watch = Watch(core)

    async def go():
        for i in range(3):
            core.add_request(f"a{i}", tokens(10, seed=20 + i), SamplingParams(max_tokens=40, temperature=0.9,
                                                                               seed=i), A)
        core.add_request("s", prompt, seeded, A)  # A's last arrival: the first of A's to be preempted
        for _ in range(6):
            await watch.step()
        for i in range(3):
            core.add_request(f"b{i}", tokens(6, seed=40 + i), SamplingParams(max_tokens=30), B)
        await watch.until_done()

    asyncio.run(go())
    assert core.scheduler.num_fair_preemptions >= 2
    assert watch.finals["s"].stats.num_preemptions >= 1
    assert watch.tokens["s"] == watch_alone.tokens["s"]
    assert not watch.too_early


def test_users_of_one_key_take_turns_and_one_tenant_alone_is_first_come_first_served():
    target = TableTarget()
    core = make(target, max_num_seqs=4, num_speculative_tokens=0, drafters=[])
    watch = Watch(core)
    heavy, light = Tenant("key-a", "alice"), Tenant("key-a", "bob")

    async def go():
        for i in range(10):
            core.add_request(f"h{i}", tokens(6, seed=i), SamplingParams(max_tokens=25), heavy)
        for _ in range(MIN_STEPS_BEFORE_FAIR_PREEMPTION + 2):
            await watch.step()
        arrived = watch.steps
        core.add_request("l0", tokens(6, seed=99), SamplingParams(max_tokens=5), light)
        while "l0" not in watch.finals:
            await watch.step()
        return arrived

    arrived = asyncio.run(go())
    assert watch.first_at["l0"] - arrived <= 2 and core.scheduler.num_fair_preemptions == 1
    # one tenant, one user: the order of arrival, and nobody is preempted for anybody
    solo = make(TableTarget(), max_num_seqs=2, num_speculative_tokens=0, drafters=[])
    solo_watch = Watch(solo)

    async def fifo():
        for i in range(5):
            solo.add_request(f"r{i}", tokens(6, seed=i), SamplingParams(max_tokens=10 + i))
        await solo_watch.until_done()

    asyncio.run(fifo())
    order = sorted(solo_watch.first_at, key=lambda rid: (solo_watch.first_at[rid], rid))
    assert order == [f"r{i}" for i in range(5)] and solo.scheduler.num_fair_preemptions == 0


def test_the_pool_offers_the_tenant_that_runs_the_fewest_and_preempts_only_an_uneven_share():
    pool = make_pool(max_num_seqs=4)
    for i in range(3):
        r = make_request(f"a{i}", arrival_time=float(i))
        r.tenant, r.num_decode_steps = A, MIN_STEPS_BEFORE_FAIR_PREEMPTION
        pool.running[r.request_id] = r
    fresh = make_request("a3", arrival_time=3.0)
    fresh.tenant = A  # admitted just now: it has not run a step since
    pool.running["a3"] = fresh
    for rid, tenant in (("a9", A), ("b0", B), ("b1", B)):
        pool.add(rid, [1, 2], SamplingParams(max_tokens=4), tenant)
    assert pool.next_waiting().request_id == "b0"  # A runs four, B none: B's first, though A's came first
    assert [r.request_id for r in pool.over_share(pool.waiting[1])] == ["a2", "a1", "a0"]  # latest first, not a3
    assert pool.over_share(pool.waiting[0]) == []  # A's own waiting request preempts none of A's
    pool.running.pop("a0"), pool.running.pop("a1")
    b = pool.next_waiting()
    pool.admit(b)
    assert pool.over_share(pool.next_waiting()) == []  # A 2, B 1: no swap of equal shares
