"""Where a run's time goes, per speculation level: prefill steps, decode steps, and the guard's view.

Full CoSine engines, each held at one level of the speculation guard (``algo.guard``; the guard
never explores or moves), run the held-back workload of ``cosine_ablation.py`` at one
concurrency, interleaved in shuffled rounds. Every engine step is timed (the whole
``EngineCore.step``) and classed as a *prefill step* (a prompt in it) or a *decode step*. Per
level the table gives the run's wall time, the prefill steps' time, and the decode steps'
count, time, tokens/s and mean number of requests; then the guard's own measure on the same
steps — committed tokens per request over the step's time in predicted plain-decode steps of
the same shape, Σ over decode steps — next to the end-to-end ratio, so one run shows how far
the measure the guard acts on is from what a user gets.

    python benchmarks/step_time_split.py [--threads 1] [--concurrency 8,16] [--levels 0,1]
        [--rounds 2] [--prompts-per-domain 4] [--warmup-per-domain 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cosine_ablation as ablation  # noqa: E402  (the workload and run helpers)

from cosine_ray.algo.guard import LEVELS, SpeculationGuard  # noqa: E402
from cosine_ray.datasets import default_prompt_dir  # noqa: E402
from cosine_ray.engine.config import DEFAULT_DRAFTERS, EngineConfig, StepConfig, parse_drafters  # noqa: E402
from cosine_ray.engine.local import LocalEngine, encode_prompt  # noqa: E402
from cosine_ray.engine.request import SamplingParams  # noqa: E402
from cosine_ray.models.loader import resolve_checkpoint  # noqa: E402


Row = tuple[bool, int, int, float, float]
"""One engine step: has a prompt in it, requests, tokens committed, seconds, seconds of a
predicted plain-decode step of the same shape."""


def held_engine(checkpoint, level: int, record: Callable[[Row], None]) -> LocalEngine:
    """A full-CoSine engine whose guard stays at ``LEVELS[level]``, every step recorded."""
    engine = LocalEngine(EngineConfig(model="smollm2-135m", drafters=parse_drafters(DEFAULT_DRAFTERS),
                                      step=StepConfig(max_batch_size=16)), checkpoint=checkpoint)
    core = engine.core
    guard = SpeculationGuard(start=level, explore_share=0.0)  # no exploring: nothing to move to
    core.scheduler.guard = core.learner.guard = guard
    seen: dict[str, object] = {}
    verify, step = core.verifier.verify, core.step

    async def timed_verify(batch, drafts):
        seen["verified"] = out = await verify(batch, drafts)
        return out

    async def timed_step(lane=None):
        seen.clear()
        start = time.perf_counter()
        out = await step(lane)
        verified = seen.get("verified")
        if verified is not None and verified.outcomes:
            latency = core.learner.costs.latency
            plain = latency.predict_llm(verified.context_lens, [1] * len(verified.context_lens))
            record((any(o.is_prefill for o in verified.outcomes), len(verified.outcomes),
                               sum(len(o.new_token_ids) for o in verified.outcomes),
                               time.perf_counter() - start, plain))
        return out

    core.verifier.verify, core.step = timed_verify, timed_step
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--concurrency", default="8,16")
    parser.add_argument("--levels", default="0,1", help="guard levels κ to hold (of %s)" % (LEVELS,))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts-per-domain", type=int, default=4)
    parser.add_argument("--warmup-per-domain", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
        levels = [LEVELS.index(float(k)) for k in args.levels.split(",")]
    except ValueError:
        parser.error(f"--concurrency takes integers and --levels values of {LEVELS}")
    if args.threads < 1 or args.rounds < 1 or min(concurrencies) < 1:
        parser.error("--threads, --rounds and --concurrency must be at least 1")

    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint("smollm2-135m")
    tokenizer = checkpoint.load_tokenizer()
    warm, measured = ablation.workload(Path(default_prompt_dir()), args.warmup_per_domain, args.prompts_per_domain)
    warm_ids = [encode_prompt(tokenizer, p) for _, p in warm]
    measured_ids = [encode_prompt(tokenizer, p) for _, p in measured]
    params = SamplingParams(max_tokens=args.max_tokens)
    steps: dict[tuple[int, int], list[Row]] = {(lvl, c): [] for lvl in levels for c in concurrencies}
    current: dict[int, list[Row]] = {}  # level → the rows of its run in progress (none in warm-up)
    engines = {lvl: held_engine(checkpoint, lvl, lambda row, lvl=lvl: current.get(lvl, []).append(row))
               for lvl in levels}
    for engine in engines.values():
        ablation.run_batch(engine, warm_ids, params, 8)
    runs: dict[tuple[int, int], list[float]] = {(lvl, c): [] for lvl in levels for c in concurrencies}
    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        for c in concurrencies:
            order = list(levels)
            rng.shuffle(order)
            for lvl in order:
                current[lvl] = steps[(lvl, c)]
                _, seconds = ablation.run_batch(engines[lvl], measured_ids, params, c)
                runs[(lvl, c)].append(seconds)

    print(f"{args.threads} thread(s), {len(measured_ids)} prompts × {args.max_tokens} tokens, {args.rounds} rounds\n")
    print("| c | level κ | run s | prefill steps s | decode steps: count, s, tok/s, mean requests "
          "| end to end vs κ = first | guard's measure vs κ = first |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in concurrencies:
        base_secs, base_goodput = None, None
        for lvl in levels:
            rows = steps[(lvl, c)]
            decode = [r for r in rows if not r[0]]
            run_s = sum(runs[(lvl, c)])
            prefill_s = sum(r[3] for r in rows if r[0])
            dec_s, dec_tok = sum(r[3] for r in decode), sum(r[2] for r in decode)
            # the guard's measure: Σ tokens per request / Σ time in plain-step units
            goodput = sum(r[2] / r[1] for r in decode) / sum(r[3] / r[4] for r in decode)
            if base_secs is None:
                base_secs, base_goodput = run_s, goodput
            print(f"| {c} | {LEVELS[lvl]:g} | {run_s:.2f} | {prefill_s:.2f} | {len(decode)}, {dec_s:.2f}, "
                  f"{dec_tok / dec_s:.1f}, {statistics.mean(r[1] for r in decode):.1f} "
                  f"| {base_secs / run_s:.3f}× | {goodput / base_goodput:.3f}× |")


if __name__ == "__main__":
    main()
