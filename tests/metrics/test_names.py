"""The metric-name table is complete: every name the code records is in it, and documented."""

from __future__ import annotations

import re
from pathlib import Path

from cosine_ray.metrics.names import METRICS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "cosine_ray"
NAME_LITERAL = re.compile(r"""["'](cosine_ray:[A-Za-z_][A-Za-z0-9_]*)["']""")
"""A quoted metric name (actor names like ``cosine_ray:stage:0`` have a second colon)."""


def names_used_in_code() -> dict[str, list[str]]:
    used: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "names.py" and path.parent.name == "metrics":
            continue
        for name in NAME_LITERAL.findall(path.read_text(encoding="utf-8")):
            used.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return used


def test_every_metric_name_in_the_code_is_in_the_table():
    used = names_used_in_code()
    assert used, "the grep found no metric names at all: the pattern is broken"
    unknown = {name: files for name, files in used.items() if name not in METRICS}
    assert not unknown, f"metric names missing from cosine_ray/metrics/names.py: {unknown}"


def test_table_entries_are_well_formed():
    for name, spec in METRICS.items():
        assert re.fullmatch(r"cosine_ray:[a-z][a-z0-9_]*", name), name
        assert spec.kind in ("counter", "gauge", "histogram"), name
        assert spec.help.strip(), f"{name} needs a help text"
        assert not name.endswith(("_total", "_bucket", "_count", "_sum")), \
            f"{name}: the exposition adds the suffixes"
        assert "le" not in spec.labels and len(set(spec.labels)) == len(spec.labels), name
        if spec.kind == "histogram":
            assert spec.buckets and list(spec.buckets) == sorted(set(spec.buckets)), name
        else:
            assert not spec.buckets, name


def test_the_metrics_page_lists_every_metric():
    page = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    section = page.split("## Names", 1)
    assert len(section) == 2, "docs/metrics.md needs a '## Names' section"
    text = section[1].split("\n## ", 1)[0]
    missing = [name for name in METRICS if f"`{name}`" not in text]
    assert not missing, f"docs/metrics.md's table does not list {missing}"
