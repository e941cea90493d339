"""Measurement against the stub server: timings, tokens, stats block, concurrency, multi-turn.

Timer tolerance: the stub sleeps at least the configured time (``time.sleep`` never returns
early), so chunk k cannot arrive before ttft + k·gap after the send (minus 2 ms for clock and
socket granularity). Above, a chunk only has to be seen before the next one is due: the gap is
half a second, hundreds of times the usual delay, so a stalled machine does not matter, while
a client that timed chunks at the end of the stream would still fail. ITL, TTFT, E2EL and TPOT
are checked exactly against their definitions from the measured chunk times.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.loadgen_fixtures import write_dataset
from support.stub_server import StubServer

from loadgen.runner import CHAT_PATH, COMPLETIONS_PATH, RunConfig, run_plan
from loadgen.workload import WorkItem, dataset_workload, load_rows

LOW = 0.002


def plan_of(items, offsets=None):
    return list(zip(items, offsets if offsets is not None else [0.0] * len(items)))


def items_of(prompts, **kw):
    return [WorkItem.make_dummy(i, turns=(p,), **kw) for i, p in enumerate(prompts)]


def cfg(url: str, **kw) -> RunConfig:
    return RunConfig(base_url=url, show_progress=False, **kw)


@pytest.mark.parametrize("endpoint", [CHAT_PATH, COMPLETIONS_PATH])
def test_timings_tokens_and_stats_match_the_stub(endpoint):
    ttft, gap, chunks, per_chunk = 0.1, 0.5, 4, 3
    with StubServer(ttft_s=ttft, chunk_s=gap, num_chunks=chunks, tokens_per_chunk=per_chunk,
                    accept_default=(5, 8)) as stub:
        result = run_plan(plan_of(items_of(["a", "b", "c"])), cfg(stub.url, endpoint=endpoint))
        bodies = [b for _, b in stub.received]
    assert result.model == "stub-model" and all(b["model"] == "stub-model" for b in bodies)
    assert all(b["cosine_ray_stats"] is True and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert len(result.records) == 3
    for r in result.records:
        assert r.status == "ok", r.error
        assert len(r.chunk_s) == chunks
        for k, t in enumerate(r.chunk_s):  # each chunk seen after it was sent, before the next was due
            assert ttft + k * gap - LOW <= t - r.sent_s < ttft + (k + 1) * gap
        assert r.ttft_s == pytest.approx(r.chunk_s[0] - r.sent_s)
        assert r.itl_s == [b - a for a, b in zip(r.chunk_s, r.chunk_s[1:])]
        assert ttft + (chunks - 1) * gap - LOW <= r.e2el_s < ttft + chunks * gap
        assert r.e2el_s >= r.chunk_s[-1] - r.sent_s
        assert (r.output_tokens, r.output_tokens_source, r.prompt_tokens) == (12, "usage", 7)
        assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 11)
        assert r.num_done_markers == 1 and r.finish_reason == "length"
        assert r.output_text == " ".join(f"w{k}" for k in range(12)) + " "
        assert (r.num_draft_tokens, r.num_accepted_tokens, r.num_verify_steps) == (8, 5, 4)
        assert r.acceptance_rate == pytest.approx(5 / 8) and r.mean_accepted_length == pytest.approx(3.0)
        assert r.drafted_by == {"ngram": 4, "retrieval": 4} and r.accepted_by == {"ngram": 3, "retrieval": 2}
        assert r.stats_extra is not None and "drafters_used" in r.stats_extra
        assert r.sent_s >= 0 and r.end_s == pytest.approx(r.sent_s + r.e2el_s)
    ledger = result.ledger.check()
    assert ledger["is_consistent"] and ledger["completed"] == 3


def test_open_loop_arrivals_are_kept():
    """Each request leaves at its offset, not after the previous answer (which takes longer than the plan)."""
    offsets, slack, ttft = [0.0, 0.5, 1.0], 0.5, 1.6
    with StubServer(ttft_s=ttft, chunk_s=0.01, num_chunks=2) as stub:
        result = run_plan(plan_of(items_of(["a", "b", "c"]), offsets), cfg(stub.url))
    for r, planned in zip(result.records, offsets):
        assert r.status == "ok" and r.scheduled_s == planned and planned - LOW <= r.sent_s < planned + slack
    assert max(r.sent_s for r in result.records) < min(r.end_s for r in result.records)
    assert result.duration_s >= offsets[-1] + ttft - LOW


def test_max_concurrency_caps_in_flight_requests():
    with StubServer(ttft_s=0.1, chunk_s=0.01, num_chunks=2) as stub:
        result = run_plan(plan_of(items_of(list("abcdef"))), cfg(stub.url, max_concurrency=2))
        assert stub.max_active == 2
    assert all(r.status == "ok" for r in result.records)
    # closed loop with 2 slots: the 5th and 6th requests waited about two service times
    queued = sorted(r.queued_s for r in result.records)
    assert queued[-1] >= 2 * 0.1 - LOW
    assert result.duration_s >= 3 * 0.11 - LOW


def test_multi_turn_sends_the_history_after_the_first_answer(tmp_path):
    data = write_dataset(tmp_path, {"mt": [{"id": "mt/0", "domain": "chat/x", "prompt": "first?",
                                            "turns": ["first?", "and second?"]}]})
    items = dataset_workload(load_rows(data, "all"), 1, {"chat": 1.0}, np.random.default_rng(0), max_tokens=3,
                             multi_turn=True)
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=3) as stub:
        result = run_plan(plan_of(items), cfg(stub.url))
        received = list(stub.received)
    assert [rid for rid, _ in received] == ["c00000-t0", "c00000-t1"]
    assert received[1][1]["messages"] == [{"role": "user", "content": "first?"},
                                          {"role": "assistant", "content": "w0 w1 w2 "},
                                          {"role": "user", "content": "and second?"}]
    t0, t1 = result.records
    assert t1.sent_s >= t0.end_s and (t0.turn, t1.turn) == (0, 1)


def test_a_failed_first_turn_skips_the_second(tmp_path):
    item = WorkItem("c00000", "mt/0", "chat", ("[[status=500]]", "never sent"), None, 3)
    with StubServer() as stub:
        result = run_plan(plan_of([item]), cfg(stub.url))
        assert len(stub.received) == 1
    assert [r.status for r in result.records] == ["failed", "not_sent"]
    assert result.records[1].error == "turn 0 failed"
    assert result.ledger.check()["is_consistent"]


def test_warmups_are_not_measured_and_no_stats_flag_is_honoured():
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=2) as stub:
        result = run_plan(plan_of(items_of(["a", "b"])), cfg(stub.url, num_warmups=2, send_stats=False))
        ids = stub.received_ids()
        bodies = [b for _, b in stub.received]
    # Both measured items start at offset 0, so which reaches the server first is a race; the
    # warmups must come strictly before either of them.
    assert ids[:2] == ["warmup-0", "warmup-1"]
    assert sorted(ids[2:]) == ["c00000-t0", "c00001-t0"]
    assert all("cosine_ray_stats" not in b for b in bodies)
    assert [r.request_id for r in result.records] == ["c00000-t0", "c00001-t0"]
    assert not any(r.has_stats for r in result.records)


def test_duration_stops_sending_without_failing():
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=2) as stub:
        result = run_plan(plan_of(items_of(list("abcd")), [0.0, 0.05, 1.0, 1.2]), cfg(stub.url, duration_s=0.5))
    assert [r.status for r in result.records] == ["ok", "ok", "not_sent", "not_sent"]
    assert "--duration" in result.records[2].error and result.abort_reason is None
    assert result.ledger.check()["is_consistent"]


# The healthy requests beside the fault get a deadline far above the stub's 30 ms service time:
# a loaded CI machine once stalled one of them past a 0.5 s deadline. Only the timeout case
# needs a short one, and its injected sleep stays well above it.
@pytest.mark.parametrize("prompt, kind, message, timeout_s", [
    ("[[status=503]]", "http", "HTTP 503: injected status 503", 30.0),
    ("[[status=400]]", "http", "HTTP 400: injected status 400", 30.0),
    ("[[malformed]]", "malformed", "not JSON", 30.0),
    ("[[sse_error]]", "sse_error", "injected stream error", 30.0),
    ("[[no_done]]", "malformed", "without data: [DONE]", 30.0),
    ("[[sleep=8]]", "timeout", "within 2 s", 2.0),
])
def test_faults_are_recorded_per_request(prompt, kind, message, timeout_s):
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=2) as stub:
        result = run_plan(plan_of(items_of(["fine", prompt, "also fine"])), cfg(stub.url, request_timeout_s=timeout_s))
    good, bad, good2 = result.records
    assert (good.status, good2.status) == ("ok", "ok"), (good.error, good2.error)
    assert (bad.status, bad.error_kind) == ("failed", kind) and message in bad.error
    ledger = result.ledger.check()
    assert ledger["is_consistent"] and (ledger["completed"], ledger["failed"]) == (2, 1)


def test_dropped_connection_is_a_failure():
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=3) as stub:
        result = run_plan(plan_of(items_of(["[[drop]]"])), cfg(stub.url))
    (r,) = result.records
    assert r.status == "failed" and r.error_kind in ("transport", "malformed")
