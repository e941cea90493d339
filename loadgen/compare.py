"""Side by side: one plan (same seed → same prompts, same arrival offsets) against several targets.

Targets are either running servers (``--target NAME=URL``) or servers this command launches one
after another (``--launch TEMPLATE`` + ``--launch-target NAME=ARGS``; by default
``cosine`` = the template as is (the server's default drafters: full CoSine), ``off`` =
``--drafters none`` (speculation off), ``vanilla`` = ``--drafters ngram`` (single-drafter
speculation)). Each launched server is started, awaited on /health, measured, and stopped with
SIGINT before the next one starts, so they never compete for the CPUs.

The table follows the CoSine paper's evaluation (§6.1 metrics, Fig. 6 normalisation): latency
per token (ms/token, the mean of E2EL / output tokens) and output throughput (tokens/s), each
also divided by the baseline's (``--baseline``, default ``off``; the baseline reads 1.00×). So
``lpt × < 1`` and ``throughput × > 1`` mean faster than speculation off. It adds TTFT, TPOT,
p99 E2EL, goodput, acceptance, and how many outputs are identical to the baseline's (at
temperature 0 a lossless server must match it, except for near-ties).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rich.console import Console
from rich.table import Table

from loadgen.client import RequestRecord
from loadgen.launcher import LaunchError, ServerProcess, build_command, free_port
from loadgen.plots import plot_acceptance, plot_latency_cdf, plot_normalised, plot_over_time
from loadgen.report import ReportOptions, wide_console, write_json, write_run
from loadgen.runner import RunConfig, RunResult, run_plan
from loadgen.workload import WorkItem

DEFAULT_LAUNCH_TARGETS = (("cosine", ""), ("off", "--drafters none"), ("vanilla", "--drafters ngram"))


@dataclass(frozen=True, slots=True)
class CompareTarget:
    name: str
    url: str | None = None
    """A running server; None = launch it with the template + ``extra_args``."""
    extra_args: str = ""


@dataclass(frozen=True, slots=True)
class LaunchOptions:
    template: str
    host: str = "127.0.0.1"
    ready_timeout_s: float = 900.0
    stop_grace_s: float = 90.0


@dataclass
class CompareResult:
    rows: list[dict[str, Any]]
    errors: list[str]
    """One line per target that failed to launch or to finish all its requests."""
    interrupted: bool = False


def parse_pairs(items: Sequence[str] | None, flag: str) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{flag} takes NAME=VALUE, got {item!r}")
        if name in (n for n, _ in pairs):
            raise ValueError(f"{flag}: target {name!r} given twice")
        pairs.append((name.strip(), value))
    return pairs


def identical_outputs(records: Sequence[RequestRecord], baseline: Sequence[RequestRecord]) -> tuple[int, int]:
    """(identical, compared): requests that completed in both runs, matched by request id."""
    base = {r.request_id: r.output_text for r in baseline if r.status == "ok"}
    both = [r for r in records if r.status == "ok" and r.request_id in base]
    return sum(r.output_text == base[r.request_id] for r in both), len(both)


def comparison_rows(summaries: Mapping[str, Mapping[str, Any]], records: Mapping[str, Sequence[RequestRecord]],
                    baseline: str) -> list[dict[str, Any]]:
    base = summaries.get(baseline)

    def ratio(value: float | None, ref: float | None) -> float | None:
        return value / ref if value is not None and ref else None

    rows = []
    for name, s in summaries.items():
        spec = s["speculation"]
        same, compared = identical_outputs(records[name], records[baseline]) if baseline in records else (0, 0)
        rows.append({
            "target": name, "completed": s["completed"], "requests": s["num_requests"],
            "mean_lpt_ms": s["mean_lpt_ms"],
            "lpt_vs_baseline": ratio(s["mean_lpt_ms"], base and base["mean_lpt_ms"]),
            "output_throughput": s["output_throughput"],
            "throughput_vs_baseline": ratio(s["output_throughput"], base and base["output_throughput"]),
            "request_throughput": s["request_throughput"],
            "mean_ttft_ms": s.get("mean_ttft_ms"), "mean_tpot_ms": s.get("mean_tpot_ms"),
            "p99_e2el_ms": s.get("p99_e2el_ms"), "request_goodput": s.get("request_goodput"),
            "acceptance_rate": spec["acceptance_rate"], "mean_accepted_length": spec["mean_accepted_length"],
            "identical_to_baseline": same, "compared_with_baseline": compared,
        })
    return rows


def print_comparison(rows: Sequence[Mapping[str, Any]], baseline: str, console: Console | None = None) -> None:
    console = console or wide_console()
    table = Table(title=f"Side by side (normalised to {baseline!r} = 1.00×)", title_justify="left")
    cols = ("target", "ok/total", "ms/token", "× lat", "out tok/s", "× thr", "TTFT ms", "TPOT ms", "p99 E2EL ms",
            "goodput", "accept", "acc len", f"same as {baseline}")
    for col in cols:
        table.add_column(col, justify="left" if col == "target" else "right")
    for r in rows:
        table.add_row(r["target"], f"{r['completed']}/{r['requests']}", *(_fmt(r[k]) for k in (
            "mean_lpt_ms", "lpt_vs_baseline", "output_throughput", "throughput_vs_baseline", "mean_ttft_ms",
            "mean_tpot_ms", "p99_e2el_ms", "request_goodput", "acceptance_rate", "mean_accepted_length")),
            f"{r['identical_to_baseline']}/{r['compared_with_baseline']}")
    console.print(table)


def markdown_table(rows: Sequence[Mapping[str, Any]], baseline: str) -> str:
    head = ("| system | ok/total | latency per token (ms) | vs " + baseline + " | throughput (tok/s) | vs "
            + baseline + " | mean TTFT (ms) | mean TPOT (ms) | p99 E2EL (ms) | acceptance | mean accepted length |"
            " identical to " + baseline + " |")
    lines = [head, "|" + " --- |" * 12]
    for r in rows:
        lines.append(f"| {r['target']} | {r['completed']}/{r['requests']} | {_fmt(r['mean_lpt_ms'])} | "
                     f"{_fmt(r['lpt_vs_baseline'])}× | {_fmt(r['output_throughput'])} | "
                     f"{_fmt(r['throughput_vs_baseline'])}× | {_fmt(r['mean_ttft_ms'])} | {_fmt(r['mean_tpot_ms'])} | "
                     f"{_fmt(r['p99_e2el_ms'])} | {_fmt(r['acceptance_rate'])} | {_fmt(r['mean_accepted_length'])} | "
                     f"{r['identical_to_baseline']}/{r['compared_with_baseline']} |")
    return "\n".join(lines) + "\n"


def _fmt(value: Any) -> str:
    return "–" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)


def run_compare(plan: Sequence[tuple[WorkItem, float]], cfg: RunConfig, targets: Sequence[CompareTarget], *,
                baseline: str, out_dir: Path, opts: ReportOptions, launch: LaunchOptions | None = None,
                log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> CompareResult:
    """Run ``plan`` against every target in order; write per-target and combined outputs."""
    summaries: dict[str, dict[str, Any]] = {}
    records: dict[str, list[RequestRecord]] = {}
    errors: list[str] = []
    interrupted = False
    for target in targets:
        target_dir = out_dir / target.name
        try:
            result = _measure(plan, cfg, target, launch, target_dir, log)
        except LaunchError as exc:
            errors.append(str(exc))
            log(f"[{target.name}] {exc}")
            continue
        except KeyboardInterrupt:
            errors.append(f"{target.name}: interrupted while launching")
            interrupted = True
            break
        data = write_run(result, target_dir, ReportOptions(**{**_as_dict(opts), "print_table": False}),
                         title=target.name, label=target.name)
        summaries[target.name], records[target.name] = data["summary"], result.records
        s = data["summary"]
        log(f"[{target.name}] {s['completed']}/{s['num_requests']} ok, {_fmt(s['output_throughput'])} tok/s, "
            f"{_fmt(s['mean_lpt_ms'])} ms/token")
        if result.abort_reason or s["failed"] or not data["ledger"]["is_consistent"]:
            why = result.abort_reason or data["summary"]["first_error"] or "ledger inconsistent"
            errors.append(f"{target.name}: {s['completed']} of {s['num_requests']} requests completed ({why})")
        if result.abort_reason and result.abort_reason.startswith("interrupted"):
            interrupted = True
            break
    rows = comparison_rows(summaries, records, baseline)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json({"baseline": baseline, "rows": rows, "errors": errors, "config": dict(opts.config),
                "targets": [t.name for t in targets]}, out_dir / "comparison.json")
    (out_dir / "comparison.md").write_text(markdown_table(rows, baseline), encoding="utf-8")
    if opts.plots and records:
        plot_latency_cdf(records, out_dir / "latency_cdf.png")
        plot_over_time(records, out_dir / "over_time.png")
        plot_acceptance(records, out_dir / "acceptance.png")
        plot_normalised(rows, baseline, out_dir / "normalised.png")
    if opts.print_table:
        print_comparison(rows, baseline)
    return CompareResult(rows, errors, interrupted)


def _measure(plan: Sequence[tuple[WorkItem, float]], cfg: RunConfig, target: CompareTarget,
             launch: LaunchOptions | None, target_dir: Path, log: Callable[[str], None]) -> RunResult:
    if target.url is not None:
        log(f"[{target.name}] measuring {target.url}")
        return run_plan(plan, _with_url(cfg, target.url))
    assert launch is not None, "a target without a URL needs --launch"
    port = free_port(launch.host)
    command = build_command(launch.template, target.extra_args, host=launch.host, port=port)
    url = f"http://{launch.host}:{port}"
    with ServerProcess(target.name, command, url, target_dir / "server.log", ready_timeout_s=launch.ready_timeout_s,
                       stop_grace_s=launch.stop_grace_s, log=log) as server:
        server.wait_ready()
        log(f"[{target.name}] measuring {url}")
        return run_plan(plan, _with_url(cfg, url))


def _with_url(cfg: RunConfig, url: str) -> RunConfig:
    return RunConfig(**{**_as_dict(cfg), "base_url": url})


def _as_dict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
