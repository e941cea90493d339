"""Twins (``engine.twins``): identical greedy requests in flight. The follower waits for its
leader and drafts from its text; outputs stay the target's greedy text.

Fakes only (tests/engine/fakes.py): a lookup-table target and a drafter that is always wrong,
so every token a follower gets ahead of plain decoding is the twin rule's doing."""

from __future__ import annotations

import asyncio

import pytest

from cosine_ray.engine.config import StepConfig
from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.request import Request, SamplingParams
from cosine_ray.engine.twins import TWIN, Twins

from fakes import VOCAB, AdversarialDrafter, TableTarget, drain  # noqa: E402

P, Q = [3, 1, 4, 1, 5], [9, 2, 6]


def make(target, **config) -> EngineCore:
    return EngineCore(StepConfig(**config), target, [AdversarialDrafter("adv", target, confidence=0.6)],
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
    assert core.scheduler.num_tracked_requests == 0


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
    assert core.scheduler.num_tracked_requests == 0


def request(rid, prompt, output, *, max_tokens=64, t=0.0, temperature=0.0) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature))
    r.output_token_ids = list(output)
    r.admitted_time = t
    return r


def test_who_leads_who_waits_and_what_a_follower_drafts():
    twins = Twins(max_hold_steps=3)
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
    twins.forget(["a", "b", "c", "d", "e", "f", "g"])
    assert twins.num_tracked == 0


def test_a_follower_whose_leader_does_not_advance_is_held_only_so_long():
    twins = Twins(max_hold_steps=3)
    lead, follow = request("a", P, [7, 8], t=0), request("b", P, [7], t=1)
    held = [bool(twins.plan([lead, follow], [lead, follow], lambda r: 4).held) for _ in range(5)]
    assert held == [True, True, True, False, True]
