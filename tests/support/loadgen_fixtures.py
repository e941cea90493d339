"""Helpers shared by the loadgen tests: prompt datasets on disk and the stub server's script."""

from __future__ import annotations

import json
from pathlib import Path

STUB_SCRIPT = Path(__file__).parent / "stub_server.py"


def write_dataset(root: Path, files: dict[str, list[dict]]) -> Path:
    """``{"name": [row, ...]}`` → ``root/name.jsonl`` files; returns ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def rows(domain: str, prompts: list[str], prefix: str | None = None) -> list[dict]:
    return [{"id": f"{prefix or domain}/{i}", "domain": domain, "prompt": p} for i, p in enumerate(prompts)]
