"""CoSine and its ablations on one mixed-domain workload, in one run (issue 4).

Workload: held-back prompts (second half of each domain file; the retrieval datastores
are built from the first half), equal mix of code / math / instruction / chat. For each
system, in turn, on the same in-process engine build:

1. warm-up: ``--warmup-per-domain`` prompts per domain at concurrency 8 (routing priors,
   confidence calibration and the latency model learn online; not measured);
2. concurrency 1: the measured prompts one at a time → tokens/s;
3. concurrency 8: the same prompts all submitted at once, 8 running → aggregate tokens/s.

Reported per system: mean accepted length (tokens per verify step, bonus included),
tokens/s at concurrency 1 and 8, and for full CoSine the share of each (true) domain's
routed steps that went to each drafter. Every output is compared with the speculation-off
output of the same prompt (greedy, token for token): lossless means identical.

    python benchmarks/cosine_ablation.py [--prompts-per-domain 4] [--max-tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from cosine_ray.bench import DEFAULT_PROMPT_DIR, DOMAIN_FILES, read_prompts
from cosine_ray.engine.config import DEFAULT_DRAFTERS, EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.engine.router import RouterConfig
from cosine_ray.models.loader import resolve_checkpoint

SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "speculation off": ("none", {}),
    "CoSine (full)": (DEFAULT_DRAFTERS, {}),
    "routing off (random)": (DEFAULT_DRAFTERS, {"routing": "random"}),
    "fusion off (single best)": (DEFAULT_DRAFTERS, {"fusion": "single"}),
    "LP off (first come)": (DEFAULT_DRAFTERS, {"scheduler": "fcfs"}),
    "adaptive off (fixed γ)": (DEFAULT_DRAFTERS, {"adaptive": False}),
}


def workload(prompt_dir: Path, warmup: int, measured: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(domain, prompt) lists: warm-up and measured sets, disjoint, from each file's second half."""
    warm, meas = [], []
    for domain, name in DOMAIN_FILES.items():
        rows = read_prompts(prompt_dir / name)
        second = [r["prompt"] for r in rows[(len(rows) + 1) // 2:]]
        # measured prompts first so a bigger warm-up never changes the measured set
        meas += [(domain, p) for p in second[:measured]]
        warm += [(domain, p) for p in second[measured:measured + warmup]]
    return warm, meas


def run_batch(engine: LocalEngine, prompts: list[list[int]], params: SamplingParams,
              concurrency: int) -> tuple[list[RequestOutput], float]:
    async def go() -> list[RequestOutput]:
        sem = asyncio.Semaphore(concurrency)

        async def one(ids):
            async with sem:
                return await engine.loop.generate_all(ids, params)
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await engine.loop.shutdown()

    start = time.perf_counter()
    outs = asyncio.run(go())
    return outs, time.perf_counter() - start


def _mean(hist) -> float:
    return hist.sum / hist.count if hist is not None and hist.count else 0.0


def _mean_ms(hist) -> float:
    return 1e3 * _mean(hist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-dir", default=str(DEFAULT_PROMPT_DIR))
    ap.add_argument("--prompts-per-domain", type=int, default=4)
    ap.add_argument("--warmup-per-domain", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma list of system names to run")
    ap.add_argument("--out", default="bench-results/cosine_ablation.json")
    args = ap.parse_args()

    checkpoint = resolve_checkpoint(args.model)
    tokenizer = checkpoint.load_tokenizer()
    warm, meas = workload(Path(args.prompt_dir), args.warmup_per_domain, args.prompts_per_domain)
    warm_ids = [encode_prompt(tokenizer, p) for _, p in warm]
    meas_ids = [encode_prompt(tokenizer, p) for _, p in meas]
    domains = [d for d, _ in meas]
    params = SamplingParams(max_tokens=args.max_tokens)
    names = [n.strip() for n in args.systems.split(",")]
    results: dict[str, dict[str, Any]] = {}
    reference: list[list[int]] | None = None
    for name in names:
        drafters, router = SYSTEMS[name]
        engine = LocalEngine(EngineConfig(model=args.model, drafters=parse_drafters(drafters), num_threads=args.threads,
                                          router=RouterConfig(max_batch_size=8, **router)), checkpoint=checkpoint)
        if warm_ids:
            run_batch(engine, warm_ids, params, 8)
        outs1, secs1 = run_batch(engine, meas_ids, params, 1)
        outs8, secs8 = run_batch(engine, meas_ids, params, 8)
        tokens1 = sum(len(o.new_token_ids) for o in outs1)
        tokens8 = sum(len(o.new_token_ids) for o in outs8)
        steps = sum(o.stats.num_verify_steps for o in outs1 + outs8)
        accepted = sum(o.stats.num_accepted_tokens for o in outs1 + outs8)
        texts = [o.new_token_ids for o in outs1]
        if reference is None and drafters == "none":
            reference = texts
        shares: dict[str, dict[str, float]] = {}
        for domain in DOMAIN_FILES:
            routed: dict[str, int] = {}
            total = 0
            for d, o in zip(domains + domains, outs1 + outs8):
                if d == domain:
                    total += o.stats.num_routed_steps
                    for k, v in o.stats.routed_to.items():
                        routed[k] = routed.get(k, 0) + v
            shares[domain] = {k: v / total for k, v in sorted(routed.items())} if total else {}
        results[name] = {
            "tokens_per_s_c1": tokens1 / secs1, "tokens_per_s_c8": tokens8 / secs8,
            "mean_accepted_length": (accepted + steps) / steps if steps else 0.0,
            "identical_to_spec_off": None if reference is None else
            sum(a == b for a, b in zip(texts, reference)) + sum(o.new_token_ids == r for o, r in zip(outs8, reference)),
            "num_outputs": 2 * len(meas_ids),
            "routing_shares": shares,
            "participation": engine.router.planner.participation.current,
            "decision_ms_mean": _mean_ms(engine.router.metrics.get("cosine_ray:scheduler_decision_seconds")),
            "gamma_mean": _mean(engine.router.metrics.get("cosine_ray:scheduler_gamma")),
        }
        print(f"{name:26s} c1 {results[name]['tokens_per_s_c1']:7.2f} tok/s  c8 {results[name]['tokens_per_s_c8']:7.2f} tok/s"
              f"  mean acc len {results[name]['mean_accepted_length']:.2f}"
              f"  identical {results[name]['identical_to_spec_off']}/{results[name]['num_outputs']}", flush=True)

    base = results.get("speculation off")
    print("\n| system | tok/s c=1 | tok/s c=8 | vs spec-off c=1 | vs spec-off c=8 | mean accepted length "
          "| mean γ_i | decision ms | identical |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        rel1 = f"{r['tokens_per_s_c1'] / base['tokens_per_s_c1']:.2f}×" if base else ""
        rel8 = f"{r['tokens_per_s_c8'] / base['tokens_per_s_c8']:.2f}×" if base else ""
        print(f"| {name} | {r['tokens_per_s_c1']:.2f} | {r['tokens_per_s_c8']:.2f} | {rel1} | {rel8} | "
              f"{r['mean_accepted_length']:.2f} | {r['gamma_mean']:.2f} | {r['decision_ms_mean']:.2f} | "
              f"{r['identical_to_spec_off']}/{r['num_outputs']} |")
    for name in ("CoSine (full)", "routing off (random)"):
        if name in results:
            print(f"\nrouting shares, {name} (share of each domain's routed steps that included the drafter):")
            for domain, sh in results[name]["routing_shares"].items():
                print(f"  {domain:12s} " + "  ".join(f"{k}={v:.2f}" for k, v in sh.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
