"""Stage-to-stage transport: plain actor calls (ObjectRef passed stage to stage) vs Ray
Compiled Graphs, for hidden-state-sized payloads. Prints median round trips per chain.

    python benchmarks/ray_hops.py [--stages 2] [--iters 200]
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
    compiled.teardown()
    ray.shutdown()


if __name__ == "__main__":
    main()
