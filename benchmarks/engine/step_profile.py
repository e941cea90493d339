"""Where a serving step's time goes: ``torch.profiler`` over the measured window of one
``cosine-ray bench`` system, on any device.

    python benchmarks/engine/step_profile.py [--device cuda] [--dtype bfloat16] [--drafters default]
        [--concurrency 8] [--prompts-per-domain 2] [--warmup-per-domain 2] [--max-tokens 64]
        [--rows 22] [--trace trace.json]

It builds the in-process engine as the bench does, sends the warm-up conversations, then
profiles the measured ones at the given concurrency and prints tok/s under the profiler (lower
than the bench's), the operators and kernels with the most device time (CUDA only) and those
with the most host time. ``--trace`` also writes a Chrome trace. Graph replays appear as
``cudaGraphLaunch`` on the host and as their kernels on the device; CUPTI's tracing makes graph
launches slower than they are without the profiler.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cosine_ray.bench.conversations import count_tokens, run_conversations
from cosine_ray.bench.engines import start_engine
from cosine_ray.bench.workloads import bench_workload
from cosine_ray.cli.args import CliError, check_local_device
from cosine_ray.datasets import default_prompt_dir
from cosine_ray.engine.config import config_from_dict
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--drafters", default="default")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompts-per-domain", type=int, default=2)
    ap.add_argument("--warmup-per-domain", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=22, help="rows of each table")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--trace", default=None, help="also write a Chrome trace here")
    args = ap.parse_args(argv)
    if min(args.concurrency, args.prompts_per_domain, args.max_tokens, args.rows) < 1 or args.warmup_per_domain < 0:
        print("step_profile: --concurrency, --prompts-per-domain, --max-tokens and --rows must be >= 1", file=sys.stderr)
        return 2
    try:
        check_local_device(args.device)
    except CliError as exc:
        print(f"step_profile: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    warm, measured = bench_workload("chat", default_prompt_dir(), args.prompts_per_domain, args.warmup_per_domain,
                                    args.max_tokens, seed=0)
    checkpoint = resolve_checkpoint(args.model)
    tokenizer = checkpoint.load_tokenizer()
    engine = start_engine(config_from_dict({"model": args.model, "drafters": args.drafters, "device": args.device,
                                            "dtype": args.dtype,
                                            "scheduler": {"max_num_seqs": max(8, args.concurrency)}}),
                          checkpoint=checkpoint)
    params = SamplingParams(max_tokens=args.max_tokens)
    if warm:
        asyncio.run(run_conversations(engine, [w.turns for w in warm], params, args.concurrency, tokenizer))
    cuda = args.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        outs = asyncio.run(run_conversations(engine, [m.turns for m in measured], params, args.concurrency,
                                             tokenizer))
        seconds = time.perf_counter() - start
    tokens = count_tokens(outs)
    print(f"{args.drafters} on {args.device} ({args.dtype}), c={args.concurrency}: {len(measured)} conversations, "
          f"{tokens} tokens in {seconds:.2f} s = {tokens / seconds:.2f} tok/s under the profiler")
    table = prof.key_averages()
    if cuda:
        print("\nmost device time:")
        print(table.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=70))
    print("\nmost host time:")
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.trace:
        prof.export_chrome_trace(args.trace)
        print(f"wrote {args.trace}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
