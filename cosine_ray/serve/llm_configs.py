"""Ray Serve LLM's application args, ``{"llm_configs": [...], ...}``, read into our models.

A Ray Serve LLM config runs with only its ``import_path`` changed to
``cosine_ray.serve.app:build_llm_app`` (``serve.app.build_app`` takes the same args). Each entry
of ``llm_configs`` (Ray's ``LLMConfig``, or the path of a YAML file holding one) is one model with
its own engine deployment behind the one ingress; a request picks it with its ``model``:

- ``model_loading_config``: ``model_id``, the name requests use; ``model_source``, what the
  loader resolves (an embedded name, a local directory, a ``.gguf`` file), default the id;
- ``engine_kwargs``: our engine config (docs/configuration.md), where a setting of a part may
  also be given by its own name (``max_model_len`` for ``scheduler.max_model_len``);
- ``deployment_config``: Serve's health-check and shutdown settings of the model's engine
  deployment; ``num_replicas`` / ``autoscaling_config`` for one replica only (more come from
  ``engine_kwargs``' ``engine_replicas``, which brings the routing and failover that go with them);
- ``runtime_env``: the engine replica's (its stage and drafter actors inherit it).

Ray's other fields are refused unless they have their default; beside ``llm_configs`` the args
take ``ingress_deployment_config`` (``num_replicas``, ``autoscaling_config`` of the ingress) and
our ingress args (keys, limits).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any, Collection

from cosine_ray.engine.config import SETTING_PATHS, EngineConfig, config_from_dict


@dataclass(frozen=True)
class EngineDeployment:
    """One model of the application: its names, its engine config and its engine deployment."""

    names: list[str] | None
    """The names requests use (None: its checkpoint's name)."""
    config_data: dict[str, Any]
    """Its engine config as plain data (validated)."""
    deployment_name: str
    """Its engine deployment's name."""
    options: dict[str, Any] = field(default_factory=dict)
    """Serve settings of its engine deployment over the defaults (``serve.app.ENGINE_OPTIONS``)."""
    runtime_env: dict[str, Any] | None = None
    """The engine replica's runtime_env (its stage and drafter actors inherit it)."""


DEFAULTED_FIELDS = {"llm_engine": "vLLM", "accelerator_type": None, "lora_config": None,
                    "resources_per_bundle": None, "experimental_configs": {}, "log_engine_metrics": False,
                    "placement_group_config": None, "callback_config": None}
"""``LLMConfig`` fields we do not honour, with the default they may have (anything else is
refused): the engine is ours, placement comes from ``engine_kwargs`` (``cluster``)."""
LLM_CONFIG_FIELDS = ("model_loading_config", "engine_kwargs", "deployment_config", "runtime_env",
                     *DEFAULTED_FIELDS)
ENGINE_SERVE_OPTIONS = ("health_check_period_s", "health_check_timeout_s", "graceful_shutdown_timeout_s",
                        "graceful_shutdown_wait_loop_s", "logging_config")
"""``deployment_config`` keys passed to the engine deployment as they are."""
REFUSED_DEPLOYMENT_KEYS = {
    "name": "each model's engine deployment is named cosine_ray_engine-<model_id>",
    "ray_actor_options": "the engine's resources come from engine_kwargs (device, cluster.use_resources, "
                         "cluster.num_cpus_per_actor)",
    "max_ongoing_requests": "the ingress bounds requests (max_pending_requests)",
    "max_queued_requests": "the ingress bounds requests (max_pending_requests)",
}
INGRESS_SERVE_OPTIONS = ("num_replicas", "autoscaling_config")
ONE_REPLICA = ("engine replicas are set in engine_kwargs: engine_replicas: N, or \"MIN,MAX\" to autoscale "
               "(routing and failover come with them, docs/scaling.md)")


def parse_builder_config(config: dict[str, Any], ingress_args: Collection[str]
                         ) -> tuple[list[EngineDeployment], dict[str, Any], dict[str, Any]]:
    """(one ``EngineDeployment`` per model, the ingress args (the keys of ``ingress_args``), the
    ingress deployment's Serve settings); ValueError naming the place of anything wrong."""
    config = dict(config)
    raw = config.pop("llm_configs", None)
    if not isinstance(raw, list) or not raw:
        raise ValueError("llm_configs must be a non-empty list of LLM configs (mappings, or YAML file paths)")
    ingress_options = _ingress_options(config.pop("ingress_deployment_config", None) or {})
    if config.pop("ingress_cls_config", None):
        raise ValueError("ingress_cls_config is not supported: the ingress is cosine_ray's OpenAI app")
    if "served_model_names" in config:
        raise ValueError("served_model_names: with llm_configs each model's name is its model_loading_config.model_id")
    unknown = sorted(k for k in config if k not in ingress_args)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} beside llm_configs; known: ingress_deployment_config, "
                         f"{', '.join(ingress_args)}")
    models, taken = [], set()
    for i, entry in enumerate(raw):
        model = parse_llm_config(_load(entry, f"llm_configs[{i}]"), f"llm_configs[{i}]", taken)
        taken.add(model.deployment_name)
        models.append(model)
    ids = [m.names[0] for m in models]
    twice = sorted({n for n in ids if ids.count(n) > 1})
    if twice:
        raise ValueError(f"model_id {twice[0]!r} is given to {ids.count(twice[0])} llm_configs; each needs its own")
    return models, config, ingress_options


def _load(entry: Any, where: str) -> dict[str, Any]:
    """An LLM config: a mapping, or the path of a YAML file holding one (read here, where the
    application is built, as Ray Serve LLM reads it)."""
    if isinstance(entry, str):
        import yaml
        try:
            with open(entry, encoding="utf-8") as f:
                entry = yaml.safe_load(f)
        except OSError as exc:
            raise ValueError(f"{where}: cannot read {entry}: {exc.strerror or exc}") from None
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be a mapping (an LLMConfig) or the path of a YAML file holding one")
    return entry


def parse_llm_config(entry: dict[str, Any], where: str, taken: set[str] = frozenset()) -> EngineDeployment:
    """One ``LLMConfig`` as the model's ``EngineDeployment`` (its deployment name not in ``taken``)."""
    unknown = sorted(k for k in entry if k not in LLM_CONFIG_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(LLM_CONFIG_FIELDS)}")
    for name, default in DEFAULTED_FIELDS.items():
        if entry.get(name) not in (default, None):
            raise ValueError(f"{where}.{name} is not supported (only its default, {default!r}): the engine is "
                             "cosine_ray's, and its placement comes from engine_kwargs (cluster settings)")
    model_id, source = _model_loading(entry.get("model_loading_config"), f"{where}.model_loading_config")
    kwargs = entry.get("engine_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError(f"{where}.engine_kwargs must be a mapping of engine config keys")
    if "model" in kwargs and kwargs["model"] != source:
        raise ValueError(f"{where}.engine_kwargs.model: the model comes from model_loading_config.model_source")
    data = engine_data({**kwargs, "model": source}, f"{where}.engine_kwargs")
    runtime_env = entry.get("runtime_env")
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise ValueError(f"{where}.runtime_env must be a mapping (Ray's runtime_env)")
    options = _engine_options(entry.get("deployment_config") or {}, f"{where}.deployment_config")
    return EngineDeployment([model_id], data, _deployment_name(model_id, taken), options, runtime_env or None)


def _model_loading(value: Any, where: str) -> tuple[str, str]:
    """(model_id, model_source) of a ``model_loading_config``."""
    if not isinstance(value, dict) or not isinstance(value.get("model_id"), str) or not value["model_id"]:
        raise ValueError(f"{where} must be a mapping with model_id (the name requests use)")
    extra = sorted(set(value) - {"model_id", "model_source", "tokenizer_source"})
    if extra:
        raise ValueError(f"{where}: unknown key(s) {', '.join(extra)}; known: model_id, model_source")
    if value.get("tokenizer_source") is not None:
        raise ValueError(f"{where}.tokenizer_source is not supported: the tokenizer comes with the model_source")
    source = value.get("model_source") or value["model_id"]
    if not isinstance(source, str):
        raise ValueError(f"{where}.model_source must be a model name, a local directory or a .gguf file "
                         "(cloud mirrors are not supported)")
    return value["model_id"], source


def engine_data(kwargs: dict[str, Any], where: str) -> dict[str, Any]:
    """Engine config data from ``engine_kwargs``: config keys as a config file has them, where a
    setting of a part may also be given by its own name (vLLM's flat engine arguments); validated."""
    top = {f.name for f in fields(EngineConfig)}
    data = {k: v for k, v in kwargs.items() if k in top or k not in SETTING_PATHS}
    for key, value in kwargs.items():
        if key in data:
            continue
        section = SETTING_PATHS[key].split(".")[0]
        part = data.setdefault(section, {})
        if not isinstance(part, dict):
            break  # config_from_dict names the part that is no mapping
        if key in part:
            raise ValueError(f"{where}: {key} is given twice ({key} and {section}.{key})")
        data[section] = {**part, key: value}
    try:
        config_from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return data


def _engine_options(value: Any, where: str) -> dict[str, Any]:
    """The engine deployment's Serve settings from a ``deployment_config``: replicas (one) and
    the settings of ``ENGINE_SERVE_OPTIONS``."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a mapping of Serve deployment settings")
    rest = dict(value)
    check_one_replica(rest.pop("num_replicas", None), rest.pop("autoscaling_config", None), where,
                      what="engine replicas")
    options = {k: rest.pop(k) for k in ENGINE_SERVE_OPTIONS if k in rest}
    for key in rest:
        why = REFUSED_DEPLOYMENT_KEYS.get(key, f"known: num_replicas, autoscaling_config, {', '.join(ENGINE_SERVE_OPTIONS)}")
        raise ValueError(f"{where}.{key} is not supported: {why}")
    return options


def check_one_replica(num_replicas: Any, autoscaling: Any, where: str, *, what: str) -> None:
    """ValueError unless ``num_replicas`` and an ``autoscaling_config``'s min, max and initial
    replicas ask for one replica (the other autoscaling settings change nothing with one)."""
    if num_replicas is not None and autoscaling is not None:
        raise ValueError(f"{where}: give num_replicas or autoscaling_config, not both")
    if num_replicas is not None and (num_replicas != 1 or isinstance(num_replicas, bool)):
        raise ValueError(f"{where}.num_replicas={num_replicas!r} asks for {what} beyond one; {ONE_REPLICA}")
    if autoscaling is None:
        return
    if not isinstance(autoscaling, dict):
        raise ValueError(f"{where}.autoscaling_config must be a mapping")
    from ray.serve.config import AutoscalingConfig  # Serve's own check of the values
    known = set(getattr(AutoscalingConfig, "model_fields", None) or AutoscalingConfig.__fields__)
    unknown = sorted(set(autoscaling) - known)
    if unknown:
        raise ValueError(f"{where}.autoscaling_config: unknown key(s) {', '.join(unknown)}")
    try:
        AutoscalingConfig(**autoscaling)
    except Exception as exc:  # pydantic's ValidationError: its second line says what is wrong
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        detail = (lines[1:] or lines)[0].split(" [type=")[0].removeprefix("Value error, ")
        raise ValueError(f"{where}.autoscaling_config: {detail}") from None
    for key in ("min_replicas", "max_replicas", "initial_replicas"):
        if autoscaling.get(key) not in (None, 1):
            raise ValueError(f"{where}.autoscaling_config.{key}={autoscaling[key]!r} asks for {what} other than "
                             f"one; {ONE_REPLICA}")


def _ingress_options(value: Any) -> dict[str, Any]:
    """The ingress deployment's Serve settings of ``ingress_deployment_config``: its replicas
    (any number: ingress replicas share nothing but the engines)."""
    if not isinstance(value, dict):
        raise ValueError("ingress_deployment_config must be a mapping of Serve deployment settings")
    extra = sorted(set(value) - set(INGRESS_SERVE_OPTIONS))
    if extra:
        raise ValueError(f"ingress_deployment_config: {', '.join(extra)} not supported; known: "
                         f"{', '.join(INGRESS_SERVE_OPTIONS)} (the ingress's limits are its args, e.g. "
                         "max_pending_requests)")
    return dict(value)


def _deployment_name(model_id: str, taken: set[str]) -> str:
    """``cosine_ray_engine-<model_id>`` with the characters Serve and process names dislike
    replaced, made unique."""
    base = "cosine_ray_engine-" + re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}-{i}"
    return name
