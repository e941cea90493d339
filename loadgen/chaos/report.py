"""Writing a chaos run: ``chaos.json``, ``ledger.jsonl``, ``calls.jsonl``, ``memory.csv``,
``chaos.png`` and the printed tables.

``chaos.json`` holds the verdict (``audit``), one row per fault (kind, target, time, requests
in flight and how they ended, recovery), the memory figures (footprint before the load, sums at
start and end, every process's slope, pooled slopes per role) and the throughput/latency
series the plot draws. ``chaos.png``: output tokens/s, p50/p99 latency of completed requests,
and the deployment's summed RSS and PSS over time, every fault marked (colour = kind).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from loadgen.chaos.audit import touched  # noqa: E402
from loadgen.chaos.faults import KINDS  # noqa: E402
from loadgen.chaos.run import ChaosResult  # noqa: E402
from loadgen.report import _fmt, wide_console, write_json  # noqa: E402

KIND_COLOURS = dict(zip(KINDS, ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
                                "tab:cyan")))


def series(result: ChaosResult, bin_s: float) -> dict[str, list[float]]:
    """Per bin (by end time, load calls): output tokens/s, completed requests, p50/p99 E2E (s)."""
    start, end = result.load_start_t, max(result.load_end_t, result.load_start_t + bin_s)
    edges = np.arange(start, end + bin_s, bin_s)
    out: dict[str, list[float]] = {"t": [], "tokens_per_s": [], "completed": [], "p50_s": [], "p99_s": []}
    load = [c for c in result.calls if c.kind == "load" and c.end_t is not None]
    for lo, hi in zip(edges[:-1], edges[1:]):
        ended = [c for c in load if lo <= c.end_t < hi]
        ok = [c.end_t - c.sent_t for c in ended if c.outcome == "ok"]
        tokens = sum((c.output_tokens if c.output_tokens is not None else c.num_chunks) for c in ended)
        out["t"].append(float((lo + hi) / 2))
        out["tokens_per_s"].append(tokens / bin_s)
        out["completed"].append(float(len(ok)))
        out["p50_s"].append(float(np.percentile(ok, 50)) if ok else float("nan"))
        out["p99_s"].append(float(np.percentile(ok, 99)) if ok else float("nan"))
    return out


def summary_data(result: ChaosResult, verdict: Mapping[str, Any], *, footprint: Mapping[str, Any] | None,
                 slope_bound: float, config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = result.config
    by_id = {c.request_id: c for c in result.calls}
    faults = [{**f.as_dict(), **touched(f, by_id)} for f in result.faults]
    slopes = result.memory.slopes(run_warmup_s=result.load_start_t + cfg.memory_warmup_s,
                                  warmup_s=cfg.memory_warmup_s, min_span_s=cfg.memory_min_span_s)
    judged = [r for r in slopes if r["judged"]]
    not_judged = dict(Counter(r["role"] for r in slopes if not r["judged"]))
    worst = max(judged, key=lambda r: r["rss_slope"], default=None)
    load = [c for c in result.calls if c.kind == "load"]
    duration = max(result.load_end_t - result.load_start_t, 1e-9)
    ok = [c.end_t - c.sent_t for c in load if c.outcome == "ok"]
    memory_ok = bool(judged) and all(r["rss_slope"] < slope_bound for r in judged)
    return {
        "verdict": {"ok": bool(verdict["ok"]) and result.abort_reason is None and bool(result.idle.get("idle"))
                    and all(f["recovery_s"] is not None for f in faults) and memory_ok,
                    "requests_ok": verdict["ok"], "memory_ok": memory_ok, "idle_after": result.idle,
                    "abort_reason": result.abort_reason},
        "config": dict(config), "model": result.model,
        "load": {"start_t": result.load_start_t, "end_t": result.load_end_t, "requests": len(load),
                 "completed": len(ok), "requests_per_s": len(load) / duration,
                 "output_tokens_per_s": sum(c.output_tokens or c.num_chunks for c in load) / duration,
                 "p50_s": float(np.percentile(ok, 50)) if ok else None,
                 "p99_s": float(np.percentile(ok, 99)) if ok else None},
        "audit": verdict, "faults": faults, "skipped_faults": result.skipped,
        "probe_baseline_s": result.probe_baseline_s,
        "recovery_s_by_kind": {k: [f["recovery_s"] for f in faults if f["kind"] == k]
                               for k in KINDS if any(f["kind"] == k for f in faults)},
        "memory": {"footprint_before": footprint, "totals": result.memory.totals(), "slope_bound": slope_bound,
                   "judged_processes": len(judged), "worst": worst, "not_judged_by_role": not_judged,
                   "pooled_by_role": result.memory.pooled_slopes(
                       run_warmup_s=result.load_start_t + cfg.memory_warmup_s, warmup_s=cfg.memory_warmup_s),
                   "processes": slopes},
        "series": series(result, bin_s=max(5.0, round(duration / 60.0))),
        "references": result.references,
        "independent_references": result.independent,
    }


def plot(result: ChaosResult, data: Mapping[str, Any], path: Path) -> None:
    s = data["series"]
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(12, 9), sharex=True)
    top.plot(s["t"], s["tokens_per_s"], ".-", color="tab:blue")
    top.set(ylabel="output tokens/s", title="throughput (load requests, by end time)")
    mid.plot(s["t"], s["p50_s"], ".-", label="p50")
    mid.plot(s["t"], s["p99_s"], ".-", label="p99")
    mid.set(ylabel="E2E latency (s)", title="latency of completed requests")
    rounds = np.array(result.memory.rounds) if result.memory.rounds else np.zeros((0, 4))
    if len(rounds):
        bottom.plot(rounds[:, 0], rounds[:, 1] / 1024, label="RSS (sum)")
        bottom.plot(rounds[:, 0], rounds[:, 2] / 1024, label="PSS (sum)")
    bottom.set(xlabel="time (s)", ylabel="GiB", title="resident memory of the deployment")
    seen: set[str] = set()
    for f in result.faults:
        colour = KIND_COLOURS.get(f.kind, "black")
        for ax in (top, mid, bottom):
            ax.axvline(f.t, color=colour, lw=0.9, alpha=0.8, label=f.kind if ax is top and f.kind not in seen else None)
            if f.recovered_t is not None:
                ax.axvspan(f.t, f.recovered_t, color=colour, alpha=0.08)
        seen.add(f.kind)
    for ax in (top, mid, bottom):
        ax.axvline(result.load_start_t, color="black", ls=":", lw=0.8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=4, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(result: ChaosResult, verdict: Mapping[str, Any], out_dir: Path, *, footprint: Mapping[str, Any] | None,
          slope_bound: float, config: Mapping[str, Any], plots: bool = True) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = summary_data(result, verdict, footprint=footprint, slope_bound=slope_bound, config=config)
    result.ledger.write(out_dir / "ledger.jsonl")
    with open(out_dir / "calls.jsonl", "w", encoding="utf-8") as f:
        for c in result.calls:
            f.write(json.dumps(c.as_row(), sort_keys=True) + "\n")
    with open(out_dir / "memory.csv", "w", encoding="utf-8") as f:
        f.write("t,process,pid,role,age_s,rss_mib,pss_mib,anon_mib\n")
        for m in result.memory.samples:
            f.write(f"{m.t:.2f},{m.key},{m.pid},{m.role},{m.age_s:.1f},{m.rss:.2f},"
                    f"{'' if m.pss is None else f'{m.pss:.2f}'},{'' if m.anon is None else f'{m.anon:.2f}'}\n")
    data["files"] = {"summary": "chaos.json", "ledger": "ledger.jsonl", "calls": "calls.jsonl", "memory": "memory.csv"}
    if plots:
        plot(result, data, out_dir / "chaos.png")
        data["files"]["plot"] = "chaos.png"
    write_json(data, out_dir / "chaos.json")
    return data


def print_report(data: Mapping[str, Any], console: Console | None = None) -> None:
    console = console or wide_console()
    a, load, mem = data["audit"], data["load"], data["memory"]
    t = Table(title="Chaos run", show_header=False, title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("Verdict", "PASS" if data["verdict"]["ok"] else "FAIL"),
            ("Requests (load / all)", f"{load['requests']} / {a['requests']}"),
            ("Outcomes", ", ".join(f"{k} {v}" for k, v in sorted(a["outcomes"].items()))),
            ("Lost / duplicated / hung", f"{a['lost']} / {a['duplicated']} / {a['hung']}"),
            ("Server's record (entries, replicas, dropped; read error)",
             f"{a['server_ledger']['entries']}, {a['server_ledger']['replicas']}, {a['server_ledger']['dropped']}"
             + (f"; {a['server_ledger']['error']}" if a['server_ledger']['error'] else "")),
            ("Undelivered in a proxy outage / unverifiable (replica record lost)",
             f"{a['undelivered_in_outage']} / {a['unverifiable']}"),
            ("Wrong text / bad logprobs / bad JSON", f"{a['wrong_text']} / {a['bad_logprobs']} / {a['bad_json']}"),
            ("5xx other than 503 / unclear errors", f"{a['server_errors']} / {a['unclear_errors']}"),
            ("Failed outside faults (max fraction)",
             f"{a['failed_outside_faults']['failed']} of {a['failed_outside_faults']['requests']} "
             f"({a['failed_outside_faults']['max_fraction']:g})"),
            ("References: independent (HF fp32) / server warm-up",
             f"{len(data['independent_references'])} / {len(data['references']) - len(data['independent_references'])}"),
            ("Errors the clients saw", ", ".join(f"{k} {v}" for k, v in sorted(a["errors_by_kind"].items())) or "none"),
            ("Throughput (req/s, output tok/s)", f"{load['requests_per_s']:.2f}, {load['output_tokens_per_s']:.1f}"),
            ("Latency p50 / p99 (s, completed)", f"{_fmt(load['p50_s'])} / {_fmt(load['p99_s'])}"),
            ("Faults injected / skipped", f"{len(data['faults'])} / {len(data['skipped_faults'])}"),
            ("Probe latency under load, no fault (s)",
             ", ".join(f"{x:.2f}" for x in data["probe_baseline_s"]) or "–"),
            ("Idle after the load", str(data["verdict"]["idle_after"]))]
    totals = mem.get("totals") or {}
    if totals:
        rows.append(("Memory sum start -> end (RSS / PSS MiB)",
                     f"{totals['start']['rss_mib']:.0f} / {totals['start']['pss_mib']:.0f} -> "
                     f"{totals['end']['rss_mib']:.0f} / {totals['end']['pss_mib']:.0f}"))
    worst = mem.get("worst")
    rows.append(("Processes judged / worst RSS slope (MiB/min)",
                 f"{mem['judged_processes']} / " + (f"{worst['rss_slope']:+.2f} ({worst['role']} {worst['pid']})"
                                                     if worst else "–") + f" (bound {mem['slope_bound']:g})"))
    rows.append(("Not judged (gone before their warm-up + span)",
                 ", ".join(f"{k} {v}" for k, v in sorted(mem["not_judged_by_role"].items())) or "none"))
    if data["verdict"]["abort_reason"]:
        rows.append(("Aborted", data["verdict"]["abort_reason"]))
    for name, value in rows:
        t.add_row(name, value)
    console.print(t)
    ft = Table(title="Faults", title_justify="left")
    for col in ("#", "t (s)", "kind", "target", "in flight", "ok/failed/hung/left", "/health down", "recovery (s)"):
        ft.add_column(col, justify="left" if col in ("kind", "target") else "right")
    for f in data["faults"]:
        target = ", ".join(f"{x['role']} {x['pid']}" for x in f["targets"][:2]) + (
            f" +{len(f['targets']) - 2}" if len(f["targets"]) > 2 else "")
        ft.add_row(str(f["index"]), f"{f['t']:.0f}", f["kind"], target, str(f["in_flight"]),
                   f"{f['completed']}/{f['failed']}/{f['hung']}/{f['disconnected']}",
                   "yes" if f["health_down"] else "no", _fmt(f["recovery_s"], 1))
    console.print(ft)
    roles = Table(title="Memory slope by role after warm-up (MiB/min, RSS, within-process fit)", title_justify="left")
    for col in ("role", "slope", "processes", "process-minutes"):
        roles.add_column(col, justify="left" if col == "role" else "right")
    for role, r in mem["pooled_by_role"].items():
        roles.add_row(role, _fmt(r["rss_slope"]), str(r["processes"]), f"{r['process_minutes']:.1f}")
    console.print(roles)
    if a["problems"]:
        console.print({k: v[:5] for k, v in a["problems"].items()})


def footprint_table(fp: Mapping[str, Any], title: str, console: Console | None = None) -> None:
    console = console or wide_console()
    t = Table(title=title, title_justify="left")
    for col in ("role", "pid", "RSS MiB", "PSS MiB", "private anon MiB"):
        t.add_column(col, justify="left" if col == "role" else "right")
    for r in fp["processes"]:
        t.add_row(r["role"], str(r["pid"]), f"{r['rss_mib']:.0f}", _fmt(r["pss_mib"], 0), _fmt(r["anon_mib"], 0))
    t.add_row("total", f"{fp['num_processes']} processes", f"{fp['rss_mib']:.0f}", f"{fp['pss_mib']:.0f}", "")
    console.print(t)
