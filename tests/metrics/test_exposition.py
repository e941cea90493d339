"""Prometheus text exposition of a registry snapshot, parsed back with prometheus_client."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cosine_ray.metrics.names import METRICS
from cosine_ray.metrics.prometheus import CONTENT_TYPE, render
from cosine_ray.metrics.registry import MetricsRegistry


def parse(snapshot) -> dict[str, list]:
    """family name -> samples; also checks every family is in the table with the right type."""
    out = {}
    for family in text_string_to_metric_families(render(snapshot).decode()):
        spec = METRICS[family.name]
        assert family.type == spec.kind, family.name
        assert family.documentation == spec.help
        out[family.name] = family.samples
    return out


def sample_values(samples, name: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


def test_counters_gauges_histograms_round_trip():
    m = MetricsRegistry()
    m.inc("cosine_ray:request_success", 3, finished_reason="stop")
    m.inc("cosine_ray:request_success", finished_reason="length")
    m.inc("cosine_ray:spec_decode_num_accepted_tokens", 7, drafter="retrieval:code", domain="code")
    m.inc("cosine_ray:generation_tokens", 42)
    m.set("cosine_ray:num_requests_running", 2)
    m.set("cosine_ray:routing_score", 0.25, drafter="ngram", domain="chat")
    for v in (0.003, 0.03, 0.3, 3.0, 300.0):
        m.observe("cosine_ray:time_to_first_token_seconds", v)
    fams = parse(m.snapshot())

    assert sample_values(fams["cosine_ray:request_success"], "cosine_ray:request_success_total") == {
        (("finished_reason", "stop"),): 3.0, (("finished_reason", "length"),): 1.0}
    assert sample_values(fams["cosine_ray:spec_decode_num_accepted_tokens"],
                         "cosine_ray:spec_decode_num_accepted_tokens_total") == {
        (("domain", "code"), ("drafter", "retrieval:code")): 7.0}
    assert sample_values(fams["cosine_ray:generation_tokens"], "cosine_ray:generation_tokens_total") == {(): 42.0}
    assert sample_values(fams["cosine_ray:num_requests_running"], "cosine_ray:num_requests_running") == {(): 2.0}
    assert sample_values(fams["cosine_ray:routing_score"], "cosine_ray:routing_score") == {
        (("domain", "chat"), ("drafter", "ngram")): 0.25}

    ttft = fams["cosine_ray:time_to_first_token_seconds"]
    buckets = {s.labels["le"]: s.value for s in ttft if s.name.endswith("_bucket")}
    bounds = METRICS["cosine_ray:time_to_first_token_seconds"].buckets
    assert list(buckets) == [*(str(float(b)) for b in bounds), "+Inf"]
    assert buckets["0.005"] == 1 and buckets["0.04"] == 2 and buckets["0.5"] == 3 and buckets["5.0"] == 4
    assert buckets["80.0"] == 4 and buckets["+Inf"] == 5
    values = list(buckets.values())
    assert values == sorted(values), "buckets must be cumulative"
    assert sample_values(ttft, "cosine_ray:time_to_first_token_seconds_count") == {(): 5.0}
    assert sample_values(ttft, "cosine_ray:time_to_first_token_seconds_sum")[()] == pytest.approx(303.333)


def test_unlabelled_metrics_are_always_exported_labelled_ones_once_recorded():
    fams = parse(MetricsRegistry().snapshot())
    for name, spec in METRICS.items():
        if spec.labels:
            assert fams[name] == [], f"{name} has no series before it is recorded"
        elif spec.kind == "histogram":
            assert sample_values(fams[name], f"{name}_count") == {(): 0.0}
            assert sample_values(fams[name], f"{name}_bucket")[(("le", "+Inf"),)] == 0.0
        else:
            suffix = "_total" if spec.kind == "counter" else ""
            assert sample_values(fams[name], name + suffix) == {(): 0.0}


def test_label_values_with_quotes_and_newlines_are_escaped():
    m = MetricsRegistry()
    weird = 'model:"/tmp/a b"\nx\\y'
    m.inc("cosine_ray:fusion_picks", 2, drafter=weird)
    fams = parse(m.snapshot())
    assert sample_values(fams["cosine_ray:fusion_picks"], "cosine_ray:fusion_picks_total") == {
        (("drafter", weird),): 2.0}


def test_snapshot_with_a_name_outside_the_table_is_refused():
    snap = MetricsRegistry().snapshot()
    snap["cosine_ray:stray"] = {(): 1.0}
    with pytest.raises(KeyError, match="stray"):
        render(snap)


def test_content_type_is_the_text_format():
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")
    text = render(MetricsRegistry().snapshot()).decode()
    assert all(line.startswith(("# HELP cosine_ray:", "# TYPE cosine_ray:", "cosine_ray:"))
               for line in text.splitlines()), "only our families, classic names (no quoting)"
