"""The prose stays a map of the code: short module docstrings, no references to files that are
not in the repository, and generated reference pages that match the code they describe."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_DOCSTRING_LINES = 20
CHECKED = ("cosine_ray", "benchmarks", "scripts", "loadgen")

# Modules whose docstrings are still longer than the limit, to be shortened by whoever owns them
# (their measurements and history go to docs/history/). Empty this list; never add to it.
LONG_MODULE_DOCSTRINGS = {
    "cosine_ray/models/attention.py",
    "cosine_ray/models/kv_cache.py",
    "cosine_ray/models/loader.py",
    "cosine_ray/models/runner.py",
    "cosine_ray/runtime/metrics_scrape.py",
    "loadgen/arrivals.py",
    "loadgen/workload.py",
}

# "DESIGN §n" names a design document that is not in the repository. Empty this list too.
CITES_DESIGN = {
    "cosine_ray/runtime/placement.py",
}
DESIGN_REFERENCE = re.compile(r"DESIGN\s*§")

# Files that still name docs/measurements.md, now split into docs/history/ pages. Empty this too.
NAMES_A_MISSING_DOCS_PAGE = {
    "cosine_ray/models/runner.py",
}
DOCS_PAGE = re.compile(r"docs/[A-Za-z0-9_./-]+\.md")


def python_files() -> list[Path]:
    return sorted(p for folder in CHECKED for p in (ROOT / folder).rglob("*.py"))


def module_docstring_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(doc.splitlines()) if doc else 0


def design_citations(path: Path) -> list[int]:
    """Lines of ``path`` (docstrings and comments alike) that cite "DESIGN §n"."""
    return [i for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if DESIGN_REFERENCE.search(line)]


def missing_docs_pages(path: Path) -> list[str]:
    return sorted({m for m in DOCS_PAGE.findall(path.read_text(encoding="utf-8")) if not (ROOT / m).is_file()})


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_module_docstrings_are_at_most_twenty_lines():
    too_long = {rel(p): n for p in python_files()
                if (n := module_docstring_lines(p)) > MAX_MODULE_DOCSTRING_LINES and rel(p) not in LONG_MODULE_DOCSTRINGS}
    assert not too_long, (f"module docstrings longer than {MAX_MODULE_DOCSTRING_LINES} lines (say what the "
                          f"module is for and its terms; move measurements and history to docs/): {too_long}")


def test_the_list_of_long_module_docstrings_only_shrinks():
    fixed = sorted(name for name in LONG_MODULE_DOCSTRINGS
                   if not (ROOT / name).is_file() or module_docstring_lines(ROOT / name) <= MAX_MODULE_DOCSTRING_LINES)
    assert not fixed, f"remove from LONG_MODULE_DOCSTRINGS in tests/test_docs.py: {fixed}"


def test_no_docstring_or_comment_cites_a_design_document_outside_the_repository():
    cites = {rel(p): lines for p in python_files() if (lines := design_citations(p)) and rel(p) not in CITES_DESIGN}
    assert not cites, f"prose citing 'DESIGN §', which is not in the repository (file: lines): {cites}"


def test_the_list_of_design_citations_only_shrinks():
    fixed = sorted(name for name in CITES_DESIGN if not (ROOT / name).is_file() or not design_citations(ROOT / name))
    assert not fixed, f"remove from CITES_DESIGN in tests/test_docs.py: {fixed}"


def test_code_names_only_docs_pages_that_exist():
    missing = {rel(p): pages for p in python_files()
               if (pages := missing_docs_pages(p)) and rel(p) not in NAMES_A_MISSING_DOCS_PAGE}
    assert not missing, f"references to docs pages that do not exist: {missing}"
    fixed = sorted(name for name in NAMES_A_MISSING_DOCS_PAGE if not missing_docs_pages(ROOT / name))
    assert not fixed, f"remove from NAMES_A_MISSING_DOCS_PAGE in tests/test_docs.py: {fixed}"


def test_the_configuration_page_is_generated_from_the_current_config():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "config_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("model", ["ChatCompletionRequest", "CompletionRequest"])
def test_the_api_page_lists_every_request_field(model):
    from cosine_ray.serve import schemas

    page = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    missing = [name for name in getattr(schemas, model).model_fields if f"`{name}`" not in page]
    assert not missing, f"docs/api.md does not document {model}'s fields {missing}"
