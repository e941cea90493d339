"""``RequestPool`` alone: admission and lanes, preemption, aborts, what a step's outcomes
change, what is released when, and a lost target. (How many are admitted, given the batch
size and the KV pool, is the scheduler's: ``test_scheduler.py``.)"""

from __future__ import annotations

import pytest

from cosine_ray.engine.request import RequestStatus, SamplingParams
from cosine_ray.engine.types import Verified

from support.factories import Clock, make_pool


def params(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def prefilled(rid: str, token: int, prompt_len: int = 3) -> Verified:
    return Verified(rid, (token,), tuple(range(prompt_len)))


def admit_all(pool) -> None:
    """What the scheduler does when the KV pool has room: first come, while the batch has room."""
    while pool.waiting and len(pool.running) < pool.max_num_seqs:
        pool.admit(pool.waiting[0])


# ---- requests in -----------------------------------------------------------------------------

def test_add_checks_the_request_before_anything_is_queued():
    pool = make_pool(max_model_len=16, vocab_size=10)
    with pytest.raises(ValueError, match="at least one token"):
        pool.add("r0", [], params())
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        pool.add("r0", [1, 10], params())
    with pytest.raises(ValueError, match="exceeds the model length 16"):
        pool.add("r0", [1] * 9, params(max_tokens=8))
    assert not pool.waiting and not pool.has_work
    pool.add("r0", [1] * 8, params(max_tokens=8))
    with pytest.raises(ValueError, match="already in use"):
        pool.add("r0", [1], params())
    assert [r.request_id for r in pool.waiting] == ["r0"]


def test_admit_takes_the_first_waiting_request_and_stamps_the_clock_once():
    clock = Clock(5.0)
    pool = make_pool(clock=clock)
    for i in range(3):
        pool.add(f"r{i}", [1, 2], params())
    clock.now = 7.0
    with pytest.raises(AssertionError):
        pool.admit(pool.waiting[1])  # nobody overtakes the first
    first = pool.waiting[0]
    pool.admit(first)
    assert list(pool.running) == ["r0"] and [r.request_id for r in pool.waiting] == ["r1", "r2"]
    assert first.status is RequestStatus.RUNNING and first.admitted_time == 7.0
    assert pool.waiting[0].status is RequestStatus.WAITING and pool.waiting[0].arrival_time == 5.0
    pool.preempt(first)
    assert pool.next_waiting() is pool.waiting[1]  # not before the stages freed its KV (the next step)
    assert pool.take_preempted() == ["r0"]
    clock.now = 9.0
    pool.admit(first)
    assert first.admitted_time == 7.0  # resumed, not admitted anew


def test_a_preempted_request_waits_first_in_line_with_a_new_kv_epoch():
    pool = make_pool()
    for rid in ("a", "b", "c"):
        pool.add(rid, [1], params())
    admit_all(pool)
    pool.add("d", [1], params())
    b = pool.running["b"]
    pool.preempt(b)
    assert list(pool.running) == ["a", "c"] and [r.request_id for r in pool.waiting] == ["b", "d"]
    assert b.status is RequestStatus.WAITING and b.kv_epoch == 1 and b.stats.num_preemptions == 1
    assert pool.take_preempted() == ["b"] and pool.take_preempted() == []  # the stages free its KV once
    assert [r.request_id for r in pool.requests()] == ["b", "d", "a", "c"]
    pool.abort("a")
    assert [r.request_id for r in pool.requests()] == ["b", "d", "c", "a"]  # released ones until freed


def test_each_admitted_request_joins_the_least_loaded_lane():
    pool = make_pool(max_num_seqs=5, num_lanes=2)
    for i in range(5):
        pool.add(f"r{i}", [1], params())
    admit_all(pool)
    assert [r.lane for r in pool.running.values()] == [0, 1, 0, 1, 0]
    assert [r.request_id for r in pool.lane(0)] == ["r0", "r2", "r4"]
    assert [r.request_id for r in pool.lane(1)] == ["r1", "r3"]
    assert len(pool.lane(None)) == 5
    pool.abort("r1")
    pool.abort("r3")
    pool.take_released()
    pool.add("r5", [1], params())
    admit_all(pool)
    assert pool.running["r5"].lane == 1  # lane 1 is empty now


def test_a_lane_has_work_when_it_runs_requests_or_the_pool_can_admit_or_release():
    pool = make_pool(max_num_seqs=1, num_lanes=2)
    assert not pool.lane_has_work(0) and not pool.has_work
    pool.add("r0", [1], params())
    assert pool.lane_has_work(0) and pool.lane_has_work(1)  # either lane may admit it
    admit_all(pool)
    assert pool.lane_has_work(0) and not pool.lane_has_work(1)
    pool.abort("r0")
    assert pool.lane_has_work(1)  # r0's state is released by whichever lane steps next
    pool.take_released()
    assert not pool.lane_has_work(0) and not pool.lane_has_work(1)
    pool.add("r1", [1], params())
    pool.add("r2", [1], params())
    admit_all(pool)
    assert pool.lane_has_work(0) and not pool.lane_has_work(1)  # r2 waits: the batch is full


# ---- aborts and release ------------------------------------------------------------------------

def test_abort_finishes_waiting_and_running_requests_and_queues_them_for_release():
    pool = make_pool(max_num_seqs=1)
    pool.add("run", [1], params())
    admit_all(pool)
    pool.add("wait", [1], params())
    assert pool.abort("wait") and pool.abort("run")
    assert not pool.abort("run") and not pool.abort("never")
    assert not pool.waiting and not pool.running
    assert pool.to_release == ("wait", "run") and pool.num_to_release == 2
    released = pool.take_released()
    assert [(r.request_id, r.finish_reason, r.is_finished) for r in released] == [
        ("wait", "abort", True), ("run", "abort", True)]
    assert pool.take_completed() == []  # aborted requests teach the drafters nothing
    assert pool.num_to_release == 0 and not pool.has_work


def test_take_released_holds_back_requests_a_step_still_works_on():
    pool = make_pool(max_num_seqs=2)
    for rid in ("a", "b"):
        pool.add(rid, [1], params())
    admit_all(pool)
    pool.running["a"].num_in_flight = 1  # another lane's step has it
    pool.abort("a")
    pool.abort("b")
    assert [r.request_id for r in pool.take_released()] == ["b"]
    assert pool.to_release == ("a",) and pool.has_work
    assert pool.take_released() == []
    pool._released[0].num_in_flight = 0
    assert [r.request_id for r in pool.take_released()] == ["a"]
    assert pool.num_to_release == 0


# ---- a step's outcomes ---------------------------------------------------------------------------

def test_advance_appends_streams_and_finishes_at_max_tokens():
    pool = make_pool()
    pool.add("r0", [5, 6, 7], params(max_tokens=4))
    admit_all(pool)
    out = pool.advance([prefilled("r0", 9)])
    assert [(o.request_id, o.new_token_ids, o.finished) for o in out] == [("r0", [9], False)]
    assert out[0].num_prompt_tokens == 3 and out[0].num_output_tokens == 1
    out = pool.advance([Verified("r0", (1, 2, 3, 4), (0, 1, 2))])  # one past max_tokens is dropped
    assert out[0].new_token_ids == [1, 2, 3] and out[0].finished and out[0].finish_reason == "length"
    assert pool.running == {} and pool.to_release == ("r0",)
    assert [r.request_id for r in pool.take_completed()] == ["r0"] and pool.take_completed() == []


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_advance_stops_at_eos_unless_ignored_and_always_at_stop_tokens(ignore_eos):
    pool = make_pool(eos_token_ids=(2,))
    pool.add("eos", [1], params(max_tokens=10, ignore_eos=ignore_eos))
    pool.add("stop", [1], params(max_tokens=10, stop_token_ids=(4,), ignore_eos=ignore_eos))
    admit_all(pool)
    out = {o.request_id: o for o in pool.advance([Verified("eos", (3, 2, 5), (0,)), Verified("stop", (3, 4, 5), (0,))])}
    assert out["stop"].new_token_ids == [3, 4] and out["stop"].finish_reason == "stop"
    if ignore_eos:
        assert out["eos"].new_token_ids == [3, 2, 5] and not out["eos"].finished
    else:
        assert out["eos"].new_token_ids == [3, 2] and out["eos"].finish_reason == "stop"


def test_a_prompt_chunk_before_the_last_streams_nothing():
    pool = make_pool()
    pool.add("r0", [1] * 40, params())
    admit_all(pool)
    assert pool.advance([Verified("r0", (), tuple(range(32)))]) == []  # the first 32 of 40 prompt tokens
    out, = pool.advance([Verified("r0", (5,), tuple(range(8)))])
    assert out.new_token_ids == [5] and pool.running["r0"].output_token_ids == [5]


def test_outcomes_of_requests_aborted_while_the_step_ran_are_skipped():
    pool = make_pool()
    for rid in ("a", "b"):
        pool.add(rid, [1], params())
    admit_all(pool)
    pool.abort("a")
    out = pool.advance([prefilled("a", 3, 1), prefilled("b", 4, 1)])
    assert [o.request_id for o in out] == ["b"]
    assert pool.take_released()[0].output_token_ids == []


# ---- a lost target -------------------------------------------------------------------------------

def test_a_recovered_target_makes_running_requests_re_prefill_until_max_restores():
    pool = make_pool(max_restores=1)
    pool.add("r0", [1, 2], params())
    admit_all(pool)
    pool.advance([prefilled("r0", 7, 2)])
    pool.target_lost(True, "stage 1 restarted")
    request = pool.running["r0"]
    assert request.kv_epoch == 1 and request.num_restores == 1 and not request.is_finished
    pool.advance([prefilled("r0", 8, 3)])
    assert request.output_token_ids == [7, 8] and request.kv_epoch == 1
    pool.target_lost(True, "stage 1 restarted again")  # the second restore is one too many
    assert pool.running == {} and request.finish_reason == "error"
    out = pool.advance([])  # the failure is streamed before any later outcome
    assert len(out) == 1 and out[0].finished and out[0].finish_reason == "error"
    assert "stage 1 restarted again" in out[0].error and out[0].num_output_tokens == 2
    assert pool.to_release == ("r0",) and pool.take_completed() == []


def test_a_target_that_did_not_come_back_fails_every_running_request():
    pool = make_pool()
    for rid in ("a", "b"):
        pool.add(rid, [1], params())
    admit_all(pool)
    pool.add("c", [1], params())
    pool.target_lost(False, "gone")
    out = pool.advance([prefilled("a", 1, 1)])
    assert sorted((o.request_id, o.finish_reason) for o in out) == [("a", "error"), ("b", "error")]
    assert [r.request_id for r in pool.waiting] == ["c"]  # a waiting request holds no KV
