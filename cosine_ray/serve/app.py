"""The Ray Serve application: an OpenAI ingress deployment in front of the router actor.

``build_app(args)`` is the Serve *application builder*: ``cosine-ray serve`` calls it, and
``serve run cosine_ray.serve.app:build_app`` / ``serve deploy deploy/serve_config.yaml``
use it directly. ``args`` are the engine config as plain data (see
``engine.config.config_from_dict``) plus ``api_key`` (or env ``COSINE_RAY_API_KEY``) and
``max_body_bytes``, ``return_spec_stats`` (every completion carries the ``cosine_ray`` stats
block) and ``metrics_require_key`` (``GET /metrics`` needs the API key too).

Overload and timeouts: ``max_pending_requests`` (default 256) bounds the generations one
replica holds (running + waiting in the engine); one more gets an OpenAI-shaped 503 +
``Retry-After`` from the app at once. Serve's own ``max_ongoing_requests`` defaults to that
plus ``CONTROL_HEADROOM`` (room for /health, /metrics and cheap rejections), so Serve's
queue (``max_queued_requests``, whose 503 has a plain-text body) is only a backstop.
``request_timeout_s`` (default 600) bounds one generation: past it the engine request is
cancelled and the client gets 408.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from cosine_ray.engine.config import config_from_dict
from cosine_ray.serve.openai_app import build_openai_app

INGRESS_ARGS = ("api_key", "max_body_bytes", "max_ongoing_requests", "max_queued_requests",
                "fresh_router", "return_spec_stats", "metrics_require_key", "max_pending_requests",
                "request_timeout_s")
DEFAULT_MAX_PENDING_REQUESTS = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0
CONTROL_HEADROOM = 32


@serve.ingress()
class OpenAIIngress:
    """One replica: tokenizer + a client of the (detached, shared) router actor."""

    def __init__(self, config_data: dict[str, Any], api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, fresh_router: bool = False,
                 return_spec_stats: bool = False, metrics_require_key: bool = False,
                 max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        from cosine_ray.models.loader import resolve_checkpoint
        from cosine_ray.runtime.engine_client import RayEngineClient
        from cosine_ray.runtime.router_actor import get_or_create_router

        config = config_from_dict(config_data)
        router = get_or_create_router(config, fresh=fresh_router)
        self.engine = RayEngineClient.from_router(router)
        self.tokenizer = resolve_checkpoint(config.model).load_tokenizer()
        self.api_key = api_key or os.environ.get("COSINE_RAY_API_KEY") or None
        self.max_body_bytes = max_body_bytes
        self.return_spec_stats = bool(return_spec_stats)
        self.metrics_require_key = bool(metrics_require_key)
        self.max_pending_requests = int(max_pending_requests)
        self.request_timeout_s = float(request_timeout_s)

    def __serve_build_asgi_app__(self):
        return build_openai_app(self.engine, self.tokenizer, model_name=self.engine.model_name,
                                max_body_bytes=self.max_body_bytes, api_key=self.api_key,
                                return_spec_stats=self.return_spec_stats,
                                metrics_require_key=self.metrics_require_key,
                                max_pending_requests=self.max_pending_requests,
                                request_timeout_s=self.request_timeout_s)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    args = dict(args or {})
    ingress = {k: args.pop(k) for k in INGRESS_ARGS if k in args}
    config_from_dict(args)  # validate before anything starts
    max_pending = int(ingress.get("max_pending_requests", DEFAULT_MAX_PENDING_REQUESTS))
    if max_pending < 1 or not float(ingress.get("request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S)) > 0:
        raise ValueError("max_pending_requests must be >= 1 and request_timeout_s > 0")
    deployment = serve.deployment(
        OpenAIIngress, name="cosine_ray",
        max_ongoing_requests=int(ingress.pop("max_ongoing_requests", max_pending + CONTROL_HEADROOM)),
        max_queued_requests=int(ingress.pop("max_queued_requests", 256)),
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=10, graceful_shutdown_timeout_s=20)
    return deployment.bind(args, **ingress)
