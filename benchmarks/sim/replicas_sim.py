"""Engine replicas on H100s, simulated: throughput and TTFT for 1, 2, 4 and 8 replicas.

Runs ``deploy/sim/h100-replicas.yaml`` (an 8B-class target on one H100 per replica, 16 system
prompts shared by chat traffic; datasheet figures and our estimates, nothing measured) with
``replicas.count`` of ``--counts`` under each routing of ``--routings``, then with one replica
killed at ``--kill-at-s`` and replaced ``--restart-s`` later. Every replica is the real engine
core on the virtual clock, and every output, a failed-over one too, is checked against the
oracle's text. Prints one row a run: throughput, TTFT mean and p99, the prefix cache's hit rate
(cached prompt tokens over prompt tokens sent), each replica's share of the requests, and the
resubmissions failover made.

    python benchmarks/sim/replicas_sim.py [--counts 1,2,4,8] [--routings prefix,least_loaded]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from cosine_ray.sim.runner import simulate
from cosine_ray.sim.scenario import Scenario, load, validate

SCENARIO = Path(__file__).resolve().parents[2] / "deploy" / "sim" / "h100-replicas.yaml"


def variant(base: Scenario, count: int, routing: str, failures: list[dict]) -> Scenario:
    data = copy.deepcopy(base.data)
    data["replicas"] = {"count": count, "routing": routing, "failures": failures}
    validate(data)
    return Scenario(data, base.base_dir)


def row(label: str, s: dict) -> str:
    share = " / ".join(f"{x:.0%}" for x in s["served_share"])
    return (f"| {label} | {s['throughput_tok_s']:,.0f} | {s['ttft_mean_s']:.2f} | {s['ttft_p99_s']:.2f} | "
            f"{s['prefix_hit_rate']:.1%} | {share} | {s['resubmissions']} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default=str(SCENARIO))
    p.add_argument("--counts", default="1,2,4,8")
    p.add_argument("--routings", default="prefix,least_loaded")
    p.add_argument("--kill-at-s", type=float, default=20.0)
    p.add_argument("--restart-s", type=float, default=30.0)
    p.add_argument("--json", default=None, help="also write every run's summary here")
    args = p.parse_args()
    base = load(args.scenario)
    counts = [int(c) for c in args.counts.split(",")]
    runs = [(f"{n} × {routing}", variant(base, n, routing, [])) for routing in args.routings.split(",")
            for n in counts]
    kill = [{"replica": 0, "at_s": args.kill_at_s, "restart_s": args.restart_s}]
    runs += [(f"{n} × prefix, replica 0 killed at {args.kill_at_s:g} s", variant(base, n, "prefix", kill))
             for n in sorted({1, min(2, max(counts))})]
    print(f"scenario {base.get('name')}: {base.workload.get('num_requests')} requests at "
          f"{base.workload['arrival']['request_rate']}/s, simulated (on paper)\n")
    print("| replicas × routing | throughput tok/s | TTFT mean s | TTFT p99 s | prefix hits | served | resubmitted |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
    summaries = {}
    for label, scenario in runs:
        summaries[label] = s = simulate(scenario).summary()
        print(row(label, s), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
