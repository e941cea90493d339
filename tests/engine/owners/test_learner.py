"""``Learner`` alone: what one verified step teaches (the request's counts at once; its gain
curve, routing vector, calibration and the drafters' feedback when absorbed), who is left
out (aborted, finished meanwhile, a lost step), the guard's and the participation's rules,
and the finished texts handed to drafters that learn."""

from __future__ import annotations

import asyncio

from cosine_ray.algo.adaptive import ParticipationController
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.tree_selection import SelectedTree
from cosine_ray.algo.verify import VerifyResult
from cosine_ray.engine.drafters.base import DraftFeedback, FinishedText
from cosine_ray.engine.types import Drafts, DraftTree, DraftingStats, Route, StepBatch, Verified, VerifiedBatch

from support.factories import Clock, make_learner, make_request
from support.fakes import FakeDrafter

GAINS = (0.0, 0.8, 1.4, 1.9)
ROUTE = Route(("good", "bad"), "exploit")


class RecordingGuard:
    """Stands in for ``SpeculationGuard``: records what the learner tells it."""

    levels = (0.0, 1.0)

    def __init__(self) -> None:
        self.observed = []

    def observe(self, level, tokens_per_request, plain_steps, rows):
        self.observed.append((level, tokens_per_request, plain_steps, rows))

    def current_level(self, rows):
        return 1

    def rescale_times(self, factor):
        pass


class LearningDrafter(FakeDrafter):
    learns = True

    def __init__(self, name: str, fail: bool = False) -> None:
        super().__init__(name)
        self.learned, self.fail = [], fail

    async def learn(self, texts):
        if self.fail:
            raise RuntimeError("drafter is gone")
        self.learned.extend(texts)


def setup(*, live=None, guard=None, participation=None, clock=None):
    good, bad = FakeDrafter("good"), FakeDrafter("bad")
    alive = {"r0"} if live is None else live
    learner = make_learner(drafters=[good, bad], is_live=lambda rid: rid in alive, guard=guard,
                           participation=participation, clock=clock or Clock(100.0))
    request = make_request("r0", (1, 2, 3), output=(7,))
    learner.routing.start(request)
    return learner, request, good, bad, alive


def step(request, *, level=None, lost=False, prefill=None):
    """The good drafter's chain 10 11 12 verified: 10 and 11 accepted, then the bonus 30."""
    tree = TokenTree.chain(7, [10, 11, 12], [0.8, 0.8, 0.8])
    answers = {"good": [(10, 0.8), (11, 0.8), (12, 0.8)], "bad": [(20, 0.8), (21, 0.8), (22, 0.8)]}
    drafts = Drafts({"r0": DraftTree(SelectedTree(tree, ("", "good", "good", "good"), (1.0, 0.8, 0.8, 0.8)),
                                     ROUTE, answers, (10, 11, 12), GAINS)}, DraftingStats(num_drafted_nodes=3))
    result = VerifyResult((1, 2), (10, 11), 30)
    outcomes = [Verified("r0", result.new_token_ids, (0, 1, 2), result)]
    requests = [request]
    if prefill is not None:
        outcomes.append(Verified(prefill.request_id, (5,), (0, 1)))
        requests.append(prefill)
    verified = VerifiedBatch([] if lost else outcomes, (3,) + (0,) * (len(outcomes) - 1),
                             (4,) + (2,) * (len(outcomes) - 1), 0.05, 0.5, lost=lost)
    batch = StepBatch(requests, budgets={"r0": 3}, level=level, started_at=99.0)
    return batch, drafts, verified


def learn(learner, batch, drafts, verified, *, between=None):
    pending = learner.record(batch, drafts, verified)
    if between is not None:
        between()
    return pending, asyncio.run(learner.absorb(pending))


def good_trunk_calibration(learner, request) -> float:
    return learner.speculator.calibration(request.domain)("good", 0.8, 1)


def test_a_verified_tree_teaches_counts_gains_routing_calibration_and_feedback():
    learner, request, good, bad, _ = setup()
    scores_before = dict(request.routing.scores)
    calibrated_before = good_trunk_calibration(learner, request)
    pending, stats = learn(learner, *step(request))
    s = request.stats
    assert (s.num_verify_steps, s.num_draft_tokens, s.num_accepted_tokens) == (1, 3, 2)
    assert s.drafted_by == {"good": 3} and s.accepted_by == {"good": 2}
    assert stats.num_accepted == 2 and stats.requests[0].fusion_picks == {"good": 3}
    assert stats.requests[0].fusion_picks_accepted == {"good": 2}
    assert request.gain_curve == GAINS  # predicts its next step
    assert request.routing.scores["good"] > scores_before["good"] and request.routing.scores["bad"] < scores_before["bad"]
    assert request.routing.last_accepted_len == 2
    assert good_trunk_calibration(learner, request) != calibrated_before
    assert good.observed == [DraftFeedback("r0", 3, 2)] and bad.observed == [DraftFeedback("r0", 0, 0)]
    assert stats.verify_predicted_s > 0 and stats.routed[0].routed == (("good", "exploit"), ("bad", "exploit"))


def test_a_request_aborted_before_the_step_was_recorded_teaches_nothing():
    learner, request, good, _, _ = setup(live=set())
    pending, stats = learn(learner, *step(request))
    assert pending.trees == [] and stats.requests == [] and request.stats.num_verify_steps == 0
    assert request.gain_curve == (0.0,) and request.routing.last_accepted_len is None and good.observed == []


def test_a_request_that_finished_before_absorb_teaches_calibration_only():
    learner, request, good, _, alive = setup()
    scores_before = dict(request.routing.scores)
    calibrated_before = good_trunk_calibration(learner, request)
    pending, stats = learn(learner, *step(request), between=alive.clear)
    assert request.stats.num_verify_steps == 1  # its own counts were taken at once
    assert request.gain_curve == (0.0,) and request.routing.scores == scores_before and good.observed == []
    assert good_trunk_calibration(learner, request) != calibrated_before


def test_a_lost_step_teaches_nothing_but_is_still_reported():
    learner, request, good, _, _ = setup()
    pending, stats = learn(learner, *step(request, lost=True))
    assert request.stats.num_verify_steps == 0 and request.gain_curve == (0.0,) and good.observed == []
    assert stats.routed and stats.verify_predicted_s == 0.0


def test_the_guard_learns_from_tree_steps_at_a_level_only():
    guard = RecordingGuard()
    learner, request, *_ = setup(guard=guard)
    _, stats = learn(learner, *step(request, level=1))
    (level, tokens, plain_steps, rows), = guard.observed
    assert (level, tokens, rows) == (1, 3.0, 1) and plain_steps > 0 and stats.speculation_level == 1.0
    learn(learner, *step(request, level=None))  # a step the guard did not choose a level for
    learn(learner, *step(request, level=1, prefill=make_request("p", (4, 4))))  # a prompt's cost is not the level's
    assert len(guard.observed) == 1
    other, other_request, *_ = setup()
    _, unguarded = learn(other, *step(other_request, level=1))
    assert unguarded.speculation_level is None


def test_participation_follows_the_verifiers_idle_share():
    participation = ParticipationController(min_drafters=1, max_drafters=2, initial=1, window=1)
    learner, request, *_ = setup(participation=participation)
    _, stats = learn(learner, *step(request))  # idle half the time: more drafters would pay
    assert stats.participation == 2 and learner.routing.drafters_per_request == 2
    other, other_request, *_ = setup()
    _, fixed = learn(other, *step(other_request))
    assert fixed.participation is None


def test_finished_texts_go_to_the_drafters_that_learn():
    learner_drafter, failing, plain = LearningDrafter("suffix"), LearningDrafter("broken", fail=True), FakeDrafter("x")
    learner = make_learner(drafters=[learner_drafter, failing, plain])
    done = make_request("done", (1, 2), output=(3, 4), domain="code")
    asyncio.run(learner.learn_from_completed([done]))
    assert learner_drafter.learned == [FinishedText("done", "code", (1, 2, 3, 4), 2)]
    assert learner.metrics.drafter_failures() == {"broken": 1}
