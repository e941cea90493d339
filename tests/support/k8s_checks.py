"""Checks for the Kubernetes manifests in ``k8s/`` that need no Kubernetes cluster.

Each check returns a list of human-readable errors (empty = valid), so a test can assert both
that the committed manifests pass and that a broken copy fails for the expected reason.

Layers, from generic to ours:

1. **CRD schema** (``crd_errors``): the KubeRay CRDs' OpenAPI v3 schemas in
   ``tests/deploy/crds`` (copied from KubeRay, see the README.md there) validated with
   ``jsonschema`` (Draft 4, the dialect OpenAPI 3.0 schemas follow). The Kubernetes
   extensions are handled like this:

   * unknown fields are **errors** (``additionalProperties: false`` is added to every object
     schema that lists ``properties`` and says nothing else): the API server would silently
     prune them, but ``kubectl apply`` (``--validate=strict``, its default) rejects them, and a
     typo like ``rayStartParam`` must not pass unnoticed;
   * ``nullable: true`` admits ``null``;
   * ``x-kubernetes-int-or-string`` (the CRDs already spell it ``anyOf: [integer, string]``;
     added where missing);
   * ``x-kubernetes-list-type: map|set`` are enforced: list items must be unique by their
     ``x-kubernetes-list-map-keys`` (missing keys take the schema default, e.g. a container
     port's ``protocol: TCP``) or as whole values;
   * ``x-kubernetes-validations`` (CEL): rules comparing with ``oldSelf`` only apply to updates
     and are skipped; rules of the form ``self in [...]`` are evaluated; any other rule on a
     field we set fails the check, saying it could not be evaluated here (none do today);
   * ``x-kubernetes-map-type`` and ``format`` (int32, int64, date-time) only describe
     merging/encoding and are not checked.

2. **KubeRay controller rules** (``kuberay_errors``): the subset of KubeRay's own validation
   (``ray-operator/controllers/ray/utils/validation.go``) that can reject our manifests after
   the API server accepted them: name length and DNS-1035 syntax, containers present, custom
   resources not given both in ``rayStartParams`` and ``resources``, no ``labels`` in
   rayStartParams, GCS fault tolerance configured only through ``gcsFaultToleranceOptions``.
   Plus replica bounds (``minReplicas <= replicas <= maxReplicas``) and unique group names.

3. **Our rules** (``cosine_errors``): every container names an image, the two worker groups
   exist and advertise the custom resources the placement code asks for.

Plain Kubernetes objects (Service, Deployment, PVC, ConfigMap, NetworkPolicy) and the Prometheus
operator's PodMonitor have no CRD file here; ``basic_object_errors`` and
``podmonitor_errors`` validate them against small hand-written JSON Schemas of the fields we use.
"""

from __future__ import annotations

import ast
import copy
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
CRD_DIR = Path(os.environ.get("COSINE_RAY_KUBERAY_CRDS") or (REPO / "tests" / "deploy" / "crds"))
"""The KubeRay CRDs in the repository; ``$COSINE_RAY_KUBERAY_CRDS`` checks against another release."""
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}
VARIANTS = ("rayservice", "raycluster", "cpu-dev")
"""Folders under k8s/ that `kubectl apply -k` deploys, each a complete variant."""
STAGE_GROUP = "datacenter-gpu"
DRAFTER_GROUP = "consumer-gpu"

Doc = dict[str, Any]


# ---- loading ---------------------------------------------------------------------------------

def load_yaml_docs(path: Path) -> list[Doc]:
    """Every non-empty document of a YAML file."""
    with path.open(encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def render_kustomization(folder: Path) -> list[Doc]:
    """The objects ``kubectl kustomize FOLDER`` would emit for our plain kustomizations.

    Our kustomizations only list ``resources`` (files or other kustomization folders), with no
    patches, name prefixes, generators or namespace: rendering is concatenation. Anything else
    raises ValueError, so this stays exactly what kustomize does (a test also compares with
    ``kubectl kustomize`` where kubectl exists)."""
    kfile = folder / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text(encoding="utf-8"))
    extra = set(spec) - {"apiVersion", "kind", "resources"}
    if extra:
        raise ValueError(f"{kfile}: only `resources` is supported by this renderer, found {sorted(extra)}")
    docs: list[Doc] = []
    for entry in spec.get("resources") or []:
        target = (folder / entry).resolve()
        if target.is_dir():
            docs.extend(render_kustomization(target))
        elif target.is_file():
            docs.extend(load_yaml_docs(target))
        else:
            raise ValueError(f"{kfile}: resource {entry!r} does not exist")
    return docs


def ray_docs(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d.get("kind") in CRD_FILES]


def cluster_spec(doc: Doc) -> Doc:
    """The RayCluster spec of a RayCluster or RayService document."""
    return doc["spec"]["rayClusterConfig"] if doc["kind"] == "RayService" else doc["spec"]


def groups(doc: Doc) -> Iterator[tuple[str, Doc]]:
    """(group name, group spec) for the head ("head") and every worker group."""
    spec = cluster_spec(doc)
    yield "head", spec["headGroupSpec"]
    for group in spec.get("workerGroupSpecs") or []:
        yield group.get("groupName", "?"), group


def worker_group(doc: Doc, name: str) -> Doc | None:
    return next((g for n, g in groups(doc) if n == name and n != "head"), None)


def ray_container(group: Doc) -> Doc:
    """KubeRay treats the first container of a group's Pod template as the Ray container."""
    return group["template"]["spec"]["containers"][0]


def parse_ray_resources(value: str) -> dict[str, float]:
    """``rayStartParams.resources`` → mapping. KubeRay passes the value to ``ray start`` through a
    shell, so the documented form is a double-quoted, escaped JSON object: '"{\\"x\\": 1}"'."""
    text = value.strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1].replace('\\"', '"')
    parsed = json.loads(text)
    if not isinstance(parsed, dict) or not all(isinstance(v, (int, float)) for v in parsed.values()):
        raise ValueError(f"rayStartParams.resources must be a JSON object of numbers, got {value!r}")
    return parsed


def serve_config_of(doc: Doc) -> Doc:
    """The parsed serveConfigV2 of a RayService (ValueError if missing or not a mapping)."""
    text = doc.get("spec", {}).get("serveConfigV2")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{doc['kind']} {doc['metadata']['name']}: spec.serveConfigV2 is missing")
    parsed = yaml.safe_load(text)
    if not isinstance(parsed, dict):
        raise ValueError("serveConfigV2 must be a YAML mapping")
    return parsed


# ---- layer 1: CRD schema ---------------------------------------------------------------------

def _to_json_schema(node: Any) -> Any:
    """OpenAPI v3 (Kubernetes structural schema) → JSON Schema Draft 4, see module docstring."""
    if isinstance(node, list):
        return [_to_json_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_json_schema(v) for k, v in node.items()}
    if out.get("x-kubernetes-int-or-string") and "type" not in out and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _list_type(validator, list_type, instance, schema):
    if not isinstance(instance, list):
        return
    if list_type == "set":
        seen: list[Any] = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"duplicate item {item!r} in a list-type=set list")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        item_props = (schema.get("items") or {}).get("properties") or {}
        seen_keys: set[tuple] = set()
        for item in instance:
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, item_props.get(k, {}).get("default")) for k in keys)
            if key in seen_keys:
                yield jsonschema.ValidationError(f"duplicate entry with {dict(zip(keys, key))} in a list keyed by {keys}")
            seen_keys.add(key)


_SELF_IN = re.compile(r"^\s*self\s+in\s+(\[.*\])\s*$")


def _cel_rules(validator, rules, instance, schema):
    for rule in rules:
        text = rule.get("rule", "")
        if "oldSelf" in text:
            continue  # transition rule: only checked when an existing object is updated
        match = _SELF_IN.match(text)
        if match:
            allowed = ast.literal_eval(match.group(1))
            if instance not in allowed:
                yield jsonschema.ValidationError(rule.get("message") or f"{instance!r} not in {allowed}")
            continue
        yield jsonschema.ValidationError(f"CEL rule {text!r} cannot be evaluated here; check by hand")


K8sValidator = jsonschema.validators.extend(
    jsonschema.Draft4Validator,
    {"x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel_rules},
)


@functools.lru_cache(maxsize=None)
def crd_validator(kind: str) -> tuple[str, Any]:
    """(``group/version`` to use, validator) for a KubeRay kind, from the CRD's storage version."""
    path = CRD_DIR / CRD_FILES[kind]
    if not path.is_file():
        raise FileNotFoundError(f"KubeRay CRD {path} not found (tests/deploy/crds ships it; "
                                f"COSINE_RAY_KUBERAY_CRDS points elsewhere)")
    crd = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    schema = _to_json_schema(version["schema"]["openAPIV3Schema"])
    K8sValidator.check_schema(schema)
    return f"{crd['spec']['group']}/{version['name']}", K8sValidator(schema)


def crd_errors(doc: Doc) -> list[str]:
    api_version, validator = crd_validator(doc["kind"])
    errors = []
    if doc.get("apiVersion") != api_version:
        errors.append(f"apiVersion {doc.get('apiVersion')!r}: the CRD stores {api_version}")
    for err in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in err.absolute_path) or "(root)"
        errors.append(f"{where}: {err.message}")
    return errors


# ---- layer 2: KubeRay controller rules -------------------------------------------------------

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_NAME = {"RayCluster": 53, "RayService": 53 - 6}  # KubeRay: MaxRayClusterNameLength (- suffix)
GROUP_RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")


def kuberay_errors(doc: Doc) -> list[str]:
    errors = []
    name = (doc.get("metadata") or {}).get("name", "")
    if not DNS1035.match(name) or len(name) > MAX_NAME[doc["kind"]]:
        errors.append(f"metadata.name {name!r}: must be a DNS-1035 label of at most {MAX_NAME[doc['kind']]} characters")
    spec = cluster_spec(doc)
    seen = set()
    for group_name, group in groups(doc):
        containers = (((group.get("template") or {}).get("spec") or {}).get("containers")) or []
        if not containers:
            errors.append(f"{group_name}: the Pod template needs at least one container")
        params = group.get("rayStartParams") or {}
        if any(params.get(k) for k in GROUP_RESOURCE_PARAMS) and group.get("resources"):
            errors.append(f"{group_name}: resources set both in rayStartParams and in `resources`")
        if "labels" in params:
            errors.append(f"{group_name}: rayStartParams['labels'] is not supported; use `labels`")
        if group_name == "head":
            continue
        if group_name in seen:
            errors.append(f"worker group name {group_name!r} used twice")
        seen.add(group_name)
        lo, hi = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
        replicas = group.get("replicas", lo)
        if not lo <= replicas <= hi:
            errors.append(f"{group_name}: need minReplicas <= replicas <= maxReplicas, got {lo}, {replicas}, {hi}")
    if spec.get("gcsFaultToleranceOptions"):
        head = spec["headGroupSpec"]
        env = {e.get("name") for c in head["template"]["spec"].get("containers", []) for e in c.get("env") or []}
        for forbidden in ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD"):
            if forbidden in env:
                errors.append(f"head env {forbidden} conflicts with gcsFaultToleranceOptions")
        if (head.get("rayStartParams") or {}).get("redis-password"):
            errors.append("rayStartParams.redis-password conflicts with gcsFaultToleranceOptions")
        if "ray.io/ft-enabled" in ((doc.get("metadata") or {}).get("annotations") or {}):
            errors.append("annotation ray.io/ft-enabled conflicts with gcsFaultToleranceOptions")
    return errors


# ---- layer 3: ours ---------------------------------------------------------------------------

def cosine_errors(doc: Doc) -> list[str]:
    """Images present; the stage and drafter groups exist and advertise the placement resources."""
    from cosine_ray.runtime.placement import DRAFTER_RESOURCE, STAGE_RESOURCE

    errors = []
    for group_name, group in groups(doc):
        for c in ((group.get("template") or {}).get("spec") or {}).get("containers") or []:
            if not c.get("image"):
                errors.append(f"{group_name}: container {c.get('name')!r} has no image")
    for group_name, resource in ((STAGE_GROUP, STAGE_RESOURCE), (DRAFTER_GROUP, DRAFTER_RESOURCE)):
        group = worker_group(doc, group_name)
        if group is None:
            errors.append(f"worker group {group_name!r} is missing")
            continue
        raw = (group.get("rayStartParams") or {}).get("resources")
        if raw is None:
            errors.append(f"{group_name}: rayStartParams.resources must advertise {resource!r}")
            continue
        try:
            advertised = parse_ray_resources(raw)
        except ValueError as exc:
            errors.append(f"{group_name}: {exc}")
            continue
        if set(advertised) != {resource} or advertised[resource] <= 0:
            errors.append(f"{group_name}: advertises {advertised}, the placement code asks for {resource!r}")
    return errors


def all_errors(doc: Doc) -> list[str]:
    return crd_errors(doc) + kuberay_errors(doc) + cosine_errors(doc)


# ---- plain Kubernetes objects and PodMonitor (no CRD file here) --------------------------------

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
_METADATA = {"type": "object", "required": ["name"],
             "properties": {"name": _NAME, "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                            "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
BASIC_OBJECT_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata"],
    "properties": {"apiVersion": {"type": "string", "minLength": 1},
                   "kind": {"type": "string", "minLength": 1}, "metadata": _METADATA},
}
PODMONITOR_SCHEMA = {
    # Only the fields of monitoring.coreos.com/v1 PodMonitor that k8s/monitoring uses, written
    # from the Prometheus operator's API reference; unknown fields are errors.
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"enum": ["monitoring.coreos.com/v1"]},
        "kind": {"enum": ["PodMonitor"]},
        "metadata": _METADATA,
        "spec": {
            "type": "object", "required": ["selector", "podMetricsEndpoints"], "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                             "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                            "additionalProperties": {"type": "string"}}}},
                "podMetricsEndpoints": {
                    "type": "array", "minItems": 1,
                    "items": {"type": "object", "required": ["port"], "additionalProperties": False,
                              "properties": {"port": {"type": "string", "minLength": 1},
                                             "path": {"type": "string", "pattern": "^/"},
                                             "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s|m|h)$"}}}},
            },
        },
    },
}


_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {"matchLabels": _LABELS}}
NETWORKPOLICY_SCHEMA = {
    # The fields of networking.k8s.io/v1 NetworkPolicy that k8s/ uses (ingress only), from the
    # Kubernetes API reference; unknown fields are errors.
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"enum": ["networking.k8s.io/v1"]},
        "kind": {"enum": ["NetworkPolicy"]},
        "metadata": _METADATA,
        "spec": {
            "type": "object", "required": ["podSelector"], "additionalProperties": False,
            "properties": {
                "podSelector": _SELECTOR,
                "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
                "ingress": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "from": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False, "minProperties": 1,
                            "properties": {"podSelector": _SELECTOR, "namespaceSelector": _SELECTOR}}},
                        "ports": {"type": "array", "items": {
                            "type": "object", "required": ["port"], "additionalProperties": False,
                            "properties": {"port": {"type": ["integer", "string"]},
                                           "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}}}}}},
            },
        },
    },
}


def _schema_errors(schema: Doc, doc: Doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]


def basic_object_errors(doc: Doc) -> list[str]:
    if doc.get("kind") == "NetworkPolicy":
        return _schema_errors(NETWORKPOLICY_SCHEMA, doc)
    errors = _schema_errors(BASIC_OBJECT_SCHEMA, doc)
    if doc.get("kind") in ("Deployment",):
        pod = (((doc.get("spec") or {}).get("template") or {}).get("spec")) or {}
        for c in pod.get("containers") or []:
            if not c.get("image"):
                errors.append(f"container {c.get('name')!r} has no image")
        selector = ((doc.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        labels = (((doc.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            errors.append("spec.selector.matchLabels must match the Pod template labels")
    return errors


def podmonitor_errors(doc: Doc) -> list[str]:
    return _schema_errors(PODMONITOR_SCHEMA, doc)


def without(doc: Doc, *path: str | int) -> Doc:
    """A deep copy of ``doc`` with the field at ``path`` removed (for broken-copy tests)."""
    broken = copy.deepcopy(doc)
    node = broken
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return broken
