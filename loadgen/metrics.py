"""Summary numbers from request records: ``vllm bench serve`` names plus speculation figures.

Definitions (ms for latencies; ``duration`` = run start to the last request's end):

- ``request_throughput`` = completed / duration; ``output_throughput`` = output tokens / duration;
  ``total_token_throughput`` = (prompt + output tokens) / duration (completed requests only).
- ``ttft``, ``tpot``, ``itl``, ``e2el``: see client.py; ``lpt`` (latency per token, the CoSine
  paper's "end-to-end latency (ms/token)") = E2EL / output tokens of each request.
- For each of ``--percentile-metrics``: mean, median, std (population, as numpy/vllm) and the
  ``--metric-percentiles`` (numpy linear interpolation). ``itl`` pools the gaps of all requests.
- ``request_goodput`` = completed requests meeting every ``--goodput`` SLO / duration; a
  request with one output token has no TPOT and counts as meeting a TPOT SLO (vllm uses 0).
- Speculation (requests that carried a stats block): acceptance rate = Σ accepted / Σ drafted;
  mean accepted length = Σ(mean_accepted_length · verify steps) / Σ verify steps (tokens committed
  per verify step, bonus included); per drafter: Σ accepted_by / Σ drafted_by.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from loadgen.client import RequestRecord

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "lpt")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PERCENTILE_METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics: unknown metric {unknown[0] if unknown else '(none)'!r}; "
                         f"choose from {','.join(PERCENTILE_METRICS)}")
    return names


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"--metric-percentiles must be numbers like 50,90,99, got {text!r}") from None
    if not values or any(not 0 < v <= 100 for v in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return values


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "e2el:5000"]`` → {"ttft": 200.0, "e2el": 5000.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {', '.join(GOODPUT_METRICS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {name}: the SLO must be > 0 ms, got {value}")
        slos[name] = ms
    return slos


def metric_values_ms(records: Iterable[RequestRecord], metric: str) -> np.ndarray:
    """Values of one metric over completed requests, in milliseconds."""
    out: list[float] = []
    for r in records:
        if r.status != "ok":
            continue
        if metric == "itl":
            out.extend(r.itl_s)
        elif metric == "lpt":
            if r.output_tokens:
                out.append(r.e2el_s / r.output_tokens)
        else:
            value = getattr(r, f"{metric}_s")
            if value is not None:
                out.append(value)
    return np.asarray(out, dtype=float) * 1000.0


def describe(values_ms: np.ndarray, name: str, percentiles: Sequence[float]) -> dict[str, float | None]:
    has = values_ms.size > 0
    out: dict[str, float | None] = {
        f"mean_{name}_ms": float(values_ms.mean()) if has else None,
        f"median_{name}_ms": float(np.median(values_ms)) if has else None,
        f"std_{name}_ms": float(values_ms.std()) if has else None}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(values_ms, p)) if has else None
    return out


def meets_slos(r: RequestRecord, slos: Mapping[str, float]) -> bool:
    for name, limit_ms in slos.items():
        value = getattr(r, f"{name}_s")
        if value is None:
            if name == "tpot":
                continue
            return False
        if value * 1000.0 > limit_ms:
            return False
    return True


def speculation_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    with_stats = [r for r in records if r.status == "ok" and r.has_stats]
    drafted = sum(r.num_draft_tokens or 0 for r in with_stats)
    accepted = sum(r.num_accepted_tokens or 0 for r in with_stats)
    steps = sum(r.num_verify_steps or 0 for r in with_stats)
    committed = sum((r.mean_accepted_length or 0.0) * (r.num_verify_steps or 0) for r in with_stats)
    by_drafter: dict[str, dict[str, float]] = defaultdict(lambda: {"drafted": 0, "accepted": 0})
    for r in with_stats:
        for name, n in r.drafted_by.items():
            by_drafter[name]["drafted"] += n
        for name, n in r.accepted_by.items():
            by_drafter[name]["accepted"] += n
    for name, row in by_drafter.items():
        row["acceptance_rate"] = row["accepted"] / row["drafted"] if row["drafted"] else None
        row["share_of_accepted"] = row["accepted"] / accepted if accepted else None
    return {"num_requests_with_stats": len(with_stats), "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted, "num_verify_steps": steps,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_accepted_length": committed / steps if steps else None,
            "by_drafter": dict(sorted(by_drafter.items()))}


def summarize(records: Sequence[RequestRecord], duration_s: float, *,
              percentile_metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
              percentiles: Sequence[float] = (50, 90, 99),
              goodput: Mapping[str, float] | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.status == "ok"]
    failed = [r for r in records if r.status == "failed"]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    out: dict[str, Any] = {
        "duration": duration_s, "num_requests": len(records), "completed": len(ok), "failed": len(failed),
        "not_sent": sum(r.status == "not_sent" for r in records),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    if goodput:
        out["goodput_slos_ms"] = dict(goodput)
        out["num_good_requests"] = sum(meets_slos(r, goodput) for r in ok)
        out["request_goodput"] = per_s(out["num_good_requests"])
    out["mean_lpt_ms"] = describe(metric_values_ms(ok, "lpt"), "lpt", ())["mean_lpt_ms"]
    for metric in percentile_metrics:
        out.update(describe(metric_values_ms(ok, metric), metric, percentiles))
    out["errors"] = dict(sorted(_count(str(r.error_kind) for r in failed).items()))
    out["first_error"] = failed[0].error if failed else None
    out["speculation"] = speculation_summary(records)
    out["domains"] = {d: domain_summary([r for r in records if r.domain == d])
                      for d in sorted({r.domain for r in records})}
    return out


def domain_summary(records: Sequence[RequestRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.status == "ok"]
    row: dict[str, Any] = {"requests": len(records), "completed": len(ok),
                           "output_tokens": sum(r.output_tokens or 0 for r in ok)}
    for metric in ("ttft", "tpot", "e2el", "lpt"):
        values = metric_values_ms(ok, metric)
        row[f"mean_{metric}_ms"] = float(values.mean()) if values.size else None
    spec = speculation_summary(records)
    row.update(acceptance_rate=spec["acceptance_rate"], mean_accepted_length=spec["mean_accepted_length"],
               by_drafter={k: v["acceptance_rate"] for k, v in spec["by_drafter"].items()})
    return row


def _count(items: Iterable[Any]) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def token_timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(bin start times, output tokens/s per bin). A request's output tokens are spread evenly
    over its content chunks (a chunk's exact token count is not in the stream)."""
    times, weights = [], []
    for r in records:
        if r.status == "ok" and r.chunk_s and r.output_tokens:
            times.extend(r.chunk_s)
            weights.extend([r.output_tokens / len(r.chunk_s)] * len(r.chunk_s))
    if not times:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, max(times) + bin_s, bin_s)
    if edges.size < 2:
        edges = np.array([0.0, bin_s])
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], tokens / bin_s
