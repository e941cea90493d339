"""EasySpec's layer-parallel drafting against sequential drafting, for distilled domain drafters.

For each domain drafter: (1) draft latency, the time of one draft forward (one token for each of
b requests, ``b`` in ``--batch-sizes``) exact and layer-parallel, interleaved over ``--rounds``;
(2) acceptance, the replay of ``drafting_ceiling.py`` (``cosine_ray.bench.replay``, turns from
its ``--turns`` output) with the drafter alone on its own domain's turns, sequential and
layer-parallel: tokens a step, and draft milliseconds a step. Both variants are lossless (the
target verifies), so only speed and acceptance can differ (docs/drafters.md).

    python benchmarks/drafters/layer_parallel.py --turns bench-results/drafting_ceiling.json
        [--drafters DIR] [--domains code,math,instruction,chat] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from cosine_ray.bench.replay import DecodedTurn, replay
from cosine_ray.bench.rounds import Interleaving, Spread


def draft_forward_ms(drafter, batch: int, steps: int) -> float:
    """Mean ms of one draft-token forward for ``batch`` requests (after an exact prefill)."""
    import torch
    rids = [f"lat-{i}" for i in range(batch)]
    ctx = [[1 + (7 * i + j) % 200 for j in range(64)] for i in range(batch)]
    drafter._chains([(r, c, 1, 1) for r, c in zip(rids, ctx)])  # exact sync of the context
    fuzzy = drafter.config.layer_parallel
    tokens = [[5] for _ in rids]
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(steps):
            drafter._forward(rids, tokens, fuzzy=fuzzy)
    elapsed = (time.perf_counter() - start) / steps
    for r in rids:
        drafter.release(r)
    return 1e3 * elapsed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="layer_parallel", description=__doc__.splitlines()[0])
    p.add_argument("--turns", required=True, help="a drafting_ceiling.py output (its decoded turns)")
    p.add_argument("--drafters", default=None, help="folder with one distilled drafter per domain (default: packaged)")
    p.add_argument("--domains", default="code,math,instruction,chat")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=50, help="draft forwards per latency measurement")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench-results/layer_parallel.json")
    args = p.parse_args(argv)

    import torch

    from cosine_ray.engine.build import PACKAGED_DRAFTERS
    from cosine_ray.engine.drafters.models.distilled import DistilledConfig, load_distilled
    from cosine_ray.models.loader import resolve_checkpoint

    torch.set_num_threads(args.threads)
    earlier = json.loads(Path(args.turns).read_text())
    measured = [DecodedTurn(t["domain"], tuple(t["prompt"]), tuple(t["output"])) for t in earlier["turns"]["measured"]]
    target = resolve_checkpoint("smollm2-135m")
    root = Path(args.drafters) if args.drafters else PACKAGED_DRAFTERS / target.name
    vocab = int(target.config.vocab_size)
    rows = []
    for domain in [d.strip() for d in args.domains.split(",")]:
        variants = {mode: load_distilled(root / domain, vocab, config=DistilledConfig(layer_parallel=mode == "parallel"),
                                         name=f"distilled:{domain}") for mode in ("sequential", "parallel")}
        latency: dict[tuple[str, int], list[float]] = {}
        interleaving = Interleaving("alternate")
        for r in range(args.rounds):
            order = interleaving.order(list(variants.items()), r + 1)
            for b in (int(x) for x in args.batch_sizes.split(",")):
                for mode, drafter in order:
                    latency.setdefault((mode, b), []).append(draft_forward_ms(drafter, b, args.steps))
        turns = [t for t in measured if t.domain == domain]
        for mode, drafter in variants.items():
            figures = replay([], turns, {drafter.name: drafter}, "all", budget=args.budget).figures()
            row = {"domain": domain, "mode": mode, "tokens_per_step": figures["tokens_per_step"],
                   "draft_ms_per_step": figures["draft_ms_per_step"]}
            for (m, b), values in latency.items():
                if m == mode:
                    spread = Spread.of(values)
                    row[f"forward_ms_b{b}"] = spread.median
                    row[f"forward_ms_b{b}_range"] = (spread.low, spread.high)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| domain | drafting | tokens a step | draft ms a step | " +
          " | ".join(f"one draft forward, b = {b} (median, min-max)" for b in args.batch_sizes.split(",")) + " |")
    print("|" + " --- |" * (4 + len(args.batch_sizes.split(","))))
    for r in rows:
        cells = [f"{r[f'forward_ms_b{b}']:.2f} ms ({r[f'forward_ms_b{b}_range'][0]:.2f}-{r[f'forward_ms_b{b}_range'][1]:.2f})"
                 for b in args.batch_sizes.split(",")]
        print(f"| {r['domain']} | {r['mode']} | {r['tokens_per_step']:.3f} | {r['draft_ms_per_step']:.2f} | "
              + " | ".join(cells) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
