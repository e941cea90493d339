"""Resident memory of a deployment over time, and whether any process of it grows.

``MemoryLog.sample`` reads RSS, PSS and private anonymous memory (``procs.memory_mib``) of
every process of the deployment at one moment; a chaos run samples every few seconds.

A process's **slope** is the least-squares line through its RSS (MiB) against time, in MiB per
minute, over the samples taken once it is ``warmup_s`` old *and* the run's own warm-up is over;
it is judged only with ``min_span_s`` of such samples (a process killed sooner has none). A
role's **pooled slope** fits one slope to all its processes at once, each with its own level
(the within-process regression), so a role whose processes are replaced often (stages after an
engine restart) still gets a figure. PSS is reported but not fitted: a process's share of a
library changes whenever another process mapping it starts or dies.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from loadgen.chaos import procs

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def uptime_s() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


@dataclass(frozen=True, slots=True)
class Sample:
    t: float
    """Run clock, seconds."""
    key: str
    """``pid@start``: one process."""
    pid: int
    role: str
    """A starting Ray worker is ``idle_worker`` or ``worker`` until its actor names it: a
    process's role is its last sample's."""
    age_s: float
    rss: float
    pss: float | None
    anon: float | None


def slope_mib_per_min(ts: Sequence[float], ys: Sequence[float]) -> float:
    t = np.asarray(ts, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    tc = t - t.mean()
    denom = float((tc * tc).sum())
    return float((tc * (y - y.mean())).sum() / denom) * 60.0 if denom > 0 else 0.0


@dataclass
class MemoryLog:
    samples: list[Sample] = field(default_factory=list)
    rounds: list[tuple[float, float, float, int]] = field(default_factory=list)
    """(t, sum of RSS, sum of PSS, number of processes) per sampling round."""

    def sample(self, processes: Iterable[procs.Proc], t: float) -> list[Sample]:
        now = uptime_s()
        taken = []
        for p in processes:
            m = procs.memory_mib(p.pid)
            if m is None or not procs.is_alive(p):
                continue
            taken.append(Sample(t, p.key, p.pid, p.role, max(0.0, now - p.start / _TICKS), m["rss"],
                                m.get("pss"), m.get("anon")))
        self.samples.extend(taken)
        self.rounds.append((t, sum(s.rss for s in taken), sum(s.pss or s.rss for s in taken), len(taken)))
        return taken

    def by_process(self) -> dict[str, list[Sample]]:
        out: dict[str, list[Sample]] = {}
        for s in self.samples:
            out.setdefault(s.key, []).append(s)
        return out

    def slopes(self, *, run_warmup_s: float, warmup_s: float, min_span_s: float,
               min_samples: int = 6) -> list[dict[str, Any]]:
        """One row per process: its first and last RSS, and its slope where it can be judged."""
        rows = []
        for key, series in self.by_process().items():
            post = [s for s in series if s.t >= run_warmup_s and s.age_s >= warmup_s]
            span = post[-1].t - post[0].t if post else 0.0
            judged = span >= min_span_s and len(post) >= min_samples
            first, last = series[0], series[-1]
            rows.append({
                "process": key, "pid": first.pid, "role": last.role, "first_t": first.t, "last_t": last.t,
                "rss_first": first.rss, "rss_last": last.rss, "pss_last": last.pss, "anon_last": last.anon,
                "judged": judged, "span_s": span, "samples": len(post),
                "rss_slope": slope_mib_per_min([s.t for s in post], [s.rss for s in post]) if judged else None,
                "anon_slope": (slope_mib_per_min([s.t for s in post], [s.anon or 0.0 for s in post])
                               if judged and all(s.anon is not None for s in post) else None),
            })
        return sorted(rows, key=lambda r: (r["role"], r["first_t"]))

    def pooled_slopes(self, *, run_warmup_s: float, warmup_s: float, min_samples: int = 3) -> dict[str, dict]:
        """role → slope fitted within each of its processes at once (MiB/min), and how many
        processes and process-minutes it rests on."""
        groups: dict[str, list[list[Sample]]] = {}
        for series in self.by_process().values():
            post = [s for s in series if s.t >= run_warmup_s and s.age_s >= warmup_s]
            if len(post) >= min_samples:
                groups.setdefault(series[-1].role, []).append(post)
        out = {}
        for role, members in sorted(groups.items()):
            num = den = 0.0
            for post in members:
                t = np.array([s.t for s in post])
                y = np.array([s.rss for s in post])
                tc = t - t.mean()
                num += float((tc * (y - y.mean())).sum())
                den += float((tc * tc).sum())
            out[role] = {"rss_slope": num / den * 60.0 if den > 0 else None, "processes": len(members),
                         "process_minutes": sum(m[-1].t - m[0].t for m in members) / 60.0}
        return out

    def totals(self) -> dict[str, Any]:
        if not self.rounds:
            return {}
        (t0, rss0, pss0, n0), (t1, rss1, pss1, n1) = self.rounds[0], self.rounds[-1]
        return {"start": {"t": t0, "rss_mib": rss0, "pss_mib": pss0, "processes": n0},
                "end": {"t": t1, "rss_mib": rss1, "pss_mib": pss1, "processes": n1}}


def footprint(processes: Iterable[procs.Proc]) -> dict[str, Any]:
    """One snapshot: every process's memory (largest PSS first) and the sums."""
    rows = []
    for p in processes:
        m = procs.memory_mib(p.pid)
        if m is not None:
            rows.append({"pid": p.pid, "role": p.role, "rss_mib": m["rss"], "pss_mib": m.get("pss"),
                         "anon_mib": m.get("anon"), "cmdline": p.cmdline[:160]})
    rows.sort(key=lambda r: -(r["pss_mib"] if r["pss_mib"] is not None else r["rss_mib"]))
    by_role: dict[str, dict[str, float]] = {}
    for r in rows:
        agg = by_role.setdefault(r["role"], {"processes": 0, "rss_mib": 0.0, "pss_mib": 0.0})
        agg["processes"] += 1
        agg["rss_mib"] += r["rss_mib"]
        agg["pss_mib"] += r["pss_mib"] or 0.0
    return {"processes": rows, "by_role": by_role, "num_processes": len(rows),
            "rss_mib": sum(r["rss_mib"] for r in rows), "pss_mib": sum(r["pss_mib"] or 0.0 for r in rows)}
