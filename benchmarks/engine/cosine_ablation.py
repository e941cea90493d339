"""CoSine and its ablations, interleaved in repeated rounds, on one mixed-domain workload.

Held-back prompts in an equal mix of code / math / instruction / chat, greedy. Every system gets
its own in-process engine, built once and warmed up at each measured concurrency (not
measured); then in each of ``--rounds`` rounds every concurrency runs every system once, in an
order shuffled per round (seeded), so a slow minute of the machine hits all systems alike.
Reported per (threads, concurrency, system): tokens/s and the ratio to speculation off, paired
per round, with the rounds' min–max and speculation off's own spread as the noise band; mean
accepted length, γ_i, decision time, and the cost and gain models against what happened; then
full CoSine against every other system, paired per round. Every output is compared with
speculation off's, token for token (docs/benchmarks.md).

    python benchmarks/engine/cosine_ablation.py [--rounds 3] [--concurrency 1,4,8,16] [--threads 1,2]
        [--prompts-per-domain 4] [--warmup-per-domain 4] [--max-tokens 64] [--systems ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cosine_ray.bench.engines import engine_config, run_batch, start_engine
from cosine_ray.bench.figures import mean_accepted_length, routing_shares
from cosine_ray.bench.rounds import Interleaving, Spread, paired_ratios
from cosine_ray.bench.workloads import held_back_split
from cosine_ray.datasets import DOMAIN_FILES, default_prompt_dir
from cosine_ray.engine.config import DEFAULT_DRAFTERS
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint

SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "speculation off": ("none", {}),
    "CoSine (full)": (DEFAULT_DRAFTERS, {}),
    "routing off (random)": (DEFAULT_DRAFTERS, {"routing": "random"}),
    "fusion off (single best)": (DEFAULT_DRAFTERS, {"fusion": "single"}),
    "LP off (first come)": (DEFAULT_DRAFTERS, {"scheduler": "fcfs"}),
    "adaptive off (fixed γ)": (DEFAULT_DRAFTERS, {"adaptive": False}),
    "drain price off": (DEFAULT_DRAFTERS, {"drain_pricing": False}),
}
OFF = "speculation off"
FULL = "CoSine (full)"
COUNTERS = ("cosine_ray:verify_seconds", "cosine_ray:verify_predicted_seconds",
            "cosine_ray:spec_decode_expected_accepted_tokens", "cosine_ray:spec_decode_num_accepted_tokens")
HISTOGRAMS = ("cosine_ray:scheduler_decision_seconds", "cosine_ray:scheduler_gamma")


def warmup_size(concurrency: int, available: int) -> int:
    """Warm-up prompts run at one concurrency: 2c, at least 4 (a single request's ~100
    steps take the guard's bucket past its young phase), at most the warm-up set."""
    return min(available, max(4, 2 * concurrency))


def registry_reading(engine: LocalEngine) -> dict[str, float]:
    """Totals of the counters and histogram sums/counts the report differences."""
    m = engine.core.metrics
    out = {name: m.total(name) for name in COUNTERS}
    for name in HISTOGRAMS:
        h = m.get(name)
        out[name + ":sum"], out[name + ":count"] = (h.sum, h.count) if h is not None else (0.0, 0)
    return out


def one_run(engine: LocalEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict[str, Any]:
    before = registry_reading(engine)
    outs, secs = run_batch(engine, prompts, params, concurrency)
    after = registry_reading(engine)
    delta = {k: after[k] - before[k] for k in after}
    steps = sum(o.stats.num_verify_steps for o in outs)
    accepted = sum(o.stats.num_accepted_tokens for o in outs)
    return {"tok_s": sum(len(o.new_token_ids) for o in outs) / secs, "seconds": secs,
            "texts": [o.new_token_ids for o in outs], "steps": steps, "accepted": accepted,
            "routed": [(dict(o.stats.routed_to), o.stats.num_routed_steps) for o in outs], **delta}


def summarise(runs: list[dict[str, Any]], off_runs: list[dict[str, Any]] | None) -> dict[str, Any]:
    def total(key: str) -> float:
        return sum(r[key] for r in runs)

    steps = total("steps")
    out = {"tok_s": statistics.mean(r["tok_s"] for r in runs), "tok_s_rounds": [r["tok_s"] for r in runs],
           "mean_accepted_length": mean_accepted_length(total("accepted"), steps),
           "gamma_mean": total("cosine_ray:scheduler_gamma:sum") / max(total("cosine_ray:scheduler_gamma:count"), 1),
           "decision_ms": 1e3 * total("cosine_ray:scheduler_decision_seconds:sum")
           / max(total("cosine_ray:scheduler_decision_seconds:count"), 1),
           "verify_pred_over_meas": total("cosine_ray:verify_predicted_seconds")
           / max(total("cosine_ray:verify_seconds"), 1e-12),
           "accept_expected_over_actual": total("cosine_ray:spec_decode_expected_accepted_tokens")
           / max(total("cosine_ray:spec_decode_num_accepted_tokens"), 1e-12)}
    if off_runs is not None:
        ratio = Spread.of(paired_ratios([r["tok_s"] for r in runs], [o["tok_s"] for o in off_runs]))
        out.update(ratio=ratio.mean, ratio_min=ratio.low, ratio_max=ratio.high)
        out["identical"] = sum(a == b for r, o in zip(runs, off_runs) for a, b in zip(r["texts"], o["texts"]))
        out["outputs"] = sum(len(r["texts"]) for r in runs)
    return out


def domain_shares(runs: list[dict[str, Any]], domains: list[str]) -> dict[str, dict[str, float]]:
    """Routing shares per domain over ``runs`` (every domain listed, {} where nothing was routed)."""
    shares = routing_shares(((d, to, n) for r in runs for d, (to, n) in zip(domains, r["routed"])), list(DOMAIN_FILES))
    return {d: shares.get(d, {}) for d in DOMAIN_FILES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-dir", default=str(default_prompt_dir()))
    ap.add_argument("--prompts-per-domain", type=int, default=4)
    ap.add_argument("--warmup-per-domain", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of system names")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/cosine_ablation.json")
    args = ap.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    thread_settings = [int(t) for t in args.threads.split(",")]
    names = [n.strip() for n in args.systems.split(",")]
    if OFF not in names:
        names.insert(0, OFF)

    checkpoint = resolve_checkpoint(args.model)
    tokenizer = checkpoint.load_tokenizer()
    warm, meas = held_back_split(Path(args.prompt_dir), args.warmup_per_domain, args.prompts_per_domain)
    warm_ids = [encode_prompt(tokenizer, p) for _, p in warm]
    meas_ids = [encode_prompt(tokenizer, p) for _, p in meas]
    domains = [d for d, _ in meas]
    params = SamplingParams(max_tokens=args.max_tokens)
    engines = {name: start_engine(engine_config(SYSTEMS[name][0], model=args.model, max_num_seqs=16,
                                                **SYSTEMS[name][1]), checkpoint=checkpoint) for name in names}
    interleaving = Interleaving("shuffle", args.seed)
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for threads in thread_settings:
        torch.set_num_threads(threads)
        for name, engine in engines.items():
            for c in concurrencies if warm_ids else ():  # every batch-size bucket the rounds use has seen steps
                run_batch(engine, warm_ids[:warmup_size(c, len(warm_ids))], params, c)
        runs: dict[tuple[int, str], list[dict[str, Any]]] = {(c, n): [] for c in concurrencies for n in names}
        for r in range(args.rounds):
            for c in concurrencies:
                for name in interleaving.order(names, r + 1):
                    runs[(c, name)].append(one_run(engines[name], meas_ids, params, c))
                print(f"threads {threads} round {r + 1} c={c}: " + "  ".join(
                    f"{n} {runs[(c, n)][-1]['tok_s']:.1f}" for n in names), flush=True)
        for c in concurrencies:
            off = runs[(c, OFF)]
            offs = [o["tok_s"] for o in off]
            key = f"threads={threads} c={c}"
            results[key] = {"noise_band": (max(offs) - min(offs)) / statistics.mean(offs),
                            "systems": {n: summarise(runs[(c, n)], off) for n in names}}
        results[f"threads={threads} routing shares"] = {
            n: domain_shares([x for c in concurrencies for x in runs[(c, n)]], domains)
            for n in names if n in ("CoSine (full)", "routing off (random)")}
        for n in names:
            guard = engines[n].core.scheduler.guard
            if guard is not None:
                results.setdefault(f"threads={threads} guard", {})[n] = guard.levels_by_bucket()
    elapsed = time.perf_counter() - started
    print_tables(results, names, thread_settings, concurrencies, args.rounds, elapsed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "elapsed_s": elapsed, "results": results}, indent=2))
    print(f"\nwrote {out}")


def print_tables(results: dict[str, Any], names: list[str], thread_settings: list[int], concurrencies: list[int],
                 rounds: int, elapsed: float) -> None:
    print(f"\n{rounds} rounds, interleaved, {elapsed / 60:.1f} min")
    for threads in thread_settings:
        print(f"\n### {threads} thread(s): tokens/s (ratio to speculation off, round min–max)\n")
        print("| system | " + " | ".join(f"c={c}" for c in concurrencies) + " | mean acc. length | mean γ_i "
              "| decision ms | verify pred/meas | accepted exp/actual | identical |")
        print("| --- |" + " --- |" * (len(concurrencies) + 6))
        for n in names:
            cells, last = [], None
            for c in concurrencies:
                s = results[f"threads={threads} c={c}"]["systems"][n]
                cells.append(f"{s['tok_s']:.2f} ({s['ratio']:.2f}× {s['ratio_min']:.2f}–{s['ratio_max']:.2f})")
                last = s
            ident = sum(results[f"threads={threads} c={c}"]["systems"][n]["identical"] for c in concurrencies)
            outs = sum(results[f"threads={threads} c={c}"]["systems"][n]["outputs"] for c in concurrencies)
            print(f"| {n} | " + " | ".join(cells) + f" | {last['mean_accepted_length']:.2f} | {last['gamma_mean']:.2f} "
                  f"| {last['decision_ms']:.2f} | {last['verify_pred_over_meas']:.2f} "
                  f"| {last['accept_expected_over_actual']:.2f} | {ident}/{outs} |")
        print("\ndecision ms per step (LP + TreeSelection), by concurrency: " + "; ".join(
            f"{n}: " + " ".join(f"c={c} {results[f'threads={threads} c={c}']['systems'][n]['decision_ms']:.2f}"
                                for c in concurrencies) for n in names))
        bands = " ".join(f"c={c} ±{results[f'threads={threads} c={c}']['noise_band'] / 2:.1%}" for c in concurrencies)
        print(f"\nnoise band (speculation off across rounds, half of max−min): {bands}")
        if FULL in names:
            print_paired(results, names, threads, concurrencies)
        print(f"guard levels at the end: {results.get(f'threads={threads} guard', {})}")
        for n, shares in results[f"threads={threads} routing shares"].items():
            print(f"routing shares, {n}: " + "; ".join(
                f"{d}: " + " ".join(f"{k}={v}" for k, v in sh.items()) for d, sh in shares.items()))
    print("\n(mean acc. length … accepted exp/actual: the last concurrency's runs)")


def print_paired(results: dict[str, Any], names: list[str], threads: int, concurrencies: list[int]) -> None:
    """Full CoSine against each ablation, paired per round (same round, same minute of the
    machine): the mean of full / ablation with its rounds' min–max, marked ``≥`` where the
    mean is at least 1 − the setting's noise band (half of speculation off's max−min)."""
    print("\nfull CoSine / each system, paired per round (mean, min–max; ≥: within the noise band):\n")
    print("| system | " + " | ".join(f"c={c}" for c in concurrencies) + " |")
    print("| --- |" + " --- |" * len(concurrencies))
    for n in names:
        if n == FULL:
            continue
        cells = []
        for c in concurrencies:
            res = results[f"threads={threads} c={c}"]
            paired = Spread.of(paired_ratios(res["systems"][FULL]["tok_s_rounds"], res["systems"][n]["tok_s_rounds"]))
            mark = "≥" if paired.mean >= 1 - res["noise_band"] / 2 else "<"
            cells.append(f"{mark} {paired.mean:.2f} ({paired.low:.2f}–{paired.high:.2f})")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print()


if __name__ == "__main__":
    main()
