"""What verifying a longer draft chain costs: one request's verify forward over a chain of γ
draft tokens (γ + 1 rows with the root), at a few context lengths, on this machine.

    python benchmarks/engine/chain_cost.py [--gammas 0,1,8,16,32,64] [--contexts 256,1024]
        [--batch 1] [--repeats 15] [--rounds 3] [--threads 2] [--model smollm2-135m]

Each (context, γ) is the median of ``--repeats`` forwards (after two warm-ups), measured in
``--rounds`` rounds whose order is shuffled, so a drift of the machine's speed falls on every
γ alike; the table prints each γ's min-max over the rounds and its time relative to γ = 0 (the
plain decode step). The KV of the chains is never kept: every forward sees the same context.
The figures say how long a draft must be accepted to pay for itself: a chain of γ whose
acceptance gives A tokens pays while (1 + A) / t(γ) beats 1 / t(0).
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from cosine_ray.engine.profile import _chain, median_seconds
from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem
from cosine_ray.engine.worker.target import TargetWorker
from cosine_ray.models.loader import load_target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gammas", default="0,1,8,16,32,64")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--batch", type=int, default=1, help="requests per forward, each with its own chain")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gammas = [int(g) for g in args.gammas.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    loaded = load_target(args.model, dtype="float32", device="cpu")
    worker = TargetWorker(loaded.stages, runner="eager")
    vocab = loaded.checkpoint.config.vocab_size
    rng = random.Random(0)
    ids = {ctx: [f"chain-{ctx}-{i}" for i in range(args.batch)] for ctx in contexts}
    pending: dict[str, tuple[int, ...]] = {}
    """KV to keep with a request's next forward: its prompt's, once; then nothing."""
    for ctx, rids in ids.items():
        for rid in rids:
            worker.score([ScoreItem.prefill(rid, [rng.randrange(vocab) for _ in range(ctx)])])
            pending[rid] = tuple(range(ctx))
    times: dict[tuple[int, int], list[float]] = {}
    work = [(ctx, g) for ctx in contexts for g in gammas]
    for _ in range(args.rounds):
        rng.shuffle(work)
        for ctx, gamma in work:
            rids = ids[ctx]
            trees = [_chain(rng.randrange(vocab), gamma, rng, vocab) for _ in rids]

            def forward() -> None:
                worker.score([ScoreItem.for_tree(rid, tree, ctx) for rid, tree in zip(rids, trees)],
                             [KVCommit(rid, pending[rid]) for rid in rids])
                for rid in rids:
                    pending[rid] = ()

            times.setdefault((ctx, gamma), []).append(median_seconds(forward, 2, args.repeats))
    print(f"{args.model}, {torch.get_num_threads()} threads, batch {args.batch}: verify forward of a chain of "
          f"γ draft tokens (median ms of {args.repeats}; min-max over {args.rounds} rounds)")
    print(f"{'context':>8} {'γ':>4} {'ms':>8} {'min-max':>15} {'× γ=0':>7}")
    for ctx in contexts:
        base = statistics.median(times[(ctx, gammas[0])])
        for gamma in gammas:
            t = times[(ctx, gamma)]
            med = statistics.median(t)
            print(f"{ctx:>8} {gamma:>4} {1e3 * med:>8.2f} {1e3 * min(t):>7.2f}-{1e3 * max(t):<7.2f} {med / base:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
