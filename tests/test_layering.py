"""Imports only go down: algo/, models/, engine/ and sim/ never pull in Ray, Ray Serve,
FastAPI or the Prometheus client (checked in a fresh interpreter so nothing else in the test
session has imported them already); every import of the package follows the floors that
docs/architecture.md draws (a package imports only from lower floors); and no module of the
package imports itself back through others: the import graph of ``cosine_ray/`` has no cycle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cosine_ray"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
FLOORS_LINE = "Floors, top to bottom:"

LAYERS = ("cosine_ray.algo", "cosine_ray.models", "cosine_ray.engine", "cosine_ray.sim")
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
    for module in ("cosine_ray.algo.verify", "cosine_ray.models.llama", "cosine_ray.engine.core",
                   "cosine_ray.engine.drafters.lookup.ngram"):
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


# ---- no import cycles ---------------------------------------------------------------------------

def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its code (function-level and
    ``TYPE_CHECKING`` imports included: a lazy import hides a cycle, it does not remove it).
    ``from package import name`` counts as importing ``package.name`` when that is a module."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith(root.name):
                    deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (iterative DFS, colours white/grey/black)."""
    colour = {n: 0 for n in graph}
    for start in sorted(graph):
        if colour[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(child, 2) == 1:
                return path[path.index(child):] + [child]
            elif colour.get(child, 2) == 0:
                colour[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def test_no_import_cycle_inside_the_package():
    graph = import_graph()
    assert len(graph) > 60 and graph["cosine_ray.engine.core"], "premise: the graph covers the package"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    """The check can fail: a package whose modules import each other (lazily) is caught."""
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("")
    (root / "a.py").write_text("from pkg.sub import b\n")
    (root / "sub" / "b.py").write_text("def f():\n    from pkg import c\n")
    (root / "c.py").write_text("from .a import x\n")
    graph = import_graph(root)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"],)
    (root / "c.py").write_text("x = 1\n")
    assert find_cycle(import_graph(root)) is None


# ---- the floors ---------------------------------------------------------------------------------

def drawn_floors(page: Path = ARCHITECTURE) -> list[set[str]]:
    """The floors the architecture page draws, bottom first: its line ``Floors, top to bottom:
    `a` > `b`, `c` > ...`` (a floor's packages separated by commas)."""
    line = next(ln for ln in page.read_text(encoding="utf-8").splitlines() if ln.startswith(FLOORS_LINE))
    floors = [{name.strip(" `/") for name in floor.split(",")} for floor in line[len(FLOORS_LINE):].split(">")]
    return floors[::-1]


def floor_violations(graph: dict[str, set[str]], floors: list[set[str]]) -> list[str]:
    """Every import that does not go down: module -> module of a package on the same or a
    higher floor (another package), a package on no floor, and any module importing the root
    package (which stands above the floors: it may import any of them)."""
    floor_of = {package: level for level, floor in enumerate(floors) for package in floor}
    problems = []
    for module in sorted(graph):
        parts = module.split(".")
        if len(parts) == 1:
            continue  # the root
        if parts[1] not in floor_of:
            problems.append(f"{module}: package {parts[1]} is on no floor")
        for dep in sorted(graph[module]):
            target = dep.split(".")[1] if "." in dep else None
            if target is None:
                problems.append(f"{module} imports {dep}, the root package")
                continue
            if target == parts[1] or target not in floor_of or parts[1] not in floor_of:
                continue  # its own package, or a package reported as on no floor
            if floor_of[target] >= floor_of[parts[1]]:
                problems.append(f"{module} imports {dep}: {parts[1]} (floor {floor_of[parts[1]]}) may only "
                                f"import packages below it, {target} is on floor {floor_of[target]}")
    return problems


def test_imports_follow_the_floors_the_architecture_page_draws():
    floors = drawn_floors()
    graph = import_graph()
    packages = {m.split(".")[1] for m in graph if "." in m}
    placed = [p for floor in floors for p in floor]
    assert len(floors) >= 5 and len(placed) == len(set(placed)), floors  # premise: the line was read
    assert set(placed) == packages, f"the page's floors name {sorted(set(placed) ^ packages)} wrongly"
    assert floor_violations(graph, floors) == []


def test_floor_check_catches_a_planted_violation(tmp_path):
    """The check can fail: a lower floor importing a higher one (lazily), two packages of one
    floor importing each other, a package on no floor, a module importing the root; and the
    real package with the edge ``runtime -> serve`` put back."""
    root = tmp_path / "pkg"
    for package in ("low", "high", "side", "stray"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "low" / "a.py").write_text("def f():\n    from pkg.high import b\n")
    (root / "high" / "b.py").write_text("from pkg.low import a\nfrom pkg import side\n")
    (root / "side" / "c.py").write_text("from ..low.a import f\n")
    floors = [{"low"}, {"high", "side"}]
    graph = import_graph(root)
    assert floor_violations(graph, floors) == [
        "pkg.high.b imports pkg.side: high (floor 1) may only import packages below it, side is on floor 1",
        "pkg.low.a imports pkg.high.b: low (floor 0) may only import packages below it, high is on floor 1",
        "pkg.stray: package stray is on no floor"]
    (root / "low" / "a.py").write_text("import pkg\n")
    (root / "high" / "b.py").write_text("from pkg.low import a\n")
    (root / "__init__.py").write_text("def f():\n    from pkg.high import b\n")  # the root may
    assert floor_violations(import_graph(root), floors + [{"stray"}]) == [
        "pkg.low.a imports pkg, the root package"]
    (root / "low" / "a.py").write_text("x = 1\n")
    assert floor_violations(import_graph(root), floors + [{"stray"}]) == []
    real = import_graph()
    real["cosine_ray.runtime.cluster"].add("cosine_ray.serve.guards.proxy_guard")
    assert floor_violations(real, drawn_floors()) == [
        "cosine_ray.runtime.cluster imports cosine_ray.serve.guards.proxy_guard: runtime (floor 3) may only import "
        "packages below it, serve is on floor 4"]


INGRESS_PROBE = """
import json, pickle, sys
from cosine_ray.algo.logits_rules import RowRules, TokenLogprob
from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.runtime.engine_client import RayEngineClient
from cosine_ray.serve.app import OpenAIIngress, build_app
from cosine_ray.serve.openai_app import build_openai_app
tokenizer = resolve_checkpoint("smollm2-135m").load_tokenizer()
ids = tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], add_generation_prompt=True)
pickle.loads({payload!r})
build_openai_app(object(), tokenizer, model_name="m")
print(json.dumps({{"torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}}))
"""


@pytest.mark.real_model
def test_openai_ingress_does_not_import_torch(real_checkpoint):
    """The ingress replica tokenizes, unpickles the engine's outputs and serves HTTP: no tensors.
    Loading torch there costs 2-3 s of CPU in every ``cosine-ray serve`` start."""
    import pickle

    from cosine_ray.algo.logits_rules import TokenLogprob
    from cosine_ray.engine.request import RequestOutput

    payload = pickle.dumps(RequestOutput("r", [1, 2], finished=False, logprobs=(TokenLogprob(1, -0.5, ((1, -0.5),)),)))
    proc = subprocess.run([sys.executable, "-c", INGRESS_PROBE.format(payload=payload)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"torch": False, "transformers": True}, result


DEPLOYER_PROBE = """
import json, sys
import cosine_ray.cli.serve_start
from cosine_ray.serve.app import build_app
app = build_app({"num_stages": 2, "allow_unauthenticated": True})
print(json.dumps({"torch": "torch" in sys.modules, "engine": "cosine_ray.engine.core" in sys.modules}))
"""


def test_building_the_application_does_not_import_the_engine():
    """``cosine-ray serve``'s deploying child builds and deploys the application while Ray and
    Serve start on the same cores: it names the engine's class by import path (the engine
    replica imports it), so it never loads torch or the engine itself."""
    proc = subprocess.run([sys.executable, "-c", DEPLOYER_PROBE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"torch": False, "engine": False}


def test_the_engine_deployment_names_the_engine_server():
    from ray.serve._private.replica import _load_deployment_def_from_import_path

    from cosine_ray.runtime.engine_server import EngineServer
    from cosine_ray.serve.app import ENGINE_CLASS

    assert _load_deployment_def_from_import_path(ENGINE_CLASS) is EngineServer
