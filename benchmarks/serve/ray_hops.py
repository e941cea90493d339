"""Stage-to-stage transport: plain actor calls (ObjectRef passed stage to stage) vs Ray
Compiled Graphs. Prints median round trips of the chain, first with echo actors and
hidden-state-sized payloads, then (``--real``) with the real stage actors of the embedded
model scoring one decode step (8 requests x 9-node trees over 128 committed tokens).

    python benchmarks/serve/ray_hops.py [--stages 2] [--iters 200] [--real]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import torch


@ray.remote(num_cpus=0)
class Hop:
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def measure(fn, iters: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--real", action="store_true", help="also time real stage actors (SmolLM2-135M)")
    args = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    hops = [Hop.remote() for _ in range(args.stages)]
    ray.get([h.forward.remote(torch.zeros(1)) for h in hops])
    from ray.dag import InputNode
    with InputNode() as inp:
        node = inp
        for h in hops:
            node = h.forward.bind(node)
    compiled = node.experimental_compile()
    print(f"{args.stages} stages, median round trip (ms) from the driver")
    print(f"{'tokens':>6} {'bytes':>9} {'actor calls':>12} {'compiled graph':>15}")
    for tokens in (1, 16, 128, 512):
        x = torch.randn(tokens, 576)

        def plain():
            ref = x
            for h in hops:
                ref = h.forward.remote(ref)
            ray.get(ref)

        def cg():
            ray.get(compiled.execute(x))

        print(f"{tokens:>6} {x.numel() * 4:>9} {measure(plain, args.iters):>12.2f} {measure(cg, args.iters):>15.2f}")
    compiled.teardown(kill_actors=True)
    if args.real:
        real_stages(args.stages, max(20, args.iters // 5))
    ray.shutdown()


def real_stages(num_stages: int, iters: int) -> None:
    from cosine_ray.algo.tree import TokenTree
    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.engine.worker.scoring import KVCommit, ScoreItem
    from cosine_ray.runtime.actors import StageActor
    config = config_from_dict({"num_stages": num_stages})
    stages = [StageActor.options(num_cpus=0).remote(config, i) for i in range(num_stages)]
    ray.get([s.ping.remote() for s in stages])
    gen = torch.Generator().manual_seed(0)
    prefill = [ScoreItem.prefill(f"r{i}", torch.randint(0, 49152, (128,), generator=gen).tolist())
               for i in range(8)]
    ref = None
    for s in stages:
        ref = s.forward.remote(prefill, ref)
    ray.get(ref)
    tree = TokenTree.from_paths(5, [[1, 2, 3, 4, 5, 6], [7, 8]])
    step = [ScoreItem.for_tree(f"r{i}", tree, 128) for i in range(8)]
    commits = [KVCommit(f"r{i}", tuple(range(128))) for i in range(8)]
    ref = None
    for s in stages:  # commit the prefill once; later calls re-score the same speculative level
        ref = s.forward.remote(step, ref, commits)
    ray.get(ref)
    step = [ScoreItem.for_tree(f"r{i}", tree, 128) for i in range(8)]

    def plain():
        ref = None
        for s in stages:
            ref = s.forward.remote(step, ref)
        ray.get(ref)

    from ray.dag import InputNode
    with InputNode() as inp:
        node = None
        for s in stages:
            node = s.forward.bind(inp, node)
    compiled = node.experimental_compile()

    def cg():
        ray.get(compiled.execute(step))

    print(f"real stages ({num_stages}), one decode step of 8 x 9-node trees: "
          f"actor calls {measure(plain, iters):.1f} ms, compiled graph {measure(cg, iters):.1f} ms")
    compiled.teardown(kill_actors=True)


if __name__ == "__main__":
    main()
