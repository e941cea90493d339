"""Twins (``engine.modes.twins``): identical greedy requests in flight. The follower waits for its
leader and drafts from its text; outputs stay the target's greedy text.

Fakes only (tests/support/fakes.py): a lookup-table target and a drafter that is always wrong,
so every token a follower gets ahead of plain decoding is the twin rule's doing."""

from __future__ import annotations

import asyncio

import pytest

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.request import Request, SamplingParams
from cosine_ray.engine.modes.twins import TWIN, Twins

from support.factories import engine_config
from support.fakes import VOCAB, AdversarialDrafter, TableTarget, drain  # noqa: E402

P, Q = [3, 1, 4, 1, 5], [9, 2, 6]


def make(target, **config) -> EngineCore:
    return EngineCore(engine_config(**config), target, [AdversarialDrafter("adv", target, confidence=0.6)],
                      vocab_size=VOCAB, seed=0)


def run(core, requests):
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    return asyncio.run(drain(core))


@pytest.mark.parametrize("twins", [True, False])
def test_a_follower_waits_for_its_leader_and_verifies_its_text_whole(twins):
    target = TableTarget()
    core = make(target, num_speculative_tokens=4, twins=twins)
    greedy = SamplingParams(max_tokens=40)
    tokens, finals = run(core, [("lead", P, greedy), ("other", Q, greedy), ("follow", P, greedy)])
    assert tokens["lead"] == tokens["follow"] == target.greedy(P, 40)
    assert tokens["other"] == target.greedy(Q, 40)
    lead, follow = finals["lead"].stats, finals["follow"].stats
    assert lead.accepted_by.get("adv", 0) == 0  # the drafter never helps: every gain below is the twin's
    if twins:
        # 40 tokens = the prefill's 1 + 39 in steps of at most 5 (4 draft nodes + the bonus)
        assert follow.num_verify_steps <= 10, follow.num_verify_steps
        assert follow.accepted_by.get(TWIN, 0) >= 30 and follow.accepted_by == {TWIN: follow.num_accepted_tokens}
        assert follow.num_routed_steps == 0  # never sent to the drafters
        assert lead.num_verify_steps >= 30 and TWIN not in lead.drafted_by
    else:
        assert follow.num_verify_steps >= 30 and TWIN not in follow.drafted_by
    assert core.num_tracked_requests == 0


def test_a_finished_leader_still_drafts_the_rest_and_sampled_requests_are_never_twins():
    target = TableTarget()
    core = make(target, num_speculative_tokens=4)
    tokens, finals = run(core, [
        ("short", P, SamplingParams(max_tokens=24)), ("long", P, SamplingParams(max_tokens=40)),
        ("s1", Q, SamplingParams(max_tokens=20, temperature=1.0, seed=1)),
        ("s2", Q, SamplingParams(max_tokens=20, temperature=1.0, seed=2))])
    assert tokens["short"] == target.greedy(P, 24) and tokens["long"] == target.greedy(P, 40)
    long = finals["long"].stats
    # it followed "short" to its end (24 tokens), then went on alone: a plain step a token
    assert long.accepted_by.get(TWIN, 0) >= 18
    assert long.num_verify_steps <= 8 + 16, long.num_verify_steps
    assert TWIN not in finals["s1"].stats.drafted_by and TWIN not in finals["s2"].stats.drafted_by
    assert core.num_tracked_requests == 0


def request(rid, prompt, output, *, max_tokens=64, t=0.0, temperature=0.0) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature))
    r.output_token_ids = list(output)
    r.num_computed_tokens = r.num_tokens - 1  # decoding: its KV holds all but the last token
    r.admitted_time = t
    return r


def test_who_leads_who_waits_and_what_a_follower_drafts():
    twins = Twins()
    budget = lambda r: 4  # noqa: E731
    lead = request("a", P, [7, 8, 9, 10, 11, 12, 13], t=0)
    near = request("b", P, [7, 8, 9, 10], t=1)            # 3 behind: waits (a step could commit 5)
    far = request("c", P, [7], t=2)                       # 6 behind: drafts the next 4
    left = request("d", P, [7, 8, 1], t=3)               # its text left the leader's: on its own
    tie = request("e", P, [7, 8, 9, 10, 11, 12, 13], t=4)  # level with the leader, admitted later: waits
    other = request("f", Q, [7, 8], t=5)
    sampled = request("g", P, [7], t=6, temperature=1.0)
    running = [lead, near, far, left, tie, other, sampled]
    plan = twins.plan(running, running, budget)
    assert plan.held == {"b", "e"}
    assert plan.drafts == {"c": (8, 9, 10, 11)}
    assert twins.plan(running, [far], budget).held == set()  # only the lane's requests are planned
    # the leader leaves the pool (finished): its text still drafts the others, none waits for it
    rest = [near, far, left, tie, other]
    plan = twins.plan(rest, rest, budget)
    assert plan.held == {"b"}  # now behind "e", which is 3 ahead of it and runs
    plan = twins.plan([near, far, left], [near, far, left], budget)
    assert plan.held == set() and plan.drafts == {"b": (11, 12, 13), "c": (8, 9, 10, 11)}
    twins.forget([])  # none of them runs any more
    assert twins.num_tracked == 0


def test_a_follower_waits_only_for_a_leader_that_advances():
    now = [0.0]
    twins = Twins(max_stall_s=2.0, clock=lambda: now[0])
    lead, follow = request("a", P, [7, 8], t=0), request("b", P, [7], t=1)

    def held_at(t):
        now[0] = t
        return bool(twins.plan([lead, follow], [lead, follow], lambda r: 4).held)

    # asked every millisecond (another lane's loop): held however often it asks
    assert all(held_at(t / 1000) for t in range(0, 1900, 1))
    assert not held_at(2.5)  # the leader has not grown for 2 s: the follower goes on alone
    lead.output_token_ids.append(9)
    assert held_at(2.6) and held_at(4.5) and not held_at(4.7)


class SlowTarget(TableTarget):
    """Each verify call takes ``seconds`` and yields to the event loop meanwhile (a remote stage)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def score(self, items):
        await asyncio.sleep(self.seconds)
        return await super().score(items)


def test_a_follower_in_another_lane_still_waits_for_its_leader():
    """Two lanes (pipeline stages): the leader and its follower are admitted into different
    lanes, and the follower's lane asks again every millisecond while the leader's 50 ms step
    runs. It must still wait for the leader and take its text."""
    from cosine_ray.engine.loop import EngineLoop

    target = SlowTarget(0.05)
    core = make(target, num_speculative_tokens=4, num_lanes=2)
    loop = EngineLoop(core)

    lanes = {}

    async def go():
        async def one(rid, delay):
            await asyncio.sleep(delay)
            return await loop.generate_all(P, SamplingParams(max_tokens=40), request_id=rid)

        async def look():
            await asyncio.sleep(0.2)
            lanes.update({rid: r.lane for rid, r in core.pool.running.items()})
        try:
            return (await asyncio.gather(one("lead", 0.0), one("follow", 0.01), look()))[:2]
        finally:
            await loop.shutdown()

    lead, follow = asyncio.run(go())
    assert lead.new_token_ids == follow.new_token_ids == target.greedy(P, 40)
    assert lanes.keys() == {"lead", "follow"} and lanes["lead"] != lanes["follow"]
    assert follow.stats.accepted_by.get(TWIN, 0) >= 30, follow.stats
    assert follow.stats.num_routed_steps <= 2, follow.stats
