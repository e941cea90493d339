"""``BatchScheduler`` alone: what ``schedule(lane)`` returns — prompt chunks and decodes with
their budgets, the lane's requests only, the step's token budget, admission and preemption by
KV blocks, the KV byte budget, twins held or drafting, and the price (on or off, probe steps,
the guard's level, the drain weights)."""

from __future__ import annotations

import dataclasses

import pytest

from cosine_ray.algo.scheduling.lp_schedule import first_come_batch
from cosine_ray.algo.tree_selection import TreePrice
from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.types import PROBE_EVERY

from support.factories import Clock, add_running, make_kv, make_pool, make_request, make_scheduler


class PricePolicy:
    """First come, with the LP's price λ set by the test."""

    def __init__(self, lam: float) -> None:
        self.lam = lam

    def decide(self, candidates, costs, config):
        return dataclasses.replace(first_come_batch(candidates, config, config.gamma_max), lam=self.lam)


class FixedGuard:
    """Stands in for ``SpeculationGuard``: every step runs at ``level``."""

    levels = (0.0, 1.0)

    def __init__(self, level: int) -> None:
        self.level = level

    def operating_goodput(self, rows: int) -> float:
        return 1.0

    def choose(self, rows: int) -> int:
        return self.level


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def generated(scheduler, request, num_output: int) -> None:
    """What the engine does after a step: the request has ``num_output`` tokens and its KV is
    committed up to the last one (which the next step's tree roots at)."""
    request.output_token_ids = [5] * num_output
    scheduler.kv.commit(request, request.num_tokens - 1)


# ---- which requests run, prefill or decode -------------------------------------------------------

def test_a_new_request_prefills_then_decodes_with_its_budget_capped_by_max_tokens():
    clock = Clock(10.0)
    pool = make_pool(clock=clock)
    scheduler = make_scheduler(pool, policy="fcfs", priced=False, num_speculative_tokens=4)
    request = pool.add("r0", [1, 2, 3], SamplingParams(max_tokens=7))
    batch = scheduler.schedule(None)
    assert ids(batch.requests) == ids(batch.prefills) == ["r0"] and batch.chunks == {"r0": 3}
    assert batch.budgets == {} and batch.num_steps == {}
    assert request.holds_kv and request.last_scheduled_at == 10.0 and request.num_decode_steps == 0
    expected = {1: 4, 3: 3, 5: 1, 6: 0}  # output tokens -> γ_i = min(γ_max, max_tokens - output - 1)
    for step, (num_output, budget) in enumerate(expected.items(), start=1):
        generated(scheduler, request, num_output)
        clock.now += 1.0
        batch = scheduler.schedule(None)
        assert ids(batch.decodes) == ["r0"] and batch.budgets == {"r0": budget}
        assert batch.num_steps == {"r0": step} and request.num_decode_steps == step
        assert request.last_scheduled_at == clock.now and batch.started_at == clock.now
    scheduler.kv.free(request)  # preempted, or a stage lost its KV: the whole context prefills again
    batch = scheduler.schedule(None)
    assert ids(batch.prefills) == ["r0"] and batch.chunks == {"r0": 9} and batch.budgets == {}


def test_schedule_of_a_lane_takes_that_lanes_requests_only():
    pool = make_pool(num_lanes=2)
    scheduler = make_scheduler(pool, policy="fcfs", priced=False)
    for i in range(4):
        pool.add(f"r{i}", [1, 2], SamplingParams())
    assert ids(scheduler.schedule(0).requests) == ["r0", "r2"]  # the first call admits all four
    assert ids(scheduler.schedule(1).requests) == ["r1", "r3"]
    assert scheduler.schedule(None).requests and make_scheduler(make_pool()).schedule(0).requests == []


@pytest.mark.parametrize("policy", ["fcfs", "lp"])
def test_the_kv_budget_defers_a_prefill_that_would_exceed_it(policy):
    pool = make_pool()
    # each request reserves (3 prompt + 6 max_tokens) tokens x 10 bytes = 90 bytes; 200 hold two
    scheduler = make_scheduler(pool, policy=policy, kv_bytes_per_token=10, kv_budget_bytes=200)
    for i in range(3):
        pool.add(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=6))
    assert ids(scheduler.schedule(None).requests) == ["r0", "r1"]
    for rid in ("r0", "r1"):  # prefilled; r2 (admitted to the pool) holds no KV yet
        generated(scheduler, pool.running[rid], 1)
    batch = scheduler.schedule(None)
    assert ids(batch.requests) == ["r0", "r1"] and set(batch.budgets) == {"r0", "r1"}
    assert not pool.running["r2"].holds_kv


def test_decodes_and_their_trees_come_first_in_the_token_budget_then_prompt_chunks():
    pool = make_pool()
    scheduler = make_scheduler(pool, policy="fcfs", priced=False, num_speculative_tokens=4, max_num_batched_tokens=16)
    add_running(pool, [make_request(f"d{i}", output=(4,), max_tokens=32) for i in range(2)])
    pool.add("p", [1] * 20, SamplingParams())
    batch = scheduler.schedule(None)  # 2 roots + 2 trees of 4 = 10 tokens; 6 are left for the prompt
    assert batch.budgets == {"d0": 4, "d1": 4} and batch.chunks == {"p": 6}
    scheduler.kv.commit(pool.running["p"], 6)  # the chunk's KV; 14 prompt tokens to go
    assert scheduler.schedule(None).chunks == {"p": 6}
    tight = make_scheduler(make_pool(), policy="fcfs", priced=False, num_speculative_tokens=4, max_num_batched_tokens=8)
    add_running(tight.pool, [make_request(f"d{i}", output=(4,), max_tokens=32) for i in range(2)])
    tight.pool.add("p", [1] * 20, SamplingParams())
    batch = tight.schedule(None)  # the trees do not fit: Algorithm 2 trims them, the prompt waits
    assert batch.budgets == {"d0": 3, "d1": 3} and batch.chunks == {} and ids(batch.requests) == ["d0", "d1"]


def test_admission_waits_for_kv_blocks_in_arrival_order():
    pool = make_pool()
    scheduler = make_scheduler(pool, policy="fcfs", priced=False, kv=make_kv(4, block_size=4))
    pool.add("a", [1] * 7, SamplingParams())  # 7 tokens + 1: 2 blocks of 4
    pool.add("big", [2] * 12, SamplingParams())  # 13 tokens: 4 blocks, 2 are left
    pool.add("small", [3] * 2, SamplingParams())  # 1 block would fit, but it does not overtake
    batch = scheduler.schedule(None)
    assert ids(batch.requests) == ["a"] and [r.request_id for r in pool.waiting] == ["big", "small"]
    assert len(pool.running["a"].block_table) == 2 and scheduler.kv.num_free_blocks == 2


def test_a_tree_the_pool_cannot_hold_is_not_drafted_and_the_last_arrival_is_preempted_for_kv():
    clock = Clock(1.0)
    pool = make_pool(clock=clock)
    scheduler = make_scheduler(pool, policy="fcfs", priced=False, kv=make_kv(4, block_size=4),
                               num_speculative_tokens=2)
    a = pool.add("a", [1] * 7, SamplingParams())
    clock.now = 2.0
    b = pool.add("b", [2] * 7, SamplingParams())
    assert scheduler.schedule(None).chunks == {"a": 7, "b": 7}  # 2 blocks each: the pool is full
    for r in (a, b):
        generated(scheduler, r, 1)  # 8 tokens, 7 computed
    batch = scheduler.schedule(None)  # each root fits its 2 blocks; a tree of 2 more would need a third
    assert batch.budgets == {"a": 0, "b": 0}
    for r in (a, b):
        generated(scheduler, r, 2)  # 9 tokens: the next root needs a third block
    batch = scheduler.schedule(None)
    assert ids(batch.requests) == ["a"] and scheduler.num_preemptions == 1
    assert [r.request_id for r in pool.waiting] == ["b"] and b.kv_epoch == 1 and b.block_table == []
    assert len(a.block_table) == 3 and pool.take_preempted() == ["b"]


# ---- twins ------------------------------------------------------------------------------------------

def twin_pool(leader_output):
    pool = make_pool()
    add_running(pool, [make_request("leader", (7, 7, 7), output=leader_output),
                       make_request("follower", (7, 7, 7), output=(5,))])
    return pool


def test_a_follower_waits_while_its_leader_is_less_than_a_tree_ahead():
    pool = twin_pool((5, 6, 7))
    scheduler = make_scheduler(pool, policy="fcfs", priced=False, twins=True, num_speculative_tokens=3)
    batch = scheduler.schedule(None)
    assert ids(batch.requests) == ["leader"] and batch.twins == {}
    scheduler = make_scheduler(pool, policy="fcfs", priced=False, twins=False, num_speculative_tokens=3)
    assert ids(scheduler.schedule(None).requests) == ["leader", "follower"]


def test_a_follower_drafts_its_leaders_text_verified_whole_even_at_speculation_level_zero():
    pool = twin_pool((5, 6, 7, 8, 9, 10))
    scheduler = make_scheduler(pool, policy=PricePolicy(1.0), guard=FixedGuard(0), twins=True,
                               num_speculative_tokens=3)
    batch = scheduler.schedule(None)
    assert ids(batch.requests) == ["leader", "follower"] and batch.level == 0
    assert batch.twins == {"follower": (6, 7, 8)}  # the leader's tokens beyond the follower's, up to γ
    assert batch.budgets == {"leader": 0, "follower": 3}


# ---- the price ---------------------------------------------------------------------------------------

def decoding_pool(n: int = 2, output=(4,)):
    pool = make_pool()
    add_running(pool, [make_request(f"r{i}", (1, 2, 3), output=output, max_tokens=64) for i in range(n)])
    return pool


def test_unpriced_budgets_are_final():
    scheduler = make_scheduler(decoding_pool(), priced=False, num_speculative_tokens=5)
    batch = scheduler.schedule(None)
    assert batch.price is None and batch.level is None and batch.weights == {}
    assert batch.budgets == {"r0": 5, "r1": 5} and scheduler.tally.request_steps == 0


def test_the_lp_prices_the_trees_of_the_step():
    scheduler = make_scheduler(decoding_pool(3), policy="lp", num_speculative_tokens=5)
    batch = scheduler.schedule(None)
    assert isinstance(batch.price, TreePrice) and batch.price.batch_size == 3
    assert batch.price.base_tokens == 3  # each decoding request's root
    assert batch.price.lam > 0 and set(batch.budgets) == {"r0", "r1", "r2"}
    assert scheduler.tally.request_steps == 3


def test_a_node_that_cannot_pay_is_not_drafted_except_on_probe_steps():
    scheduler = make_scheduler(decoding_pool(1), policy=PricePolicy(0.0), num_speculative_tokens=5)
    budgets = [scheduler.schedule(None).budgets["r0"] for _ in range(2 * PROBE_EVERY)]
    probes = {PROBE_EVERY - 1, 2 * PROBE_EVERY - 1}  # the 8th and 16th decoding steps
    assert budgets == [5 if i in probes else 0 for i in range(2 * PROBE_EVERY)]
    assert scheduler.tally.held_back == 2 * PROBE_EVERY - 2 and scheduler.tally.request_steps == 2 * PROBE_EVERY
    paying = make_scheduler(decoding_pool(1), policy=PricePolicy(1e6), num_speculative_tokens=5)
    assert paying.schedule(None).budgets == {"r0": 5}
    pearl = make_scheduler(decoding_pool(1), policy=PricePolicy(0.0), skip_unpaying=False, num_speculative_tokens=5)
    assert pearl.schedule(None).budgets == {"r0": 5}  # PEARL drafts anyway


def test_the_guards_level_scales_the_price_and_level_zero_drafts_nothing():
    off = make_scheduler(decoding_pool(), policy=PricePolicy(1e6), guard=FixedGuard(0), num_speculative_tokens=5)
    batch = off.schedule(None)
    assert batch.level == 0 and batch.budgets == {"r0": 0, "r1": 0} and batch.price.lam == 0.0
    on = make_scheduler(decoding_pool(), policy=PricePolicy(1e6), guard=FixedGuard(1), num_speculative_tokens=5)
    batch = on.schedule(None)
    assert batch.level == 1 and batch.budgets == {"r0": 5, "r1": 5} and batch.price.lam == 1e6


@pytest.mark.parametrize("drain_pricing", [True, False])
def test_while_the_pool_drains_a_token_is_worth_what_it_shortens_the_drain(drain_pricing):
    pool = make_pool()
    scheduler = make_scheduler(pool, policy=PricePolicy(1e6), drain_pricing=drain_pricing)
    for rid in ("long", "short", "done"):
        pool.add(rid, [1, 2], SamplingParams(max_tokens=20))
    scheduler.schedule(None)  # admits all three: the peak
    for rid, n in (("long", 1), ("short", 10), ("done", 15)):
        generated(scheduler, pool.running[rid], n)
    assert scheduler.schedule(None).weights == {} and scheduler.drain_weights() == {}  # as full as at the peak
    del pool.running["done"]  # finished: fewer run than at the peak, and nothing waits
    batch = scheduler.schedule(None)
    if not drain_pricing:
        assert batch.weights == {}
        return
    assert batch.weights["long"] == 1.0 and 0.0 <= batch.weights["short"] < 0.01
    assert scheduler.tally.drained == 2
    pool.add("new", [1], SamplingParams())
    assert scheduler.drain_weights() == {}  # a request waits: no drain
