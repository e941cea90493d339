"""MetricsRegistry semantics (plain counters, no Prometheus)."""

from __future__ import annotations

import pickle

import pytest

from cosine_ray.metrics.names import METRICS
from cosine_ray.metrics.registry import Histogram, MetricsRegistry


def test_counter_inc_and_total_over_labels():
    m = MetricsRegistry()
    m.inc("cosine_ray:spec_decode_num_draft_tokens", 3, drafter="ngram", domain="code")
    m.inc("cosine_ray:spec_decode_num_draft_tokens", 2, drafter="ngram", domain="math")
    m.inc("cosine_ray:spec_decode_num_draft_tokens", 5, drafter="retrieval", domain="code")
    assert m.get("cosine_ray:spec_decode_num_draft_tokens", drafter="ngram", domain="code") == 3
    assert m.total("cosine_ray:spec_decode_num_draft_tokens") == 10
    assert m.total("cosine_ray:spec_decode_num_draft_tokens", drafter="ngram") == 5
    assert m.total("cosine_ray:spec_decode_num_draft_tokens", domain="code") == 8
    assert m.get("cosine_ray:spec_decode_num_draft_tokens", drafter="model", domain="chat") == 0


def test_label_values_are_strings_and_label_sets_are_checked():
    m = MetricsRegistry()
    m.inc("cosine_ray:spec_decode_num_accepted_tokens_per_pos", position=2)
    assert m.get("cosine_ray:spec_decode_num_accepted_tokens_per_pos", position="2") == 1
    with pytest.raises(ValueError, match="takes labels"):
        m.inc("cosine_ray:spec_decode_num_accepted_tokens_per_pos")
    with pytest.raises(ValueError, match="takes labels"):
        m.inc("cosine_ray:prompt_tokens", 1, drafter="ngram")


def test_unknown_names_wrong_kinds_and_negative_counts_fail_loudly():
    m = MetricsRegistry()
    with pytest.raises(KeyError, match="names.METRICS"):
        m.inc("cosine_ray:no_such_metric")
    with pytest.raises(TypeError, match="is a gauge"):
        m.inc("cosine_ray:num_requests_running")
    with pytest.raises(TypeError, match="is a counter"):
        m.observe("cosine_ray:prompt_tokens", 1.0)
    with pytest.raises(ValueError, match="cannot decrease"):
        m.inc("cosine_ray:prompt_tokens", -1)


def test_gauge_set_replaces():
    m = MetricsRegistry()
    m.set("cosine_ray:num_requests_waiting", 4)
    m.set("cosine_ray:num_requests_waiting", 1)
    assert m.get("cosine_ray:num_requests_waiting") == 1.0


def test_histogram_buckets_are_upper_inclusive_with_overflow():
    m = MetricsRegistry()
    buckets = METRICS["cosine_ray:scheduler_batch_size"].buckets
    for v in (0, 1, 1.5, 2, 5000):
        m.observe("cosine_ray:scheduler_batch_size", v)
    hist = m.get("cosine_ray:scheduler_batch_size")
    assert isinstance(hist, Histogram) and hist.count == 5 and hist.sum == pytest.approx(5004.5)
    assert len(hist.counts) == len(buckets) + 1
    assert hist.counts[buckets.index(0)] == 1      # le=0
    assert hist.counts[buckets.index(1)] == 1      # le=1 holds 1 (Prometheus buckets are v <= le)
    assert hist.counts[buckets.index(2)] == 2      # 1.5 and 2
    assert hist.counts[-1] == 1                    # +Inf only


def test_snapshot_is_a_picklable_copy():
    m = MetricsRegistry()
    m.inc("cosine_ray:request_success", finished_reason="stop")
    m.observe("cosine_ray:time_to_first_token_seconds", 0.2)
    snap = pickle.loads(pickle.dumps(m.snapshot()))
    m.inc("cosine_ray:request_success", finished_reason="stop")
    m.observe("cosine_ray:time_to_first_token_seconds", 0.3)
    assert snap["cosine_ray:request_success"] == {(("finished_reason", "stop"),): 1.0}
    assert snap["cosine_ray:time_to_first_token_seconds"][()].count == 1
    assert set(snap) == set(METRICS)


def test_add_cumulative_folds_readings_and_survives_restarts():
    m = MetricsRegistry()
    name = "cosine_ray:stage_busy_seconds"
    m.add_cumulative(name, 2.0, "pid-1", stage=0)
    m.add_cumulative(name, 5.0, "pid-1", stage=0)
    assert m.get(name, stage=0) == 5.0
    m.add_cumulative(name, 1.0, "pid-1", stage=0)   # lower: the source restarted from zero
    assert m.get(name, stage=0) == 6.0
    m.add_cumulative(name, 3.0, "pid-2", stage=0)   # a new incarnation: all of it is new
    assert m.get(name, stage=0) == 9.0
    m.add_cumulative(name, 3.0, "pid-2", stage=0)   # the same reading twice adds nothing
    assert m.get(name, stage=0) == 9.0
    m.add_cumulative(name, 4.0, "pid-1", stage=1)   # other labels are other series
    assert m.get(name, stage=1) == 4.0 and m.total(name) == 13.0
    with pytest.raises(TypeError):
        m.add_cumulative("cosine_ray:num_requests_running", 1.0, "x")


def test_http_totals_fold_per_replica_and_ignore_stale_pushes():
    m = MetricsRegistry()
    m.add_http_totals("a", {("/v1/completions", 200): 3})
    m.add_http_totals("a", {("/v1/completions", 200): 2})   # an older push arriving late
    m.add_http_totals("b", {("/v1/completions", 200): 1, ("/health", 200): 4})
    m.add_http_totals("a", {("/v1/completions", 200): 5, ("/v1/completions", 400): 1})
    assert m.get("cosine_ray:http_requests", route="/v1/completions", status=200) == 6
    assert m.get("cosine_ray:http_requests", route="/v1/completions", status=400) == 1
    assert m.total("cosine_ray:http_requests") == 11
