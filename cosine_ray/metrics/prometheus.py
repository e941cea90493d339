"""Render a ``MetricsRegistry.snapshot()`` as Prometheus text exposition (the edge).

Only this module and ``serve/`` import ``prometheus_client``; the engine keeps plain counters
(``metrics/registry.py``). We use prometheus_client's custom-collector API rather than its
global registry: the numbers live in the engine process, arrive here as a picklable snapshot,
and are turned into metric families on each scrape, so nothing is double counted and no
process-global state is involved.

Conventions (``names.py``): counters get ``_total``; histograms ``_bucket{le}`` (cumulative),
``_sum`` and ``_count``. Unlabelled metrics are always exported (0 until recorded), as
prometheus_client does for its own unlabelled metrics; labelled ones only once they have a
series.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from cosine_ray.metrics.names import METRICS
from cosine_ray.metrics.registry import Histogram, LabelKey

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format: our names are plain ``[a-zA-Z_:][a-zA-Z0-9_:]*``, so the output of
``generate_latest`` is valid 0.0.4 text, which every Prometheus 2.x and 3.x reads."""

Snapshot = Mapping[str, Mapping[LabelKey, Any]]


class SnapshotCollector:
    """A prometheus_client collector over one registry snapshot."""

    def __init__(self, snapshot: Snapshot) -> None:
        unknown = sorted(set(snapshot) - set(METRICS))
        if unknown:
            raise KeyError(f"snapshot has metrics missing from names.METRICS: {unknown}")
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        for name, spec in METRICS.items():
            series = dict(self.snapshot.get(name, {}))
            if not series and not spec.labels:
                series = {(): Histogram(spec.buckets) if spec.kind == "histogram" else 0.0}
            labels = list(spec.labels)
            if spec.kind == "counter":
                family: Metric = CounterMetricFamily(name, spec.help, labels=labels)
                for key, value in series.items():
                    family.add_metric([v for _, v in key], float(value))
            elif spec.kind == "gauge":
                family = GaugeMetricFamily(name, spec.help, labels=labels)
                for key, value in series.items():
                    family.add_metric([v for _, v in key], float(value))
            else:
                family = HistogramMetricFamily(name, spec.help, labels=labels)
                for key, hist in series.items():
                    family.add_metric([v for _, v in key], cumulative_buckets(hist), hist.sum)
            yield family


def cumulative_buckets(hist: Histogram) -> list[tuple[str, float]]:
    """[(le, cumulative count)] ending with +Inf (= the histogram's count)."""
    out, total = [], 0
    for bound, count in zip(list(hist.buckets) + [float("inf")], hist.counts):
        total += count
        out.append((floatToGoString(bound), float(total)))
    return out


def render(snapshot: Snapshot) -> bytes:
    """Prometheus text exposition (format 0.0.4) of a registry snapshot."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return generate_latest(registry)
