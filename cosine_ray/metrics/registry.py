"""Plain in-process counters, gauges and histograms (no Prometheus client here).

The engine records into a ``MetricsRegistry``; an exporter at the edge turns a
``snapshot()`` into Prometheus text. Names and label sets are checked against
``names.METRICS`` so a typo fails loudly in tests instead of exporting a stray series.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from cosine_ray.metrics.names import METRICS, MetricSpec

LabelKey = tuple[tuple[str, str], ...]


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    """Non-cumulative count per bucket, plus one for +Inf."""
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1


class MetricsRegistry:
    def __init__(self) -> None:
        self._values: dict[str, dict[LabelKey, Any]] = {name: {} for name in METRICS}
        self._readings: dict[tuple[str, str, LabelKey], float] = {}
        """Last cumulative reading per (metric, source, labels): see ``add_cumulative``."""
        self._levels: dict[tuple[str, LabelKey], dict[str, tuple[float, float]]] = {}
        """Per gauge series, each source's (up, down) totals: see ``add_level``."""

    @staticmethod
    def _key(name: str, spec: MetricSpec, labels: dict[str, Any]) -> LabelKey:
        if set(labels) != set(spec.labels):
            raise ValueError(f"{name} takes labels {spec.labels}, got {tuple(sorted(labels))}")
        return tuple((k, str(labels[k])) for k in spec.labels)

    def _spec(self, name: str, kind: str) -> MetricSpec:
        spec = METRICS.get(name)
        if spec is None:
            raise KeyError(f"unknown metric {name!r}: add it to cosine_ray.metrics.names.METRICS")
        if spec.kind != kind:
            raise TypeError(f"{name} is a {spec.kind}, not a {kind}")
        return spec

    def inc(self, name: str, value: float = 1.0, **labels: Any) -> None:
        spec = self._spec(name, "counter")
        if value < 0:
            raise ValueError(f"counter {name} cannot decrease")
        series = self._values[name]
        key = self._key(name, spec, labels)
        series[key] = series.get(key, 0.0) + value

    def add_cumulative(self, name: str, reading: float, source: str, *, lower_means_restart: bool = True,
                       **labels: Any) -> None:
        """Fold a cumulative reading taken from another process into a counter.

        Stage busy seconds and drafter respawns are counted where they happen and read at
        scrape time. The counter grows by ``reading - last reading of (source, labels)``; a
        reading below the last one means the source restarted from zero, so all of it is new.
        The exported counter therefore never decreases, across restarts of the source too.
        With ``lower_means_restart=False`` a lower reading is a stale one that arrived late
        (sources whose restarts get a new ``source`` name) and is ignored."""
        spec = self._spec(name, "counter")
        key = (name, source, self._key(name, spec, labels))
        last = self._readings.get(key, 0.0)
        if reading < last and not lower_means_restart:
            return
        self._readings[key] = float(reading)
        self.inc(name, reading - last if reading >= last else reading, **labels)

    def add_http_totals(self, replica: str, totals: dict[tuple, Any]) -> None:
        """Cumulative counts of one ingress replica, folded in order-insensitively (a late,
        older push changes nothing). A key ``(route, status)`` counts HTTP responses; a key
        ``(metric name, labels)`` is one of the ingress's own series: a counter's cumulative
        total, or a gauge's cumulative (up, down) pair (``add_level``)."""
        for key, value in totals.items():
            name, labels = key
            if isinstance(labels, tuple):
                if METRICS[name].kind == "gauge":
                    self.add_level(name, replica, *value, **dict(labels))
                else:
                    self.add_cumulative(name, value, replica, lower_means_restart=False, **dict(labels))
            else:
                self.add_cumulative("cosine_ray:http_requests", value, replica, lower_means_restart=False,
                                    route=name, status=labels)

    def add_level(self, name: str, source: str, up: float, down: float, **labels: Any) -> None:
        """A gauge kept by other processes as two cumulative totals (what came in, what went out):
        its value is the sum over sources of up - down, each total taken at its highest reading,
        so readings that arrive late or out of order leave it right."""
        spec = self._spec(name, "gauge")
        key = self._key(name, spec, labels)
        sources = self._levels.setdefault((name, key), {})
        last_up, last_down = sources.get(source, (0.0, 0.0))
        sources[source] = (max(last_up, float(up)), max(last_down, float(down)))
        self._values[name][key] = sum(u - d for u, d in sources.values())

    def set(self, name: str, value: float, **labels: Any) -> None:
        spec = self._spec(name, "gauge")
        self._values[name][self._key(name, spec, labels)] = float(value)

    def observe(self, name: str, value: float, **labels: Any) -> None:
        spec = self._spec(name, "histogram")
        series = self._values[name]
        key = self._key(name, spec, labels)
        hist = series.get(key)
        if hist is None:
            hist = series[key] = Histogram(spec.buckets)
        hist.observe(float(value))

    def get(self, name: str, **labels: Any) -> Any:
        """Current value of one series (0 / None when never recorded); for tests and stats."""
        spec = METRICS[name]
        value = self._values[name].get(self._key(name, spec, labels))
        if value is None and spec.kind != "histogram":
            return 0.0
        return value

    def total(self, name: str, **match: Any) -> float:
        """Sum of a counter/gauge over every series whose labels include ``match``."""
        want = {(k, str(v)) for k, v in match.items()}
        return sum(v for key, v in self._values[name].items() if want <= set(key))

    def snapshot(self) -> dict[str, dict[LabelKey, Any]]:
        """A picklable copy: {name: {labels: float | Histogram}}."""
        out: dict[str, dict[LabelKey, Any]] = {}
        for name, series in self._values.items():
            out[name] = {k: (Histogram(v.buckets, list(v.counts), v.sum, v.count)
                             if isinstance(v, Histogram) else v) for k, v in series.items()}
        return out
