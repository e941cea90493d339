"""``cosine-loadgen chaos`` and ``cosine-loadgen footprint``: flags, and the run end to end.

Exit codes (as ``run``): 0 the verdict passed (no request lost, duplicated or hung, every text
as expected, no 5xx but 503, no more failures outside faults than ``--max-failed-fraction``,
every fault recovered, the server idle after, every judged memory slope under the bound); 1 it
did not, or the server did not come up (results written as far as they go); 2 bad flags (one
line, nothing started).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadgen.chaos.cluster import ClusterError, NodeSpec
from loadgen.chaos.deploy import Deployment, DeploymentError, DeploymentOptions
from loadgen.chaos.faults import Injector, parse_kinds
from loadgen.chaos.memory import footprint
from loadgen.chaos.references import NoReferenceModel, hf_references, resolve_reference_model
from loadgen.chaos.run import ChaosConfig, ChaosRun
from loadgen.chaos.shapes import build_shapes, parse_features
from loadgen.chaos.traffic import Mix
from loadgen.launcher import LaunchError
from loadgen.workload import DEFAULT_DATASET_DIR, SPLITS, load_rows

DEFAULT_LAUNCH = "cosine-ray serve --port {port} --drafters-in-engine ngram --no-stages-in-engine"


def add_parsers(sub: Any) -> None:
    ch = sub.add_parser("chaos", help="random kills under load: every request accounted for, memory flat")
    target = ch.add_argument_group("server")
    target.add_argument("--url", default=None, help="join a running server on this machine (its Ray session)")
    target.add_argument("--launch", default=None, metavar="TEMPLATE",
                        help=f"server command with {{port}} (and {{address}} with --head-node); "
                             f"default: {DEFAULT_LAUNCH!r}")
    target.add_argument("--launch-host", default="127.0.0.1")
    target.add_argument("--launch-timeout", type=float, default=900.0)
    target.add_argument("--stop-timeout", type=float, default=90.0)
    target.add_argument("--head-node", default=None, metavar="SPEC",
                        help="start a Ray head node here first (ray start), e.g. CPU=2,datacenter_gpu=2; "
                             "the server joins it")
    target.add_argument("--worker-node", action="append", default=None, metavar="SPEC",
                        help="a worker node on this machine (repeat), e.g. CPU=2,consumer_gpu=8: "
                             "the node kind kills one")
    f = ch.add_argument_group("faults")
    f.add_argument("--duration", type=float, default=1800.0, help="seconds of load after the warm-up pass")
    f.add_argument("--clients", type=int, default=16)
    f.add_argument("--kill-every", type=float, default=30.0, help="seconds between faults")
    f.add_argument("--kinds", default="all", help="comma list of stage,drafter,engine,proxy,worker,pause,node (or all)")
    f.add_argument("--order", choices=("random", "cycle"), default="random",
                   help="random: each fault's kind at random; cycle: every kind in turn (seeded order)")
    f.add_argument("--max-kills", type=int, default=1000)
    f.add_argument("--pause-seconds", type=float, default=10.0, help="SIGSTOP..SIGCONT length of a pause fault")
    f.add_argument("--recovery-timeout", type=float, default=300.0)
    f.add_argument("--max-failed-fraction", type=float, default=0.0,
                   help="of the load requests no fault overlapped, the fraction that may fail (default 0)")
    w = ch.add_argument_group("requests")
    w.add_argument("--dataset-dir", type=Path, default=DEFAULT_DATASET_DIR)
    w.add_argument("--split", choices=SPLITS, default="second-half")
    w.add_argument("--num-shapes", type=int, default=32, help="distinct requests (prompt x endpoint x seed)")
    w.add_argument("--max-tokens", type=int, default=32)
    w.add_argument("--seeded-fraction", type=float, default=0.3, help="shapes sampled with a fixed seed")
    w.add_argument("--completions-fraction", type=float, default=0.25, help="shapes sent to /v1/completions")
    w.add_argument("--features", default="all",
                   help="API features the shapes use in turn: plain,n,stop,logprobs,json,tools (or all)")
    w.add_argument("--reference-model", default="auto", metavar="DIR|auto|none",
                   help="Hugging Face directory whose fp32 greedy decoding gives the greedy references "
                        "(auto: the served model in cosine_ray's cache; none: the server's own warm-up answers)")
    w.add_argument("--stream-fraction", type=float, default=0.5)
    w.add_argument("--disconnect-fraction", type=float, default=0.1, help="callers that leave early")
    w.add_argument("--request-timeout", type=float, default=180.0, help="per request; past it the request is hung")
    w.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    w.add_argument("--model", default=None)
    m = ch.add_argument_group("memory and output")
    m.add_argument("--memory-interval", type=float, default=10.0)
    m.add_argument("--memory-warmup", type=float, default=300.0,
                   help="seconds of load (and of a process's age) before slopes are fitted")
    m.add_argument("--memory-min-span", type=float, default=300.0, help="post-warm-up seconds to judge a process")
    m.add_argument("--slope-bound", type=float, default=0.5, help="MiB/min of RSS a judged process may grow")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--output-dir", type=Path, default=None)
    m.add_argument("--no-plots", action="store_true")
    fp = sub.add_parser("footprint", help="resident memory of every process of a server on this machine")
    fp.add_argument("--url", required=True)
    fp.add_argument("--output", type=Path, default=None, help="also write the table as JSON here")


def _fractions(args: argparse.Namespace) -> None:
    for name in ("seeded_fraction", "completions_fraction", "stream_fraction", "disconnect_fraction"):
        value = getattr(args, name)
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1], got {value}")


def chaos_config(args: argparse.Namespace) -> tuple[ChaosConfig, DeploymentOptions, tuple[str, ...]]:
    """ValueError (→ exit 2) on any bad flag."""
    _fractions(args)
    if args.url and (args.launch or args.head_node or args.worker_node):
        raise ValueError("give --url (join) or --launch/--head-node (start one), not both")
    if args.worker_node and not args.head_node:
        raise ValueError("--worker-node needs --head-node (the nodes of a cluster made here)")
    if args.num_shapes < 1 or args.max_tokens < 1:
        raise ValueError("--num-shapes and --max-tokens must be >= 1")
    kinds = parse_kinds(args.kinds)
    if "node" in kinds and not args.worker_node:
        if args.kinds.strip() != "all":
            raise ValueError("the node kind needs a worker node: add --head-node SPEC --worker-node SPEC")
        kinds = tuple(k for k in kinds if k != "node")
    launch = None if args.url else (args.launch or DEFAULT_LAUNCH)
    if launch and "{port}" not in launch:
        raise ValueError("--launch template must contain {port}")
    args.features = parse_features(args.features) if isinstance(args.features, str) else args.features
    if args.reference_model not in ("auto", "none"):
        resolve_reference_model(args.reference_model, None)
    cfg = ChaosConfig(duration_s=args.duration, clients=args.clients, kill_every_s=args.kill_every, kinds=kinds,
                      order=args.order, max_kills=args.max_kills, pause_s=args.pause_seconds,
                      recovery_timeout_s=args.recovery_timeout, request_timeout_s=args.request_timeout,
                      mix=Mix(args.stream_fraction, args.disconnect_fraction), memory_interval_s=args.memory_interval,
                      memory_warmup_s=args.memory_warmup, memory_min_span_s=args.memory_min_span, seed=args.seed,
                      api_key=args.api_key, model=args.model, max_failed_fraction=args.max_failed_fraction)
    head = NodeSpec.parse(args.head_node) if args.head_node else None
    workers = tuple(NodeSpec.parse(w) for w in args.worker_node or ())
    out_dir = args.output_dir or Path("loadgen-results") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    args.output_dir = out_dir
    opts = DeploymentOptions(url=args.url, launch=launch, host=args.launch_host, launch_timeout_s=args.launch_timeout,
                             stop_timeout_s=args.stop_timeout, head=head, workers=workers, log_dir=out_dir)
    return cfg, opts, kinds


def run_chaos(args: argparse.Namespace, fail: Any) -> int:
    from loadgen.chaos import audit, report

    try:
        cfg, opts, _ = chaos_config(args)
        rows = load_rows(args.dataset_dir, args.split)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    rng = np.random.default_rng(np.random.SeedSequence(args.seed).spawn(2)[1])
    shapes = build_shapes(rows, args.num_shapes, rng, max_tokens=args.max_tokens, seeded_fraction=args.seeded_fraction,
                          completions_fraction=args.completions_fraction, features=args.features)
    out_dir: Path = args.output_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log = _logger(out_dir / "chaos.log")
    injector = None
    try:
        with Deployment(opts, log=log) as dep:
            before = footprint(dep.processes())
            report.footprint_table(before, f"Deployment at idle before the load ({dep.url})")
            references = independent_references(args, dep.url, shapes, log)
            injector = Injector(dep.processes, np.random.default_rng(np.random.SeedSequence(args.seed).spawn(3)[2]),
                                cluster=dep.cluster, pause_s=cfg.pause_s, log=log)
            run = ChaosRun(cfg, dep.url, shapes, find=dep.processes, injector=injector, log=log, references=references)
            try:
                result = asyncio.run(run.main())
            finally:
                injector.resume_all()
    except (DeploymentError, LaunchError, ClusterError, NoReferenceModel) as exc:
        fail(str(exc).splitlines()[0])
        return 1
    verdict = audit.audit(result.calls, result.ledger, result.references, result.faults, result.server,
                          shapes=shapes, max_failed_fraction=cfg.max_failed_fraction)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "api_key"}
    data = report.write(result, verdict, out_dir, footprint=before, slope_bound=args.slope_bound, config=config,
                        plots=not args.no_plots)
    report.print_report(data)
    print(f"results: {out_dir}")
    if not data["verdict"]["ok"]:
        fail(f"chaos verdict FAIL (see {out_dir / 'chaos.json'}: verdict, audit.problems)")
        return 1
    return 0


def independent_references(args: argparse.Namespace, url: str, shapes: list, log: Any) -> dict[str, list[str]]:
    """The greedy references of ``--reference-model`` (none: {}); auto asks the server its model."""
    served = args.model
    if args.reference_model == "auto" and served is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            served = str(httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise NoReferenceModel(f"--reference-model auto: GET /v1/models failed ({type(exc).__name__}); "
                                   f"pass --model or --reference-model DIR") from None
    model_dir = resolve_reference_model(args.reference_model, served)
    if model_dir is None:
        log("[chaos] --reference-model none: greedy answers are checked against the server's own warm-up")
        return {}
    return hf_references(model_dir, shapes, log)[0]


def run_footprint(args: argparse.Namespace, fail: Any) -> int:
    from loadgen.chaos import report
    try:
        with Deployment(DeploymentOptions(url=args.url)) as dep:
            fp = footprint(dep.processes())
    except DeploymentError as exc:
        fail(str(exc))
        return 1
    report.footprint_table(fp, f"Processes of the server at {args.url}")
    if args.output:
        args.output.write_text(json.dumps(fp, indent=2) + "\n", encoding="utf-8")
    return 0


def _logger(path: Path):
    handle = open(path, "a", encoding="utf-8")

    def log(message: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {message}"
        print(line, flush=True)
        handle.write(line + "\n")
        handle.flush()

    return log


class UsageError(ValueError):
    """Bad flags (exit 2)."""
