"""Verify-forward time of the real SmolLM2-135M split in 2 stages, by draft tokens per request,
for each CPU projection kernel side by side.

    python benchmarks/verify_forward.py [--threads 1] [--context 128] [--reps 8] [--kernels mkl,onednn]

Each measurement prefills ``--context`` tokens per request, then times one forward of ``n``
new tokens per request through both stages with logits for every new token (what a verify
step costs the target), median of ``--reps``; the kernels (``COSINE_RAY_CPU_GEMM``: MKL's
``x @ W^T`` or oneDNN's pre-packed linear) alternate rep by rep, so a slow moment of the
machine hits both. On CPU the cost growth with the tokens of a step sets how much
speculation (and batching) can win; compare ``--threads 1`` (one torch thread per stage
actor, the Ray path) with ``--threads 2`` (the in-process engine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from cosine_ray.models.llama import CPU_GEMM_ENV, LlamaStage, StageBatch
from cosine_ray.models.loader import resolve_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--kernels", default="mkl,onednn")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint("smollm2-135m")
    state = checkpoint.load_state_dict()
    half = checkpoint.config.num_layers // 2
    kernels = [k.strip() for k in args.kernels.split(",")]
    models = {}
    for kernel in kernels:
        os.environ[CPU_GEMM_ENV] = kernel
        stages = [LlamaStage(checkpoint.config, state, 0, half), LlamaStage(checkpoint.config, state, half)]
        models[kernel] = (stages, [s.new_kv_cache() for s in stages])

    def one(kernel: str, num_requests: int, n: int) -> float:
        stages, caches = models[kernel]
        rids = [f"r{i}" for i in range(num_requests)]
        for cache in caches:
            for rid in rids:
                if rid not in cache.request_ids:
                    cache.allocate(rid)
                cache.truncate(rid, 0)

        def forward(batch: StageBatch) -> None:
            stages[1].forward(batch, caches[1], stages[0].forward(batch, caches[0]))

        forward(StageBatch.from_chains(rids, [[5] * args.context for _ in rids], [0] * num_requests))
        for cache in caches:
            for rid in rids:
                cache.commit(rid)
        batch = StageBatch.from_chains(rids, [[7] * n for _ in rids], [args.context] * num_requests,
                                       last_logits_only=False)
        start = time.perf_counter()
        forward(batch)
        return time.perf_counter() - start

    def measure(num_requests: int, n: int) -> dict[str, float]:
        times: dict[str, list[float]] = {k: [] for k in kernels}
        for rep in range(args.reps + 2):
            for kernel in kernels:
                t = one(kernel, num_requests, n)
                if rep >= 2:  # two warm-up rounds
                    times[kernel].append(t)
        return {k: statistics.median(v) * 1e3 for k, v in times.items()}

    print(f"threads={args.threads}, context {args.context}, median of {args.reps}, kernels alternating "
          f"(ms per verify forward; ratio = {kernels[0]} / {kernels[-1]})")
    print("| requests × new tokens | " + " | ".join(kernels) + " | ratio |")
    print("| --- |" + " --- |" * (len(kernels) + 1))
    for num_requests in (1, 4, 8):
        for n in (1, 2, 5, 9, 17):
            ms = measure(num_requests, n)
            print(f"| {num_requests} × {n} | " + " | ".join(f"{ms[k]:.1f}" for k in kernels)
                  + f" | {ms[kernels[0]] / ms[kernels[-1]]:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
