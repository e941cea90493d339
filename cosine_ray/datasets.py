"""The packaged prompt sets and their fixed split (imports nothing heavy: no torch, no Ray).

Four JSON-lines files ship in ``cosine_ray/data/prompts/`` (sources and licences in the
README.md there; the instruction set is CC BY-NC 4.0, non-commercial), one per domain of the
CoSine/PipeDec/PEARL mixed-domain workloads::

    code         humaneval.jsonl   164 rows
    math         gsm8k.jsonl     1,319 rows
    instruction  alpaca.jsonl      175 rows
    chat         mtbench.jsonl      80 rows (``turns`` holds both MT-bench turns)

Each line is one JSON object with ``id``, ``domain`` and a non-empty string ``prompt``. **The
fixed split.** The first half of each file (``(n + 1) // 2`` rows) builds the packaged
retrieval datastores and is what warm-ups and classifier fits may use; the second half is held
back for measurement (``cosine-ray bench``, ``cosine-loadgen``, the benchmarks), so no figure is
measured on prompts a datastore has seen.

``$COSINE_RAY_PROMPTS`` names another folder with the same four file names, used instead of
the packaged one. The files are read, and split, by ``loadgen.prompt_sets``, the one reader
cosine_ray and loadgen share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence, TypeVar

from loadgen.prompt_sets import PROMPTS_ENV, SPLITS, read_prompt_lines, split_point, split_rows
from loadgen.prompt_sets import default_prompt_dir as _default_prompt_dir

__all__ = ["PACKAGED_PROMPT_DIR", "PROMPTS_ENV", "DOMAIN_FILES", "SPLITS", "default_prompt_dir", "domain_file",
           "split_point", "first_half", "second_half", "split_rows", "read_prompts", "domain_prompts",
           "held_back_prompts"]

PACKAGED_PROMPT_DIR = Path(__file__).resolve().parent / "data" / "prompts"
"""``cosine_ray/data/prompts`` of this installation (package data, shipped by ``pip install``)."""
DOMAIN_FILES = {"code": "humaneval.jsonl", "math": "gsm8k.jsonl",
                "instruction": "alpaca.jsonl", "chat": "mtbench.jsonl"}
"""domain → file name, in the order benchmarks report the domains."""

T = TypeVar("T")


def default_prompt_dir() -> Path:
    """``$COSINE_RAY_PROMPTS`` if set, else the packaged ``cosine_ray/data/prompts``."""
    return _default_prompt_dir(PACKAGED_PROMPT_DIR)


def domain_file(domain: str, prompt_dir: str | Path | None = None,
                error: type[Exception] = ValueError) -> Path:
    """The prompt file of a packaged domain in ``prompt_dir`` (default: ``default_prompt_dir()``)."""
    if domain not in DOMAIN_FILES:
        raise error(f"no packaged prompt set for domain {domain!r} (packaged: {', '.join(DOMAIN_FILES)})")
    return Path(prompt_dir if prompt_dir is not None else default_prompt_dir()) / DOMAIN_FILES[domain]


def first_half(rows: Sequence[T]) -> list[T]:
    """The rows that build datastores and may be used to warm up or fit."""
    return split_rows(rows, "first-half")


def second_half(rows: Sequence[T]) -> list[T]:
    """The held-back rows: measure on these only."""
    return split_rows(rows, "second-half")


def read_prompts(path: str | Path, error: type[Exception] = ValueError) -> list[dict[str, Any]]:
    """The rows of a prompt file, each with a non-empty string ``prompt``; raises ``error`` with one line."""
    return [row for _, row in read_prompt_lines(path, error)]


def domain_prompts(domain: str, split: str = "second-half", prompt_dir: str | Path | None = None,
                   error: type[Exception] = ValueError) -> list[dict[str, Any]]:
    """The rows of one packaged domain's file, restricted to ``split``."""
    return split_rows(read_prompts(domain_file(domain, prompt_dir, error), error), split, error)


def held_back_prompts(prompt_dir: str | Path | None, per_domain: int | None,
                      error: type[Exception] = ValueError) -> list[tuple[str, str]]:
    """``(domain, prompt)`` for the first ``per_domain`` held-back prompts of each domain, in
    ``DOMAIN_FILES`` order (``prompt_dir`` None = ``default_prompt_dir()``, ``per_domain`` None = all)."""
    prompt_dir = Path(prompt_dir) if prompt_dir is not None else default_prompt_dir()
    out = []
    for domain, name in DOMAIN_FILES.items():
        rows = read_prompts(prompt_dir / name, error)
        out.extend((domain, r["prompt"]) for r in second_half(rows)[:per_domain])
    return out
