"""Where a run's time goes, per speculation level: prefill steps, decode steps, and the guard's view.

Full CoSine engines, each held at one level of the speculation guard (``algo.guard``; the guard
never explores or moves), run the held-back workload of ``cosine_ablation.py`` at one
concurrency, interleaved in shuffled rounds. Every engine step is timed (the whole
``EngineCore.step``) and classed as a *prefill step* (a prompt in it) or a *decode step*. Per
level the table gives the run's wall time, the prefill steps' time, and the decode steps'
count, time, tokens/s and mean number of requests; then the guard's own measure, from the
observations the engine hands it (``Learner._observe_level``: committed tokens per request
over the step's time in predicted plain-decode steps of the same shape, decode steps only),
summed undecayed over the run, next to the end-to-end ratio: one run shows how far the measure
the guard acts on is from what a user gets.

    python benchmarks/engine/step_time_split.py [--threads 1] [--concurrency 8,16] [--levels 0,1]
        [--rounds 2] [--prompts-per-domain 4] [--warmup-per-domain 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from cosine_ray.algo.guard import LEVELS, SpeculationGuard
from cosine_ray.bench.engines import engine_config, run_batch, start_engine
from cosine_ray.bench.rounds import Interleaving
from cosine_ray.bench.workloads import held_back_split
from cosine_ray.datasets import default_prompt_dir
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint


Row = tuple[bool, int, int, float]
"""One engine step: has a prompt in it, requests, tokens committed, seconds."""


class Run:
    """What one (level, concurrency) setting recorded over its rounds."""

    def __init__(self) -> None:
        self.steps: list[Row] = []
        self.seen_by_guard: list[tuple[float, float]] = []
        """The guard's own observations: (tokens per request, time in plain-decode steps)."""
        self.seconds: list[float] = []


class _RecordingGuard(SpeculationGuard):
    """The guard as it runs, its observations also handed to ``seen`` (the run in progress)."""

    seen: Callable[[float, float], None] = staticmethod(lambda tokens, plain_steps: None)

    def observe(self, level: int, tokens_per_request: float, plain_steps: float, rows: int = 1) -> None:
        self.seen(tokens_per_request, plain_steps)
        super().observe(level, tokens_per_request, plain_steps, rows)


def held_engine(checkpoint, level: int, current: Callable[[], Run | None]) -> LocalEngine:
    """A full-CoSine engine whose guard stays at ``LEVELS[level]``; every step, and what the
    guard observes, recorded into ``current()`` (None: not recorded, as in warm-up)."""
    engine = start_engine(engine_config(max_num_seqs=16), checkpoint=checkpoint)
    core = engine.core
    guard = _RecordingGuard(start=level, explore_share=0.0, young_explore_share=0.0)  # no exploring: nothing to move to

    def seen(tokens: float, plain_steps: float) -> None:
        if (run := current()) is not None:
            run.seen_by_guard.append((tokens, plain_steps))

    guard.seen = seen
    core.scheduler.guard = core.learner.guard = guard
    last: list = []  # the step's verified batch
    verify, step = core.verifier.verify, core.step

    async def capturing_verify(batch, drafts):
        last.append(out := await verify(batch, drafts))
        return out

    async def timed_step(lane=None):
        last.clear()
        start = time.perf_counter()
        out = await step(lane)
        run = current()
        if run is not None and last and last[0].outcomes:
            outcomes = last[0].outcomes
            run.steps.append((any(o.is_prefill for o in outcomes), len(outcomes),
                              sum(len(o.new_token_ids) for o in outcomes), time.perf_counter() - start))
        return out

    core.verifier.verify, core.step = capturing_verify, timed_step
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
    warm, measured = held_back_split(Path(default_prompt_dir()), args.warmup_per_domain, args.prompts_per_domain)
    warm_ids = [encode_prompt(tokenizer, p) for _, p in warm]
    measured_ids = [encode_prompt(tokenizer, p) for _, p in measured]
    params = SamplingParams(max_tokens=args.max_tokens)
    runs = {(lvl, c): Run() for lvl in levels for c in concurrencies}
    current: dict[int, Run] = {}  # level → its run in progress (none in warm-up)
    engines = {lvl: held_engine(checkpoint, lvl, lambda lvl=lvl: current.get(lvl)) for lvl in levels}
    for engine in engines.values():
        run_batch(engine, warm_ids, params, 8)
    interleaving = Interleaving("shuffle", args.seed)
    for r in range(1, args.rounds + 1):
        for c in concurrencies:
            for lvl in interleaving.order(levels, r):
                current[lvl] = runs[(lvl, c)]
                _, seconds = run_batch(engines[lvl], measured_ids, params, c)
                runs[(lvl, c)].seconds.append(seconds)
                del current[lvl]

    print(f"{args.threads} thread(s), {len(measured_ids)} prompts × {args.max_tokens} tokens, {args.rounds} rounds\n")
    print("| c | level κ | run s | prefill steps s | decode steps: count, s, tok/s, mean requests "
          "| end to end vs κ = first | guard's measure vs κ = first |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c in concurrencies:
        base_secs, base_goodput = None, None
        for lvl in levels:
            run = runs[(lvl, c)]
            decode = [r for r in run.steps if not r[0]]
            run_s = sum(run.seconds)
            prefill_s = sum(r[3] for r in run.steps if r[0])
            dec_s, dec_tok = sum(r[3] for r in decode), sum(r[2] for r in decode)
            # the guard's goodput, undecayed: Σ tokens per request / Σ time in plain-step units
            goodput = sum(t for t, _ in run.seen_by_guard) / sum(p for _, p in run.seen_by_guard)
            if base_secs is None:
                base_secs, base_goodput = run_s, goodput
            print(f"| {c} | {LEVELS[lvl]:g} | {run_s:.2f} | {prefill_s:.2f} | {len(decode)}, {dec_s:.2f}, "
                  f"{dec_tok / dec_s:.1f}, {statistics.mean(r[1] for r in decode):.1f} "
                  f"| {base_secs / run_s:.3f}× | {goodput / base_goodput:.3f}× |")


if __name__ == "__main__":
    main()
