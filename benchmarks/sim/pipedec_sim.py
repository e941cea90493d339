"""PipeDec at the paper's scale, simulated: Llama-3.1-70B over S RTX-3090 stages with a 1B drafter
(``deploy/sim/pipedec-paper.yaml``), one request at a time, in three pipeline modes: plain
pipeline parallelism, lanes (one drafter chain through all stages) and PipeDec.

For S in ``--stages`` and each ``--pairs`` α:h (the drafter's top-1 accuracy, which a chain uses,
and a PipeDec layer's hit rate, its top-32 accuracy) it prints TPOT per mode, PipeDec's speedup
over both, its tokens per timestep and hit rate. The simulator runs the real engine core,
PipeDec driver and verifier on a virtual clock, and every output is checked against the
oracle's text. ``--rates`` adds the mode switch under Poisson load (docs/benchmarks.md).

    python benchmarks/sim/pipedec_sim.py --stages 7,14,21 --pairs 0.7:0.7,0.8:0.8,0.9:0.9,0.7:0.9,0.7:0.95
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from cosine_ray.sim.runner import simulate
from cosine_ray.sim.scenario import Scenario, load, validate

SCENARIO = Path(__file__).resolve().parents[2] / "deploy" / "sim" / "pipedec-paper.yaml"


def variant(base: Scenario, num_stages: int, alpha: float, mode: str, *, guard: bool = False) -> Scenario:
    """The scenario at ``num_stages`` stages, the drafter right with probability ``alpha`` at
    every depth, in pipeline ``mode`` (PP | lanes | PipeDec; ``guard``: PipeDec's mode guard)."""
    data = copy.deepcopy(base.data)
    gpus = [f"gpu-{i:02d}" for i in range(num_stages)]
    latency = base.data["stages"][0]["latency"]
    data["devices"] = [d for d in data["devices"] if not d.startswith("gpu-")] + gpus
    data["stages"] = [{"device": g, "latency": latency} for g in gpus]
    data["drafters"][0]["acceptance"] = {"default": {"by_depth": [alpha] * (num_stages + 8)}}
    step = data["engine"]["step"]
    if mode == "PP":
        step["num_speculative_tokens"] = 0
    step["pipeline_mode"] = "pipedec" if mode == "PipeDec" else "lanes"
    step["pipedec_guard"] = guard
    validate(data)
    return Scenario(data, base.base_dir)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default=str(SCENARIO))
    p.add_argument("--stages", default="7,14,21")
    p.add_argument("--pairs", default="0.7:0.7,0.8:0.8,0.9:0.9,0.7:0.9,0.7:0.95",
                   help="comma list of α:h (lanes' chain accuracy : PipeDec's layer hit rate)")
    p.add_argument("--rates", default="", help="also sweep open-loop arrival rates (req/s), e.g. 0.02,0.05,0.1")
    p.add_argument("--load-stages", type=int, default=14)
    p.add_argument("--load-alpha", type=float, default=0.9, help="drafter accuracy of the load sweep (both modes)")
    p.add_argument("--load-requests", type=int, default=40)
    p.add_argument("--out", default="bench-results/pipedec_sim.json")
    args = p.parse_args()
    base = load(args.scenario)
    rows = []
    pairs = [tuple(float(x) for x in pair.split(":")) for pair in args.pairs.split(",")]
    print("| S | α (lanes) | h (PipeDec) | PP TPOT ms | lanes TPOT ms | PipeDec TPOT ms | PipeDec × PP | "
          "PipeDec × lanes | lanes accepted/step | PipeDec tokens/timestep | PipeDec hit rate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for num_stages in (int(s) for s in args.stages.split(",")):
        for alpha, hit in pairs:
            s = {mode: simulate(variant(base, num_stages, hit if mode == "PipeDec" else alpha, mode)).summary()
                 for mode in ("PP", "lanes", "PipeDec")}
            tpot = {m: v["tpot_mean_s"] * 1e3 for m, v in s.items()}
            row = {"stages": num_stages, "alpha": alpha, "hit": hit, "tpot_ms": tpot,
                   "lanes_accepted": s["lanes"]["mean_accepted_length"],
                   "pipedec_tokens_per_timestep": s["PipeDec"]["pipedec_tokens_per_timestep"],
                   "pipedec_hit_rate": s["PipeDec"]["pipedec_hit_rate"]}
            rows.append(row)
            print(f"| {num_stages} | {alpha:.2f} | {hit:.2f} | {tpot['PP']:.1f} | {tpot['lanes']:.1f} | {tpot['PipeDec']:.1f} | "
                  f"{tpot['PP'] / tpot['PipeDec']:.2f}× | {tpot['lanes'] / tpot['PipeDec']:.2f}× | "
                  f"{row['lanes_accepted']:.2f} | {row['pipedec_tokens_per_timestep']:.2f} | "
                  f"{row['pipedec_hit_rate']:.2f} |", flush=True)
    load_rows = load_sweep(base, args) if args.rates else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"scenario": args.scenario, "rows": rows, "load": load_rows}, indent=1))


def load_sweep(base: Scenario, args: argparse.Namespace) -> list[dict]:
    """The mode switch under load: Poisson arrivals (open loop) at each rate, lanes only vs
    pipedec enabled as shipped (a request alone in the pool runs PipeDec while its mode guard
    measures it faster than lanes; lanes otherwise)."""
    num_stages, alpha = args.load_stages, args.load_alpha
    print(f"\nOpen-loop Poisson arrivals, S={num_stages}, α = h = {alpha}, {args.load_requests} requests, "
          f"batches of up to 16 in {num_stages} lanes")
    print("| req/s | lanes TPOT ms | pipedec-enabled TPOT ms | × | tokens in PipeDec | lanes TTFT ms | "
          "pipedec-enabled TTFT ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        out = {}
        for mode in ("lanes", "PipeDec"):
            sc = variant(base, num_stages, alpha, mode, guard=True)
            sc.data["workload"] = {**sc.data["workload"], "num_requests": args.load_requests, "max_concurrency": None,
                                   "arrival": {"request_rate": rate, "burstiness": 1.0}}
            # under load the engine batches: up to 16 requests, one micro-batch lane per stage
            sc.data["engine"]["step"].update(max_num_seqs=16, num_lanes=num_stages)
            out[mode] = simulate(sc).summary()
        tokens = out["PipeDec"]["output_tokens"]
        share = out["PipeDec"]["pipedec_timesteps"] * out["PipeDec"]["pipedec_tokens_per_timestep"] / tokens
        row = {"rate": rate, "lanes": out["lanes"], "pipedec": out["PipeDec"], "pipedec_token_share": share}
        rows.append(row)
        lt, pt = out["lanes"]["tpot_mean_s"] * 1e3, out["PipeDec"]["tpot_mean_s"] * 1e3
        print(f"| {rate:g} | {lt:.1f} | {pt:.1f} | {lt / pt:.2f}× | {share:.0%} | "
              f"{out['lanes']['ttft_mean_s'] * 1e3:.0f} | {out['PipeDec']['ttft_mean_s'] * 1e3:.0f} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
