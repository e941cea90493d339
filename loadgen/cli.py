"""``cosine-loadgen run | compare | chaos | footprint | hostile``: flag names follow ``vllm bench
serve`` where one exists (``chaos`` and ``footprint``: ``loadgen/chaos/cli.py``; ``hostile``:
``loadgen/hostile/cli.py``).

Exit codes: 0 every request completed and the ledger is consistent; 1 something failed (a
request, an unreachable server, a server that did not come up, an interrupt): one line on
stderr, and the results measured so far are written; 2 bad flags or a bad dataset file (one
line ``cosine-loadgen: error: …`` on stderr, nothing sent).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

import numpy as np

from loadgen.arrivals import SCHEDULES, ArrivalConfig, arrival_offsets
from loadgen.metrics import parse_goodput, parse_percentile_metrics, parse_percentiles
from loadgen.runner import CHAT_PATH, COMPLETIONS_PATH, RunConfig
from loadgen.tasks import MIXED_KINDS, TASK_WORKLOADS, mixed_workload, task_workload
from loadgen.workload import (DEFAULT_DATASET_DIR, SPLITS, WorkItem, WorkloadError, build_workload, dataset_workload,
                              load_rows, parse_domain_mix, random_workload, split_counts)

PROG = "cosine-loadgen"
ENDPOINTS = {"chat": CHAT_PATH, "completions": COMPLETIONS_PATH, CHAT_PATH: CHAT_PATH,
             COMPLETIONS_PATH: COMPLETIONS_PATH}


class UsageError(Exception):
    """Bad flags or input: one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but errors are one line on stderr and exit 2 (no usage dump)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def add_common_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("chat", "dataset", "code-edit", "template", "random") + TASK_WORKLOADS
                   + ("mixed",), default="chat",
                   help="chat (or dataset, its older name): the prompt rows of the four domains as they are "
                        "(--multi-turn for MT-bench conversations); code-edit: requests carrying a function "
                        "to change; template: many users asking the same kind of question; json: a text and "
                        "a JSON schema to extract a record into (response_format); edit: a function, a "
                        "change to make and the original as the request's prediction; rag: passages and a "
                        "task whose answer copies from them; agent: tool-calling loops repeating their calls "
                        "and observations; mixed: json, edit, rag, agent and chat interleaved in equal "
                        "numbers (loadgen/workload.py and loadgen/tasks.py say how each is built)")
    w.add_argument("--dataset-dir", type=Path, default=DEFAULT_DATASET_DIR,
                   help="directory of *.jsonl prompt files (id, domain, prompt[, turns]); default: the "
                        "prompt sets packaged with cosine_ray (or $COSINE_RAY_PROMPTS)")
    w.add_argument("--split", choices=SPLITS, default="second-half",
                   help="rows of each file to use (default: the second half; the first built the datastores)")
    w.add_argument("--domain-mix", default=None, help="e.g. code=0.25,math=0.25,instruction=0.25,chat=0.25 "
                   "(default: equal over the dataset's domains)")
    w.add_argument("--num-prompts", type=int, default=100, help="conversations to send")
    w.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (dataset workload)")
    w.add_argument("--multi-turn", action="store_true",
                   help="send every turn of multi-turn rows (MT-bench), each after the previous answer")
    w.add_argument("--random-input-len", type=int, default=256)
    w.add_argument("--random-output-len", type=int, default=128)
    w.add_argument("--random-range-ratio", type=float, default=0.0)
    w.add_argument("--random-token-range", default="1000,20000", help="LOW,HIGH token ids (HIGH <= vocabulary)")
    w.add_argument("--endpoint", default=None, help="chat | completions (default chat; random: completions)")
    w.add_argument("--temperature", type=float, default=0.0)
    w.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (servers that honour it)")
    w.add_argument("--model", default=None, help="model field (default: the first of GET /v1/models)")
    w.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    a = p.add_argument_group("arrivals")
    a.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (inf = all at once)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, < 1 burstier")
    a.add_argument("--schedule", choices=SCHEDULES, default="constant",
                   help="CoSine online modes: low | high | fluctuating (see loadgen/arrivals.py)")
    a.add_argument("--low-rate-fraction", type=float, default=0.25)
    a.add_argument("--fluctuation-period", type=float, default=60.0, help="seconds")
    a.add_argument("--max-concurrency", type=int, default=None)
    a.add_argument("--duration", type=float, default=None, help="stop sending new requests after this many s")
    m = p.add_argument_group("measurement and output")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    m.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    m.add_argument("--metric-percentiles", default="50,90,99")
    m.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    m.add_argument("--num-warmups", type=int, default=None, help="sequential warm-up requests, not measured "
                   "(default 0 for run, 1 per target for compare)")
    m.add_argument("--no-speculation-stats", action="store_true", help="do not send cosine_ray_stats: true")
    m.add_argument("--output-dir", type=Path, default=None, help="default: loadgen-results/<command>-<time>")
    m.add_argument("--no-plots", action="store_true")
    m.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description="Speculation-aware load generator for OpenAI-compatible servers.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    run = sub.add_parser("run", help="measure one server")
    run.add_argument("--base-url", default="http://127.0.0.1:8000")
    add_common_args(run)
    v = run.add_argument_group("vllm bench serve's result file")
    v.add_argument("--save-result", action="store_true",
                   help="also write vllm bench serve's result JSON (its keys; loadgen/vllm_result.py)")
    v.add_argument("--result-dir", type=Path, default=None, help="where it goes (default: the output dir)")
    v.add_argument("--result-filename", default=None,
                   help="its name (default vllm's: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    v.add_argument("--label", default=None, help="vllm's label (default: the backend, openai-chat or openai)")
    v.add_argument("--save-detailed", action="store_true",
                   help="add the per-request lists (ttfts, itls, generated_texts, ...) as vllm does")
    cmp_ = sub.add_parser("compare", help="the same workload against several servers, one table")
    cmp_.add_argument("--target", action="append", default=None, metavar="NAME=URL",
                      help="a running server (repeat); or use --launch")
    cmp_.add_argument("--launch", default=None, metavar="TEMPLATE",
                      help="server command with {port} (and {host}), e.g. 'cosine-ray serve --port {port}'")
    cmp_.add_argument("--launch-target", action="append", default=None, metavar="NAME=ARGS",
                      help="extra server args per target (default: cosine='' off='--drafters none' "
                           "vanilla='--drafters ngram')")
    cmp_.add_argument("--launch-host", default="127.0.0.1")
    cmp_.add_argument("--launch-timeout", type=float, default=900.0, help="seconds for /health to answer 200")
    cmp_.add_argument("--stop-timeout", type=float, default=90.0, help="seconds after SIGINT before SIGTERM/KILL")
    cmp_.add_argument("--baseline", default="off", help="target the table is normalised to")
    add_common_args(cmp_)
    from loadgen.chaos.cli import add_parsers
    add_parsers(sub)
    from loadgen.hostile.cli import add_parser as add_hostile
    add_hostile(sub)
    return parser


def build_plan(args: argparse.Namespace) -> tuple[list[tuple[WorkItem, float]], dict[str, Any]]:
    """The seeded plan: (conversation, arrival offset). Prompts and arrivals use separate streams."""
    if args.num_prompts < 1:
        raise UsageError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    workload_rng, arrival_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(args.seed).spawn(2))
    endpoint = ENDPOINTS.get(args.endpoint or ("completions" if args.workload == "random" else "chat"))
    if endpoint is None:
        raise UsageError(f"--endpoint must be chat or completions, got {args.endpoint!r}")
    args.endpoint = endpoint
    if args.workload == "random":
        if endpoint != COMPLETIONS_PATH:
            raise UsageError("--workload random sends token-id prompts: use --endpoint completions")
        try:
            low, high = (int(v) for v in args.random_token_range.split(","))
        except ValueError:
            raise UsageError(f"--random-token-range must be LOW,HIGH integers, got {args.random_token_range!r}") from None
        items = random_workload(args.num_prompts, workload_rng, input_len=args.random_input_len,
                                output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                                token_low=low, token_high=high)
        described = {"workload": "random", "input_len": args.random_input_len, "output_len": args.random_output_len}
    else:
        if args.multi_turn and endpoint != CHAT_PATH:
            raise UsageError("--multi-turn needs the chat endpoint (history is sent as messages)")
        if args.workload in TASK_WORKLOADS + ("mixed",):
            if endpoint != CHAT_PATH or args.multi_turn:
                raise UsageError(f"--workload {args.workload} sends whole chats: use the chat endpoint, "
                                 f"without --multi-turn")
            if args.workload == "mixed":
                counts = split_counts(args.num_prompts, {k: 1.0 / len(MIXED_KINDS) for k in MIXED_KINDS})
                items = mixed_workload(args.dataset_dir, args.split, counts, args.max_tokens, args.seed)
            else:
                items = task_workload(args.workload, args.dataset_dir, args.split, args.num_prompts,
                                      args.max_tokens, args.seed)
            described = {"workload": args.workload, "dataset_dir": str(args.dataset_dir), "split": args.split,
                         "max_tokens": args.max_tokens}
            return _planned(args, items, described, arrival_rng, endpoint)
        rows = load_rows(args.dataset_dir, args.split)
        mix = parse_domain_mix(args.domain_mix, list(rows))
        if args.workload in ("chat", "dataset"):
            items = dataset_workload(rows, args.num_prompts, mix, workload_rng, max_tokens=args.max_tokens,
                                     multi_turn=args.multi_turn)
        elif args.multi_turn:
            raise UsageError(f"--multi-turn applies to --workload chat, not {args.workload}")
        else:
            items = build_workload(args.workload, rows, args.num_prompts, mix, workload_rng,
                                   max_tokens=args.max_tokens)
        described = {"workload": args.workload, "dataset_dir": str(args.dataset_dir), "split": args.split,
                     "domain_mix": mix, "multi_turn": args.multi_turn, "max_tokens": args.max_tokens}
    return _planned(args, items, described, arrival_rng, endpoint)


def _planned(args: argparse.Namespace, items: list[WorkItem], described: dict[str, Any],
             arrival_rng: np.random.Generator, endpoint: str) -> tuple[list[tuple[WorkItem, float]], dict[str, Any]]:
    """The items with their seeded arrival offsets, and the run described."""
    try:
        arrivals = ArrivalConfig(args.request_rate, args.burstiness, args.schedule, args.low_rate_fraction,
                                 args.fluctuation_period)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    offsets = arrival_offsets(len(items), arrivals, arrival_rng)
    described.update(num_conversations=len(items), num_requests=sum(i.num_turns for i in items), seed=args.seed,
                     endpoint=endpoint, request_rate=args.request_rate, burstiness=args.burstiness,
                     schedule=args.schedule, max_concurrency=args.max_concurrency,
                     last_arrival_s=float(offsets[-1]) if len(offsets) else 0.0)
    return list(zip(items, (float(o) for o in offsets))), described


def run_config(args: argparse.Namespace, base_url: str, default_warmups: int) -> RunConfig:
    try:
        return RunConfig(base_url=base_url, endpoint=args.endpoint, model=args.model, api_key=args.api_key,
                         max_concurrency=args.max_concurrency, request_timeout_s=args.request_timeout,
                         temperature=args.temperature, send_stats=not args.no_speculation_stats,
                         ignore_eos=args.ignore_eos, duration_s=args.duration,
                         num_warmups=default_warmups if args.num_warmups is None else args.num_warmups,
                         show_progress=not args.no_progress)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def report_options(args: argparse.Namespace, described: dict[str, Any]):
    from loadgen.report import ReportOptions
    try:
        return ReportOptions(percentile_metrics=parse_percentile_metrics(args.percentile_metrics),
                             percentiles=parse_percentiles(args.metric_percentiles),
                             goodput=parse_goodput(args.goodput), plots=not args.no_plots,
                             config={"command": args.command, **described})
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _output_dir(args: argparse.Namespace) -> Path:
    return args.output_dir or Path("loadgen-results") / f"{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"


def _run(args: argparse.Namespace) -> int:
    from loadgen.report import write_run
    from loadgen.runner import run_plan
    plan, described = build_plan(args)
    cfg, opts = run_config(args, args.base_url, 0), report_options(args, described)
    out_dir = _output_dir(args)
    result = run_plan(plan, cfg)
    data = write_run(result, out_dir, opts, title=f"Serving benchmark: {cfg.base_url}")
    s, ledger = data["summary"], data["ledger"]
    print(f"results: {out_dir}")
    if args.save_result:
        print(f"vllm result: {save_vllm_result(args, result, s, out_dir)}")
    if result.abort_reason or s["failed"] or not ledger["is_consistent"]:
        cause = (f"aborted: {result.abort_reason}" if result.abort_reason else
                 f"{s['failed']} failed (first: {s['first_error']})" if s["failed"] else "ledger inconsistent")
        _fail(f"{s['completed']} of {s['num_requests']} requests completed; {cause}; partial results in {out_dir}")
        return 1
    return 0


def save_vllm_result(args: argparse.Namespace, result: Any, summary: dict[str, Any], out_dir: Path) -> Path:
    """Write ``vllm bench serve``'s result JSON of the run (``--save-result``); its path."""
    from loadgen.report import write_json
    from loadgen.vllm_result import backend_name, result_filename, vllm_result

    date = time.strftime("%Y%m%d-%H%M%S")
    model_id = result.model or args.model or "unknown"
    label = args.label or backend_name(args.endpoint)
    data = vllm_result(result.records, summary, duration_s=result.duration_s, model_id=model_id,
                       endpoint=args.endpoint, label=args.label, num_prompts=args.num_prompts,
                       request_rate=args.request_rate, burstiness=args.burstiness,
                       max_concurrency=args.max_concurrency, percentile_metrics=parse_percentile_metrics(
                           args.percentile_metrics), percentiles=parse_percentiles(args.metric_percentiles),
                       goodput=bool(args.goodput), detailed=args.save_detailed, date=date)
    folder = args.result_dir or out_dir
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (args.result_filename or result_filename(label, args.request_rate, args.max_concurrency,
                                                             model_id, date))
    write_json(data, path)
    return path


def _compare(args: argparse.Namespace) -> int:
    from loadgen.compare import DEFAULT_LAUNCH_TARGETS, CompareTarget, LaunchOptions, parse_pairs, run_compare
    try:
        urls = parse_pairs(args.target, "--target")
        extras = parse_pairs(args.launch_target, "--launch-target")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if urls and (args.launch or extras):
        raise UsageError("give either --target NAME=URL or --launch TEMPLATE (with --launch-target), not both")
    if extras and not args.launch:
        raise UsageError("--launch-target needs --launch TEMPLATE")
    if not urls and not args.launch:
        raise UsageError("compare needs --target NAME=URL (repeat) or --launch TEMPLATE")
    if args.launch and "{port}" not in args.launch:
        raise UsageError("--launch template must contain {port} (the server's port, chosen free per target)")
    if args.launch_timeout <= 0 or args.stop_timeout <= 0:
        raise UsageError("--launch-timeout and --stop-timeout must be > 0 seconds")
    targets = ([CompareTarget(n, url=u) for n, u in urls] if urls else
               [CompareTarget(n, extra_args=a) for n, a in (extras or DEFAULT_LAUNCH_TARGETS)])
    if args.baseline not in {t.name for t in targets}:
        raise UsageError(f"--baseline {args.baseline!r} is not a target ({', '.join(t.name for t in targets)})")
    plan, described = build_plan(args)
    cfg = run_config(args, urls[0][1] if urls else "http://127.0.0.1", 1)
    opts = report_options(args, {**described, "targets": {t.name: t.url or t.extra_args for t in targets},
                                 "launch": args.launch, "baseline": args.baseline})
    out_dir = _output_dir(args)
    launch = LaunchOptions(args.launch, args.launch_host, args.launch_timeout, args.stop_timeout) if args.launch else None
    result = run_compare(plan, cfg, targets, baseline=args.baseline, out_dir=out_dir, opts=opts, launch=launch)
    print(f"results: {out_dir}")
    if result.errors or result.interrupted:
        more = f" (+{len(result.errors) - 1} more)" if len(result.errors) > 1 else ""
        _fail(f"{result.errors[0] if result.errors else 'interrupted'}{more}; partial results in {out_dir}")
        return 1
    return 0


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from loadgen.chaos import cli as chaos_cli
    from loadgen.hostile import cli as hostile_cli
    try:
        args = build_parser().parse_args(argv)
        if args.command == "chaos":
            return chaos_cli.run_chaos(args, _fail)
        if args.command == "footprint":
            return chaos_cli.run_footprint(args, _fail)
        if args.command == "hostile":
            return hostile_cli.run_hostile(args, _fail)
        return _run(args) if args.command == "run" else _compare(args)
    except (UsageError, WorkloadError, chaos_cli.UsageError, hostile_cli.UsageError) as exc:
        _fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return 2
    except KeyboardInterrupt:
        _fail("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
