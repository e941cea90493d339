"""``cosine-ray serve``: start (or join) Ray, deploy the Serve application, print the URL, run
until Ctrl-C (which deletes the application: the engine takes its stages and drafters along).

``--config FILE`` takes either an engine config (the keys of ``engine/config.py``, e.g.
``deploy/engine.yaml``, plus the ingress args such as ``api_key``: the ``args`` of the
application builder ``cosine_ray.serve.app:build_app``) or a Ray Serve config (top-level ``applications:``, e.g.
``deploy/serve_config.yaml``): then the one application whose ``import_path`` is
``cosine_ray.serve.app:build_app`` gives the engine config and the ingress args (``api_key``,
...), its ``name`` and ``route_prefix``, and the file's ``http_options`` / ``proxy_location``
give the HTTP settings. Flags override the file; any other Serve setting is reported as
ignored (``serve run FILE`` applies them). Args in Ray Serve LLM's shape (``llm_configs``:
several models, ``cli.serve_llm``) are served as they are. Every user error is one line and exit
status 2.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from cosine_ray.cli import vllm_flags
from cosine_ray.cli.args import (DRAFTERS_HELP, MODEL_HELP, SPEC_TOKENS_HELP, STAGES_HELP, CliError, add_batching_args,
                                 add_cosine_args, add_device_args, add_model_source_args, batching_overrides,
                                 check_local_device, cosine_overrides, model_source_settings, runner_from_args)
from cosine_ray.cli.serve_llm import LLM_APP_IMPORT_PATHS

DEFAULT_NUM_STAGES = 2
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
APP_IMPORT_PATHS = ("cosine_ray.serve.app:build_app", "cosine_ray.serve.app.build_app", *LLM_APP_IMPORT_PATHS)
"""How a Serve config names our application builders (Serve accepts both spellings)."""
APP_NAME = "cosine_ray"
SERVE_KEYS_APPLIED = ("applications", "http_options", "proxy_location")
APP_KEYS_APPLIED = ("name", "route_prefix", "import_path", "args")


def add_parser(sub) -> None:
    srv = sub.add_parser("serve", help="start the Ray cluster + OpenAI-compatible HTTP server")
    srv.add_argument("--config", default=None,
                     help="YAML engine config (the keys of cosine_ray/engine/config.py, e.g. deploy/engine.yaml), "
                          "or a Ray Serve config file such as deploy/serve_config.yaml (its cosine_ray app's args "
                          "and http_options); flags override the file")
    srv.add_argument("--host", default=None, help=f"HTTP host (default {DEFAULT_HOST}, or the Serve config's)")
    srv.add_argument("--port", type=int, default=None, help=f"HTTP port (default {DEFAULT_PORT}, or the Serve config's)")
    srv.add_argument("--address", default=None,
                     help="join this Ray cluster instead of starting one (without it a new local cluster is "
                          "started, whatever RAY_ADDRESS or a previous `ray start` recorded)")
    srv.add_argument("--model", default=None, help=MODEL_HELP + " (default smollm2-135m)")
    add_model_source_args(srv)
    srv.add_argument("--drafters", default=None, help=DRAFTERS_HELP + " (default: default)")
    srv.add_argument("--stages", "--pipeline-parallel-size", "-pp", dest="stages", type=int, default=None,
                     help=STAGES_HELP + f" (default {DEFAULT_NUM_STAGES})")
    add_device_args(srv, defaults=False)
    add_batching_args(srv)
    srv.add_argument("--num-speculative-tokens", type=int, default=None, help=SPEC_TOKENS_HELP + " (default 8)")
    srv.add_argument("--drafters-in-engine", dest="drafters_in_engine", default=None,
                     metavar="KINDS",
                     help="drafter kinds run inside the engine process (default: ngram,retrieval,suffix, "
                          "table lookups); none = every drafter in an actor of its own")
    srv.add_argument("--stages-in-engine", action=argparse.BooleanOptionalAction, default=None,
                     help="run the target's stages inside the engine replica instead of one actor each "
                          "(default: in the engine on a local CPU cluster, where it starts sooner with less "
                          "memory; one actor per stage when joining a cluster with --address or on CUDA)")
    srv.add_argument("--engine-replicas", dest="engine_replicas", default=None, metavar="N|auto|MIN,MAX",
                     help="engine replicas, each a whole pipeline (default 1); auto or MIN,MAX: Serve "
                          "autoscaling on queued requests (docs/scaling.md)")
    add_cosine_args(srv)
    srv.add_argument("--api-key", default=None, help="require this key (or env COSINE_RAY_API_KEY)")
    srv.add_argument("--allow-unauthenticated", action="store_true",
                     help="serve without an API key on a host other than localhost (refused by default)")
    srv.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="require one of the keys in this file (or env COSINE_RAY_API_KEY_FILE): one a line, "
                          "`KEY [name=NAME] [max_concurrent=N] [max_tokens_in_flight=N]`, # comments (docs/api.md)")
    srv.add_argument("--return-spec-stats", action="store_true",
                     help="add the `cosine_ray` speculation-stats block to every completion")
    srv.add_argument("--metrics-require-key", action="store_true",
                     help="GET /metrics needs the API key too (default: public, like /health)")
    srv.add_argument("--num-cpus", type=int, default=None, help="CPUs of a locally started Ray cluster")
    srv.add_argument("--max-pending-requests", type=int, default=None,
                     help="generations one replica holds at once; one more gets 503 + Retry-After (default 256)")
    srv.add_argument("--request-timeout-s", type=float, default=None,
                     help="a generation running longer is cancelled and answered 408 (default 600)")
    vllm_flags.add_vllm_args(srv)


# ---- the config file ------------------------------------------------------------------------

@dataclass
class ConfigFile:
    """What ``--config`` contributed: engine config data as written (not yet validated), the
    ingress args, and (Serve configs) the HTTP settings and application identity."""

    engine: dict[str, Any] = field(default_factory=dict)
    ingress: dict[str, Any] = field(default_factory=dict)
    http_options: dict[str, Any] = field(default_factory=dict)
    proxy_location: str | None = None
    app_name: str = APP_NAME
    route_prefix: str = "/"
    ignored: list[str] = field(default_factory=list)
    """Serve settings of the file that ``cosine-ray serve`` does not apply."""
    serve_config: bool = False
    """A Ray Serve config (``applications:``): what ``serve run`` of it runs, so the CLI adds no
    default of its own for the stages (``local_cpu``)."""
    llm_builder: dict[str, Any] | None = None
    """Args in Ray Serve LLM's shape: their ``llm_configs`` (and ingress deployment settings);
    ``ingress`` holds the rest (``cli.serve_llm``)."""


def read_config_file(path: str) -> ConfigFile:
    """An engine config or a Ray Serve config (``applications:``), as ``ConfigFile``."""
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise CliError(f"cannot read --config {path}: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CliError(f"--config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return ConfigFile()
    if not isinstance(data, dict):
        raise CliError(f"--config {path} must be a mapping of settings")
    if "applications" not in data:  # the args of build_app: engine config + ingress args
        return _app_args_file(data)
    return _read_serve_config(path, data)


def _app_args_file(args: dict[str, Any], **serve: Any) -> ConfigFile:
    """The ``ConfigFile`` of an application builder's ``args``: engine config + ingress args, or
    Ray Serve LLM's ``llm_configs`` + ingress args."""
    if "llm_configs" in args:
        from cosine_ray.cli.serve_llm import split_llm_args
        builder, ingress = split_llm_args(args)
        return ConfigFile(ingress=ingress, llm_builder=builder, **serve)
    engine, ingress = _split_app_args(args)
    return ConfigFile(engine=engine, ingress=ingress, **serve)


def _split_app_args(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine config data, ingress args) of the application builder's ``args``."""
    from cosine_ray.serve.app import INGRESS_ARGS
    ingress = {*INGRESS_ARGS, "served_model_names"}
    return ({k: v for k, v in args.items() if k not in ingress}, {k: v for k, v in args.items() if k in ingress})


def _read_serve_config(path: str, data: dict[str, Any]) -> ConfigFile:
    apps = data["applications"]
    if not isinstance(apps, list) or not all(isinstance(a, dict) for a in apps):
        raise CliError(f"--config {path}: `applications` must be a list of applications")
    ours = [a for a in apps if a.get("import_path") in APP_IMPORT_PATHS]
    if not ours:
        found = ", ".join(repr(a.get("import_path")) for a in apps) or "none"
        raise CliError(f"--config {path}: no application has import_path {APP_IMPORT_PATHS[0]} "
                       f"(found {found})")
    if len(ours) > 1:
        names = ", ".join(repr(a.get("name", "?")) for a in ours)
        raise CliError(f"--config {path}: {len(ours)} applications ({names}) have import_path "
                       f"{APP_IMPORT_PATHS[0]}; cosine-ray serve runs one, keep one in the file")
    (app,) = ours
    args = app.get("args") or {}
    http = data.get("http_options") or {}
    if not isinstance(args, dict) or not isinstance(http, dict):
        raise CliError(f"--config {path}: the application's `args` and `http_options` must be mappings")
    ignored = [k for k in data if k not in SERVE_KEYS_APPLIED]
    ignored += [f"applications[{app.get('name', APP_NAME)}].{k}" for k in app if k not in APP_KEYS_APPLIED]
    ignored += [f"{a.get('name', '?')} (another application)" for a in apps if a is not app]
    if app.get("import_path") in LLM_APP_IMPORT_PATHS and "llm_configs" not in args:
        raise CliError(f"--config {path}: the application {app['import_path']} needs llm_configs in its args")
    return _app_args_file(args, http_options=dict(http), proxy_location=data.get("proxy_location"),
                          app_name=str(app.get("name", APP_NAME)), route_prefix=str(app.get("route_prefix", "/")),
                          ignored=ignored, serve_config=True)


# ---- what to run ----------------------------------------------------------------------------

@dataclass
class ServePlan:
    engine: dict[str, Any]
    """The validated engine config as plain data (``config_to_dict``)."""
    app_args: dict[str, Any]
    """What ``build_app`` gets: ``engine`` plus the ingress args."""
    host: str
    port: int
    http_options: dict[str, Any]
    """For ``serve.start`` (the file's, with ``host`` and ``port`` resolved)."""
    proxy_location: str | None
    app_name: str
    route_prefix: str
    ignored: list[str]
    console: vllm_flags.Console = field(default_factory=vllm_flags.Console)
    """How much the cluster prints, and whether it runs Ray's dashboard."""
    models: list[Any] | None = None
    """Ray Serve LLM's models (``serve.llm_configs.EngineDeployment``); ``engine`` is the first's."""


def _engine_data(args: argparse.Namespace, file: ConfigFile | None) -> dict[str, Any]:
    """Engine config data from the file (or serve's defaults) plus the flags that override it."""
    from cosine_ray.engine.config import config_from_dict, config_to_dict

    data = dict(file.engine) if file is not None else {"num_stages": DEFAULT_NUM_STAGES}
    vllm_data, vllm_settings = vllm_flags.engine_settings(args)
    data.update(model_source_settings(args), **vllm_data)
    for key, flag in (("model", vllm_flags.model_flag(args)), ("drafters", args.drafters), ("num_stages", args.stages),
                      ("device", getattr(args, "device", None)), ("dtype", getattr(args, "dtype", None)),
                      ("weights", getattr(args, "weights", None)),
                      ("kv_cache_memory", getattr(args, "kv_cache_memory", None))):
        if flag is not None:
            data[key] = flag
    config = config_from_dict(data)
    settings = {**batching_overrides(args), **cosine_overrides(args), **vllm_settings}
    if args.address:
        settings["address"] = args.address
    if getattr(args, "drafters_in_engine", None) is not None:
        settings["drafters_in_engine"] = args.drafters_in_engine
    if getattr(args, "engine_replicas", None) is not None:
        settings["engine_replicas"] = args.engine_replicas
    if getattr(args, "stages_in_engine", None) is not None:
        settings["stages_in_engine"] = args.stages_in_engine
    elif "stages_in_engine" not in (data.get("cluster") or {}) and not (file is not None and file.serve_config):
        settings["stages_in_engine"] = local_cpu(config, args.address)
    runner = runner_from_args(args)
    if runner:
        settings["runner"] = runner
    return config_to_dict(config.replace(**settings))


def local_cpu(config, address: str | None) -> bool:
    """Where neither a flag nor the file says (a Ray Serve config file keeps what ``serve run``
    of it runs: one actor per stage), ``cosine-ray serve`` runs the stages in the engine
    when it starts a local cluster on CPU: one machine, where a stage actor is a process that
    imports torch (a slower start, more memory) and a Ray call every step, and spreads nothing
    (docs/performance-cpu.md). Joining a cluster, on CUDA (a device per stage), or with
    ``cluster.use_resources`` (stages placed on the nodes that offer ``datacenter_gpu``), one
    actor each."""
    return not (address or config.cluster.address or config.cluster.use_resources) and str(config.device) == "cpu"


def _ingress_args(args: argparse.Namespace, file: ConfigFile | None) -> dict[str, Any]:
    """The file's ingress args, overridden by flags (and ``COSINE_RAY_API_KEY`` over the file's
    key). The env var is read here, in the CLI process: Serve replicas are Ray workers started
    by the raylet and do not inherit this process's environment."""
    out = dict(file.ingress) if file is not None else {}
    out = vllm_flags.check_ingress_settings({**out, **vllm_flags.ingress_settings(args)})
    api_key = args.api_key or os.environ.get("COSINE_RAY_API_KEY")
    if api_key:
        out["api_key"] = api_key
    key_file = getattr(args, "api_key_file", None) or os.environ.get("COSINE_RAY_API_KEY_FILE") \
        or out.pop("api_key_file", None)
    out.pop("api_key_file", None)
    if key_file:  # read here: the replicas get its keys, not its path (they may run on another node)
        from cosine_ray.serve.guards.tenants import as_key_entries, read_key_file
        try:
            out["api_keys"] = as_key_entries(read_key_file(key_file))
        except ValueError as exc:
            raise CliError(str(exc)) from None
    if "api_keys" in out:
        from cosine_ray.serve.guards.tenants import key_ring
        try:
            key_ring(out.get("api_key"), out["api_keys"])
        except ValueError as exc:
            raise CliError(f"api_keys: {exc}") from None
    if getattr(args, "return_spec_stats", False):
        out["return_spec_stats"] = True
    if getattr(args, "metrics_require_key", False):
        out["metrics_require_key"] = True
    if getattr(args, "allow_unauthenticated", False):
        out["allow_unauthenticated"] = True
    for name in ("max_pending_requests", "request_timeout_s"):
        if getattr(args, name, None) is not None:
            out[name] = getattr(args, name)
    for name, value in out.items():
        kind, ok = INGRESS_ARG_CHECKS.get(name, ("", lambda v: True))
        if not ok(value):
            flag = f"--{name.replace('_', '-')}" if name in ("max_pending_requests", "request_timeout_s") else name
            raise CliError(f"{flag} must be {kind}, got {value!r}")
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


INGRESS_ARG_CHECKS = {
    "api_key": ("a non-empty string", lambda v: isinstance(v, str) and bool(v)),
    "api_keys": ("a list of {key, name, max_concurrent, max_tokens_in_flight}", lambda v: isinstance(v, list)),
    "body_timeout_s": ("> 0", lambda v: (_is_int(v) or isinstance(v, float)) and v > 0),
    "max_body_bytes": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "max_ongoing_requests": ("an integer >= 1", lambda v: _is_int(v) and v >= 1),
    "max_queued_requests": ("an integer (-1 = no limit)", lambda v: _is_int(v) and v >= -1),
    "return_spec_stats": ("true or false", lambda v: isinstance(v, bool)),
    "metrics_require_key": ("true or false", lambda v: isinstance(v, bool)),
    "allow_unauthenticated": ("true or false", lambda v: isinstance(v, bool)),
    "max_pending_requests": (">= 1", lambda v: _is_int(v) and v >= 1),
    "request_timeout_s": ("> 0", lambda v: (_is_int(v) or isinstance(v, float)) and v > 0),
}
"""The ingress args (``serve.app.INGRESS_ARGS``) checked before anything starts: a bad value
would otherwise fail in the replica, which Serve restarts forever."""


def serve_plan(args: argparse.Namespace) -> ServePlan:
    """Everything ``run`` needs, validated; CliError (one line, exit 2) on any user error."""
    file = read_config_file(args.config) if args.config else None
    where = f"--config {args.config}: " if args.config else ""
    if args.num_cpus is not None and args.num_cpus < 1:
        raise CliError(f"--num-cpus must be >= 1, got {args.num_cpus}")
    if file is not None and file.llm_builder is not None:
        return _llm_plan(args, file)
    try:
        engine = _engine_data(args, file)
    except (ValueError, OSError) as exc:
        raise CliError(where + str(exc).splitlines()[0]) from None
    from cosine_ray.cli.serve_start import fetch_model
    fetch_model(engine, where)  # fail fast with a clear message (and fetch and convert it once)
    if not engine["cluster"].get("address"):
        check_local_device(engine["device"])  # a local cluster runs on this machine's devices
    if getattr(args, "dashboard", False) and engine["cluster"].get("address"):
        raise CliError("--dashboard starts Ray's dashboard with a local cluster; a joined cluster has its own")
    host, port, http = _http_settings(args, file)
    ingress = _ingress_args(args, file)
    return ServePlan(engine=engine, app_args={**engine, **ingress}, host=host, port=port, http_options=http,
                     proxy_location=file.proxy_location if file else None,
                     app_name=file.app_name if file else APP_NAME, route_prefix=file.route_prefix if file else "/",
                     ignored=list(file.ignored) if file else [], console=vllm_flags.Console.of(args))


def _llm_plan(args: argparse.Namespace, file: ConfigFile) -> ServePlan:
    """The plan of Ray Serve LLM-shaped args: the file's models as they are, the flags'
    ingress and HTTP settings (``cli.serve_llm``)."""
    from cosine_ray.cli.serve_llm import check_no_engine_flags, first_engine, llm_models

    check_no_engine_flags(args, _engine_data, ConfigFile(serve_config=True))
    host, port, http = _http_settings(args, file)
    ingress = _ingress_args(args, file)
    models = llm_models(args.config, file.llm_builder, ingress, args.address)
    engine = first_engine(models, args.address)
    return ServePlan(engine=engine, app_args={**file.llm_builder, **ingress}, host=host, port=port,
                     http_options=http, proxy_location=file.proxy_location, app_name=file.app_name,
                     route_prefix=file.route_prefix, ignored=list(file.ignored), models=models,
                     console=vllm_flags.Console.of(args))


def _http_settings(args: argparse.Namespace, file: ConfigFile | None) -> tuple[str, int, dict[str, Any]]:
    """(host, port, Serve's http_options) from the flags over the file's."""
    http = dict(file.http_options) if file is not None else {}
    host = args.host if args.host is not None else str(http.get("host", DEFAULT_HOST))
    port = args.port if args.port is not None else http.get("port", DEFAULT_PORT)
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise CliError(f"--port must be in 1..65535, got {port}")
    http.update(host=host, port=port)
    return host, port, http


LOOPBACK_HOSTS = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """Whether ``host`` binds this machine only (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() in LOOPBACK_HOSTS


def check_exposure(host: str, app_args: dict[str, Any]) -> dict[str, Any]:
    """Closed by default: serving beyond this machine needs an API key, or an explicit
    ``--allow-unauthenticated`` (``allow_unauthenticated: true`` in the file). CliError
    otherwise. Returns ``app_args`` as ``build_app`` must get them: the builder refuses to run
    without a key unless told the server may be open, and it cannot see the host (a Serve
    config's ``http_options`` are not its args), so a keyless server on localhost says so."""
    if app_args.get("api_key") or app_args.get("api_keys") or app_args.get("allow_unauthenticated"):
        return app_args
    if not is_loopback(host):
        raise CliError(f"--host {host} serves beyond this machine and no API key is set: give --api-key KEY "
                       f"(or COSINE_RAY_API_KEY), or --allow-unauthenticated to serve it open")
    return {**app_args, "allow_unauthenticated": True}


def local_cluster_cpus(*engines: dict[str, Any]) -> int:
    """Logical CPUs for a locally started cluster of these engines (one, or Ray Serve LLM's
    models): every stage and drafter actor reserves ``num_cpus_per_actor`` and Serve's
    controller, proxy and replica need room too, so the default set of 2 stages + 5 drafters
    does not fit a 2-core machine's 2 logical CPUs (the actors would wait forever). Actors run 1
    torch thread each, so over-subscribing logical CPUs is what we want; at least the machine's
    cores."""
    import math

    from cosine_ray.engine.config import parse_drafters

    needed = 2
    for data in engines:
        per_actor = float((data.get("cluster") or {}).get("num_cpus_per_actor", 0.5))
        num_actors = int(data.get("num_stages", DEFAULT_NUM_STAGES)) + len(
            parse_drafters(str(data.get("drafters") or "none")))
        needed += math.ceil(num_actors * per_actor)
    return max(needed, os.cpu_count() or 2)


def check_port_free(host: str, port: int) -> None:
    """CliError when this machine cannot listen on host:port (in use, or not our address):
    checked before a local cluster starts, as Serve's proxy would fail only in its logs."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise CliError(f"--host {host}: {exc.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CliError(f"port {port} on {host} is in use; pick another with --port") from None
            raise CliError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def check_address_reachable(address: str, timeout_s: float = 5.0) -> None:
    """CliError when ``--address`` names a HOST:PORT (or ray://HOST:PORT) nobody answers on:
    ray.init would retry such an address for minutes. ``auto`` is left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise CliError(f"cannot reach the Ray cluster at {address} ({reason}); start it with "
                       f"`ray start --head`, or leave out --address for a local cluster") from None


def check_cluster_gpus(engine: dict[str, Any], resources: dict[str, float]) -> None:
    """CliError when the engine runs on CUDA and the joined cluster has no GPU at all: every
    stage actor asks Ray for one, and would wait for it forever."""
    if str(engine.get("device", "cpu")).startswith("cuda") and resources.get("GPU", 0) < 1:
        raise CliError(f"device {engine['device']!r}: the Ray cluster at {engine['cluster']['address']} "
                       f"has no GPU (its resources: {', '.join(sorted(resources)) or 'none'}); "
                       f"use --device cpu or add GPU nodes")


def start_cluster_and_deploy(args: argparse.Namespace, plan: ServePlan, deployer,
                             on_connected: Callable[[], None] = lambda: None) -> ServePlan:
    """Connect to (or start) the cluster, check placement, start Serve and deploy the
    application through ``deployer``; CliError on any user-facing failure. ``on_connected``
    runs right after ``ray.init`` (which replaces the process's SIGTERM handler)."""
    import ray
    from ray import serve

    from cosine_ray.cli.serve_start import ServeStart, deploy_in_child, place_actors, serve_start_error
    from cosine_ray.runtime.cluster import connect

    logging.getLogger("ray.serve").setLevel(plan.console.system_level)  # Serve's lines in this process

    address = plan.engine["cluster"].get("address")
    if address:
        check_address_reachable(address)
    else:
        check_port_free(plan.host, plan.port)
    try:
        engines = [m.config_data for m in plan.models] if plan.models else [plan.engine]
        connect(address, num_cpus=args.num_cpus or local_cluster_cpus(*engines),
                include_dashboard=plan.console.dashboard, logging_level=plan.console.system_level)
    except (ConnectionError, ValueError, TimeoutError) as exc:
        if not address:
            raise
        raise CliError(f"cannot join the Ray cluster at {address}: {str(exc).splitlines()[0]}") from None
    on_connected()
    if address:
        check_cluster_gpus(plan.engine, ray.cluster_resources())
    try:
        if plan.models:
            from cosine_ray.cli.serve_llm import place_models
            place_models(plan.models)
        else:
            plan = place_actors(plan)
    except CliError:
        ray.shutdown()
        raise
    start = {"http_options": plan.http_options, "logging_config": plan.console.serve_logging()}
    if plan.proxy_location is not None:
        start["proxy_location"] = plan.proxy_location
    starting = ServeStart(**start)  # the deploy needs only Serve's controller, not its HTTP proxy
    starting.wait_for_controller()
    if starting.done.is_set() and starting.error is not None:  # failed before any controller
        ray.shutdown()
        raise serve_start_error(args.config, starting.error)
    if plan.models:
        print(f"cosine_ray: starting {len(plan.models)} models ({', '.join(m.names[0] for m in plan.models)}), "
              "an engine each (first start loads the models)...", flush=True)
    else:
        where = " in the engine" if plan.engine["cluster"].get("stages_in_engine") else ""
        print(f"cosine_ray: starting {plan.engine['num_stages']} stage(s){where} and drafters "
              f"[{plan.engine['drafters']}] for {plan.engine['model']} (first start loads the model)...", flush=True)
    try:
        deploy_in_child(plan, deployer)
        try:
            starting.result()  # the proxy is up too
        except Exception as exc:  # a proxy that never answered, settings an existing Serve refused
            raise serve_start_error(args.config, exc) from None
    except CliError:
        starting.done.wait()  # what follows tears Serve down: not while it starts
        try:
            serve.delete(plan.app_name)  # what Serve kept of the failed application (a joined cluster stays up)
            if deployer.cancelled:  # stopped by Ctrl-C / SIGTERM: Serve goes too, as at a stop once serving
                serve.shutdown()
        finally:
            ray.shutdown()
        raise
    return plan


def release_start_memory() -> None:
    """What the start allocated and no longer uses (the config files, the plan, Serve's start),
    handed back to the system: this process only waits from now on."""
    import gc

    from cosine_ray.runtime.memory import release_free_heap

    gc.collect()
    release_free_heap()


def run(args: argparse.Namespace) -> int:
    if getattr(args, "log_level", None):
        logging.getLogger().setLevel(args.log_level.upper())
    plan = serve_plan(args)
    plan.app_args = check_exposure(plan.host, plan.app_args)
    for what in plan.ignored:
        print(f"cosine-ray: note: --config {args.config}: ignoring {what} (`serve run` applies it)",
              file=sys.stderr, flush=True)
    from cosine_ray.cli.serve_start import Deployer

    deployer = Deployer()  # imports the engine while the cluster starts; told what to deploy below
    # Ctrl-C / SIGTERM from now on, also during the start and when inherited as ignored (a
    # background job): stop; during the start that means killing the deploying child. Both
    # take one path: the application is deleted, which lets the replicas finish what they
    # serve (``graceful_shutdown_timeout_s``), then exit 0. ray.init installs its own SIGTERM
    # handler (sys.exit, under Ray's C++ trace: `docker stop` and Kubernetes would abort the
    # server mid-request), so ours goes back once Ray is up.
    stop = threading.Event()

    def on_stop(*_: Any) -> None:
        stop.set()
        deployer.cancel()

    def handle_stop_signals() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_stop)

    handle_stop_signals()
    try:
        plan = start_cluster_and_deploy(args, plan, deployer, on_connected=handle_stop_signals)
    except CliError:
        if stop.is_set():  # the deploy failed because we killed it: not an error of the user's
            print("cosine_ray: stopped during the start", file=sys.stderr, flush=True)
            return 130
        raise
    finally:
        deployer.cancel()  # a no-op once it deployed
    import ray
    from ray import serve
    if not stop.is_set():
        release_start_memory()
        url = f"http://{plan.host}:{plan.port}{plan.route_prefix.rstrip('/')}"
        print(f"cosine_ray: serving OpenAI API at {url}/v1 (health: {url}/health, "
              f"Prometheus: {url}/metrics). Ctrl-C stops.", flush=True)
        stop.wait()
    print("cosine_ray: shutting down", file=sys.stderr, flush=True)
    try:
        serve.delete(plan.app_name)  # the engine deployment takes its stage and drafter actors with it
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
