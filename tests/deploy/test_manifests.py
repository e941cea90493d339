"""The Kubernetes manifests in k8s/ checked without a Kubernetes cluster.

What runs: every YAML parses; every variant (k8s/rayservice, k8s/raycluster, k8s/cpu-dev)
renders from its kustomization (and matches `kubectl kustomize` where kubectl exists); every
RayService / RayCluster validates against the KubeRay CRD schemas in tests/deploy/crds
(KubeRay 1.7 line) plus KubeRay's controller rules (tests/support/k8s_checks.py says how the
OpenAPI extensions are handled); the serveConfigV2 goes through Ray Serve's config
schema and the app's own builder (`cosine_ray.serve.app.build_app` → `config_from_dict`) and
equals deploy/serve_config.yaml up to the overrides listed below; the custom resources the
worker groups advertise are exactly the ones the placement code asks for, in enough units for
every stage and drafter; probes point at the app's public /health; GCS fault tolerance points
at the Redis in k8s/redis; PodMonitors select the Ray Pods; the Grafana ConfigMap is in sync
with dashboards/. Broken copies (a required field removed, a wrong type, a typo) must fail.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import support.k8s_checks as k

# ---- the single source of the Serve config -----------------------------------------------------

BASE_SERVE_CONFIG = k.REPO / "deploy" / "serve_config.yaml"
APP = "cosine_ray"
SERVE_OVERRIDES: dict[str, dict[tuple[str, ...], Any]] = {
    # file (relative to the repo) → {path under applications[APP].args: value}. Every serve config
    # shipped under k8s/ is deploy/serve_config.yaml plus exactly these changes; the manifests'
    # comments list the same overrides.
    "k8s/rayservice/rayservice.yaml": {("device",): "cuda", ("cluster", "use_resources"): True,
                                       ("cluster", "drafters_in_engine"): "none", ("drafters",): "ngram,retrieval"},
    "k8s/cpu-dev/rayservice.yaml": {("cluster", "use_resources"): True, ("cluster", "drafters_in_engine"): "none",
                                    ("drafters",): "ngram,retrieval"},
    "k8s/serve_config.cluster.yaml": {("device",): "cuda", ("cluster", "use_resources"): True,
                                      ("cluster", "drafters_in_engine"): "none", ("drafters",): "ngram,retrieval"},
}
SERVE_CONFIG_OF_VARIANT = {
    # Where each variant's Serve app comes from: the RayService's own serveConfigV2, or (plain
    # RayCluster) the file docs/deployment.md tells you to `serve deploy`.
    "rayservice": "k8s/rayservice/rayservice.yaml",
    "cpu-dev": "k8s/cpu-dev/rayservice.yaml",
    "raycluster": "k8s/serve_config.cluster.yaml",
}


def _variant_docs(variant: str) -> list[dict]:
    return k.render_kustomization(k.K8S_DIR / variant)


def _ray_doc(variant: str) -> dict:
    (doc,) = k.ray_docs(_variant_docs(variant))
    return doc


def _serve_config(relpath: str) -> dict:
    path = k.REPO / relpath
    (doc,) = k.load_yaml_docs(path)
    return k.serve_config_of(doc) if doc.get("kind") == "RayService" else doc


def _app(serve_config: dict) -> dict:
    (app,) = [a for a in serve_config["applications"] if a["name"] == APP]
    return app


def _with_overrides(base: dict, overrides: dict[tuple[str, ...], Any]) -> dict:
    out = copy.deepcopy(base)
    args = _app(out)["args"]
    for path, value in overrides.items():
        node = args
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def _engine_config(serve_config: dict):
    """The EngineConfig the app would build: the serve-only args are split off with the app's
    own INGRESS_ARGS list, the rest goes through config_from_dict."""
    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.serve.app import INGRESS_ARGS

    args = {key: value for key, value in (_app(serve_config).get("args") or {}).items()
            if key not in INGRESS_ARGS}
    return config_from_dict(args)


def serve_config_errors(serve_config: dict) -> list[str]:
    """Ray Serve's own schema, then the app's builder on the args (what `serve deploy` runs)."""
    from ray.serve.schema import ServeDeploySchema

    from cosine_ray.serve.app import build_app

    try:
        validate = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj
        validate(serve_config)
        app = _app(serve_config)
        if app.get("import_path") != "cosine_ray.serve.app:build_app":
            return [f"import_path {app.get('import_path')!r} is not the cosine_ray app builder"]
        build_app(copy.deepcopy(app.get("args") or {}))
    except (ValueError, TypeError, KeyError) as exc:  # pydantic's ValidationError is a ValueError
        return [f"{type(exc).__name__}: {str(exc).splitlines()[0]}"]
    return []


# ---- parsing and rendering --------------------------------------------------------------------

def test_every_yaml_file_under_k8s_parses_and_is_used():
    files = sorted(k.K8S_DIR.rglob("*.yaml"))
    assert len(files) >= 10
    used: set[Path] = set()
    for variant in k.VARIANTS:
        folder = k.K8S_DIR / variant
        stack = [folder]
        while stack:  # the files each variant's kustomization pulls in
            current = stack.pop()
            used.add(current / "kustomization.yaml")
            for entry in yaml.safe_load((current / "kustomization.yaml").read_text())["resources"]:
                target = (current / entry).resolve()
                if target.is_dir():
                    stack.append(target)
                else:
                    used.add(target)
    serve_configs = {(k.REPO / p).resolve() for p in SERVE_CONFIG_OF_VARIANT.values()}
    for path in files:
        docs = k.load_yaml_docs(path)
        assert docs, f"{path} is empty"
        for doc in docs:
            assert isinstance(doc, dict), f"{path}: a document is not a mapping"
            if "applications" in doc:  # a Serve config, not a Kubernetes object
                continue
            assert doc.get("apiVersion") and doc.get("kind"), f"{path}: document without apiVersion/kind"
        assert path.resolve() in used | serve_configs, f"{path} is not used by any variant"


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_variant_renders_with_unique_objects(variant):
    docs = _variant_docs(variant)
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"duplicate objects in {variant}: {keys}"
    assert len(k.ray_docs(docs)) == 1
    expected_kind = "RayCluster" if variant == "raycluster" else "RayService"
    assert k.ray_docs(docs)[0]["kind"] == expected_kind


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed: renderer cross-check skipped")
@pytest.mark.parametrize("variant", k.VARIANTS)
def test_renderer_matches_kubectl_kustomize(variant):
    out = subprocess.run(["kubectl", "kustomize", str(k.K8S_DIR / variant)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = sorted((d for d in yaml.safe_load_all(out.stdout) if d), key=lambda d: (d["kind"], d["metadata"]["name"]))
    ours = sorted(_variant_docs(variant), key=lambda d: (d["kind"], d["metadata"]["name"]))
    assert theirs == ours


# ---- schema validation ------------------------------------------------------------------------

@pytest.mark.parametrize("variant", k.VARIANTS)
def test_ray_manifest_validates_against_kuberay_crd_and_rules(variant):
    doc = _ray_doc(variant)
    assert k.crd_errors(doc) == []
    assert k.kuberay_errors(doc) == []
    assert k.cosine_errors(doc) == []


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_other_objects_validate(variant):
    for doc in _variant_docs(variant):
        if doc["kind"] in k.CRD_FILES:
            continue
        errors = k.podmonitor_errors(doc) if doc["kind"] == "PodMonitor" else k.basic_object_errors(doc)
        assert errors == [], f"{doc['kind']} {doc['metadata'].get('name')}: {errors}"


def test_crd_schemas_are_the_kuberay_ones():
    for kind in k.CRD_FILES:
        api_version, validator = k.crd_validator(kind)
        assert api_version == "ray.io/v1"
        assert "spec" in validator.schema["properties"]


# ---- broken copies must fail ------------------------------------------------------------------

def _spec_path(doc: dict, *rest):
    return (("spec", "rayClusterConfig") if doc["kind"] == "RayService" else ("spec",)) + rest


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_removing_head_group_fails_crd_validation(variant):
    doc = _ray_doc(variant)
    broken = k.without(doc, *_spec_path(doc, "headGroupSpec"))
    assert any("'headGroupSpec' is a required property" in e for e in k.crd_errors(broken))


@pytest.mark.parametrize("variant", k.VARIANTS)
@pytest.mark.parametrize("field", ["groupName", "maxReplicas", "minReplicas", "template"])
def test_removing_required_worker_group_field_fails(variant, field):
    doc = _ray_doc(variant)
    broken = k.without(doc, *_spec_path(doc, "workerGroupSpecs", 0, field))
    assert any(f"'{field}' is a required property" in e for e in k.crd_errors(broken))


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_removing_a_container_image_fails(variant):
    doc = _ray_doc(variant)
    broken = k.without(doc, *_spec_path(doc, "workerGroupSpecs", 1, "template", "spec", "containers", 0, "image"))
    assert any("has no image" in e for e in k.all_errors(broken))


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_wrong_type_and_unknown_field_fail(variant):
    doc = _ray_doc(variant)
    broken = copy.deepcopy(doc)
    spec = k.cluster_spec(broken)
    spec["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 8       # must be a string
    spec["headGroupSpec"]["rayStartParam"] = {}                         # typo
    errors = k.crd_errors(broken)
    assert any("8 is not of type 'string'" in e for e in errors)
    assert any("'rayStartParam' was unexpected" in e for e in errors)


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_duplicate_container_port_fails(variant):
    doc = _ray_doc(variant)
    broken = copy.deepcopy(doc)
    ports = k.ray_container(k.cluster_spec(broken)["headGroupSpec"])["ports"]
    ports.append({"name": "serve-again", "containerPort": ports[0]["containerPort"]})
    assert any("duplicate entry" in e for e in k.crd_errors(broken))


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_missing_or_wrong_custom_resource_fails(variant):
    from cosine_ray.runtime.placement import DRAFTER_RESOURCE

    doc = _ray_doc(variant)
    broken = k.without(doc, *_spec_path(doc, "workerGroupSpecs", 1, "rayStartParams", "resources"))
    assert any(DRAFTER_RESOURCE in e for e in k.cosine_errors(broken))
    renamed = copy.deepcopy(doc)
    k.worker_group(renamed, k.DRAFTER_GROUP)["rayStartParams"]["resources"] = '"{\\"consumer-gpu\\": 1}"'
    assert any("the placement code asks for" in e for e in k.cosine_errors(renamed))


def test_removing_serve_config_fails():
    doc = _ray_doc("rayservice")
    with pytest.raises(ValueError, match="serveConfigV2 is missing"):
        k.serve_config_of(k.without(doc, "spec", "serveConfigV2"))


def test_bad_serve_config_fails_through_the_app(monkeypatch):
    monkeypatch.setenv("COSINE_RAY_API_KEY", "from-the-secret")
    config = _serve_config(SERVE_CONFIG_OF_VARIANT["rayservice"])
    unknown = copy.deepcopy(config)
    _app(unknown)["args"]["speculation"]["no_such_option"] = 1
    assert any("no_such_option" in e for e in serve_config_errors(unknown))
    bad_drafter = copy.deepcopy(config)
    _app(bad_drafter)["args"]["drafters"] = "ngram,telepathy"
    assert any("telepathy" in e for e in serve_config_errors(bad_drafter))
    no_apps = copy.deepcopy(config)
    del no_apps["applications"]
    assert serve_config_errors(no_apps)


def test_kuberay_rules_catch_ft_and_replica_mistakes():
    doc = _ray_doc("rayservice")
    broken = copy.deepcopy(doc)
    spec = k.cluster_spec(broken)
    k.ray_container(spec["headGroupSpec"])["env"].append({"name": "RAY_REDIS_ADDRESS", "value": "x:6379"})
    spec["workerGroupSpecs"][0]["replicas"] = spec["workerGroupSpecs"][0]["maxReplicas"] + 1
    broken["metadata"]["name"] = "Cosine_Ray"
    errors = k.kuberay_errors(broken)
    assert any("RAY_REDIS_ADDRESS" in e for e in errors)
    assert any("minReplicas <= replicas <= maxReplicas" in e for e in errors)
    assert any("DNS-1035" in e for e in errors)


# ---- the Serve app ----------------------------------------------------------------------------

@pytest.mark.parametrize("relpath", sorted(SERVE_OVERRIDES))
def test_serve_config_is_the_deploy_config_plus_documented_overrides(relpath):
    base = yaml.safe_load(BASE_SERVE_CONFIG.read_text())
    assert _serve_config(relpath) == _with_overrides(base, SERVE_OVERRIDES[relpath])


@pytest.mark.parametrize("relpath", sorted(SERVE_OVERRIDES) + ["deploy/serve_config.yaml"])
def test_serve_config_loads_through_the_app(relpath, monkeypatch):
    """With the key every Ray container gets from the required Secret; without it the builder
    refuses (closed by default: these configs listen on 0.0.0.0), unless the args allow it."""
    config = _serve_config(relpath)
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)
    (refused,) = serve_config_errors(config)
    assert refused.startswith("ValueError: no API key: set COSINE_RAY_API_KEY") and "allow_unauthenticated" in refused
    opened = copy.deepcopy(config)
    _app(opened)["args"]["allow_unauthenticated"] = True
    assert serve_config_errors(opened) == []
    monkeypatch.setenv("COSINE_RAY_API_KEY", "from-the-secret")
    assert serve_config_errors(config) == []
    engine = _engine_config(config)
    if relpath != "deploy/serve_config.yaml":
        assert engine.cluster.use_resources, "on a cluster the actors must ask for the group resources"


# ---- placement: the resources the code asks for are the ones the groups advertise -------------

def _cpu_quantity(value: str | int) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("variant", k.VARIANTS)
def test_every_actor_fits_on_the_worker_groups(variant):
    """Ask the placement code what each stage and drafter actor requests, then check that
    (a) only the stage group can host stages and only the drafter group drafters, and (b) the
    groups at minReplicas hold every actor (custom resource, GPU and CPU per Pod)."""
    from cosine_ray.runtime.placement import ROLE_RESOURCES, actor_options

    doc = _ray_doc(variant)
    engine = _engine_config(_serve_config(SERVE_CONFIG_OF_VARIANT[variant]))
    counts = {"stage": engine.num_stages,
              "drafter": sum(1 for d in engine.drafters if d.kind not in engine.cluster.drafters_in_engine)}
    assert counts["drafter"] >= 1
    group_of_role = {"stage": k.STAGE_GROUP, "drafter": k.DRAFTER_GROUP}
    advertised_names = set()
    for role, count in counts.items():
        requests = [actor_options(role, i, engine) for i in range(count)]
        (resource,) = {name for r in requests for name in r["resources"]}
        assert resource == ROLE_RESOURCES[role]
        hosts = [name for name, g in k.groups(doc) if name != "head"
                 and resource in k.parse_ray_resources(g["rayStartParams"]["resources"])]
        assert hosts == [group_of_role[role]], f"{resource} advertised by {hosts}"
        group = k.worker_group(doc, group_of_role[role])
        per_pod = k.parse_ray_resources(group["rayStartParams"]["resources"])[resource]
        advertised_names |= set(k.parse_ray_resources(group["rayStartParams"]["resources"]))
        pods_needed = math.ceil(count * max(r["resources"][resource] for r in requests) / per_pod)
        assert group["minReplicas"] >= pods_needed, f"{role}: {count} actors need {pods_needed} Pods"
        assert group["maxReplicas"] > group["minReplicas"], f"{group_of_role[role]} cannot scale"
        limits = k.ray_container(group)["resources"]["limits"]
        actors_per_pod = math.floor(per_pod)
        gpus = max(r.get("num_gpus", 0) for r in requests)
        assert int(limits.get("nvidia.com/gpu", 0)) >= gpus * actors_per_pod, \
            f"{group_of_role[role]}: {actors_per_pod} actor(s) asking num_gpus={gpus} per Pod"
        cpus = max(r["num_cpus"] for r in requests)
        assert _cpu_quantity(limits["cpu"]) >= cpus * actors_per_pod
    assert advertised_names == set(ROLE_RESOURCES.values())
    assert k.cluster_spec(doc)["enableInTreeAutoscaling"] is True


def test_gpu_variants_use_gpus_and_cpu_dev_does_not():
    for variant in ("rayservice", "raycluster"):
        doc = _ray_doc(variant)
        for name in (k.STAGE_GROUP, k.DRAFTER_GROUP):
            limits = k.ray_container(k.worker_group(doc, name))["resources"]["limits"]
            assert int(limits["nvidia.com/gpu"]) >= 1
        assert _engine_config(_serve_config(SERVE_CONFIG_OF_VARIANT[variant])).device == "cuda"
    doc = _ray_doc("cpu-dev")
    for _, group in k.groups(doc):
        assert "nvidia.com/gpu" not in json.dumps(group)
        assert "nodeSelector" not in group["template"]["spec"]
    assert _engine_config(_serve_config(SERVE_CONFIG_OF_VARIANT["cpu-dev"])).device == "cpu"


def test_ray_version_is_the_installed_one_everywhere():
    import ray

    versions = {k.cluster_spec(_ray_doc(v))["rayVersion"] for v in k.VARIANTS}
    assert versions == {ray.__version__}


# ---- probes, fault tolerance, monitoring, dashboards ------------------------------------------

def _port_number(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    return number


@pytest.mark.parametrize("variant", ["rayservice", "cpu-dev"])
def test_worker_readiness_probes_hit_the_public_health_route(variant):
    from cosine_ray.serve.openai_app import PUBLIC_PATHS

    assert "/health" in PUBLIC_PATHS, "probes send no API key"
    doc = _ray_doc(variant)
    serve_port = _serve_config(SERVE_CONFIG_OF_VARIANT[variant])["http_options"]["port"]
    for name, group in k.groups(doc):
        container = k.ray_container(group)
        if name == "head":
            # KubeRay submits serveConfigV2 only once the head Pod is Ready: a /health probe on
            # the head would keep the app from ever starting.
            assert "readinessProbe" not in container and "livenessProbe" not in container
            continue
        probe = container["readinessProbe"]["httpGet"]
        assert probe["path"] == "/health"
        assert _port_number(container, probe["port"]) == serve_port
        assert container["readinessProbe"]["timeoutSeconds"] > 5, "/health waits up to 5 s for the engine"
        if "livenessProbe" in container:
            assert container["livenessProbe"]["httpGet"]["path"] == "/health"


@pytest.mark.parametrize("variant", ["rayservice", "raycluster"])
def test_gcs_fault_tolerance_uses_the_redis_of_the_variant(variant):
    docs = _variant_docs(variant)
    ft = k.cluster_spec(k.ray_docs(docs)[0])["gcsFaultToleranceOptions"]
    host, port = ft["redisAddress"].rsplit(":", 1)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    service = by_kind["Service"][host]
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    deployment = next(d for d in by_kind["Deployment"].values()
                      if all(d["spec"]["template"]["metadata"]["labels"].get(a) == b
                             for a, b in service["spec"]["selector"].items()))
    redis = deployment["spec"]["template"]["spec"]["containers"][0]
    ref = ft["redisPassword"]["valueFrom"]["secretKeyRef"]
    assert "Secret" not in by_kind and not ref.get("optional"), "the password is a Secret the operator creates"
    env_refs = [e["valueFrom"]["secretKeyRef"] for e in redis["env"] if "valueFrom" in e]
    assert {"name": ref["name"], "key": ref["key"]} in env_refs
    assert "--requirepass" in redis["args"]


def test_cpu_dev_needs_no_redis_or_prometheus_operator():
    kinds = {d["kind"] for d in _variant_docs("cpu-dev")}
    assert "PodMonitor" not in kinds and "Deployment" not in kinds
    assert "gcsFaultToleranceOptions" not in k.cluster_spec(_ray_doc("cpu-dev"))


@pytest.mark.parametrize("variant", ["rayservice", "raycluster"])
def test_podmonitors_select_ray_pods_and_named_ports(variant):
    docs = _variant_docs(variant)
    monitors = [d for d in docs if d["kind"] == "PodMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"cosine-ray-engine", "cosine-ray-ray"}
    ray_doc = k.ray_docs(docs)[0]
    for monitor in monitors:
        selector = monitor["spec"]["selector"]["matchLabels"]
        selected = []
        for name, group in k.groups(ray_doc):
            # KubeRay adds ray.io/node-type (head|worker) to every Pod it creates.
            labels = {**group["template"]["metadata"]["labels"],
                      "ray.io/node-type": "head" if name == "head" else "worker"}
            if all(labels.get(a) == b for a, b in selector.items()):
                selected.append(group)
        assert selected, f"{monitor['metadata']['name']} selects no Ray Pod"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for group in selected:
                _port_number(k.ray_container(group), endpoint["port"])  # the named port exists
    from cosine_ray.serve.metrics_http import METRICS_PATH
    from cosine_ray.serve.openai_app import PUBLIC_PATHS

    engine = next(m for m in monitors if m["metadata"]["name"] == "cosine-ray-engine")
    assert engine["spec"]["podMetricsEndpoints"][0]["path"] == METRICS_PATH
    assert METRICS_PATH in PUBLIC_PATHS, "Prometheus scrapes carry no API key"
    assert engine["spec"]["selector"]["matchLabels"]["ray.io/node-type"] == "head", \
        "one exporter: scrape the engine through one proxy only"


def _load_render_dashboards():
    sys.path.insert(0, str(k.K8S_DIR))
    try:
        import render_dashboards
    finally:
        sys.path.remove(str(k.K8S_DIR))
    return render_dashboards


def test_dashboards_configmap_is_in_sync_with_dashboards_dir():
    rd = _load_render_dashboards()
    committed = rd.CONFIGMAP_PATH.read_text(encoding="utf-8")
    assert committed == rd.render(rd.DASHBOARDS_DIR), "stale: run `python k8s/render_dashboards.py`"
    configmap = yaml.safe_load(committed)
    assert sorted(configmap["data"] or {}) == [p.name for p in rd.dashboard_files(rd.DASHBOARDS_DIR)]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_dashboards_generator_with_files_missing_dir_and_bad_json(tmp_path):
    rd = _load_render_dashboards()
    assert yaml.safe_load(rd.render(tmp_path / "missing"))["data"] == {}
    (tmp_path / "b_latency.json").write_text(json.dumps({"title": "latency", "panels": [{"id": 1}]}))
    (tmp_path / "a_accept.json").write_text('{"title": "acceptance", "uid": "x"}')
    (tmp_path / "notes.txt").write_text("not a dashboard")
    configmap = yaml.safe_load(rd.render(tmp_path))
    assert list(configmap["data"]) == ["a_accept.json", "b_latency.json"]
    assert json.loads(configmap["data"]["b_latency.json"]) == {"title": "latency", "panels": [{"id": 1}]}
    out = tmp_path / "cm.yaml"
    assert rd.main(["--dashboards", str(tmp_path), "--output", str(out)]) == 0
    assert rd.main(["--dashboards", str(tmp_path), "--output", str(out), "--check"]) == 0
    (tmp_path / "c_new.json").write_text("{}")
    assert rd.main(["--dashboards", str(tmp_path), "--output", str(out), "--check"]) == 1
    (tmp_path / "d_bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="d_bad.json"):
        rd.render(tmp_path)
