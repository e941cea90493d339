"""Static checks of dashboards/*.json (the live check against Prometheus is test_prometheus.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cosine_ray.metrics.names import METRICS

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "dashboards").glob("*.json"))
METRIC_TOKEN = re.compile(r"cosine_ray:[A-Za-z0-9_]+")
NOT_CHARTED = {"cosine_ray:metrics_collection_failures": "only exists after a failed scrape-time read; "
                                                         "alert on it rather than chart it"}


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(file, panel title, expr) for every target of every panel."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text(encoding="utf-8"))["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def resolve(token: str) -> tuple[str, str]:
    """An exposition series name -> (table name, kind); raises KeyError if it is not ours."""
    for suffix, kinds in (("_total", ("counter",)), ("_bucket", ("histogram",)), ("_sum", ("histogram",)),
                          ("_count", ("histogram",)), ("", ("gauge",))):
        if token.endswith(suffix):
            base = token[: len(token) - len(suffix)] if suffix else token
            if base in METRICS and METRICS[base].kind in kinds:
                return base, METRICS[base].kind
    raise KeyError(token)


def test_the_three_dashboards_exist_and_are_up_to_date():
    assert [p.name for p in DASHBOARDS] == ["overview.json", "pipeline.json", "speculation.json"]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_dashboards.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_uses_the_datasource_variable(path):
    board = json.loads(path.read_text(encoding="utf-8"))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] and board["title"]
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_every_query_references_only_names_from_the_table():
    bad = []
    for file, title, expr in dashboard_queries():
        tokens = METRIC_TOKEN.findall(expr)
        if not tokens:
            bad.append((file, title, expr, "no cosine_ray metric"))
        for token in tokens:
            try:
                resolve(token)
            except KeyError:
                bad.append((file, title, expr, token))
    assert not bad, bad


def test_rates_apply_to_counters_and_quantiles_to_buckets():
    for file, title, expr in dashboard_queries():
        for fn, token in re.findall(r"\b(rate|increase|irate)\((cosine_ray:[A-Za-z0-9_]+)", expr):
            assert resolve(token)[1] in ("counter", "histogram"), (file, title, token)
        for token in METRIC_TOKEN.findall(expr):
            if resolve(token)[1] == "gauge":
                assert f"rate({token}" not in expr and f"increase({token}" not in expr, (file, title)
        for match in re.finditer(r"histogram_quantile\(", expr):
            inner = expr[match.end():]
            first = METRIC_TOKEN.search(inner).group(0)
            assert first.endswith("_bucket"), (file, title, expr)
            assert "by (le)" in inner, (file, title, expr)


def test_every_metric_is_charted_somewhere():
    charted = {resolve(t)[0] for _, _, expr in dashboard_queries() for t in METRIC_TOKEN.findall(expr)}
    missing = sorted(set(METRICS) - charted - set(NOT_CHARTED))
    assert not missing, f"metrics without a panel: {missing}"


def test_deploy_files_point_at_each_other():
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/cosine_ray.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    boards = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/cosine_ray.yaml").read_text())
    assert boards["providers"][0]["type"] == "file" and boards["providers"][0]["options"]["path"]
