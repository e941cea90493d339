"""The k8s/ variants are closed by default, checked on what `kubectl kustomize` renders.

Every variant is rendered by `kubectl kustomize` where kubectl is installed, and by the
repository's own renderer (tests/support/k8s_checks.py) always; the checks run on both. What
must hold (``closed_errors``): no secret value ships in the manifests (no Secret object, no
`change-me` password) and every Secret they use is required (no ``optional: true``), with its
`kubectl create secret ... $(openssl rand ...)` line in the docs; Ray's token authentication
is on; the dashboard listens on the head's loopback or, where the KubeRay operator must reach
it (a RayService), the NetworkPolicies admit only the operator to it; every Ray and Redis Pod
is isolated by a NetworkPolicy, and a stranger Pod reaches nothing but the Serve port.
``admits`` evaluates NetworkPolicies as Kubernetes does (policies add up; a Pod no policy
selects admits everyone). Broken copies must fail for the reason named.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from typing import Any

import pytest
import yaml

import support.k8s_checks as k

DOCS = [k.REPO / "docs" / "deployment.md", k.REPO / "docs" / "security.md"]
LOOPBACK = ("127.0.0.1", "localhost", "::1")
RAY_LABELS = {"app.kubernetes.io/name": "cosine-ray"}
REDIS_LABELS = {"app.kubernetes.io/name": "cosine-ray-redis"}
OPERATOR = ({"kubernetes.io/metadata.name": "ray-system"}, {"app.kubernetes.io/name": "kuberay-operator"})
PROMETHEUS = ({"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"})
STRANGER = ({"kubernetes.io/metadata.name": "other"}, {"app": "anything"})
NEIGHBOUR = ({"kubernetes.io/metadata.name": "default"}, {"app": "anything"})
"""A Pod of another app in the deployment's own namespace."""
HERE = {"kubernetes.io/metadata.name": "default"}
PORTS = {"serve": 8000, "dashboard": 8265, "gcs-server": 6379, "client": 10001, "metrics": 8080}


def render(variant: str, renderer: str) -> list[dict]:
    if renderer == "python":
        return k.render_kustomization(k.K8S_DIR / variant)
    out = subprocess.run(["kubectl", "kustomize", str(k.K8S_DIR / variant)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


RENDERERS = [pytest.param("kubectl", marks=pytest.mark.skipif(shutil.which("kubectl") is None,
                                                               reason="kubectl not installed")), "python"]


# ---- NetworkPolicy semantics -------------------------------------------------------------------

def _matches(selector: dict | None, labels: dict) -> bool:
    return all(labels.get(a) == b for a, b in ((selector or {}).get("matchLabels") or {}).items())


def _peer_matches(peer: dict, ns_labels: dict, pod_labels: dict) -> bool:
    if "namespaceSelector" in peer:
        return _matches(peer["namespaceSelector"], ns_labels) and _matches(peer.get("podSelector"), pod_labels)
    return ns_labels == HERE and _matches(peer["podSelector"], pod_labels)  # a podSelector alone: this namespace


def admits(policies: list[dict], pod_labels: dict, port: int, peer: tuple[dict, dict]) -> bool:
    """Whether a Pod labelled ``pod_labels`` (in namespace default) admits TCP ``port`` from
    ``peer`` (namespace labels, Pod labels)."""
    selecting = [p for p in policies if _matches(p["spec"]["podSelector"], pod_labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            ports = rule.get("ports")
            if ports and not any(p["port"] == port and p.get("protocol", "TCP") == "TCP" for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(_peer_matches(x, *peer) for x in peers):
                return True
    return False


# ---- what must hold ----------------------------------------------------------------------------

def _walk(node: Any, path: str = ""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from _walk(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}[{i}]")


def secret_refs(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, secretKeyRef) of every Secret the rendered objects read."""
    return [(f"{d['kind']} {d['metadata']['name']}: {path}", node["secretKeyRef"])
            for d in docs for path, node in _walk(d) if isinstance(node.get("secretKeyRef"), dict)]


def _documented_secret_commands() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in DOCS if p.exists())


def closed_errors(docs: list[dict]) -> list[str]:
    errors = []
    text = yaml.safe_dump_all(docs)
    if re.search(r"change-me", text, re.I):
        errors.append("a placeholder password ships in the manifests")
    for d in docs:
        if d["kind"] == "Secret":
            errors.append(f"Secret {d['metadata']['name']} ships with the manifests: the operator creates it")
    documented = _documented_secret_commands()
    for where, ref in secret_refs(docs):
        if ref.get("optional"):
            errors.append(f"{where}: Secret {ref['name']} is optional: a missing one must stop the Pod")
        command = rf"kubectl create secret generic {ref['name']} --from-literal={ref['key']}=\S*openssl rand"
        if not re.search(command, documented):
            errors.append(f"{where}: no `kubectl create secret generic {ref['name']} "
                          f"--from-literal={ref['key']}=$(openssl rand ...)` in the docs")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if not policies:
        errors.append("no NetworkPolicy")
    (ray,) = k.ray_docs(docs)
    spec = k.cluster_spec(ray)
    if (spec.get("authOptions") or {}).get("mode") != "token":
        errors.append("Ray token authentication (authOptions.mode: token) is off")
    head = {**k.ray_container(spec["headGroupSpec"]), "labels": {
        **spec["headGroupSpec"]["template"]["metadata"]["labels"], "ray.io/node-type": "head"}}
    host = spec["headGroupSpec"].get("rayStartParams", {}).get("dashboard-host", "0.0.0.0")  # KubeRay's default
    if host not in LOOPBACK:
        if ray["kind"] != "RayService":
            errors.append(f"dashboard-host {host}: only a RayService's operator needs the dashboard")
        if admits(policies, head["labels"], PORTS["dashboard"], STRANGER) or \
                admits(policies, head["labels"], PORTS["dashboard"], NEIGHBOUR):
            errors.append(f"dashboard-host {host} and the dashboard admits any Pod: jobs run code")
        if not admits(policies, head["labels"], PORTS["dashboard"], OPERATOR):
            errors.append("the KubeRay operator cannot reach the dashboard it deploys through")
    for name, group in k.groups(ray):
        labels = {**group["template"]["metadata"]["labels"],
                  "ray.io/node-type": "head" if name == "head" else "worker"}
        if not any(_matches(p["spec"]["podSelector"], labels) for p in policies):
            errors.append(f"{name}: no NetworkPolicy selects its Pods")
            continue
        for port_name in ("gcs-server", "client", "metrics", "dashboard"):
            for who, peer in (("a Pod of another namespace", STRANGER), ("another app's Pod", NEIGHBOUR)):
                if admits(policies, labels, PORTS[port_name], peer):
                    errors.append(f"{name}: {who} reaches port {PORTS[port_name]} ({port_name})")
        if not admits(policies, labels, PORTS["serve"], STRANGER):
            errors.append(f"{name}: clients cannot reach the Serve port")
        if not admits(policies, labels, PORTS["gcs-server"], (HERE, RAY_LABELS)):
            errors.append(f"{name}: the other Ray Pods cannot reach it")
    if any(d["kind"] == "PodMonitor" for d in docs) and not admits(
            policies, {**RAY_LABELS, "ray.io/node-type": "worker"}, PORTS["metrics"], PROMETHEUS):
        errors.append("Prometheus cannot scrape Ray's metrics port")
    if any(d["kind"] == "Deployment" and d["metadata"]["name"] == "cosine-ray-redis" for d in docs):
        if admits(policies, REDIS_LABELS, 6379, NEIGHBOUR) or admits(policies, REDIS_LABELS, 6379, STRANGER):
            errors.append("Redis admits Pods other than Ray's")
        if not admits(policies, REDIS_LABELS, 6379, (HERE, {**RAY_LABELS, "ray.io/node-type": "head"})):
            errors.append("the GCS on the head cannot reach Redis")
    return errors


# ---- the variants ------------------------------------------------------------------------------

@pytest.mark.parametrize("renderer", RENDERERS)
@pytest.mark.parametrize("variant", k.VARIANTS)
def test_every_variant_is_closed_by_default(variant, renderer):
    docs = render(variant, renderer)
    assert closed_errors(docs) == []
    (ray,) = k.ray_docs(docs)
    spec = k.cluster_spec(ray)
    host = spec["headGroupSpec"]["rayStartParams"]["dashboard-host"]
    assert host in LOOPBACK if variant == "raycluster" else host == "0.0.0.0"  # the operator deploys through it
    refs = secret_refs(docs)
    for name, group in k.groups(ray):  # every Ray container has the API key, from the required Secret
        (key,) = [e for e in k.ray_container(group)["env"] if e["name"] == "COSINE_RAY_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"] == {"name": "cosine-ray-api-key", "key": "api-key"}, name
    assert {r["name"] for _, r in refs} == ({"cosine-ray-api-key"} if variant == "cpu-dev"
                                            else {"cosine-ray-api-key", "cosine-ray-redis"})


def test_the_policy_evaluator_follows_kubernetes_rules():
    """The evaluator the checks rest on: no policy = open; policies add up; an empty `from`
    admits everyone; a podSelector alone means the policy's own namespace."""
    pod = {"app": "x"}
    assert admits([], pod, 80, STRANGER)
    only_ns = {"spec": {"podSelector": {"matchLabels": pod}, "ingress": [
        {"from": [{"podSelector": {"matchLabels": {"role": "client"}}}], "ports": [{"port": 80}]}]}}
    assert not admits([only_ns], pod, 80, STRANGER)
    assert admits([only_ns], pod, 80, (HERE, {"role": "client"}))
    assert not admits([only_ns], pod, 80, ({"kubernetes.io/metadata.name": "other"}, {"role": "client"}))
    assert not admits([only_ns], pod, 81, (HERE, {"role": "client"}))
    open_81 = {"spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 81}]}]}}
    assert admits([only_ns, open_81], pod, 81, STRANGER) and not admits([only_ns, open_81], pod, 80, STRANGER)
    deny_all = {"spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    assert not admits([deny_all], pod, 80, (HERE, pod))


# ---- broken copies must fail -------------------------------------------------------------------

def _broken(variant: str, change) -> list[str]:
    docs = copy.deepcopy(k.render_kustomization(k.K8S_DIR / variant))
    change(docs)
    return closed_errors(docs)


def _ray(docs):
    return k.cluster_spec(k.ray_docs(docs)[0])


def _optional_key(docs):
    env = k.ray_container(_ray(docs)["workerGroupSpecs"][0])["env"]
    next(e for e in env if e["name"] == "COSINE_RAY_API_KEY")["valueFrom"]["secretKeyRef"]["optional"] = True


def _default_password(docs):
    docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "cosine-ray-redis"},
                 "stringData": {"password": "change-me-before-production"}})


def _open_dashboard(docs):
    _ray(docs)["headGroupSpec"]["rayStartParams"]["dashboard-host"] = "0.0.0.0"
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "cosine-ray-dashboard")
    policy["spec"]["ingress"][0]["from"] = [{"namespaceSelector": {}}]  # any Pod of any namespace


def _no_policies(docs):
    docs[:] = [d for d in docs if d["kind"] != "NetworkPolicy"]


def _no_token(docs):
    del _ray(docs)["authOptions"]


def _undocumented(docs):
    ref = {"name": "cosine-ray-hf-token", "key": "token"}
    k.ray_container(_ray(docs)["headGroupSpec"])["env"].append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}})


@pytest.mark.parametrize("variant, change, message", [
    ("rayservice", _optional_key, "Secret cosine-ray-api-key is optional"),
    ("rayservice", _default_password, "a placeholder password ships"),
    ("cpu-dev", _default_password, "Secret cosine-ray-redis ships with the manifests"),
    ("rayservice", _open_dashboard, "the dashboard admits any Pod"),
    ("raycluster", _open_dashboard, "only a RayService's operator needs the dashboard"),
    ("rayservice", _no_policies, "no NetworkPolicy"),
    ("cpu-dev", _no_policies, "head: no NetworkPolicy selects its Pods"),
    ("raycluster", _no_token, "Ray token authentication (authOptions.mode: token) is off"),
    ("rayservice", _undocumented, "no `kubectl create secret generic cosine-ray-hf-token"),
])
def test_a_variant_opened_up_fails(variant, change, message):
    errors = _broken(variant, change)
    assert any(message in e for e in errors), errors


def test_a_stranger_reaching_redis_or_the_gcs_fails():
    def open_redis(docs):
        policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "cosine-ray-redis")
        policy["spec"]["ingress"][0]["from"] = []

    def open_everything(docs):
        internal = next(d for d in docs if d["metadata"]["name"] == "cosine-ray-internal")
        internal["spec"]["ingress"][0]["from"].append({"namespaceSelector": {}})

    assert "Redis admits Pods other than Ray's" in _broken("raycluster", open_redis)
    errors = _broken("rayservice", open_everything)
    assert any("a Pod of another namespace reaches port 10001 (client)" in e for e in errors), errors
    assert any("reaches port 6379 (gcs-server)" in e for e in errors), errors
