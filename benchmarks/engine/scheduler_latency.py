"""Decision latency of the LP batch scheduler (``cosine_ray.algo.scheduling.lp_schedule``).

    python benchmarks/engine/scheduler_latency.py [--decisions 200] [--sizes 8,64,256,1024] [--seed 0] [--tight]

For each pool size, random seeded pools of running and waiting requests (varied contexts,
acceptance rates and prompts, a KV budget that admits about half of the waiting ones) under
``LatencyModel.default()``. Rows: ``schedule_batch`` (one full decision; ``milp %`` is the share
that needed HiGHS), ``milp only`` (the relaxation's certificate disabled: HiGHS every time) and
``first_come_batch`` (the "LP off" ablation). ``cpu med ms`` is the decision's thread CPU time;
``--tight`` makes Γ_max and T_max bind. The goal: a median ≤ 0.1 ms at 64 candidates and ≤ 1 ms
at 1,024.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import time

import numpy as np

from cosine_ray.algo.scheduling.latency_model import LatencyModel
from cosine_ray.algo.scheduling.lp_schedule import Candidate, ScheduleConfig, first_come_batch, schedule_batch


def random_pool(rng: random.Random, size: int, max_batch_size: int) -> list[Candidate]:
    pool = []
    num_running = min(size, max_batch_size + rng.randint(0, max_batch_size))
    for i in range(size):
        alpha = rng.uniform(0.05, 0.95)
        gains, acc = [0.0], 1.0
        for _ in range(8):
            acc *= alpha
            gains.append(gains[-1] + acc)
        running = i < num_running
        context = rng.randint(16, 2048)
        pool.append(Candidate(f"r{i}", context, context * 92_160, tuple(gains), running,
                              rng.uniform(0.0, 1.5), 0 if running else rng.randint(16, 512)))
    return pool


def percentiles(values: list[float]) -> tuple[float, float, float]:
    ms = np.array(values) * 1e3
    return float(np.median(ms)), float(np.percentile(ms, 90)), float(np.percentile(ms, 99))


def run(sizes: list[int], decisions: int, seed: int, tight: bool) -> None:
    model = LatencyModel.default()
    if tight:  # Γ_max and T_max bind: the relaxation is often not feasible, HiGHS decides
        config = ScheduleConfig(max_batch_size=8, gamma_max=8, total_gamma_max=12, t_max_s=0.3, time_limit_s=5.0)
    else:
        config = ScheduleConfig(max_batch_size=8, gamma_max=8, total_gamma_max=64, t_max_s=1.0, time_limit_s=5.0)
    print(f"constraints: total_gamma_max={config.total_gamma_max}, t_max_s={config.t_max_s}, "
          f"KV budget = running + half the waiting bytes")
    print(f"{'pool':>6} {'what':<18} {'median ms':>10} {'p90 ms':>9} {'p99 ms':>9} {'cpu med ms':>10} "
          f"{'milp %':>7} {'milp median ms':>15}")
    for size in sizes:
        rng = random.Random(seed + size)
        pools = []
        for _ in range(decisions):
            pool = random_pool(rng, size, config.max_batch_size)
            waiting = sum(c.kv_bytes for c in pool if not c.running)
            running = sum(c.kv_bytes for c in pool if c.running)
            pools.append((pool, dataclasses.replace(config, kv_budget_bytes=running + waiting / 2)))
        rows = {"schedule_batch": [], "milp only": [], "first_come_batch": []}
        milp_times, cpu_times = [], []
        for pool, cfg in pools:
            t, c = time.perf_counter(), time.thread_time()
            s = schedule_batch(pool, model, cfg)
            rows["schedule_batch"].append(time.perf_counter() - t)
            cpu_times.append(time.thread_time() - c)
            if s.num_milp:
                milp_times.append(rows["schedule_batch"][-1])
            assert s.status in ("optimal", "tmax_relaxed"), s.status
        n_milp = max(1, decisions // 10)  # HiGHS is ~10 ms a call: fewer decisions for this row
        for pool, cfg in pools[:n_milp]:
            milp_cfg = dataclasses.replace(cfg, use_relaxation=False)
            t = time.perf_counter()
            schedule_batch(pool, model, milp_cfg)
            rows["milp only"].append(time.perf_counter() - t)
        for pool, cfg in pools:
            t = time.perf_counter()
            first_come_batch(pool, cfg, 4, model=model)
            rows["first_come_batch"].append(time.perf_counter() - t)
        for name, values in rows.items():
            med, p90, p99 = percentiles(values)
            extra = ""
            if name == "schedule_batch":
                share = 100.0 * len(milp_times) / len(values)
                extra = (f"{statistics.median(cpu_times) * 1e3:>10.3f} {share:>6.1f}% "
                         f"{statistics.median(milp_times) * 1e3 if milp_times else math.nan:>15.2f}")
            print(f"{size:>6} {name:<18} {med:>10.3f} {p90:>9.3f} {p99:>9.3f} {extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decisions", type=int, default=200)
    parser.add_argument("--sizes", default="8,64,256,1024")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tight", action="store_true", help="binding Γ_max and T_max (exercises HiGHS)")
    args = parser.parse_args()
    run([int(s) for s in args.sizes.split(",")], args.decisions, args.seed, args.tight)


if __name__ == "__main__":
    main()
