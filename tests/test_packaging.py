"""pyproject.toml declares what the code imports: every third-party package that a module of
``cosine_ray`` or ``loadgen`` imports (anywhere: in a function, under ``TYPE_CHECKING``) is a
declared dependency, every declared dependency is imported (or listed in
``NEEDED_WITHOUT_IMPORT`` with why), and the installed versions meet the declared ranges.
Modules map to distributions through ``importlib.metadata.packages_distributions()``."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("cosine_ray", "loadgen")
NEEDED_WITHOUT_IMPORT = {
    "accelerate": "transformers refuses to load a GGUF file without it (models/conversion.py)",
}
"""Declared distributions that no module of ours imports, and why they are needed anyway."""


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_requirements(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Requirement]:
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    requirements = [Requirement(r) for r in data["project"]["dependencies"]]
    return {normalize(r.name): r for r in requirements}


def imported_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Top-level module → the files that import it, for every absolute import of a module that
    is neither in the standard library nor one of ``packages``."""
    out: dict[str, set[str]] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.partition(".")[0]
                    if top not in sys.stdlib_module_names and top not in packages:
                        out.setdefault(top, set()).add(str(path.relative_to(root)))
    return out


def imported_distributions() -> dict[str, set[str]]:
    """Distribution (normalized) → the files that import one of its modules."""
    owners = md.packages_distributions()
    out: dict[str, set[str]] = {}
    for module, files in imported_modules().items():
        assert module in owners, f"{module} (imported by {sorted(files)}) is installed by no distribution"
        for dist in owners[module]:
            out.setdefault(normalize(dist), set()).update(files)
    return out


def test_every_imported_package_is_declared():
    declared = declared_requirements()
    missing = {dist: sorted(files) for dist, files in imported_distributions().items() if dist not in declared}
    assert not missing, f"imported but not in pyproject.toml's dependencies: {missing}"


def test_every_declared_package_is_imported_or_needed():
    imported = imported_distributions()
    assert {"torch", "transformers", "ray", "fastapi", "pydantic"} <= set(imported)  # the walk works
    unused = sorted(set(declared_requirements()) - set(imported) - set(NEEDED_WITHOUT_IMPORT))
    assert not unused, f"declared but imported by nothing (drop them, or say why in NEEDED_WITHOUT_IMPORT): {unused}"
    stale = sorted(set(NEEDED_WITHOUT_IMPORT) & set(imported))
    assert not stale, f"imported after all, so NEEDED_WITHOUT_IMPORT need not list them: {stale}"


def test_installed_versions_meet_the_declared_ranges():
    """The floors are versions that ran here (at or below what is installed)."""
    outside = {name: (str(req.specifier), md.version(req.name)) for name, req in declared_requirements().items()
               if not req.specifier.contains(md.version(req.name), prereleases=True)}
    assert not outside, f"installed versions outside the declared ranges: {outside}"
    unbounded = sorted(name for name, req in declared_requirements().items()
                       if not any(s.operator in (">=", "==") for s in req.specifier))
    assert not unbounded, f"declared without a floor: {unbounded}"


def test_the_import_walk_sees_every_form(tmp_path):
    """It can fail: absolute imports anywhere count; the standard library, relative imports and
    our own packages do not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import json\nfrom . import mod\nfrom pkg import mod as m2\n")
    (pkg / "mod.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import numpy.linalg\n"
                                "def f():\n    from yaml import safe_load\n    import alpha.beta, gamma\n")
    assert imported_modules(tmp_path, ("pkg",)) == {
        "numpy": {"pkg/mod.py"}, "yaml": {"pkg/mod.py"}, "alpha": {"pkg/mod.py"}, "gamma": {"pkg/mod.py"}}
    toml = tmp_path / "pyproject.toml"
    toml.write_text('[project]\ndependencies = ["PyYAML>=6", "ray[serve]>=2.40", "Jinja2"]\n')
    assert set(declared_requirements(toml)) == {"pyyaml", "ray", "jinja2"}
