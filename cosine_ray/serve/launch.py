"""``cosine-ray serve``: start (or join) Ray, deploy the app, print the URL, run until Ctrl-C."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

DEFAULT_NUM_STAGES = 2


def serve_args(args: argparse.Namespace, error: type[Exception]) -> dict[str, Any]:
    """Engine config data from --config plus the flags that override it."""
    from cosine_ray.engine.config import config_from_dict, config_to_dict, load_config_file
    try:
        data = config_to_dict(load_config_file(args.config)) if args.config else {"num_stages": DEFAULT_NUM_STAGES}
        for key, flag in (("model", args.model), ("drafters", args.drafters), ("num_stages", args.stages)):
            if flag is not None:
                data[key] = flag
        from cosine_ray.cli import cosine_router_overrides
        router = {**(data.get("router") or {}), **cosine_router_overrides(args)}
        if args.max_batch_size is not None:
            router["max_batch_size"] = args.max_batch_size
        if "num_lanes" not in router or router["num_lanes"] == 1:
            router["num_lanes"] = max(1, int(data.get("num_stages", DEFAULT_NUM_STAGES)))
        data["router"] = router
        cluster = dict(data.get("cluster") or {})
        if args.address:
            cluster["address"] = args.address
        if getattr(args, "drafters_in_router", None) is not None:
            cluster["drafters_in_router"] = args.drafters_in_router
        data["cluster"] = cluster
        config = config_from_dict(data)
        from cosine_ray.models.loader import resolve_checkpoint
        resolve_checkpoint(config.model)  # fail fast with a clear message (and fetch it once)
    except ValueError as exc:
        raise error(str(exc).splitlines()[0]) from None
    if not 0 < args.port < 65536:
        raise error(f"--port must be in 1..65535, got {args.port}")
    pending, timeout = getattr(args, "max_pending_requests", None), getattr(args, "request_timeout_s", None)
    if pending is not None and pending < 1:
        raise error(f"--max-pending-requests must be >= 1, got {pending}")
    if timeout is not None and not timeout > 0:
        raise error(f"--request-timeout-s must be > 0, got {timeout}")
    return config_to_dict(config)


def local_cluster_cpus(data: dict[str, Any]) -> int:
    """Logical CPUs for a locally started cluster: every stage and drafter actor reserves
    ``num_cpus_per_actor`` and Serve's controller, proxy and replica need room too, so the
    default set of 2 stages + 5 drafters does not fit a 2-core machine's 2 logical CPUs (the
    actors would wait forever). Actors run 1 torch thread each, so over-subscribing logical
    CPUs is what we want; at least the machine's cores."""
    import math

    from cosine_ray.engine.config import parse_drafters

    per_actor = float((data.get("cluster") or {}).get("num_cpus_per_actor", 0.5))
    num_actors = int(data.get("num_stages", DEFAULT_NUM_STAGES)) + len(parse_drafters(str(data.get("drafters") or "none")))
    needed = math.ceil(num_actors * per_actor) + 2
    return max(needed, os.cpu_count() or 2)


def run_serve(args: argparse.Namespace, error: type[Exception]) -> int:
    data = serve_args(args, error)
    import ray
    from ray import serve

    from cosine_ray.runtime.cluster import connect
    from cosine_ray.runtime.router_actor import kill_router
    from cosine_ray.serve.app import build_app

    connect(data["cluster"].get("address"), num_cpus=args.num_cpus or local_cluster_cpus(data))
    serve.start(http_options={"host": args.host, "port": args.port})
    kill_router()  # this launch gets a fresh router; replicas Serve (re)starts later attach to it
    app_args = dict(data)
    # The env var is read here, in the CLI process: Serve replicas are Ray workers started by the
    # raylet and do not inherit this process's environment (a key set only here was ignored).
    api_key = args.api_key or os.environ.get("COSINE_RAY_API_KEY")
    if api_key:
        app_args["api_key"] = api_key
    if getattr(args, "return_spec_stats", False):
        app_args["return_spec_stats"] = True
    if getattr(args, "metrics_require_key", False):
        app_args["metrics_require_key"] = True
    if getattr(args, "max_pending_requests", None) is not None:
        app_args["max_pending_requests"] = args.max_pending_requests
    if getattr(args, "request_timeout_s", None) is not None:
        app_args["request_timeout_s"] = args.request_timeout_s
    print(f"cosine_ray: starting {data['num_stages']} stage(s) and drafters "
          f"[{data['drafters']}] for {data['model']} (first start loads the model)...", flush=True)
    serve.run(build_app(app_args), name="cosine_ray", route_prefix="/", blocking=False)
    url = f"http://{args.host}:{args.port}"
    print(f"cosine_ray: serving OpenAI API at {url}/v1 (health: {url}/health, "
          f"Prometheus: {url}/metrics). Ctrl-C stops.", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("cosine_ray: shutting down", file=sys.stderr, flush=True)
    try:
        serve.delete("cosine_ray")
        kill_router()
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
