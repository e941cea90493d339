"""Reaching the engine deployment of a running Serve app from a test (the Ray driver).

The engine is the Serve deployment ``cosine_ray_engine`` (``runtime.engine_server``); its
stage and drafter actors are named ``cosine_ray:<role>:<i>`` in the engine's own namespace
(``describe()["namespace"]``). Every call here has a deadline.
"""

from __future__ import annotations

import random
import time
from typing import Any

import ray
from ray import serve

from cosine_ray.runtime.engine_client import ENGINE_DEPLOYMENT

APP_NAME = "cosine_ray"


def engine_handle(app_name: str = APP_NAME, deployment: str = ENGINE_DEPLOYMENT):
    # Each test module's CLI starts (and at the end shuts down) its own Serve instance on the
    # session's cluster; this process caches a client of the previous module's controller.
    # Drop it when that controller is gone so the lookup finds the current one.
    from ray.serve import context as serve_context
    serve_context._check_cached_client_alive()
    return serve.get_deployment_handle(deployment, app_name=app_name)


def engine_call(method: str, *args: Any, timeout_s: float = 30.0, app_name: str = APP_NAME,
                deployment: str = ENGINE_DEPLOYMENT) -> Any:
    """Blocking call of an engine method (test code outside any event loop); ``deployment``:
    another engine of the app (Ray Serve LLM's ``cosine_ray_engine-<model_id>``)."""
    return getattr(engine_handle(app_name, deployment), method).remote(*args).result(timeout_s=timeout_s)


def deploy(args: dict[str, Any], *, timeout_s: float = 600.0, app_name: str = APP_NAME) -> dict[str, Any]:
    """``serve.run`` the application with engine config ``args`` and wait until the engine that
    answers is one built from them (``serve.run`` may return while the previous version still
    serves): its ``describe()``."""
    import time

    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.serve.app import build_app

    config = config_from_dict({k: v for k, v in args.items() if k not in INGRESS_KEYS})
    want = {"num_stages": config.num_stages, "num_speculative_tokens": config.speculation.num_speculative_tokens,
            "stages_in_engine": config.cluster.stages_in_engine, "drafters": [s.name for s in config.drafters]}
    # Serve versions a deployment of ``serve.run`` with a string from the global ``random``
    # module, which conftest's autouse fixture seeds identically for every test: two deploys in
    # one process would get the same version and Serve would keep the old engine.
    random.seed()
    serve.run(build_app({"allow_unauthenticated": True, **args}), name=app_name, route_prefix=None)  # localhost
    deadline = time.monotonic() + timeout_s
    while True:
        info = engine_call("describe", timeout_s=60, app_name=app_name)
        have = {**info["config"], "drafters": info["drafters"]}
        if have == want and len(engine_replicas(app_name)) == 1:
            return info
        assert time.monotonic() < deadline, f"the engine did not become {want} (have {have})"
        time.sleep(0.5)


INGRESS_KEYS = ("api_key", "max_body_bytes", "max_ongoing_requests", "max_queued_requests", "return_spec_stats",
                "metrics_require_key", "max_pending_requests", "request_timeout_s", "allow_unauthenticated")


def engine_namespace(timeout_s: float = 30.0, app_name: str = APP_NAME) -> str:
    return engine_call("describe", timeout_s=timeout_s, app_name=app_name)["namespace"]


def engine_actor(name: str, namespace: str | None = None):
    """A stage or drafter actor of the running engine, by name (``cosine_ray:stage:0``)."""
    return ray.get_actor(name, namespace=namespace or engine_namespace())


def engine_replicas(app_name: str = APP_NAME) -> list[str]:
    """Names (namespace ``serve``) of the engine deployment's live replica actors."""
    prefix = f"SERVE_REPLICA::{app_name}#{ENGINE_DEPLOYMENT}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def ingress_replicas(app_name: str = APP_NAME) -> list[str]:
    prefix = f"SERVE_REPLICA::{app_name}#{app_name}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def our_actors() -> list[tuple[str, str]]:
    """(namespace, name) of live named actors that belong to cosine_ray or Ray Serve."""
    return sorted((a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("cosine_ray:") or a["namespace"] == "serve")



def wait_gone(timeout_s: float) -> list[tuple[str, str]]:
    """Wait until ``our_actors()`` is empty or ``timeout_s`` passed; what is left."""
    deadline = time.monotonic() + timeout_s
    while (left := our_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left

def force_cleanup() -> None:
    """Whatever a killed CLI left behind in the session cluster."""
    try:
        serve.shutdown()
    except Exception as exc:
        print(f"[engine_app] serve.shutdown: {exc!r}")
    for namespace, name in our_actors():
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except Exception:
            pass


def stop_and_clean(proc: Any, log: Any) -> tuple[int, list[tuple[str, str]]]:
    """Stop a ``cosine-ray serve`` CLI (``support.cli_server.stop_cli``), close its log, and
    clean up whatever it left in the session cluster: (its exit code, the actors still alive)."""
    from support.cli_server import stop_cli

    rc = stop_cli(proc)
    log.close()
    left = wait_gone(30.0)
    if left:
        force_cleanup()
        left = wait_gone(30.0)
    return rc, left
