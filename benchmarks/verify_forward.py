"""Verify-forward time of the real SmolLM2-135M split in 2 stages, by draft tokens per request.

    python benchmarks/verify_forward.py [--threads 1] [--context 128] [--reps 8]

Each measurement prefills ``--context`` tokens per request, then times one forward of ``n``
new tokens per request through both stages (what a verify step costs the target), median of
``--reps``. On CPU the cost grows with the tokens of a step, which sets how much speculation
can win; compare ``--threads 1`` (one torch thread per stage actor, the Ray path) with
``--threads 2`` (the in-process engine).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cosine_ray.models.llama import LlamaStage, StageBatch
from cosine_ray.models.loader import resolve_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint("smollm2-135m")
    state = checkpoint.load_state_dict()
    half = checkpoint.config.num_layers // 2
    stages = [LlamaStage(checkpoint.config, state, 0, half), LlamaStage(checkpoint.config, state, half)]
    caches = [s.new_kv_cache() for s in stages]

    def forward(batch: StageBatch) -> None:
        stages[1].forward(batch, caches[1], stages[0].forward(batch, caches[0]))

    def measure(num_requests: int, n: int) -> float:
        rids = [f"r{i}" for i in range(num_requests)]
        for cache in caches:
            for rid in rids:
                if rid not in cache.request_ids:
                    cache.allocate(rid)
        times = []
        for rep in range(args.reps + 2):
            for cache in caches:
                for rid in rids:
                    cache.truncate(rid, 0)
            forward(StageBatch.from_chains(rids, [[5] * args.context for _ in rids], [0] * num_requests))
            for cache in caches:
                for rid in rids:
                    cache.commit(rid)
            batch = StageBatch.from_chains(rids, [[7] * n for _ in rids], [args.context] * num_requests)
            start = time.perf_counter()
            forward(batch)
            if rep >= 2:  # two warm-up rounds
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    print(f"threads={args.threads}, context {args.context}, median of {args.reps} (ms per verify forward)")
    for num_requests in (1, 4):
        print(f"  {num_requests} request(s): " + "  ".join(
            f"{n} tok: {measure(num_requests, n):.1f}" for n in (1, 5, 9, 17)), flush=True)


if __name__ == "__main__":
    main()
