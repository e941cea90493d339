"""What the benchmarks send, from the packaged prompt sets (``cosine_ray.datasets``): measured
prompts come from the held-back second half of each file, warm-ups from the first half or from
held-back prompts after the measured ones. The workloads are ``cosine-loadgen``'s
(``loadgen.workload``, and ``loadgen.tasks`` for the scripted ``json``, ``edit``, ``rag`` and
``agent`` ones and for ``mixed``, all of them together).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cosine_ray.datasets import DOMAIN_FILES, domain_prompts, read_prompts, second_half
from loadgen.tasks import MIXED_KINDS, TASK_WORKLOADS, mixed_workload, task_workload


BENCH_WORKLOADS = ("chat", "json", "edit", "rag", "agent", "mixed", "multi-turn", "code-edit", "template")
"""Every ``--workload`` of ``cosine-ray bench``: users' traffic kinds, all of them together, and
the older text workloads."""


def bench_workload(name: str, prompt_dir: str | Path, per_domain: int, warmup_per_domain: int, max_tokens: int,
                   seed: int) -> tuple[list[Any], list[Any]]:
    """(warm-up, measured) conversations (``loadgen.workload.WorkItem``) of a ``cosine-ray bench``
    workload, ``per_domain`` measured ones a domain from the second half of each file and
    ``warmup_per_domain`` warm-up ones from the first half; ``WorkloadError`` when bad. The
    scripted workloads (``TASK_WORKLOADS``) count ``per_domain`` of their one kind, ``mixed``
    ``per_domain`` of each of its kinds (its ``chat`` ones spread over the four domains)."""
    import numpy as np

    from loadgen.workload import WORKLOADS, WorkloadError, build_workload, load_rows
    if name in TASK_WORKLOADS:
        return (task_workload(name, prompt_dir, "first-half", warmup_per_domain, max_tokens, seed + 1),
                task_workload(name, prompt_dir, "second-half", per_domain, max_tokens, seed))
    if name == "mixed":
        return (mixed_workload(prompt_dir, "first-half", dict.fromkeys(MIXED_KINDS, warmup_per_domain), max_tokens,
                               seed + 1),
                mixed_workload(prompt_dir, "second-half", dict.fromkeys(MIXED_KINDS, per_domain), max_tokens, seed))
    if name not in WORKLOADS:
        raise WorkloadError(f"--workload must be one of {', '.join(BENCH_WORKLOADS)}, got {name!r}")
    measured_rows = load_rows(Path(prompt_dir), "second-half")
    warm_rows = load_rows(Path(prompt_dir), "first-half")
    mix = {d: 1.0 / len(measured_rows) for d in sorted(measured_rows)}
    measured = build_workload(name, measured_rows, per_domain * len(mix), mix, np.random.default_rng(seed),
                              max_tokens=max_tokens)
    warm = build_workload(name, warm_rows, warmup_per_domain * len(mix), mix, np.random.default_rng(seed + 1),
                          max_tokens=max_tokens) if warmup_per_domain else []
    return warm, measured


def held_back_split(prompt_dir: str | Path, warmup: int, measured: int) -> tuple[list[tuple[str, str]],
                                                                                 list[tuple[str, str]]]:
    """(domain, prompt) warm-up and measured sets, disjoint, both from each file's second half:
    the first ``measured`` held-back prompts of a domain, then the next ``warmup`` (so a bigger
    warm-up never changes the measured set)."""
    warm, meas = [], []
    for domain, name in DOMAIN_FILES.items():
        held = [r["prompt"] for r in second_half(read_prompts(Path(prompt_dir) / name))]
        meas += [(domain, p) for p in held[:measured]]
        warm += [(domain, p) for p in held[measured:measured + warmup]]
    return warm, meas


def fixed_length_prompts(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of exactly ``length`` tokens, from the packaged prompt texts run together."""
    rows = [r["prompt"] for d in DOMAIN_FILES for r in domain_prompts(d, "all")]
    prompts, text = [], ""
    for row in rows:
        text += row + "\n"
        ids = tokenizer(text)["input_ids"]
        if len(ids) >= length:
            prompts.append(ids[:length])
            text = ""
        if len(prompts) == n:
            break
    return prompts
