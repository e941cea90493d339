"""Summary maths on hand-made records: every expected number is worked out by hand below."""

from __future__ import annotations

import math

import pytest

from loadgen.client import RequestRecord
from loadgen.ledger import Ledger
from loadgen.metrics import (parse_goodput, parse_percentile_metrics, parse_percentiles, summarize,
                             token_timeline)


def rec(i: int, *, ttft: float, e2el: float, out: int, itl: list[float], domain: str = "code",
        stats: dict | None = None, prompt: int = 10) -> RequestRecord:
    r = RequestRecord(f"c{i}-t0", f"c{i}", 0, domain, f"src/{i}", status="ok", sent_s=0.0, prompt_tokens=prompt,
                      ttft_s=ttft, e2el_s=e2el, output_tokens=out, itl_s=itl, end_s=e2el,
                      tpot_s=(e2el - ttft) / (out - 1) if out > 1 else None)
    if stats:
        r.read_stats(stats)
    return r


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        # TTFT 100 ms, E2EL 500 ms, 5 tokens → TPOT (500-100)/4 = 100 ms, 100 ms/token
        rec(1, ttft=0.1, e2el=0.5, out=5, itl=[0.1, 0.1, 0.2], stats={
            "num_draft_tokens": 10, "num_accepted_tokens": 4, "mean_accepted_length": 2.0, "num_verify_steps": 2,
            "drafted_by": {"ngram": 6, "retrieval": 4}, "accepted_by": {"ngram": 3, "retrieval": 1}}),
        # one token: no TPOT; 200 ms/token
        rec(2, ttft=0.2, e2el=0.2, out=1, itl=[], domain="math", stats={
            "num_draft_tokens": 0, "num_accepted_tokens": 0, "mean_accepted_length": 1.0, "num_verify_steps": 1,
            "drafted_by": {}, "accepted_by": {}}),
        # TTFT 400 ms, E2EL 1400 ms, 11 tokens → TPOT 100 ms; 127.27 ms/token; no stats block
        rec(3, ttft=0.4, e2el=1.4, out=11, itl=[0.3, 0.7]),
        RequestRecord("c4-t0", "c4", 0, "math", "src/4", status="failed", error_kind="http", error="HTTP 500: x",
                      ttft_s=0.001, e2el_s=0.002, output_tokens=99, prompt_tokens=99),
        RequestRecord("c5-t0", "c5", 0, "code", "src/5", status="not_sent", error="aborted"),
    ]


def test_counts_throughput_and_percentiles(records):
    s = summarize(records, 2.0, percentile_metrics=("ttft", "tpot", "itl", "e2el", "lpt"), percentiles=(50, 90, 99))
    assert (s["num_requests"], s["completed"], s["failed"], s["not_sent"]) == (5, 3, 1, 1)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 17  # failed rows excluded
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(8.5)
    assert s["total_token_throughput"] == pytest.approx(23.5)
    # TTFT 100, 200, 400: mean 233.33, median 200, population std sqrt(46666.67/3) = 124.72,
    # p90 at rank 1.8 → 200 + 0.8·200 = 360, p99 at rank 1.98 → 396
    assert s["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(((100 - 700 / 3) ** 2 + (200 - 700 / 3) ** 2
                                                        + (400 - 700 / 3) ** 2) / 3))
    assert s["p90_ttft_ms"] == pytest.approx(360) and s["p99_ttft_ms"] == pytest.approx(396)
    # TPOT only where output > 1: 100 and 100
    assert s["mean_tpot_ms"] == pytest.approx(100) and s["std_tpot_ms"] == pytest.approx(0)
    # ITL pools all gaps: 100, 100, 200, 300, 700 → mean 280, median 200
    assert s["mean_itl_ms"] == pytest.approx(280) and s["median_itl_ms"] == pytest.approx(200)
    assert s["mean_e2el_ms"] == pytest.approx(700) and s["median_e2el_ms"] == pytest.approx(500)
    # latency per token: 100, 200, 1400/11
    assert s["mean_lpt_ms"] == pytest.approx((100 + 200 + 1400 / 11) / 3)
    assert s["errors"] == {"http": 1} and s["first_error"] == "HTTP 500: x"


def test_goodput(records):
    s = summarize(records, 2.0, goodput=parse_goodput(["ttft:250", "e2el:600"]))
    assert s["num_good_requests"] == 2 and s["request_goodput"] == pytest.approx(1.0)  # #3 misses TTFT
    s = summarize(records, 2.0, goodput=parse_goodput(["tpot:50"]))
    assert s["num_good_requests"] == 1  # #1 and #3 have TPOT 100; #2 has none (counts as met)
    s = summarize(records, 4.0, goodput=parse_goodput(["ttft:1000", "tpot:100", "e2el:1400"]))
    assert s["num_good_requests"] == 3 and s["request_goodput"] == pytest.approx(0.75)  # limits inclusive


def test_speculation_by_domain_and_drafter(records):
    spec = summarize(records, 2.0)["speculation"]
    assert spec["num_requests_with_stats"] == 2
    assert spec["acceptance_rate"] == pytest.approx(4 / 10)
    # committed per step: (2.0·2 + 1.0·1) / 3 steps
    assert spec["mean_accepted_length"] == pytest.approx(5 / 3)
    assert spec["by_drafter"]["ngram"] == {"drafted": 6, "accepted": 3, "acceptance_rate": 0.5,
                                           "share_of_accepted": 0.75}
    assert spec["by_drafter"]["retrieval"]["acceptance_rate"] == pytest.approx(0.25)
    domains = summarize(records, 2.0)["domains"]
    assert domains["code"]["acceptance_rate"] == pytest.approx(0.4)
    assert domains["math"]["acceptance_rate"] is None  # drafted nothing
    assert domains["math"]["mean_accepted_length"] == pytest.approx(1.0)
    assert (domains["math"]["requests"], domains["math"]["completed"]) == (2, 1)


def test_empty_run_has_no_numbers():
    s = summarize([], 0.0, goodput={"ttft": 10.0})
    assert s["completed"] == 0 and s["request_throughput"] is None and s["mean_ttft_ms"] is None
    assert s["speculation"]["acceptance_rate"] is None and s["request_goodput"] is None


def test_unknown_stats_fields_are_kept_not_fatal():
    r = RequestRecord("a", "a", 0, "code", "x")
    r.read_stats({"num_draft_tokens": 4, "num_accepted_tokens": "many", "domain": "code",
                  "drafters_used": ["ngram"], "drafted_by": {"ngram": 4, "bad": "x"}})
    assert r.has_stats and r.num_draft_tokens == 4 and r.num_accepted_tokens is None
    assert r.acceptance_rate is None and r.drafted_by == {"ngram": 4}
    assert r.stats_extra == '{"domain": "code", "drafters_used": ["ngram"]}'


def test_token_timeline_spreads_tokens_over_chunks():
    r = rec(1, ttft=0.1, e2el=2.5, out=6, itl=[])
    r.chunk_s = [0.2, 1.2, 2.4]  # 2 tokens per chunk
    starts, rate = token_timeline([r], bin_s=1.0)
    assert list(starts) == [0.0, 1.0, 2.0] and list(rate) == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("fn, text, message", [
    (parse_percentile_metrics, "ttft,bogus", "unknown metric 'bogus'"),
    (parse_percentiles, "0,99", "(0, 100]"),
    (parse_percentiles, "p99", "numbers"),
])
def test_parse_errors(fn, text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        fn(text)


@pytest.mark.parametrize("items", [["ttft"], ["foo:10"], ["ttft:x"], ["e2el:0"]])
def test_goodput_parse_errors(items):
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(items)


def test_ledger_detects_loss_duplication_and_bad_streams():
    ok = Ledger()
    for rid in ("a", "b", "c"):
        ok.record("planned", rid)
    ok.record("sent", "a"), ok.record("ok", "a", done_markers=1, response_id="r1")
    ok.record("sent", "b"), ok.record("failed", "b", error_kind="http")
    ok.record("not_sent", "c", reason="aborted")
    assert ok.check()["is_consistent"] and ok.check()["completed"] == 1

    bad = Ledger()
    for rid in ("a", "b", "c", "d"):
        bad.record("planned", rid)
    bad.record("sent", "a")                                              # lost: no terminal event
    bad.record("sent", "b"), bad.record("ok", "b", done_markers=2, response_id="r1")  # two [DONE]
    bad.record("sent", "c"), bad.record("ok", "c", done_markers=1, response_id="r1")  # reused id
    bad.record("ok", "c", done_markers=1, response_id="r2")              # duplicated terminal
    bad.record("sent", "zz"), bad.record("failed", "zz")                  # never planned
    report = bad.check()
    assert not report["is_consistent"]
    assert report["problems"]["lost"] == ["a"] and report["problems"]["duplicated"] == ["c"]
    assert report["problems"]["unknown"] == ["zz"] and report["problems"]["bad_done_markers"] == ["b"]
    assert report["problems"]["reused_response_ids"] == ["r1"]
    assert "d" in report["problems"]["never_finished"]
