"""The capacity questions, answered by simulation: Markdown + PNG plots in one command.

    python benchmarks/sim/sim_report.py --scenario deploy/sim/paper-testbed.yaml --out bench-results/sim-report

Every point is one ``cosine-ray simulate`` run of the scenario (the engine's real scheduler on a
virtual clock) with one thing changed:

1. **request rate** (Poisson arrivals): mean latency, TPOT and throughput of full CoSine, each
   ablation (routing off, fusion off, LP off, adaptive off) and speculation off;
2. **drafter nodes per verifier**: the first n drafters of the scenario (domains kept balanced),
   goodput = output tokens/s of requests whose TPOT meets ``--slo-tpot-ms``;
3. **link bandwidth**: the engine↔drafter and engine↔stage links (``engine_drafter``,
   ``engine_stage``) swept (the last stage ships fp32 logits of every scored node back, as our
   engine does today, or only ids);
4. **pipeline depth**: the target split into S equal stages on S devices, S micro-batch lanes.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from cosine_ray.sim.runner import simulate  # noqa: E402
from cosine_ray.sim.scenario import Scenario, load, set_key, validate  # noqa: E402

SYSTEMS = {
    "CoSine (full)": {},
    "routing off": {"routing": "random"},
    "fusion off": {"fusion": "single"},
    "LP off": {"scheduler": "fcfs"},
    "adaptive off": {"adaptive": False},
    "speculation off": {"num_speculative_tokens": 0},
}


def variant(base: Scenario, step: dict | None = None, changes: dict | None = None) -> Scenario:
    """``base`` with StepConfig overrides and dotted-path keys changed (``sim.scenario.set_key``)."""
    data = copy.deepcopy(base.data)
    if step:
        data.setdefault("engine", {}).setdefault("step", {}).update(step)
    for path, value in (changes or {}).items():
        set_key(data, path, value)
    validate(data)
    return Scenario(data, base.base_dir)


def run(scn: Scenario, slo_tpot_s: float) -> dict:
    result = simulate(scn)
    s = result.summary()
    good = [r for r in result.requests if r.tpot_s <= slo_tpot_s]
    s["goodput_tok_s"] = sum(r.num_tokens for r in good) / s["makespan_s"]
    s["slo_attainment"] = len(good) / len(result.requests)
    return s


def balanced(drafters: list[dict], n: int) -> list[dict]:
    """The first n drafters taking one per domain in turn (names are DOMAIN-i)."""
    by_domain: dict[str, list[dict]] = {}
    for d in drafters:
        by_domain.setdefault(d["name"].rsplit("-", 1)[0], []).append(d)
    out, i = [], 0
    while len(out) < n and any(by_domain.values()):
        for group in by_domain.values():
            if i < len(group) and len(out) < n:
                out.append(group[i])
        i += 1
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenario", default="deploy/sim/paper-testbed.yaml")
    ap.add_argument("--out", default="bench-results/sim-report")
    ap.add_argument("--requests", type=int, default=64, help="requests per simulated point")
    ap.add_argument("--rates", default="0.25,0.5,1,1.5")
    ap.add_argument("--rate", type=float, default=0.5, help="request rate of the other sweeps")
    ap.add_argument("--slo-tpot-ms", type=float, default=60.0)
    args = ap.parse_args(argv)
    base = load(args.scenario)
    base.data["workload"]["num_requests"] = args.requests
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slo = args.slo_tpot_ms / 1e3
    started = time.perf_counter()
    rates = [float(r) for r in args.rates.split(",")]
    data: dict = {"rates": {}, "drafters": {}, "links": {}, "depth": {}}

    def point(label: str, scn: Scenario) -> dict:
        s = run(scn, slo)
        print(f"{label}: {s['throughput_tok_s']:.1f} tok/s, latency {s['e2e_mean_s']:.2f} s, "
              f"TPOT {s['tpot_mean_s'] * 1e3:.1f} ms, accepted {s['mean_accepted_length']:.2f} "
              f"({s['wall_s']:.1f} s)", file=sys.stderr, flush=True)
        return s

    for name, step in SYSTEMS.items():
        data["rates"][name] = [point(f"{name} @ {r}/s", variant(base, step, {"workload.arrival.request_rate": r}))
                               for r in rates]
    drafters = base.data.get("drafters", [])
    for n in sorted({max(1, len(drafters) // 4), max(1, len(drafters) // 2), len(drafters)}):
        data["drafters"][n] = point(f"{n} drafters", variant(base, None, {"drafters": balanced(drafters, n),
                                                                   "workload.arrival.request_rate": args.rate}))
    for mbps in (10, 100, 1000, 10000):
        data["links"][f"engine_drafter {mbps} Mbps"] = point(
            f"engine_drafter {mbps} Mbps", variant(base, None, {"links.engine_drafter.bandwidth_mbps": mbps,
                                                    "workload.arrival.request_rate": args.rate}))
    for mbps in (1000, 10000, 100000):
        for returns in ("logits", "ids"):
            data["links"][f"engine_stage {mbps} Mbps, {returns}"] = point(
                f"engine_stage {mbps} Mbps {returns}",
                variant(base, None, {"links.engine_stage.bandwidth_mbps": mbps, "target.returns": returns,
                                     "workload.arrival.request_rate": args.rate}))
    stage = base.data["stages"][0]
    for depth in (1, 2, 4, 8):
        stages = [{"device": f"depth-gpu{i}", "latency": stage["latency"], "layers": 1.0 / depth} for i in range(depth)]
        devices = sorted(set(base.data.get("devices", [])) | {s["device"] for s in stages})
        data["depth"][depth] = point(f"{depth} stages", variant(
            base, {"num_lanes": depth}, {"stages": stages, "devices": devices,
                                         "workload.arrival.request_rate": args.rate}))
    data["wall_s"] = time.perf_counter() - started
    (out / "report.json").write_text(json.dumps(data, indent=1, default=str))
    write_plots(data, rates, out)
    (out / "report.md").write_text(markdown(data, rates, base, args), encoding="utf-8")
    print(f"wrote {out / 'report.md'} ({data['wall_s']:.0f} s)")
    return 0


def write_plots(data: dict, rates: list[float], out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, points in data["rates"].items():
        axes[0].plot(rates, [p["e2e_mean_s"] for p in points], marker="o", label=name)
        axes[1].plot(rates, [p["tpot_mean_s"] * 1e3 for p in points], marker="o", label=name)
        axes[2].plot(rates, [p["throughput_tok_s"] for p in points], marker="o", label=name)
    for ax, title in zip(axes, ("mean latency (s)", "mean TPOT (ms)", "throughput (tok/s)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rate_sweep.png", dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ns = list(data["drafters"])
    axes[0].bar([str(n) for n in ns], [data["drafters"][n]["goodput_tok_s"] for n in ns])
    axes[0].set_title("goodput vs drafter nodes")
    links = list(data["links"])
    axes[1].barh(links, [data["links"][k]["tpot_mean_s"] * 1e3 for k in links])
    axes[1].set_title("mean TPOT (ms) by link")
    depths = list(data["depth"])
    axes[2].plot(depths, [data["depth"][d]["throughput_tok_s"] for d in depths], marker="o", label="throughput")
    axes[2].set_title("throughput (tok/s) vs pipeline depth")
    fig.tight_layout()
    fig.savefig(out / "capacity.png", dpi=110)
    plt.close(fig)


def markdown(data: dict, rates: list[float], base: Scenario, args) -> str:
    lines = [f"# Capacity report: {base.get('name', args.scenario)}", "",
             f"`python benchmarks/sim/sim_report.py --scenario {args.scenario} --requests {args.requests} "
             f"--rates {args.rates} --rate {args.rate} --slo-tpot-ms {args.slo_tpot_ms:g}` "
             f"({data['wall_s']:.0f} s of simulation). Simulated, not measured: every device cost is the "
             "scenario's latency model (see its `source` fields).", "",
             "## Latency and throughput vs request rate", "", "![rate sweep](rate_sweep.png)", "",
             "| system | " + " | ".join(f"{r:g} req/s: latency s / TPOT ms / tok/s / accepted" for r in rates) + " |",
             "| --- " * (len(rates) + 1) + "|"]
    for name, points in data["rates"].items():
        lines.append(f"| {name} | " + " | ".join(
            f"{p['e2e_mean_s']:.2f} / {p['tpot_mean_s'] * 1e3:.1f} / {p['throughput_tok_s']:.0f} / "
            f"{p['mean_accepted_length']:.2f}" for p in points) + " |")
    best = {}
    for i, r in enumerate(rates):
        others = {n: ps[i] for n, ps in data["rates"].items() if n != "CoSine (full)"}
        bname = min(others, key=lambda n: others[n]["e2e_mean_s"])
        full = data["rates"]["CoSine (full)"][i]
        best[r] = (bname, full["e2e_mean_s"] / others[bname]["e2e_mean_s"] - 1,
                   full["throughput_tok_s"] / max(p["throughput_tok_s"] for p in others.values()) - 1)
    lines += ["", "Full CoSine against the best other system at each rate (latency change, throughput change): "
              + "; ".join(f"{r:g}/s: {b[0]} {b[1]:+.0%} latency, {b[2]:+.0%} throughput" for r, b in best.items()),
              "", f"## Drafter nodes, links, depth (request rate {args.rate:g}/s)", "", "![capacity](capacity.png)", "",
              "| setting | throughput tok/s | goodput tok/s | latency s | TPOT ms | accepted |", "| --- | --- | --- | --- | --- | --- |"]
    rows = [(f"{n} drafter nodes", p) for n, p in data["drafters"].items()] + \
           list(data["links"].items()) + [(f"{d} pipeline stages", p) for d, p in data["depth"].items()]
    for label, p in rows:
        lines.append(f"| {label} | {p['throughput_tok_s']:.0f} | {p['goodput_tok_s']:.0f} | {p['e2e_mean_s']:.2f} | "
                     f"{p['tpot_mean_s'] * 1e3:.1f} | {p['mean_accepted_length']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
