"""PEARL at the paper's scale, simulated: a 7B drafter on its own A100 and a 34B target over 2
A100s, or a 70B target over 3 (``deploy/sim/pearl-paper.yaml``; per-token times are the paper's
own measured speeds), one request at a time, in three modes: autoregressive decoding (AR),
speculative decoding at its best γ of ``--gammas`` (SD), and PEARL (``step.pearl: on``) at
γ = round(c), c = T_target / T_draft, and at its best γ, plus ``pearl: auto``.

For each drafter accuracy α of ``--alphas`` it prints TPOT per mode and the speedups over AR and
SD beside the paper's; ``--adaptive`` also runs SD and PEARL with our LP-priced γ. The simulator
runs the real engine core, PEARL bookkeeping and verifier on a virtual clock, and every output
is checked against the oracle's text.

    python benchmarks/sim/pearl_sim.py --alphas 0.7,0.8,0.9,0.95
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

from cosine_ray.sim.runner import simulate
from cosine_ray.sim.scenario import Scenario, load, validate

SCENARIO = Path(__file__).resolve().parents[2] / "deploy" / "sim" / "pearl-paper.yaml"
PAIRS = {  # target: (latency entry, stages, the paper's SD and PEARL speedups over AR on HumanEval)
    "34b": ("a100-codellama-34b", 2, 1.76, 2.48),
    "70b": ("a100-codellama-70b", 3, 3.03, 4.43),
}


def variant(base: Scenario, target: str, alpha: float, gamma: int, *, pearl: str,
            adaptive: bool = False) -> Scenario:
    data = copy.deepcopy(base.data)
    latency, num_stages, _, _ = PAIRS[target]
    gpus = [f"a100-{i}" for i in range(num_stages)]
    data["devices"] = [d for d in data["devices"] if not d.startswith("a100-") or d == "a100-draft"] + gpus
    data["stages"] = [{"device": g, "latency": latency} for g in gpus]
    data["drafters"][0]["acceptance"] = {"default": {"by_depth": [alpha] * 16}}
    step = data["engine"]["step"]
    step.update(num_speculative_tokens=gamma, pearl=pearl)
    if adaptive:
        step.update(adaptive=True, scheduler="lp")
    validate(data)
    return Scenario(data, base.base_dir)


def c_ratio(base: Scenario, target: str) -> float:
    """T_target / T_draft of one token (the paper's c)."""
    latency = base.data["latency"][PAIRS[target][0]]["linear"]
    return latency["c0_ms"] / base.data["drafters"][0]["latency"]["c_tok_ms"]


def tpot_ms(scenario: Scenario) -> tuple[float, dict]:
    s = simulate(scenario).summary()
    return s["tpot_mean_s"] * 1e3, s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default=str(SCENARIO))
    p.add_argument("--targets", default="34b,70b")
    p.add_argument("--alphas", default="0.7,0.8,0.9,0.95")
    p.add_argument("--gammas", default="1,2,3,4,5,6,8")
    p.add_argument("--adaptive", action="store_true", help="also SD and PEARL with the LP-priced adaptive γ")
    p.add_argument("--out", default="bench-results/pearl_sim.json")
    args = p.parse_args()
    base = load(args.scenario)
    gammas = [int(g) for g in args.gammas.split(",")]
    rows = []
    head = ("| target | α | AR ms | SD ms (best γ) | PEARL ms γ=round(c) | PEARL auto ms γ=round(c) | "
            "PEARL ms (best γ) | PEARL × AR | PEARL × SD |")
    if args.adaptive:
        head += " SD adaptive ms | PEARL adaptive ms |"
    print(head + " paper SD × AR | paper PEARL × AR | paper PEARL × SD |")
    print("| --- " * (head.count("|") - 1 + 3) + "|")
    for target in args.targets.split(","):
        c = c_ratio(base, target)
        window = max(1, round(c))
        _, _, paper_sd, paper_pearl = PAIRS[target]
        for alpha in (float(a) for a in args.alphas.split(",")):
            ar, _ = tpot_ms(variant(base, target, alpha, 0, pearl="off"))
            sd = {g: tpot_ms(variant(base, target, alpha, g, pearl="off"))[0] for g in gammas}
            pearl = {g: tpot_ms(variant(base, target, alpha, g, pearl="on")) for g in gammas}
            sd_g = min(sd, key=sd.get)
            pearl_g = min(pearl, key=lambda g: pearl[g][0])
            best = pearl[pearl_g][0]
            auto, _ = tpot_ms(variant(base, target, alpha, window, pearl="auto"))
            row = {"target": target, "c": c, "alpha": alpha, "ar_ms": ar, "sd_ms": sd, "sd_best_gamma": sd_g,
                   "pearl_ms": {g: v[0] for g, v in pearl.items()}, "pearl_best_gamma": pearl_g,
                   "pearl_window_gamma": window, "pearl_auto_window_ms": auto,
                   "pearl_mean_accepted": {g: v[1]["mean_accepted_length"] for g, v in pearl.items()}}
            line = (f"| {target} (c={c:.1f}) | {alpha:.2f} | {ar:.1f} | {sd[sd_g]:.1f} (γ={sd_g}) | "
                    f"{pearl[window][0]:.1f} | {auto:.1f} | {best:.1f} (γ={pearl_g}) | {ar / best:.2f}× | {sd[sd_g] / best:.2f}× |")
            if args.adaptive:
                sda, _ = tpot_ms(variant(base, target, alpha, max(gammas), pearl="off", adaptive=True))
                pa, _ = tpot_ms(variant(base, target, alpha, max(gammas), pearl="on", adaptive=True))
                row.update(sd_adaptive_ms=sda, pearl_adaptive_ms=pa)
                line += f" {sda:.1f} | {pa:.1f} |"
            rows.append(row)
            print(line + f" {paper_sd:.2f}× | {paper_pearl:.2f}× | {paper_pearl / paper_sd:.2f}× |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"scenario": args.scenario, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
