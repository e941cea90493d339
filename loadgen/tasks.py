"""Workloads of users' traffic whose requests are scripted (``WorkItem``s whose turns are
``ScriptedTurn``s): each request is sent as written, whatever the server answered before.

- ``json``: a short text and a JSON schema to extract a record into, the schema sent as the
  request's ``response_format`` (a grammar), from ``tasks/json.jsonl`` (32 texts over 4 schemas);
- ``edit``: code with an instruction to change it and the original code as the request's
  *prediction* (OpenAI's Predicted Outputs), from ``tasks/edit.jsonl`` in the prompt folder
  (30 tasks written around HumanEval stubs; the prompts README says how);
- ``rag``: three passages (GSM8K problems of ``gsm8k.jsonl``) and a task whose answer copies
  from one of them (quote its sentences, summarise it in its own words);
- ``agent``: an agent loop with a fixed tool set (``AGENT_TOOLS``), synthesized from the HumanEval
  stubs of ``humaneval.jsonl``: the task, the file read back, a first attempt written, its tests
  run. Each request repeats the tool calls and observations before it; the script's, not the
  model's answers, so every server sees the same prompts;
- ``mixed``: all of these and the four domains' chat (``loadgen.workload``), interleaved.

The fixed split applies as to the prompt files (``loadgen.prompt_sets``).
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from loadgen.prompt_sets import read_prompt_lines, split_rows
from loadgen.workload import WorkItem, WorkloadError, dataset_workload, load_rows

CODE_PROMPTS = "humaneval.jsonl"
PASSAGES = "gsm8k.jsonl"

TASK_WORKLOADS = ("json", "edit", "rag", "agent")
"""Workloads of scripted requests built here (``task_workload``)."""
MIXED_KINDS = TASK_WORKLOADS + ("chat",)
"""The kinds the ``mixed`` workload interleaves (``chat``: ``loadgen.workload``'s four domains)."""
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
    schema: str = ""
    """A JSON schema (JSON text) the answer must follow, sent as ``response_format``; "" for none."""

    @property
    def chat(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    def __str__(self) -> str:
        return self.messages[-1][1]

    def body_fields(self) -> dict[str, Any]:
        """The OpenAI request fields besides the messages: the prediction, and the schema as
        ``response_format``."""
        fields: dict[str, Any] = {}
        if self.prediction:
            fields["prediction"] = {"type": "content", "content": self.prediction}
        if self.schema:
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "record", "schema": json.loads(self.schema), "strict": True}}
        return fields


def task_workload(name: str, prompt_dir: str | Path, split: str, num: int, max_tokens: int,
                  seed: int) -> list[WorkItem]:
    """``num`` conversations of a ``TASK_WORKLOADS`` workload from ``split`` of its data, in a
    seeded order (every row once before any twice); their turns are ``ScriptedTurn``s."""
    if name == "json":
        rows = _rows(Path(prompt_dir) / TASKS_DIR / "json.jsonl", split)
        items = [(r["id"] + "#json", "json", (ScriptedTurn((("user", r["prompt"]),), schema=r["schema"]),))
                 for r in rows]
    elif name == "edit":
        rows = _rows(Path(prompt_dir) / TASKS_DIR / "edit.jsonl", split)
        items = [(r["source"] + "#edit", "edit", (edit_turn(r),)) for r in rows]
    elif name == "rag":
        rows = _rows(Path(prompt_dir) / PASSAGES, split)
        groups = [rows[i:i + RAG_PASSAGES] for i in range(0, len(rows) - RAG_PASSAGES + 1, RAG_PASSAGES)]
        items = [(g[0]["id"] + "#rag", "rag", (rag_turn([r["prompt"] for r in g], n),)) for n, g in enumerate(groups)]
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


def mixed_workload(prompt_dir: str | Path, split: str, counts: Mapping[str, int], max_tokens: int,
                   seed: int) -> list[WorkItem]:
    """Conversations of every kind in ``counts`` (``MIXED_KINDS`` → how many), from ``split`` of
    their data, interleaved in a seeded order and numbered from 0: users' traffic, all at once.
    The ``chat`` ones are the four domains in equal mix (``loadgen.workload.dataset_workload``)."""
    items: list[WorkItem] = []
    for kind, num in counts.items():
        if kind not in MIXED_KINDS:
            raise WorkloadError(f"unknown kind {kind!r} of the mixed workload; choose from {', '.join(MIXED_KINDS)}")
        if num <= 0:
            continue
        if kind == "chat":
            rows = load_rows(Path(prompt_dir), split)
            items += dataset_workload(rows, num, {d: 1.0 / len(rows) for d in sorted(rows)},
                                      np.random.default_rng(seed), max_tokens=max_tokens)
        else:
            items += task_workload(kind, prompt_dir, split, num, max_tokens, seed)
    order = random.Random(seed).sample(range(len(items)), len(items))
    return [dataclasses.replace(items[j], conversation_id=f"c{i:05d}") for i, j in enumerate(order)]


RAG_PASSAGES = 3
"""Passages in each ``rag`` request."""
RAG_TASKS = (
    "Copy, word for word, every sentence of passage [{k}] that contains a number, one sentence per line.",
    "Summarize passage [{k}] in two or three sentences, reusing its own words, then quote the question it "
    "ends with.",
    "Quote the question that passage [{k}] asks, then list every fact the passage gives before it, each as a "
    "quoted sentence of the passage.",
)
"""What a ``rag`` request asks of one of its passages: an answer that copies from it."""


def rag_turn(passages: list[str], n: int) -> ScriptedTurn:
    """The ``n``-th ``rag`` request over ``passages``: they are numbered [1].. in the prompt, and
    the task (``RAG_TASKS``, turn by turn) is about passage 1 + n mod their number."""
    k = 1 + n % len(passages)
    task = RAG_TASKS[(n // len(passages)) % len(RAG_TASKS)].format(k=k)
    context = "\n\n".join(f"[{i}] {text}" for i, text in enumerate(passages, 1))
    return ScriptedTurn((("user", f"Answer from the passages below.\n\n{context}\n\n{task}"),))


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
