"""The prompt-set files and their fixed split: the one reader of cosine_ray and loadgen.

A prompt set is a JSON-lines file, one object a line with a non-empty string ``prompt`` (the
packaged ones, ``cosine_ray/data/prompts``, also carry ``id``, ``domain`` and for MT-bench
``turns``). **The fixed split**: the first half of a file (``(n + 1) // 2`` rows) builds the
packaged retrieval datastores and may warm up or fit; the second half is held back for
measurement. ``$COSINE_RAY_PROMPTS`` names a folder used instead of the packaged one.

Standard library only, and never ``import cosine_ray`` (``find_spec`` locates the package
without running it): loadgen drives any server without cosine_ray's import-time settings (the
OpenMP and oneDNN environment it gives every process it starts), and ``cosine_ray.datasets``
imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Sequence, TypeVar

PROMPTS_ENV = "COSINE_RAY_PROMPTS"
SPLITS = ("first-half", "second-half", "all")

T = TypeVar("T")


def packaged_prompt_dir() -> Path:
    """``cosine_ray/data/prompts`` of the installed cosine_ray (beside this package if none is)."""
    spec = importlib.util.find_spec("cosine_ray")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).resolve() / "data" / "prompts"
    return Path(__file__).resolve().parents[1] / "cosine_ray" / "data" / "prompts"


def default_prompt_dir(packaged: Path | None = None) -> Path:
    """``$COSINE_RAY_PROMPTS`` if set, else ``packaged`` (None: ``packaged_prompt_dir()``)."""
    env = os.environ.get(PROMPTS_ENV)
    if env:
        return Path(env)
    return packaged if packaged is not None else packaged_prompt_dir()


def split_point(num_rows: int) -> int:
    """Rows before this index are the first half (the odd row goes to the first half)."""
    return (num_rows + 1) // 2


def split_rows(rows: Sequence[T], split: str, error: type[Exception] = ValueError) -> list[T]:
    """``first-half``, ``second-half`` or ``all`` of ``rows``."""
    if split not in SPLITS:
        raise error(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    cut = split_point(len(rows))
    return list({"first-half": rows[:cut], "second-half": rows[cut:], "all": rows}[split])


def read_prompt_lines(path: str | Path, error: type[Exception] = ValueError) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) of every non-blank line of a prompt file, each row a JSON object with
    a non-empty string ``prompt``; anything else raises ``error`` with one line naming the file
    (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise error(f"prompt file {path} does not exist")
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise error(f"{path}:{n}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise error(f"{path}:{n}: expected a JSON object with a 'prompt'")
                if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                    raise error(f"{path}:{n}: 'prompt' must be a non-empty string")
                rows.append((n, row))
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {path}: {exc}") from None
    if not rows:
        raise error(f"prompt file {path} has no prompts")
    return rows
