"""Workloads of users' traffic whose requests are scripted (``WorkItem``s whose turns are
``ScriptedTurn``s): each request is sent as written, whatever the server answered before.

- ``edit``: code with an instruction to change it and the original code as the request's
  *prediction* (OpenAI's Predicted Outputs), from ``tasks/edit.jsonl`` in the prompt folder
  (30 tasks written around HumanEval stubs; the prompts README says how);
- ``agent``: an agent loop with a fixed tool set (``AGENT_TOOLS``), synthesized from the HumanEval
  stubs of ``humaneval.jsonl``: the task, the file read back, a first attempt written, its tests
  run. Each request repeats the tool calls and observations before it; the script's, not the
  model's answers, so every server sees the same prompts.

The fixed split applies as to the prompt files (``loadgen.prompt_sets``). Standard library only.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadgen.prompt_sets import read_prompt_lines, split_rows
from loadgen.workload import WorkItem, WorkloadError

CODE_PROMPTS = "humaneval.jsonl"

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


def task_workload(name: str, prompt_dir: str | Path, split: str, num: int, max_tokens: int,
                  seed: int) -> list[WorkItem]:
    """``num`` conversations of the ``edit`` or ``agent`` workload from ``split`` of its data, in a
    seeded order (every row once before any twice); their turns are ``ScriptedTurn``s."""
    if name == "edit":
        rows = _rows(Path(prompt_dir) / TASKS_DIR / "edit.jsonl", split)
        items = [(r["source"] + "#edit", "edit", (edit_turn(r),)) for r in rows]
    elif name == "agent":
        rows = _rows(Path(prompt_dir) / CODE_PROMPTS, split)
        items = [(r["id"] + "#agent", "agent", agent_turns(r["prompt"])) for r in rows]
    else:
        raise WorkloadError(f"unknown task workload {name!r}; choose from {', '.join(TASK_WORKLOADS)}")
    order = random.Random(seed).sample(range(len(items)), len(items))
    picked = [items[order[i % len(items)]] for i in range(num)]
    return [WorkItem(f"c{i:05d}", source, domain, turns, None, max_tokens)
            for i, (source, domain, turns) in enumerate(picked)]


def _rows(path: Path, split: str) -> list[dict[str, Any]]:
    return [row for _, row in split_rows(read_prompt_lines(path, WorkloadError), split, WorkloadError)]


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
