"""What the benchmarks send, from the packaged prompt sets (``cosine_ray.datasets``): measured
prompts come from the held-back second half of each file, warm-ups from the first half or from
held-back prompts after the measured ones.

Two workloads of users' traffic are built here (the others by ``loadgen.workload``):

- ``edit``: code with an instruction to change it and the original code as the *prediction*
  (OpenAI's Predicted Outputs), from ``data/prompts/tasks/edit.jsonl``;
- ``agent``: an agent loop with a fixed tool set, synthesized from the HumanEval stubs: read the
  file, write a first attempt, run the tests, each tool call and observation repeated in the
  requests after it (the script's, not the model's answers, so every system sees the same
  prompts). Each request of a conversation is a ``ScriptedTurn``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cosine_ray.datasets import DOMAIN_FILES, domain_prompts, read_prompts, second_half, split_rows


TASK_WORKLOADS = ("edit", "agent")
"""Workloads of scripted requests built here (``task_workload``)."""
TASKS_DIR = "tasks"
"""Their data, under the prompt folder (beside the four domain files, which the other
workloads read by ``*.jsonl``)."""


@dataclass(frozen=True, slots=True)
class ScriptedTurn:
    """One request of a scripted conversation: the whole chat up to the answer, and the
    prediction its client sends ("" for none)."""

    messages: tuple[tuple[str, str], ...]
    """(role, content) of every message before the answer."""
    prediction: str = ""

    @property
    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    def __str__(self) -> str:
        return self.messages[-1][1]


@dataclass(frozen=True, slots=True)
class TaskItem:
    """A conversation of scripted requests (the fields ``cosine-ray bench`` reads of a
    ``loadgen.workload.WorkItem``)."""

    conversation_id: str
    source_id: str
    domain: str
    turns: tuple[ScriptedTurn, ...]
    max_tokens: int


def task_workload(name: str, prompt_dir: str | Path, split: str, num: int, max_tokens: int,
                  seed: int) -> list[TaskItem]:
    """``num`` conversations of the ``edit`` or ``agent`` workload from ``split`` of its data, in a
    seeded order (every row once before any twice)."""
    from loadgen.workload import WorkloadError
    if name == "edit":
        rows = split_rows(read_prompts(Path(prompt_dir) / TASKS_DIR / "edit.jsonl", WorkloadError), split, WorkloadError)
        items = [TaskItem("", r["source"] + "#edit", "edit", (edit_turn(r),), max_tokens) for r in rows]
    elif name == "agent":
        rows = split_rows(read_prompts(Path(prompt_dir) / DOMAIN_FILES["code"], WorkloadError), split, WorkloadError)
        items = [TaskItem("", r["id"] + "#agent", "agent", agent_turns(r["prompt"]), max_tokens) for r in rows]
    else:
        raise WorkloadError(f"unknown task workload {name!r}; choose from {', '.join(TASK_WORKLOADS)}")
    order = random.Random(seed).sample(range(len(items)), len(items))
    picked = [items[order[i % len(items)]] for i in range(num)]
    return [TaskItem(f"c{i:05d}", t.source_id, t.domain, t.turns, t.max_tokens) for i, t in enumerate(picked)]


def edit_turn(row: dict[str, Any]) -> ScriptedTurn:
    """An edit request: the instruction around the code, the code as its prediction."""
    return ScriptedTurn((("user", row["prompt"]),), row["prediction"])


AGENT_TOOLS = (
    {"name": "read_file", "description": "Read a file of the repository.",
     "parameters": {"path": "string"}},
    {"name": "write_file", "description": "Write a file of the repository, replacing its content.",
     "parameters": {"path": "string", "content": "string"}},
    {"name": "run_tests", "description": "Run the doctests of a file and report the failures.",
     "parameters": {"path": "string"}},
    {"name": "finish", "description": "End the task with a short summary.", "parameters": {"summary": "string"}},
)
AGENT_SYSTEM = ("You are a coding agent working in a Python repository. You can call these tools:\n{tools}\n"
                "To call a tool, reply with one JSON object {{\"tool\": NAME, \"arguments\": {{...}}}} and nothing "
                "else. Call finish when the task is done.")
AGENT_FILE = "solution.py"


def agent_turns(stub_prompt: str) -> tuple[ScriptedTurn, ...]:
    """The four requests of an agent loop over one HumanEval stub: after the task, after reading
    the file, after writing a first attempt, after running its tests."""
    code = stub_prompt.split("\n", 1)[1].strip("\n") + "\n" if stub_prompt.startswith("Complete") else stub_prompt
    name = next((line[4:line.index("(")] for line in code.splitlines() if line.startswith("def ")), "solution")
    attempt = code + "    raise NotImplementedError\n"
    examples = max(code.count(">>> "), 1)

    def call(tool: str, **arguments: Any) -> tuple[str, str]:
        return "assistant", json.dumps({"tool": tool, "arguments": arguments})

    def result(**fields: Any) -> tuple[str, str]:
        return "tool", json.dumps(fields)

    steps = [
        (("system", AGENT_SYSTEM.format(tools=json.dumps(AGENT_TOOLS))),
         ("user", f"Implement the function `{name}` in {AGENT_FILE} so that its docstring examples pass.")),
        (call("read_file", path=AGENT_FILE), result(path=AGENT_FILE, content=code)),
        (call("write_file", path=AGENT_FILE, content=attempt), result(ok=True, path=AGENT_FILE, bytes=len(attempt))),
        (call("run_tests", path=AGENT_FILE),
         result(path=AGENT_FILE, passed=0, failed=examples,
                output=f"Failed example:\n    {name}(...)\nException raised:\n    NotImplementedError")),
    ]
    turns, history = [], ()
    for step in steps:
        history += step
        turns.append(ScriptedTurn(history))
    return tuple(turns)


def useless_prediction(prediction: str, seed: int) -> str:
    """Random words as long as ``prediction``: a prediction the answer never follows."""
    rng = random.Random(seed)
    text = ""
    while len(text) < len(prediction):
        text += "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) + " "
    return text[:len(prediction)]


def bench_workload(name: str, prompt_dir: str | Path, per_domain: int, warmup_per_domain: int, max_tokens: int,
                   seed: int) -> tuple[list[Any], list[Any]]:
    """(warm-up, measured) conversations (``loadgen.workload.WorkItem``, or ``TaskItem`` for the
    ``edit`` and ``agent`` workloads: ``per_domain`` of their one kind) of a ``cosine-ray
    bench`` workload, ``per_domain`` measured ones a domain from the second half of each file
    and ``warmup_per_domain`` warm-up ones from the first half; ``WorkloadError`` when bad."""
    import numpy as np

    from loadgen.workload import WORKLOADS, WorkloadError, build_workload, load_rows
    if name in TASK_WORKLOADS:
        return (task_workload(name, prompt_dir, "first-half", warmup_per_domain, max_tokens, seed + 1),
                task_workload(name, prompt_dir, "second-half", per_domain, max_tokens, seed))
    if name not in WORKLOADS:
        raise WorkloadError(f"--workload must be one of {', '.join(WORKLOADS + TASK_WORKLOADS)}, got {name!r}")
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
