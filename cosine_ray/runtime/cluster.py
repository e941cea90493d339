"""Joining or starting the Ray cluster, and the names of our actors."""

from __future__ import annotations

import os

import ray

NAMESPACE = "cosine_ray"

PROXY_CALLBACK = "cosine_ray.serve.guards.proxy_guard.middlewares"
"""The import path Serve's HTTP proxies call for their middlewares (``serve/guards/proxy_guard.py``).
A string, not an import: Serve resolves it in each proxy process, and ``runtime/`` sits below
``serve/`` (docs/architecture.md, Layering)."""
PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"


WORKER_MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}
"""glibc malloc in every Ray worker of ours: at most 2 arenas instead of 8 per core. Ray's core
worker, gRPC and the step loop allocate from a dozen threads; each thread arena keeps its own
free, fragmented pages, which ``malloc_trim`` (runtime/memory.py) cannot all hand back, so the
engine's resident memory crept up in steps under load (the soak test's RSS slope). Fewer
arenas, less memory held apart; the threads that allocate here are not contended."""


SERVE_ENV = {"RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "2", "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "0.5"}
"""Serve's controller health-checks each HTTP proxy every 2 s instead of 10: a dead proxy (whose
health call fails at once) is replaced after 3 failed checks, ~6 s instead of ~30 s of refused
connections (docs/chaos.md); a live but slow one still has the 10-s check timeout each time.
A handle waits 0.5 s (Serve: 0.1 s) for a replica's queue length before it retries: the engine
replica answers from its busy event loop, and each timeout is a warning on the console."""
LOCAL_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}
"""A local cluster starts no idle Python workers ahead of need: every process of ours hosts an
actor, which gets a worker of its own anyway, so prestarted ones only held an interpreter's
memory (docs/chaos.md, the footprint at idle)."""


def actor_name(role: str, index: int) -> str:
    """``cosine_ray:<role>:<index>`` (all in namespace ``cosine_ray``)."""
    return f"{NAMESPACE}:{role}:{index}"


def connect(address: str | None = None, *, num_cpus: int | None = None, include_dashboard: bool = False,
            logging_level: str | None = None, log_to_driver: bool = True) -> None:
    """Join ``address`` (``auto`` or ``ray://...`` or ``HOST:PORT``), or start a local cluster.

    A local cluster gets a fixed ``num_cpus`` (default: the machine's cores) so scheduling
    does not depend on what else runs; our actors ask for fractional CPUs and limit their
    own torch threads instead (see ``placement``). Without an address a *new* local cluster
    is started (``address="local"``): Ray would otherwise join ``RAY_ADDRESS`` or the cluster
    the last ``ray start`` recorded in ``<RAY_TMPDIR or /tmp>/ray/ray_current_cluster``, which
    may be long gone (a head that died without ``ray stop``), and then refuse ``num_cpus``
    (tests/runtime/test_stale_ray_address.py). To join a cluster, pass its address.

    Every worker of the job gets ``runtime_env`` env vars: one torch thread, fewer malloc arenas,
    Serve's proxy health-check period (``SERVE_ENV``) and the proxy's callback
    (``serve.guards.proxy_guard``); a local cluster also gets ``LOCAL_SYSTEM_CONFIG``, and Ray's
    dashboard only with ``include_dashboard`` (without it Ray still runs its small API server).
    ``logging_level``: what Ray prints in this process (Ray's default: INFO). ``log_to_driver``:
    this process prints what the workers print; a second process of the same job on the same
    terminal (``cosine-ray serve``'s deploying child) must not, or every line shows twice.
    """
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **WORKER_MALLOC_ENV,
                                **SERVE_ENV, PROXY_CALLBACK_ENV: PROXY_CALLBACK}}
    level = {} if logging_level is None else {"logging_level": logging_level}
    if address:
        ray.init(address=address, namespace=NAMESPACE, runtime_env=runtime_env, log_to_driver=log_to_driver, **level)
    else:
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 2, namespace=NAMESPACE,
                 include_dashboard=include_dashboard, runtime_env=runtime_env, log_to_driver=log_to_driver,
                 _system_config=LOCAL_SYSTEM_CONFIG, **level)
