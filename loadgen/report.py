"""Writing a run: ``summary.json``, ``requests.parquet``, ``ledger.jsonl``, plots, the printed table.

``requests.parquet`` has one row per planned request (also failed and not-sent ones) with an
explicit schema, so an empty or all-failed run still has typed columns; ``drafted_by`` /
``accepted_by`` are ``map<string, int64>``, ``itl_s`` / ``chunk_s`` are lists of seconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.table import Table

from loadgen.client import RequestRecord
from loadgen.metrics import summarize
from loadgen.plots import plot_run
from loadgen.runner import RunResult

_COUNTS = pa.map_(pa.string(), pa.int64())
REQUEST_SCHEMA = pa.schema([
    ("request_id", pa.string()), ("conversation_id", pa.string()), ("turn", pa.int32()),
    ("domain", pa.string()), ("source_id", pa.string()), ("status", pa.string()),
    ("error_kind", pa.string()), ("error", pa.string()), ("http_status", pa.int32()),
    ("scheduled_s", pa.float64()), ("queued_s", pa.float64()), ("sent_s", pa.float64()),
    ("first_token_s", pa.float64()), ("end_s", pa.float64()), ("ttft_s", pa.float64()),
    ("e2el_s", pa.float64()), ("tpot_s", pa.float64()), ("itl_s", pa.list_(pa.float64())),
    ("chunk_s", pa.list_(pa.float64())), ("prompt_tokens", pa.int64()), ("output_tokens", pa.int64()),
    ("output_tokens_source", pa.string()), ("num_done_markers", pa.int32()), ("response_id", pa.string()),
    ("finish_reason", pa.string()), ("output_text", pa.string()), ("has_stats", pa.bool_()),
    ("num_draft_tokens", pa.int64()), ("num_accepted_tokens", pa.int64()),
    ("mean_accepted_length", pa.float64()), ("num_verify_steps", pa.int64()),
    ("acceptance_rate", pa.float64()), ("drafted_by", _COUNTS), ("accepted_by", _COUNTS),
    ("stats_extra", pa.string()),
])


def write_parquet(records: Sequence[RequestRecord], path: Path) -> None:
    rows = [r.as_row() for r in records]
    for row in rows:
        for key in ("drafted_by", "accepted_by"):
            row[key] = list(row[key].items())
    pq.write_table(pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA), path)


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf → null, tuples → lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(data: Mapping[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_clean(data), indent=2, sort_keys=False) + "\n", encoding="utf-8")


def wide_console() -> Console:
    """The terminal's width on a terminal; 160 columns into files and pipes (no squeezed tables)."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def print_summary(summary: Mapping[str, Any], ledger: Mapping[str, Any], *, title: str,
                  percentile_metrics: Sequence[str], percentiles: Sequence[float],
                  console: Console | None = None) -> None:
    """The ``vllm bench serve``-style block, then acceptance by domain and by drafter."""
    console = console or wide_console()
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"]),
            ("Not sent", summary["not_sent"]), ("Benchmark duration (s)", summary["duration"]),
            ("Total input tokens", summary["total_input_tokens"]),
            ("Total generated tokens", summary["total_output_tokens"]),
            ("Request throughput (req/s)", summary["request_throughput"]),
            ("Output token throughput (tok/s)", summary["output_throughput"]),
            ("Total token throughput (tok/s)", summary["total_token_throughput"])]
    if "request_goodput" in summary:
        rows.append(("Request goodput (req/s)", summary["request_goodput"]))
    rows.append(("Mean latency per token (ms/tok)", summary["mean_lpt_ms"]))
    for metric in percentile_metrics:
        rows.append((f"Mean {metric.upper()} (ms)", summary[f"mean_{metric}_ms"]))
        rows.append((f"Median {metric.upper()} (ms)", summary[f"median_{metric}_ms"]))
        rows += [(f"P{p:g} {metric.upper()} (ms)", summary[f"p{p:g}_{metric}_ms"]) for p in percentiles if p != 50]
    spec = summary["speculation"]
    rows += [("Requests with speculation stats", spec["num_requests_with_stats"]),
             ("Acceptance rate (accepted/drafted)", spec["acceptance_rate"]),
             ("Mean accepted length (tok/verify step)", spec["mean_accepted_length"]),
             ("Ledger: planned / sent / ok / failed / not sent",
              f"{ledger['planned']} / {ledger['sent']} / {ledger['completed']} / {ledger['failed']} / "
              f"{ledger['not_sent']}"),
             ("Ledger: lost / duplicated", f"{ledger['num_lost']} / {ledger['num_duplicated']}"
              + ("" if ledger["is_consistent"] else "  INCONSISTENT"))]
    for name, value in rows:
        table.add_row(name, _fmt(value))
    console.print(table)

    domains = Table(title="By domain", title_justify="left")
    for col in ("domain", "ok/total", "mean TTFT ms", "mean TPOT ms", "ms/token", "accept rate", "mean acc len"):
        domains.add_column(col, justify="left" if col == "domain" else "right", no_wrap=col == "domain")
    for name, row in summary["domains"].items():
        domains.add_row(name, f"{row['completed']}/{row['requests']}", _fmt(row["mean_ttft_ms"]),
                        _fmt(row["mean_tpot_ms"]), _fmt(row["mean_lpt_ms"]), _fmt(row["acceptance_rate"], 3),
                        _fmt(row["mean_accepted_length"], 3))
    console.print(domains)
    if spec["by_drafter"]:
        drafters = Table(title="By drafter", title_justify="left")
        for col in ("drafter", "drafted", "accepted", "accept rate", "share of accepted"):
            drafters.add_column(col, justify="left" if col == "drafter" else "right")
        for name, row in spec["by_drafter"].items():
            drafters.add_row(name, _fmt(int(row["drafted"])), _fmt(int(row["accepted"])),
                             _fmt(row["acceptance_rate"], 3), _fmt(row["share_of_accepted"], 3))
        console.print(drafters)


@dataclass(frozen=True, slots=True)
class ReportOptions:
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el")
    percentiles: Sequence[float] = (50, 90, 99)
    goodput: Mapping[str, float] = field(default_factory=dict)
    plots: bool = True
    print_table: bool = True
    config: Mapping[str, Any] = field(default_factory=dict)
    """Echoed into summary.json (the flags and the plan's description)."""


def write_run(result: RunResult, out_dir: Path, opts: ReportOptions, *, title: str = "Serving benchmark",
              label: str = "run", console: Console | None = None) -> dict[str, Any]:
    """Everything for one run into ``out_dir``; returns the summary.json data."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(result.records, result.duration_s, percentile_metrics=opts.percentile_metrics,
                        percentiles=opts.percentiles, goodput=opts.goodput or None)
    ledger = result.ledger.check()
    files = {"summary": "summary.json", "requests": "requests.parquet", "ledger": "ledger.jsonl"}
    write_parquet(result.records, out_dir / files["requests"])
    result.ledger.write(out_dir / files["ledger"])
    if opts.plots:
        files["plots"] = [p.name for p in plot_run({label: result.records}, out_dir)]
    data = {"title": title, "model": result.model, "started_at": result.started_at,
            "abort_reason": result.abort_reason, "config": dict(opts.config), "summary": summary,
            "ledger": ledger, "files": files}
    write_json(data, out_dir / files["summary"])
    if opts.print_table:
        print_summary(summary, ledger, title=title, percentile_metrics=opts.percentile_metrics,
                      percentiles=opts.percentiles, console=console)
    return data
