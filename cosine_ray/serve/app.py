"""The Ray Serve application: an OpenAI ingress deployment bound to the engine deployment.

``build_app(args)`` is the Serve *application builder*: ``cosine-ray serve`` calls it, and
``serve run cosine_ray.serve.app:build_app`` / ``serve deploy deploy/serve_config.yaml`` use it
directly. ``args`` are the engine config as plain data (``engine.config``) plus the ingress
settings (``INGRESS_ARGS``: keys, a key file, limits, the tool-call parser, a chat template,
served model names; ``OpenAIIngress`` says each). Given ``llm_configs`` it builds Ray
Serve LLM's shape (``build_llm_app``, ``serve.llm_configs``: several models behind one ingress).

Two deployments (the Ray Serve LLM pattern): ``cosine_ray_engine`` (``EngineServer``: the request
pool and step loop, owner of the stage and drafter actors; ``cluster.engine_replicas`` replicas,
routed and scaled as ``runtime.engine_router`` says), one per model, and the
ingress ``cosine_ray`` (tokenizers + FastAPI app), which gets the engines' ``DeploymentHandle``s
through ``bind``. Serve starts, health-checks, restarts and reconfigures them all.

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
from cosine_ray.serve.llm_configs import EngineDeployment

INGRESS_ARGS = ("api_key", "api_keys", "api_key_file", "max_body_bytes", "max_ongoing_requests",
                "max_queued_requests", "return_spec_stats", "metrics_require_key", "max_pending_requests",
                "request_timeout_s", "body_timeout_s", "allow_unauthenticated", "tool_call_parser", "chat_template",
                "served_model_names")
DEFAULT_MAX_PENDING_REQUESTS = 256
DEFAULT_REQUEST_TIMEOUT_S = 600.0
CONTROL_HEADROOM = 32
ENGINE_MAX_ONGOING = 100_000
"""The engine replica takes every generation the ingress replicas admitted (each ingress
bounds its own with ``max_pending_requests``); queueing is the engine's request pool."""


@serve.ingress()
class OpenAIIngress:
    """One replica: the engine deployments' handles and their models' tokenizers.

    ``engine`` and ``config_data`` are the first model's; ``served_model_names`` its names
    (default: its checkpoint's name); ``more_models`` each further model as ``{"names", "engine",
    "config"}`` (the Ray Serve LLM builder's several ``llm_configs``). ``api_key`` or env
    ``COSINE_RAY_API_KEY``; ``api_keys``, a key file's entries (``api_key_file`` is read when the
    application is built), or env ``COSINE_RAY_API_KEY_FILE``, read here; ``tool_call_parser``
    (``serve.text.tool_parsers``) and ``chat_template``, the text of a Jinja template."""

    def __init__(self, engine: Any, config_data: dict[str, Any], api_key: str | None = None,
                 api_keys: list[dict[str, Any]] | None = None,
                 max_body_bytes: int = 1 << 20, return_spec_stats: bool = False,
                 metrics_require_key: bool = False, max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 body_timeout_s: float | None = None, tool_call_parser: str | None = None,
                 chat_template: str | None = None, served_model_names: list[str] | None = None,
                 more_models: list[dict[str, Any]] | None = None) -> None:
        from cosine_ray.serve.errors import DEFAULT_BODY_TIMEOUT_S
        from cosine_ray.serve.guards.tenants import as_key_entries, read_key_file
        from cosine_ray.serve.text.tool_parsers import DEFAULT_TOOL_CALL_PARSER

        self.engine, self.tokenizer = _engine_client(engine, config_data)
        self.served_model_names = list(served_model_names or [self.engine.model_name])
        self.more_models = [(list(m["names"]), *_engine_client(m["engine"], m["config"])) for m in more_models or ()]
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
        self.tool_call_parser = tool_call_parser or DEFAULT_TOOL_CALL_PARSER
        self.chat_template = chat_template

    def __serve_build_asgi_app__(self):
        from cosine_ray.serve.completion_ledger import with_completion_ledger
        from cosine_ray.serve.openai_app import build_openai_app  # here: importing this module stays light
        asgi = build_openai_app(self.engine, self.tokenizer, model_name=self.engine.model_name,
                                served_model_names=self.served_model_names, more_models=self.more_models,
                                max_body_bytes=self.max_body_bytes, api_key=self.api_key,
                                api_keys=self.api_keys, body_timeout_s=self.body_timeout_s,
                                return_spec_stats=self.return_spec_stats,
                                metrics_require_key=self.metrics_require_key,
                                max_pending_requests=self.max_pending_requests,
                                request_timeout_s=self.request_timeout_s, chat_template=self.chat_template,
                                tool_call_parser=self.tool_call_parser)
        return with_completion_ledger(asgi)  # the client request ids it answered, for an audit


def _engine_client(handle: Any, config_data: dict[str, Any]) -> tuple[Any, Any]:
    """The ingress's client of one engine deployment, and its model's tokenizer."""
    from cosine_ray.models.loader import resolve_checkpoint
    from cosine_ray.runtime.engine_client import RayEngineClient

    config = config_from_dict(config_data)
    checkpoint = resolve_checkpoint(config.model, **config.checkpoint_args)
    several = config.cluster.engine_replica_range[1] > 1  # a lost replica's streams go on elsewhere
    client = RayEngineClient(handle, model_name=checkpoint.name, failover_attempts=FAILOVER_ATTEMPTS if several else 0,
                             max_model_len=config.resolved(
                                 context_len=checkpoint.config.max_position_embeddings).scheduler.max_model_len,
                             vocab_size=checkpoint.config.vocab_size)
    return client, checkpoint.load_tokenizer()


FAILOVER_ATTEMPTS = 3
"""Resubmissions of a stream whose engine replica is lost, with several replicas
(``RayEngineClient.failover_attempts``)."""
ENGINE_CLASS = "cosine_ray.runtime.engine_server.EngineServer"
"""The engine deployment's class, by import path: the engine replica imports it (torch and the
engine); the process that builds and deploys the application never does (``cosine-ray serve``'s
deploying child, ``serve run``)."""
ENGINE_OPTIONS = {"health_check_period_s": 10, "health_check_timeout_s": 30, "graceful_shutdown_timeout_s": 20}
"""The engine deployment's Serve settings (a Ray Serve LLM ``deployment_config`` may override them)."""


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The application of one model: ``args`` are its engine config plus the ingress args
    (``INGRESS_ARGS``); with ``llm_configs`` they are Ray Serve LLM's shape (``build_llm_app``)."""
    from cosine_ray.runtime.engine_client import ENGINE_DEPLOYMENT

    args = dict(args or {})
    if "llm_configs" in args:
        return build_llm_app(args)
    ingress = {k: args.pop(k) for k in INGRESS_ARGS if k in args}
    names = ingress.pop("served_model_names", None)
    if names is not None:
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"served_model_names must be a list of non-empty names, got {names!r}")
    config_from_dict(args)  # validate before anything starts
    return build_application([EngineDeployment(names, args, ENGINE_DEPLOYMENT)], ingress)


def build_llm_app(args: dict[str, Any]) -> serve.Application:
    """The application of Ray Serve LLM's args, ``{"llm_configs": [...], ...}``: one engine
    deployment per model behind the one ingress (``serve.llm_configs``)."""
    from cosine_ray.serve.llm_configs import parse_builder_config

    models, ingress, ingress_options = parse_builder_config(dict(args or {}), INGRESS_ARGS)
    return build_application(models, ingress, ingress_options)


def build_application(models: list[EngineDeployment], ingress: dict[str, Any],
                      ingress_options: dict[str, Any] | None = None) -> serve.Application:
    """The ingress bound to one engine deployment per model. ``ingress``: the ingress args
    (``INGRESS_ARGS`` but ``served_model_names``); ``ingress_options``: Serve settings of the
    ingress deployment (``num_replicas``, ``autoscaling_config``)."""
    from cosine_ray.runtime.engine_router import engine_replica_options
    from cosine_ray.runtime.placement import engine_actor_options
    from cosine_ray.serve.guards.admission import OVERCOMMIT
    from cosine_ray.serve.guards.tenants import as_key_entries, key_ring, read_key_file

    ingress = dict(ingress)
    if "api_key_file" in ingress:  # read here, where it is given: a replica may run on another node
        ingress["api_keys"] = list(ingress.get("api_keys") or []) + as_key_entries(
            read_key_file(ingress.pop("api_key_file")))
    key_ring(ingress.get("api_key"), ingress.get("api_keys") or ())  # a key or a name given twice: refused now
    if ingress.get("tool_call_parser") is not None:
        from cosine_ray.serve.text.tool_parsers import tool_call_parser
        tool_call_parser(ingress["tool_call_parser"])  # an unknown parser: refused now, not in the replica
    if ingress.get("chat_template") is not None:  # a file is read here, where it is given; a bad template refused
        from cosine_ray.serve.text.prompts import read_chat_template
        ingress["chat_template"] = read_chat_template(ingress["chat_template"])
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
    engines = []
    for model in models:
        config = config_from_dict(model.config_data)
        actor_options = engine_actor_options(config)
        if model.runtime_env:
            actor_options["runtime_env"] = model.runtime_env
        engines.append(serve.deployment(
            name=model.deployment_name, max_ongoing_requests=ENGINE_MAX_ONGOING, ray_actor_options=actor_options,
            **engine_replica_options(config), **{**ENGINE_OPTIONS, **model.options})(ENGINE_CLASS).bind(
                model.config_data))
    deployment = serve.deployment(
        OpenAIIngress, name="cosine_ray",
        max_ongoing_requests=int(ingress.pop("max_ongoing_requests", OVERCOMMIT * max_pending + CONTROL_HEADROOM)),
        max_queued_requests=int(ingress.pop("max_queued_requests", 256)),
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=10, graceful_shutdown_timeout_s=20, **(ingress_options or {}))
    first, *more = models
    if first.names is not None:
        ingress["served_model_names"] = list(first.names)
    if more:
        ingress["more_models"] = [{"names": list(m.names or ()), "engine": e, "config": m.config_data}
                                  for m, e in zip(more, engines[1:])]
    return deployment.bind(engines[0], first.config_data, **ingress)
