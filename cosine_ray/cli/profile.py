"""``cosine-ray profile``: measure the target's verify forward and each drafter over a grid and
fit the latency models T_llm / T_ssm the LP scheduler uses."""

from __future__ import annotations

import argparse
import time

from cosine_ray.cli.args import DRAFTERS_HELP, MODEL_HELP, CliError, add_device_args, check_local_device, runner_from_args
from cosine_ray.engine.config import DEFAULT_DRAFTERS


def add_parser(sub) -> None:
    prof = sub.add_parser("profile", help="measure the target and drafters; fit the LP scheduler's latency models")
    prof.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    prof.add_argument("--stages", type=int, default=1, help="pipeline stages (layer slices) of the target")
    prof.add_argument("--drafters", default=DEFAULT_DRAFTERS, help=DRAFTERS_HELP)
    prof.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_device_args(prof)
    prof.add_argument("--quick", action="store_true", help="small grid, 3 repetitions (what `serve` runs at first start)")
    prof.add_argument("--out", default=None,
                      help="output JSON (default: $COSINE_RAY_PROFILE_DIR or ~/.cache/cosine_ray/profiles, "
                           "then <model>-<device>-<dtype>-s<stages>-t<threads>-d<drafters>.json)")


def run(args: argparse.Namespace) -> int:
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.profile import format_table, profile_path, run_profile, save_profile

    if args.stages < 1 or (args.threads is not None and args.threads < 1):
        raise CliError("--stages and --threads must be >= 1")
    check_local_device(args.device)
    try:
        config = EngineConfig(model=args.model, drafters=parse_drafters(args.drafters),
                              num_stages=args.stages, num_threads=args.threads, device=args.device,
                              dtype=args.dtype, weights=args.weights, kv_cache_memory=args.kv_cache_memory).replace(
            runner=runner_from_args(args))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    start = time.perf_counter()
    try:
        model = run_profile(config, quick=args.quick)
    except (ValueError, OSError) as exc:  # ModelLoadError is a ValueError
        raise CliError(str(exc).splitlines()[0]) from None
    elapsed = time.perf_counter() - start
    try:
        path = save_profile(model, args.out or profile_path(config))
    except OSError as exc:
        raise CliError(f"cannot write the profile: {exc}") from None
    print(format_table(model))
    print(f"profiled {model.model_name} ({'quick' if args.quick else 'full'}, {model.num_threads} threads) "
          f"in {elapsed:.1f} s -> {path}")
    return 0
