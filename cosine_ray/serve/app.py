"""The Ray Serve application: an OpenAI ingress deployment bound to the engine deployment.

``build_app(args)`` is the Serve *application builder*: ``cosine-ray serve`` calls it, and
``serve run cosine_ray.serve.app:build_app`` / ``serve deploy deploy/serve_config.yaml`` use it
directly. ``args`` are the engine config as plain data (``engine.config``) plus the ingress
settings (``INGRESS_ARGS``: ``api_key`` or env ``COSINE_RAY_API_KEY``; ``api_keys``, a key
file's entries, or ``api_key_file``, read when the application is built, or env
``COSINE_RAY_API_KEY_FILE``, read by the replica; ``return_spec_stats``, ...).

Two deployments (the Ray Serve LLM pattern): ``cosine_ray_engine`` (``EngineServer``: the request
pool and step loop, owner of the stage and drafter actors; one replica) and the ingress
``cosine_ray`` (tokenizer + FastAPI app), which gets the engine's ``DeploymentHandle`` through
``bind``. Serve starts, health-checks, restarts and reconfigures both.

Overload: ``max_pending_requests`` (default 256) bounds the generations one ingress replica
holds, shared fairly between keys (``serve.guards.admission``, which may overcommit it); Serve's
``max_ongoing_requests`` is that overcommitted bound plus ``CONTROL_HEADROOM``, so every request
reaches fair admission and Serve's own queue is a backstop. ``request_timeout_s`` (default 600)
bounds one generation (408), ``body_timeout_s`` (default 30) the wait for a body (408).
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from cosine_ray.engine.config import config_from_dict

INGRESS_ARGS = ("api_key", "api_keys", "api_key_file", "max_body_bytes", "max_ongoing_requests",
                "max_queued_requests", "return_spec_stats", "metrics_require_key", "max_pending_requests",
                "request_timeout_s", "body_timeout_s", "allow_unauthenticated")
DEFAULT_MAX_PENDING_REQUESTS = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0
CONTROL_HEADROOM = 32
ENGINE_MAX_ONGOING = 100_000
"""The engine replica takes every generation the ingress replicas admitted (each ingress
bounds its own with ``max_pending_requests``); queueing is the engine's request pool."""


@serve.ingress()
class OpenAIIngress:
    """One replica: tokenizer + the engine deployment's handle."""

    def __init__(self, engine: Any, config_data: dict[str, Any], api_key: str | None = None,
                 api_keys: list[dict[str, Any]] | None = None,
                 max_body_bytes: int = 1 << 20, return_spec_stats: bool = False,
                 metrics_require_key: bool = False, max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 body_timeout_s: float | None = None) -> None:
        from cosine_ray.models.loader import resolve_checkpoint
        from cosine_ray.runtime.engine_client import RayEngineClient
        from cosine_ray.serve.errors import DEFAULT_BODY_TIMEOUT_S
        from cosine_ray.serve.guards.tenants import as_key_entries, read_key_file

        config = config_from_dict(config_data)
        checkpoint = resolve_checkpoint(config.model)
        self.engine = RayEngineClient(engine, model_name=checkpoint.name,
                                      max_model_len=config.resolved(
                                          context_len=checkpoint.config.max_position_embeddings).scheduler.max_model_len,
                                      vocab_size=checkpoint.config.vocab_size)
        self.tokenizer = checkpoint.load_tokenizer()
        self.api_key = api_key or os.environ.get("COSINE_RAY_API_KEY") or None
        self.api_keys = list(api_keys or [])
        if os.environ.get("COSINE_RAY_API_KEY_FILE"):
            self.api_keys += as_key_entries(read_key_file(os.environ["COSINE_RAY_API_KEY_FILE"]))
        self.body_timeout_s = DEFAULT_BODY_TIMEOUT_S if body_timeout_s is None else float(body_timeout_s)
        self.max_body_bytes = max_body_bytes
        self.return_spec_stats = bool(return_spec_stats)
        self.metrics_require_key = bool(metrics_require_key)
        self.max_pending_requests = int(max_pending_requests)
        self.request_timeout_s = float(request_timeout_s)

    def __serve_build_asgi_app__(self):
        from cosine_ray.serve.completion_ledger import with_completion_ledger
        from cosine_ray.serve.openai_app import build_openai_app  # here: importing this module stays light
        asgi = build_openai_app(self.engine, self.tokenizer, model_name=self.engine.model_name,
                                max_body_bytes=self.max_body_bytes, api_key=self.api_key,
                                api_keys=self.api_keys, body_timeout_s=self.body_timeout_s,
                                return_spec_stats=self.return_spec_stats,
                                metrics_require_key=self.metrics_require_key,
                                max_pending_requests=self.max_pending_requests,
                                request_timeout_s=self.request_timeout_s)
        return with_completion_ledger(asgi)  # the client request ids it answered, for an audit


ENGINE_CLASS = "cosine_ray.runtime.engine_server.EngineServer"
"""The engine deployment's class, by import path: the engine replica imports it (torch and the
engine); the process that builds and deploys the application never does (``cosine-ray serve``'s
deploying child, ``serve run``)."""


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    from cosine_ray.runtime.engine_client import ENGINE_DEPLOYMENT
    from cosine_ray.runtime.placement import engine_actor_options
    from cosine_ray.serve.guards.admission import OVERCOMMIT
    from cosine_ray.serve.guards.tenants import as_key_entries, key_ring, read_key_file

    args = dict(args or {})
    ingress = {k: args.pop(k) for k in INGRESS_ARGS if k in args}
    if "api_key_file" in ingress:  # read here, where it is given: a replica may run on another node
        ingress["api_keys"] = list(ingress.get("api_keys") or []) + as_key_entries(
            read_key_file(ingress.pop("api_key_file")))
    key_ring(ingress.get("api_key"), ingress.get("api_keys") or ())  # a key or a name given twice: refused now
    config = config_from_dict(args)  # validate before anything starts
    # Closed by default: the builder cannot see the HTTP host (a Serve config's http_options
    # are not its args), so without a key the server may only be open when the args say so
    # (`cosine-ray serve` says so for localhost). The key the check saw is the one served.
    api_key = ingress.get("api_key") or os.environ.get("COSINE_RAY_API_KEY")
    allow_open = ingress.pop("allow_unauthenticated", False)
    has_key = api_key or ingress.get("api_keys") or os.environ.get("COSINE_RAY_API_KEY_FILE")
    if allow_open not in (True, False) or not (has_key or allow_open):
        raise ValueError("no API key: set COSINE_RAY_API_KEY (or COSINE_RAY_API_KEY_FILE) on the Ray nodes, or "
                         "api_key, api_keys or api_key_file in the args, or allow_unauthenticated: true to serve "
                         "without one")
    if api_key:
        ingress["api_key"] = api_key
    max_pending = int(ingress.get("max_pending_requests", DEFAULT_MAX_PENDING_REQUESTS))
    if max_pending < 1 or not float(ingress.get("request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S)) > 0:
        raise ValueError("max_pending_requests must be >= 1 and request_timeout_s > 0")
    engine = serve.deployment(
        name=ENGINE_DEPLOYMENT, num_replicas=1, max_ongoing_requests=ENGINE_MAX_ONGOING,
        ray_actor_options=engine_actor_options(config), health_check_period_s=10, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=20)(ENGINE_CLASS).bind(args)
    deployment = serve.deployment(
        OpenAIIngress, name="cosine_ray",
        max_ongoing_requests=int(ingress.pop("max_ongoing_requests", OVERCOMMIT * max_pending + CONTROL_HEADROOM)),
        max_queued_requests=int(ingress.pop("max_queued_requests", 256)),
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=10, graceful_shutdown_timeout_s=20)
    return deployment.bind(engine, args, **ingress)
