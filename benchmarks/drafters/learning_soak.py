"""The learning drafters under a soak: their index memory stays bounded while they learn.

A real in-process engine (default drafters: the ``learning`` set) serves closed-loop traffic for
``--seconds`` from ``--concurrency`` clients cycling the shipped prompts, so the same prompts come
back; every finished request is learned by its domain's expert, so the global indexes grow until
``--index-tokens`` (``EngineConfig.suffix_index_tokens``) makes them evict their oldest requests.
Every ``--sample-every`` seconds it records each suffix drafter's indexed tokens and bytes, the
process's resident memory and C heap in use, and the interval's tokens/s; at the end it prints
PASS/FAIL for: the indexes stay under the cap, do not grow once full, and every request
finished, and reports the memory slopes over the second half (docs/benchmarks.md).

    python benchmarks/drafters/learning_soak.py [--seconds 180] [--concurrency 8] [--index-tokens 25000]
        [--drafters learning] [--max-tokens 64] [--threads 2] [--sample-every 15]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from cosine_ray.bench.engines import engine_config, start_engine
from cosine_ray.bench.figures import mean_accepted_length
from cosine_ray.datasets import DOMAIN_FILES, default_prompt_dir, read_prompts
from cosine_ray.engine.local import LocalEngine, encode_prompt
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.runtime.memory import malloc_in_use_bytes, release_free_heap


def rss_mib() -> float:
    """Resident memory of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def index_sizes(engine: LocalEngine) -> dict[str, dict[str, int]]:
    return {d.name: d.state_size() for d in engine.drafters if hasattr(d, "state_size")}


def slope_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


async def soak(engine: LocalEngine, prompts: list[list[int]], params: SamplingParams, args) -> list[dict[str, Any]]:
    start = time.perf_counter()
    end = start + args.seconds
    counter = {"next": 0, "tokens": 0, "steps": 0, "accepted": 0, "requests": 0, "errors": 0}
    samples: list[dict[str, Any]] = []

    def sample() -> None:
        release_free_heap()  # as the server does every 5 s: RSS then shows what is held
        t = time.perf_counter() - start
        last = samples[-1] if samples else {"t": 0.0, "tokens": 0, "steps": 0, "accepted": 0}
        dt = max(t - last["t"], 1e-9)
        steps = counter["steps"] - last["steps"]
        samples.append({"t": t, "tokens": counter["tokens"], "steps": counter["steps"],
                        "accepted": counter["accepted"], "requests": counter["requests"], "errors": counter["errors"],
                        "tok_s": (counter["tokens"] - last["tokens"]) / dt,
                        "mean_accepted_length": mean_accepted_length(counter["accepted"] - last["accepted"], steps),
                        "rss_mib": rss_mib(), "heap_in_use_mib": (malloc_in_use_bytes() or 0) / 2**20,
                        "python_objects": len(gc.get_objects()), "indexes": index_sizes(engine)})

    async def client() -> None:
        while time.perf_counter() < end:
            ids = prompts[counter["next"] % len(prompts)]
            counter["next"] += 1
            out = await engine.loop.generate_all(ids, params)
            if out.error:
                counter["errors"] += 1
                continue
            counter["requests"] += 1
            counter["tokens"] += len(out.new_token_ids)
            counter["steps"] += out.stats.num_verify_steps
            counter["accepted"] += out.stats.num_accepted_tokens

    async def sampler() -> None:
        while time.perf_counter() < end:
            await asyncio.sleep(args.sample_every)
            sample()

    sample()
    try:
        await asyncio.gather(sampler(), *(client() for _ in range(args.concurrency)))
    finally:
        await engine.loop.shutdown()
    sample()
    return samples


def check(samples: list[dict[str, Any]], cap: int) -> list[tuple[str, bool, str]]:
    out = [("every request finished without an error", samples[-1]["errors"] == 0,
            f"{samples[-1]['requests']} finished, {samples[-1]['errors']} failed")]
    names = sorted(samples[0]["indexes"])
    peak = {n: max(s["indexes"][n]["global_tokens"] for s in samples) for n in names}
    out.append(("bounded: every global index <= cap at every sample", all(v <= cap for v in peak.values()),
                ", ".join(f"{n} peak {v}" for n, v in peak.items())))
    for n in names:
        full = next((s for s in samples if s["indexes"][n]["global_tokens"] >= 0.9 * cap), None)
        if full is None:
            out.append((f"{n}: no growth once full", True, "never reached 90 % of the cap (nothing to check)"))
            continue
        at_full, last = full["indexes"][n]["global_bytes"], samples[-1]["indexes"][n]["global_bytes"]
        out.append((f"{n}: no growth once full", last <= at_full * 1.10,
                    f"{at_full / 2**20:.2f} MiB at t={full['t']:.0f}s -> {last / 2**20:.2f} MiB at the end"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--index-tokens", type=int, default=25_000)
    ap.add_argument("--drafters", default="learning")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-every", type=float, default=15.0)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompt-dir", default=str(default_prompt_dir()))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench-results/learning_soak.json")
    args = ap.parse_args()
    if args.seconds <= 0 or args.concurrency < 1 or args.index_tokens < 1 or args.sample_every <= 0:
        ap.error("--seconds, --sample-every must be > 0; --concurrency, --index-tokens >= 1")
    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint(args.model)
    tokenizer = checkpoint.load_tokenizer()
    texts = [row["prompt"] for name in DOMAIN_FILES.values() for row in read_prompts(Path(args.prompt_dir) / name)]
    random.Random(args.seed).shuffle(texts)
    prompts = [encode_prompt(tokenizer, t) for t in texts]
    engine = start_engine(engine_config(args.drafters, model=args.model, suffix_index_tokens=args.index_tokens,
                                        max_num_seqs=args.concurrency), checkpoint=checkpoint)
    samples = asyncio.run(soak(engine, prompts, SamplingParams(max_tokens=args.max_tokens), args))

    names = sorted(samples[0]["indexes"])
    print(f"\n{args.drafters}: {args.concurrency} clients for {args.seconds:.0f} s, cap {args.index_tokens} "
          f"tokens per global index, {len(prompts)} prompts cycled, {args.threads} torch threads\n")
    print("| t (s) | requests | tok/s | mean acc. length | RSS MiB | heap MiB | objects | " +
          " | ".join(f"{n} tokens / KiB" for n in names) + " |")
    print("| --- " * (7 + len(names)) + "|")
    for s in samples:
        print(f"| {s['t']:.0f} | {s['requests']} | {s['tok_s']:.1f} | {s['mean_accepted_length']:.2f} | "
              f"{s['rss_mib']:.1f} | {s['heap_in_use_mib']:.1f} | {s['python_objects']} | " + " | ".join(
                  f"{s['indexes'][n]['global_tokens']} / "
                  f"{(s['indexes'][n]['global_bytes'] + s['indexes'][n]['local_bytes']) / 1024:.0f}"
                  for n in names) + " |")
    half = [s for s in samples[:-1] if s["t"] >= args.seconds / 2]  # the last one is after the drain
    rss_slope = slope_per_min([(s["t"], s["rss_mib"]) for s in half])
    heap_slope = slope_per_min([(s["t"], s["heap_in_use_mib"]) for s in half])
    last = samples[-1]["indexes"]
    per_token = {n: last[n]["global_bytes"] / last[n]["global_tokens"] for n in names if last[n]["global_tokens"]}
    print(f"\nbytes per indexed token at the end: " + ", ".join(f"{n} {v:.0f}" for n, v in per_token.items()))
    print(f"slopes over the second half: resident memory {rss_slope:+.2f} MiB/min, C heap in use "
          f"{heap_slope:+.2f} MiB/min")
    results = check(samples, args.index_tokens)
    for what, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {detail}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "samples": samples, "rss_slope_mib_per_min": rss_slope,
                               "heap_slope_mib_per_min": heap_slope,
                               "bytes_per_token": per_token,
                               "checks": [{"check": w, "pass": ok, "detail": d} for w, ok, d in results]}, indent=2))
    print(f"wrote {out}")
    raise SystemExit(0 if all(ok for _, ok, _ in results) else 1)


if __name__ == "__main__":
    main()
