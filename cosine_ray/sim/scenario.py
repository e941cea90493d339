"""The scenario file of ``cosine-ray simulate``: a deployment and a workload, in YAML or JSON.

Checked against ``SCHEMA`` (JSON Schema, ``jsonschema``), then against itself (names that must
exist, such as each stage's device and latency model). Top-level keys: ``engine`` (the parts of
the engine's own config that a simulation runs: ``scheduler``, ``speculation``, ``runtime``,
``experiments``, as in deploy/engine.yaml), ``target`` (shapes that size the transfers),
``latency`` (named cost models of the whole target on a device), ``devices`` (FIFO servers;
``engine`` is the engine's host and always exists), ``engine_host``, ``stages``, ``links``,
``drafters``, ``replicas`` (``sim.replicas``: copies of the deployment, their routing and
failures) and ``workload`` (cosine-loadgen's arrivals and domain mixes). A key or device under
an older name is refused with its new name. ``cosine-ray simulate --schema`` prints the schema;
docs/simulator.md explains every key with an example, and ``deploy/sim/`` has the scenarios
the validation and the report run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cosine_ray.engine.config import SETTING_PATHS, EngineConfig, config_from_dict
from cosine_ray.sim.replicas import REPLICAS_SCHEMA

ENGINE_PARTS = ("scheduler", "speculation", "runtime", "experiments")
"""The parts of ``EngineConfig`` a scenario's ``engine`` may set (the others say what is served
and where, which the scenario's own keys describe)."""
_NUM = {"type": "number", "minimum": 0}
_POS = {"type": "number", "exclusiveMinimum": 0}
_LINK = {"type": "object", "additionalProperties": False,
         "properties": {"bandwidth_mbps": _POS, "latency_ms": _NUM}}
_ACCEPT = {"type": "object", "additionalProperties": False, "required": ["by_depth"],
           "properties": {"by_depth": {"type": "array", "minItems": 1, "maxItems": 256,
                                       "items": {"type": "number", "minimum": 0, "maximum": 1}},
                          "coverage": {"type": "number", "minimum": 0, "maximum": 1}}}
_COSTS = {"type": "object", "additionalProperties": False,
          "properties": {"c0_ms": _NUM, "c_req_ms": _NUM, "c_tok_ms": _NUM}}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "cosine-ray simulate scenario",
    "type": "object",
    "additionalProperties": False,
    "required": ["latency", "stages", "workload"],
    "properties": {
        "name": {"type": "string"},
        "seed": {"type": "integer", "minimum": 0},
        "engine": {"type": "object", "description": "the engine config's parts a simulation runs "
                   f"({', '.join(ENGINE_PARTS)}: the keys of deploy/engine.yaml)"},
        "target": {"type": "object", "additionalProperties": False, "properties": {
            "hidden_size": {"type": "integer", "minimum": 1},
            "vocab_size": {"type": "integer", "minimum": 2},
            "activation_bytes": {"type": "integer", "minimum": 1},
            "kv_bytes_per_token": {"type": "integer", "minimum": 0},
            "returns": {"enum": ["logits", "ids"]}}},
        "latency": {"type": "object", "minProperties": 1, "additionalProperties": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "source": {"type": "string"},
                "profile": {"type": "string"},
                "linear": {"type": "object", "additionalProperties": False, "properties": {
                    "c0_ms": _NUM, "c_req_ms": _NUM, "c_tok_ms": _NUM, "c_knee_ms": _NUM,
                    "knee_tokens": {"type": "integer", "minimum": 0}, "c_attn_us": _NUM}},
                "roofline": {"type": "object", "additionalProperties": False,
                             "required": ["params_billions", "memory_bandwidth_gbs", "tflops"],
                             "properties": {"params_billions": _POS, "bytes_per_param": _POS,
                                            "memory_bandwidth_gbs": _POS, "tflops": _POS,
                                            "bandwidth_efficiency": {"type": "number", "exclusiveMinimum": 0,
                                                                     "maximum": 1},
                                            "compute_efficiency": {"type": "number", "exclusiveMinimum": 0,
                                                                   "maximum": 1},
                                            "kv_bytes_per_token": _NUM, "overhead_ms": _NUM}}},
            "oneOf": [{"required": ["profile"]}, {"required": ["linear"]}, {"required": ["roofline"]}]}},
        "devices": {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True},
        "engine_host": {"type": "object", "additionalProperties": False, "properties": {
            "device": {"type": "string"}, "step_overhead_ms": _NUM, "step_overhead_per_request_ms": _NUM}},
        "stages": {"type": "array", "minItems": 1, "maxItems": 128, "items": {
            "type": "object", "additionalProperties": False, "required": ["device", "latency"],
            "properties": {"device": {"type": "string"}, "latency": {"type": "string"}, "layers": _POS}}},
        "links": {"type": "object", "additionalProperties": False, "properties": {
            "engine_stage": _LINK, "stage_stage": _LINK, "engine_drafter": _LINK}},
        "drafters": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "acceptance"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "device": {"type": "string"},
                "latency": {"oneOf": [_COSTS, {"type": "object", "additionalProperties": False,
                                               "required": ["profile"],
                                               "properties": {"profile": {"type": "string"},
                                                              "drafter": {"type": "string"}}}]},
                "acceptance": {"type": "object", "required": ["default"], "additionalProperties": _ACCEPT},
                "correlation": {"type": "number", "minimum": 0, "maximum": 1},
                "sharpness": {"type": "number", "minimum": 0, "maximum": 1}}}},
        "replicas": REPLICAS_SCHEMA,
        "workload": {"type": "object", "additionalProperties": False, "properties": {
            "num_requests": {"type": "integer", "minimum": 1},
            "duration_s": _POS,
            "arrival": {"type": "object", "additionalProperties": False, "properties": {
                "request_rate": {"oneOf": [_POS, {"const": "inf"}]},
                "burstiness": _POS, "schedule": {"enum": ["constant", "low", "high", "fluctuating"]},
                "low_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                "period_s": _POS}},
            "max_concurrency": {"type": ["integer", "null"], "minimum": 1},
            "domains": {"type": "object", "minProperties": 1, "additionalProperties": _NUM},
            "input_len": {"type": "integer", "minimum": 1},
            "output_len": {"type": "integer", "minimum": 1},
            "range_ratio": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
            "shared_prefix": {"type": "object", "additionalProperties": False, "required": ["groups", "tokens"],
                              "properties": {"groups": {"type": "integer", "minimum": 1},
                                             "tokens": {"type": "integer", "minimum": 1}}},
            "requests": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "required": ["input_len", "output_len"],
                "properties": {"domain": {"type": "string"}, "input_len": {"type": "integer", "minimum": 1},
                               "output_len": {"type": "integer", "minimum": 1}, "arrival_s": _NUM}}}}},
    },
}


class ScenarioError(ValueError):
    """A bad scenario file: the message names the key."""


@dataclass(slots=True)
class Scenario:
    data: dict[str, Any]
    base_dir: Path = field(default_factory=Path.cwd)
    """Relative profile paths are read from here (the scenario file's folder)."""

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def workload(self) -> dict[str, Any]:
        return self.data["workload"]

    @property
    def seed(self) -> int:
        return int(self.data.get("seed", 0))


def validate(data: Any) -> None:
    """Raise ScenarioError with the first problem (its key path), or return."""
    import jsonschema

    if not isinstance(data, dict):
        raise ScenarioError("the scenario must be a mapping")
    refuse_renamed_keys(data)
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(data), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        where = ".".join(str(p) for p in e.absolute_path) or "the scenario"
        raise ScenarioError(f"{where}: {e.message}")
    engine_config(data)
    devices = set(data.get("devices", ())) | {ENGINE_DEVICE}
    latency = data["latency"]
    host = data.get("engine_host", {}).get("device", ENGINE_DEVICE)
    if host not in devices:
        raise ScenarioError(f"engine_host.device: unknown device {host!r} (devices: {', '.join(sorted(devices))})")
    for i, st in enumerate(data["stages"]):
        if st["device"] not in devices:
            raise ScenarioError(f"stages.{i}.device: unknown device {st['device']!r}")
        if st["latency"] not in latency:
            raise ScenarioError(f"stages.{i}.latency: unknown latency model {st['latency']!r}")
    names = [d["name"] for d in data.get("drafters", ())]
    if len(set(names)) != len(names):
        raise ScenarioError("drafters: two drafters share a name")
    for i, d in enumerate(data.get("drafters", ())):
        if d.get("device", ENGINE_DEVICE) not in devices:
            raise ScenarioError(f"drafters.{i}.device: unknown device {d['device']!r}")
        prof = (d.get("latency") or {}).get("profile")
        if prof is not None and "profile" not in latency.get(prof, {}):
            raise ScenarioError(f"drafters.{i}.latency.profile: {prof!r} is not a measured profile in `latency`")
    count = data.get("replicas", {}).get("count", 1)
    for i, f in enumerate(data.get("replicas", {}).get("failures", ())):
        if f["replica"] >= count:
            raise ScenarioError(f"replicas.failures.{i}.replica: {f['replica']} is not one of the {count} replicas")
    w = data["workload"]
    if ("requests" in w) == ("num_requests" in w or "duration_s" in w):
        raise ScenarioError("workload: give either `requests` or `num_requests`/`duration_s`")
    if "requests" not in w and "num_requests" in w and "duration_s" in w:
        raise ScenarioError("workload: give `num_requests` or `duration_s`, not both")
    if "domains" in w and not sum(w["domains"].values()) > 0:
        raise ScenarioError("workload.domains: the weights must sum to more than 0")
    rate = w.get("arrival", {}).get("request_rate", "inf")
    if "duration_s" in w and rate == "inf":
        raise ScenarioError("workload.duration_s needs a finite arrival.request_rate")
    if w.get("arrival", {}).get("schedule", "constant") != "constant" and rate == "inf":
        raise ScenarioError("workload.arrival.schedule needs a finite request_rate (the peak rate)")


def engine_config(data: dict[str, Any]) -> EngineConfig:
    """The engine config of the scenario's ``engine`` parts, resolved (one lane unless
    ``scheduler.num_lanes`` says); ScenarioError names a bad key."""
    engine = data.get("engine") or {}
    try:
        config = config_from_dict(engine)
    except ValueError as exc:
        raise ScenarioError(f"engine: {exc}") from None
    other = sorted(set(engine) - set(ENGINE_PARTS))
    if other:
        raise ScenarioError(f"engine: {', '.join(other)} is not simulated; give {', '.join(ENGINE_PARTS)}")
    return config.resolved()


ENGINE_DEVICE = "engine"
"""The device that is the engine's host: it always exists."""
RENAMED_KEYS = {"router": "engine_host"}
RENAMED_LINKS = {"router_stage": "engine_stage", "router_drafter": "engine_drafter"}
RENAMED_DEVICES = {"router": ENGINE_DEVICE}
"""Old names of keys, links and devices: a scenario that uses one gets an error naming the new one."""


def refuse_renamed_keys(data: dict) -> None:
    """Raise ScenarioError naming the new name of the first old one in ``data``, or return."""
    for old, new in RENAMED_KEYS.items():
        if old in data:
            raise ScenarioError(f"'{old}' was renamed: use '{new}'")
    links = data.get("links")
    for old, new in RENAMED_LINKS.items():
        if isinstance(links, dict) and old in links:
            raise ScenarioError(f"'links.{old}' was renamed: use 'links.{new}'")
    devices = data.get("devices") if isinstance(data.get("devices"), list) else []
    parts = [data.get("engine_host"), *(data.get("stages") or ()), *(data.get("drafters") or ())]
    named = set(devices) | {p.get("device") for p in parts if isinstance(p, dict)}
    for old, new in RENAMED_DEVICES.items():
        if old in named:
            raise ScenarioError(f"device '{old}' was renamed: use '{new}'")


def load(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path} is not YAML/JSON: {str(exc).splitlines()[0]}") from None
    validate(data)
    return Scenario(data, path.resolve().parent)


def set_key(data: dict, path: str, value: Any) -> None:
    """Set ``a.b.0.c`` (mapping keys and list indices) to ``value``, making mappings on the way;
    ``None`` removes the key (switch ``num_requests`` to ``duration_s``, say). ScenarioError when
    a part of the path is not a mapping or not an index of its list."""
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ScenarioError("an empty key path")
    node: Any = data
    for i, k in enumerate(keys):
        last = i == len(keys) - 1
        where = ".".join(keys[:i + 1])
        if isinstance(node, list):
            try:
                index = int(k)
                node[index]
            except (ValueError, IndexError):
                raise ScenarioError(f"{where} is not an index of the list") from None
            if last:
                node[index] = value
            else:
                node = node[index]
            continue
        if not isinstance(node, dict):
            raise ScenarioError(f"{'.'.join(keys[:i])} is not a mapping")
        if last:
            if value is None:
                node.pop(k, None)
            else:
                node[k] = value
        else:
            node = node.setdefault(k, {})


def set_engine_settings(data: dict, **settings: Any) -> None:
    """Engine settings by name, each in its part of the scenario's ``engine`` (``num_lanes`` in
    ``engine.scheduler``: the names of ``EngineConfig.replace``)."""
    unknown = sorted(set(settings) - set(SETTING_PATHS))
    if unknown:
        raise ScenarioError(f"engine: unknown setting(s) {', '.join(unknown)}")
    for name, value in settings.items():
        set_key(data, f"engine.{SETTING_PATHS[name]}", value)


def request_rate(value: Any) -> float:
    return math.inf if value in ("inf", None) else float(value)
