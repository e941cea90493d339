"""Imports only go down (DESIGN §3): algo/, models/ and engine/ never pull in Ray, Ray Serve,
FastAPI or the Prometheus client. Checked in a fresh interpreter so nothing else in the test
session has imported them already."""

from __future__ import annotations

import json
import subprocess
import sys

LAYERS = ("cosine_ray.algo", "cosine_ray.models", "cosine_ray.engine")
FORBIDDEN = ("ray", "ray.serve", "fastapi", "prometheus_client")

PROBE = """
import importlib, json, pkgutil, sys
imported = []
for layer in {layers!r}:
    package = importlib.import_module(layer)
    imported.append(layer)
    for info in pkgutil.walk_packages(package.__path__, layer + "."):
        importlib.import_module(info.name)
        imported.append(info.name)
print(json.dumps({{"imported": imported,
                  "forbidden": [m for m in {forbidden!r} if m in sys.modules]}}))
"""


def test_lower_layers_do_not_import_ray_serve_fastapi_or_prometheus():
    code = PROBE.format(layers=LAYERS, forbidden=FORBIDDEN)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    imported = result["imported"]
    # the walk really covered the layers (a broken walk would pass vacuously)
    for module in ("cosine_ray.algo.verify", "cosine_ray.models.llama", "cosine_ray.engine.router",
                   "cosine_ray.engine.drafters.ngram"):
        assert module in imported
    assert result["forbidden"] == [], (
        f"{result['forbidden']} imported by the lower layers ({', '.join(LAYERS)}); "
        f"only cosine_ray.runtime / serve / metrics exporters may import them")


def test_probe_detects_a_forbidden_import():
    """The probe sees a forbidden module in sys.modules, so an empty list above means something."""
    code = "import sys, types; sys.modules['ray'] = types.ModuleType('ray'); " + \
           PROBE.format(layers=("cosine_ray.algo",), forbidden=FORBIDDEN)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["forbidden"] == ["ray"]
