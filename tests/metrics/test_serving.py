"""Serving metrics of one request (RequestTimeline) and stage busy/idle time, on fake clocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from cosine_ray.engine.worker.scoring import ScoreItem

from cosine_ray.engine.worker.target import StageWorker
from cosine_ray.metrics.registry import MetricsRegistry
from cosine_ray.metrics.serving import RequestTimeline


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeRequest:
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    arrival_time: float = 100.0
    admitted_time: float | None = None


def hist(m: MetricsRegistry, name: str):
    return m.get(f"cosine_ray:{name}")


def test_timeline_of_a_speculative_request():
    m, clock, req = MetricsRegistry(), FakeClock(), FakeRequest()
    timeline = RequestTimeline(m, clock, req)
    req.admitted_time = 100.5
    clock.now = 101.0
    timeline.observe([7], False, None)            # prefill's token: TTFT 1.0, queue 0.5
    clock.now = 101.4
    timeline.observe([8, 9, 10, 11], False, None)  # a step accepted 3 + bonus: 0.1 s per token
    clock.now = 101.6
    timeline.observe([12], True, "length")
    assert hist(m, "time_to_first_token_seconds").sum == pytest.approx(1.0)
    assert hist(m, "request_queue_time_seconds").sum == pytest.approx(0.5)
    itl = hist(m, "inter_token_latency_seconds")
    assert itl.count == 5 and itl.sum == pytest.approx(0.4 + 0.2)
    assert hist(m, "e2e_request_latency_seconds").sum == pytest.approx(1.6)
    tpot = hist(m, "time_per_output_token_seconds")
    assert tpot.count == 1 and tpot.sum == pytest.approx(0.6 / 5)
    assert m.get("cosine_ray:prompt_tokens") == 5 and m.get("cosine_ray:generation_tokens") == 6
    assert m.get("cosine_ray:request_success", finished_reason="length") == 1
    timeline.finish("abort")  # idempotent: the loop's finally after a normal finish
    assert m.total("cosine_ray:request_success") == 1


def test_abort_before_any_token_counts_only_the_ending():
    m, clock, req = MetricsRegistry(), FakeClock(), FakeRequest()
    timeline = RequestTimeline(m, clock, req)
    clock.now = 103.0
    timeline.finish("abort")
    assert m.get("cosine_ray:request_success", finished_reason="abort") == 1
    assert m.get("cosine_ray:prompt_tokens") == 0 and m.get("cosine_ray:generation_tokens") == 0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert hist(m, name) is None


def test_error_after_tokens_keeps_tokens_but_no_latency():
    m, clock, req = MetricsRegistry(), FakeClock(), FakeRequest(admitted_time=100.0)
    timeline = RequestTimeline(m, clock, req)
    clock.now = 100.2
    timeline.observe([3], False, None)
    clock.now = 100.3
    timeline.observe([], True, "error")
    assert m.get("cosine_ray:request_success", finished_reason="error") == 1
    assert m.get("cosine_ray:generation_tokens") == 1 and m.get("cosine_ray:prompt_tokens") == 5
    assert hist(m, "e2e_request_latency_seconds") is None and hist(m, "time_per_output_token_seconds") is None


def test_single_token_request_has_no_tpot():
    m, clock, req = MetricsRegistry(), FakeClock(), FakeRequest(admitted_time=100.0)
    timeline = RequestTimeline(m, clock, req)
    clock.now = 100.25
    timeline.observe([2], True, "stop")
    assert hist(m, "e2e_request_latency_seconds").sum == pytest.approx(0.25)
    assert hist(m, "time_per_output_token_seconds") is None
    assert hist(m, "inter_token_latency_seconds") is None


# ---- stage busy / idle -----------------------------------------------------------------------

class FakeCache:
    def __init__(self) -> None:
        self.lengths: dict[str, int] = {}
        self.request_ids: list[str] = []

    def __contains__(self, rid: str) -> bool:
        return rid in self.lengths

    def allocate(self, rid: str) -> None:
        self.lengths[rid] = 0

    def commit(self, rid: str, keep) -> None:
        pass

    def commit_many(self, commits) -> None:
        pass

    def committed_length(self, rid: str) -> int:
        return self.lengths[rid]


class FakeStage:
    """Each forward takes ``cost`` seconds of the fake clock (and fails when asked to)."""

    is_last = False  # a middle stage: its output goes back as it is
    device = torch.device("cpu")

    def __init__(self, clock: FakeClock, cost: float) -> None:
        self.clock, self.cost, self.fail = clock, cost, False

    def new_kv_cache(self, budget_bytes=None, **kwargs) -> FakeCache:
        return FakeCache()

    def forward(self, batch, cache, hidden):
        self.clock.now += self.cost
        if self.fail:
            raise RuntimeError("boom")
        return torch.zeros(1)


def test_stage_worker_counts_busy_and_idle_time():
    clock = FakeClock()
    stage = FakeStage(clock, cost=0.25)
    worker = StageWorker(stage, clock=clock)
    items = [ScoreItem.prefill("r", [1, 2, 3])]
    clock.now += 1.0                      # waiting for work: a bubble
    worker.forward(items)
    assert worker.utilisation() == pytest.approx((0.25, 1.0))
    stage.fail = True
    with pytest.raises(RuntimeError):
        worker.forward(items)             # a failed forward was still busy
    clock.now += 0.5
    assert worker.utilisation() == pytest.approx((0.5, 1.5))


def test_a_forward_in_progress_counts_as_busy_so_both_only_grow():
    clock = FakeClock()
    seen = []

    class Probe(FakeStage):
        def forward(self, batch, cache, hidden):
            for _ in range(3):
                self.clock.now += 0.1
                seen.append(worker.utilisation())  # a scrape during the forward
            return torch.zeros(1)

    worker = StageWorker(Probe(clock, 0.0), clock=clock)
    clock.now += 0.2
    worker.forward([ScoreItem.prefill("r", [1])])
    seen.append(worker.utilisation())
    busy, idle = zip(*seen)
    assert list(busy) == sorted(busy) and list(idle) == sorted(idle)
    assert seen[-1] == pytest.approx((0.3, 0.2))
