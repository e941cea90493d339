"""Measurement against the stub server: timings, tokens, stats block, concurrency, multi-turn.

Timings are checked by events, not seconds, so a slow or stalled machine changes nothing: the
run's clock can be the stub's ``Lockstep`` (the number of lines the stub has written; it writes
the next only once the client has read the clock), which makes every stamp an exact count; the
stub's event log shows who arrived before which answer ended; and the client's own stamps are
compared with one another. ITL, TTFT, E2EL and TPOT are checked exactly against their
definitions from the measured chunk times.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.loadgen_fixtures import write_dataset
from support.stub_server import Lockstep, StubServer

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
def test_each_chunk_is_timed_as_it_arrives(endpoint):
    """On the lockstep clock a stamp is the number of lines the stub had written: chunk k of a
    completion is line k + 1 (a chat answer's role chunk comes first), the usage and [DONE]
    lines end the answer. A client that timed chunks at the end of the stream would stamp every
    one with the last line's number."""
    lockstep = Lockstep()
    with StubServer(ttft_s=0.0, chunk_s=0.0, num_chunks=4, tokens_per_chunk=3, lockstep=lockstep) as stub:
        result = run_plan(plan_of(items_of(["a"])), cfg(stub.url, endpoint=endpoint), clock=lockstep.now)
    (r,) = result.records
    first = 2 if endpoint == CHAT_PATH else 1  # the line number of content chunk 0
    assert r.status == "ok" and r.sent_s == 0.0, r.error
    assert r.chunk_s == [first, first + 1, first + 2, first + 3]
    assert (r.ttft_s, r.itl_s) == (first, [1.0, 1.0, 1.0])
    assert r.e2el_s == r.end_s == first + 3 + 3  # then the final chunk, the usage chunk, [DONE]
    assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 11)


@pytest.mark.parametrize("endpoint", [CHAT_PATH, COMPLETIONS_PATH])
def test_timings_tokens_and_stats_match_the_stub(endpoint):
    chunks = 4
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=chunks, tokens_per_chunk=3, accept_default=(5, 8)) as stub:
        result = run_plan(plan_of(items_of(["a", "b", "c"])), cfg(stub.url, endpoint=endpoint))
        bodies = [b for _, b in stub.received]
    assert result.model == "stub-model" and all(b["model"] == "stub-model" for b in bodies)
    assert all(b["cosine_ray_stats"] is True and b["stream_options"] == {"include_usage": True} for b in bodies)
    assert len(result.records) == 3
    for r in result.records:
        assert r.status == "ok", r.error
        assert len(r.chunk_s) == chunks and r.chunk_s == sorted(r.chunk_s) and r.chunk_s[0] > r.sent_s
        assert r.ttft_s == pytest.approx(r.chunk_s[0] - r.sent_s)
        assert r.itl_s == [b - a for a, b in zip(r.chunk_s, r.chunk_s[1:])]
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
    """Each request leaves at its offset, not after the previous answer: the stub answers none
    until all three have arrived, so a client that waited for an answer before sending the next
    request would see an answer end first."""
    offsets = [0.0, 0.1, 0.2]
    with StubServer(ttft_s=0.0, chunk_s=0.0, num_chunks=2, hold_until=3) as stub:
        result = run_plan(plan_of(items_of(["a", "b", "c"]), offsets), cfg(stub.url))
        events = list(stub.events)
    assert [kind for kind, _ in events] == ["start"] * 3 + ["end"] * 3, events
    for r, planned in zip(result.records, offsets):
        assert r.status == "ok" and r.scheduled_s == planned and r.sent_s >= planned - LOW  # never early
    sent = [r.sent_s for r in result.records]
    assert sent == sorted(sent) and max(sent) < min(r.end_s for r in result.records)


def test_max_concurrency_caps_in_flight_requests():
    """Two slots: the stub never has more than two answers open, the k-th request (k ≥ 3)
    arrives only after k − 2 answers ended, and on the client's clock each request that waited
    for a slot left after the answer that freed it."""
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=2) as stub:
        result = run_plan(plan_of(items_of(list("abcdef"))), cfg(stub.url, max_concurrency=2))
        events = list(stub.events)
    assert all(r.status == "ok" for r in result.records)
    open_answers, ended, starts = 0, 0, 0
    for kind, _ in events:
        if kind == "start":
            assert open_answers < 2 and ended >= starts - 1, events  # this is request starts + 1
            open_answers, starts = open_answers + 1, starts + 1
        else:
            open_answers, ended = open_answers - 1, ended + 1
    assert (starts, ended) == (6, 6)
    sent = sorted(r.sent_s for r in result.records)
    ends = sorted(r.end_s for r in result.records)
    assert all(sent[k] >= ends[k - 2] for k in range(2, 6)), (sent, ends)
    assert all(0 <= r.queued_s <= r.sent_s - r.scheduled_s for r in result.records)
    assert result.duration_s >= ends[-1]


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
