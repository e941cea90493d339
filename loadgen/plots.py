"""PNG plots (matplotlib, Agg backend: no display needed).

Every function takes ``runs``: name → request records (one run, or one per compared target) and
overlays them, so ``run`` and ``compare`` share the code:

    latency_cdf.png   empirical CDFs of TTFT, TPOT, E2EL and latency per token
    over_time.png     output tokens/s (~40 bins) and E2EL/TTFT of each request vs. its send time
    acceptance.png    acceptance rate and mean accepted length by domain; acceptance by drafter
    normalised.png    (compare only) latency per token and throughput relative to the baseline
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.client import RequestRecord  # noqa: E402
from loadgen.metrics import metric_values_ms, speculation_summary, token_timeline  # noqa: E402

Runs = Mapping[str, Sequence[RequestRecord]]


def plot_latency_cdf(runs: Runs, path: Path) -> None:
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for ax, (metric, label) in zip(axes, (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2el", "E2E latency"),
                                          ("lpt", "latency per token"))):
        for name, records in runs.items():
            values = np.sort(metric_values_ms(records, metric))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
        ax.set(xlabel=f"{label} (ms)", ylabel="fraction of requests", title=label, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    _legend(axes[0])
    _save(fig, path)


def pick_bin_s(runs: Runs, num_bins: int = 40) -> float:
    """About ``num_bins`` bins over the longest run, at least 0.1 s, rounded to 1-2-5 steps."""
    last = max((r.end_s or 0.0 for records in runs.values() for r in records), default=0.0)
    raw = max(last / num_bins, 0.1)
    step = 10 ** np.floor(np.log10(raw))
    return float(min((m * step for m in (1, 2, 5, 10) if m * step >= raw), default=raw))


def plot_over_time(runs: Runs, path: Path, bin_s: float | None = None) -> None:
    bin_s = bin_s or pick_bin_s(runs)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, records in runs.items():
        starts, rate = token_timeline(records, bin_s)
        if starts.size:
            top.plot(starts + bin_s / 2, rate, ".-", label=name)
        ok = [r for r in records if r.status == "ok"]
        if ok:
            sent = [r.sent_s for r in ok]
            line = bottom.plot(sent, [r.e2el_s * 1000 for r in ok], ".", label=f"{name} E2EL")[0]
            ttft = [(r.sent_s, r.ttft_s * 1000) for r in ok if r.ttft_s is not None]
            if ttft:
                bottom.plot(*zip(*ttft), "x", color=line.get_color(), alpha=0.6, label=f"{name} TTFT")
    top.set(ylabel="output tokens/s", title=f"throughput over time ({bin_s:g} s bins)")
    bottom.set(xlabel="time since start (s)", ylabel="latency (ms)", title="latency by send time")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        _legend(ax)
    _save(fig, path)


def plot_acceptance(runs: Runs, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8))
    names = list(runs)
    domains = sorted({r.domain for records in runs.values() for r in records})
    drafters = sorted({d for records in runs.values() for r in records for d in r.drafted_by})
    width = 0.8 / max(1, len(names))
    any_stats = False
    for i, name in enumerate(names):
        by_domain = [speculation_summary([r for r in runs[name] if r.domain == d]) for d in domains]
        rates = [s["acceptance_rate"] or 0.0 for s in by_domain]
        lengths = [s["mean_accepted_length"] or 0.0 for s in by_domain]
        any_stats |= any(s["num_requests_with_stats"] for s in by_domain)
        x = np.arange(len(domains)) + i * width
        axes[0].bar(x, rates, width, label=name)
        axes[1].bar(x, lengths, width, label=name)
        per_drafter = speculation_summary(runs[name])["by_drafter"]
        axes[2].bar(np.arange(len(drafters)) + i * width,
                    [(per_drafter.get(d) or {}).get("acceptance_rate") or 0.0 for d in drafters], width, label=name)
    for ax, ticks, title in ((axes[0], domains, "acceptance rate by domain"),
                             (axes[1], domains, "mean accepted length by domain (tok/step)"),
                             (axes[2], drafters, "acceptance rate by drafter")):
        ax.set_xticks(np.arange(len(ticks)) + width * (len(names) - 1) / 2, ticks, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    if not any_stats:
        fig.suptitle("no speculation stats in the responses (server without cosine_ray_stats, or "
                     "--no-speculation-stats)", fontsize=9)
    _legend(axes[0])
    _save(fig, path)


def plot_normalised(rows: Sequence[Mapping[str, Any]], baseline: str, path: Path) -> None:
    """Bars of latency/token and throughput relative to ``baseline`` (= 1.0)."""
    names = [r["target"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "lpt_vs_baseline", "latency per token (lower is better)"),
                           (axes[1], "throughput_vs_baseline", "output throughput (higher is better)")):
        values = [r.get(key) or 0.0 for r in rows]
        bars = ax.bar(names, values, color=["tab:gray" if n == baseline else "tab:blue" for n in names])
        ax.bar_label(bars, fmt="%.2f×", fontsize=8)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_title(f"{title}, vs {baseline}", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def plot_run(runs: Runs, out_dir: Path) -> list[Path]:
    """The three per-run plots into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "latency_cdf.png", out_dir / "over_time.png", out_dir / "acceptance.png"]
    plot_latency_cdf(runs, paths[0])
    plot_over_time(runs, paths[1])
    plot_acceptance(runs, paths[2])
    return paths


def _legend(ax: Any) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
