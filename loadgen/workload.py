"""Workloads: what each request asks. The dataset mix (``dataset_workload``, optionally
multi-turn), code editing (``code_edit_workload``), repeated templates (``template_workload``)
and random token ids (``random_workload``); all draws come from the caller's numpy Generator.

The dataset: every ``*.jsonl`` file in the dataset directory holds one JSON object per line
with ``id``, ``domain`` and ``prompt`` (MT-bench rows also ``turns``). A row's domain is the part
of ``domain`` before ``/`` (``chat/writing`` → ``chat``). By default only the **second half** of
each file is used: the first half built the servers' retrieval datastores, so measuring on it
would flatter retrieval drafting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from loadgen.prompt_sets import default_prompt_dir, read_prompt_lines, split_rows


default_dataset_dir = default_prompt_dir
"""``$COSINE_RAY_PROMPTS``, else the prompt sets packaged with cosine_ray (``loadgen.prompt_sets``)."""
DEFAULT_DATASET_DIR = default_dataset_dir()
SPLITS = ("second-half", "first-half", "all")


class WorkloadError(ValueError):
    """A bad dataset file or workload option; the message names the file/line or the flag."""


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One conversation to send (one request per turn)."""

    conversation_id: str
    source_id: str
    """The dataset row's id (``gsm8k/700``) or ``random/N``."""
    domain: str
    turns: tuple = ()
    """User messages (str); one entry unless multi-turn. Empty for token-id prompts. The
    scripted workloads' turns are ``loadgen.tasks.ScriptedTurn``s, each a whole request."""
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int = 128

    @property
    def num_turns(self) -> int:
        return max(1, len(self.turns))

    @classmethod
    def make_dummy(cls, i: int = 0, *, domain: str = "code", turns: Sequence[str] = ("hello",),
                   max_tokens: int = 8) -> "WorkItem":
        return cls(f"c{i:05d}", f"dummy/{i}", domain, tuple(turns), None, max_tokens)


@dataclass(frozen=True, slots=True)
class PromptRow:
    source_id: str
    domain: str
    turns: tuple[str, ...]


def load_rows(dataset_dir: Path, split: str = "second-half") -> dict[str, list[PromptRow]]:
    """domain → rows of the chosen split, files in sorted order, rows in file order."""
    if split not in SPLITS:
        raise WorkloadError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    dataset_dir = Path(dataset_dir)
    files = sorted(dataset_dir.glob("*.jsonl")) if dataset_dir.is_dir() else []
    if not files:
        raise WorkloadError(f"no *.jsonl prompt files in {dataset_dir} (set --dataset-dir)")
    by_domain: dict[str, list[PromptRow]] = {}
    for path in files:
        for row in split_rows(_read_file(path), split, WorkloadError):
            by_domain.setdefault(row.domain, []).append(row)
    return by_domain


def _read_file(path: Path) -> list[PromptRow]:
    """A prompt file's rows (``loadgen.prompt_sets``), each also with a domain and its turns."""
    rows = []
    for lineno, obj in read_prompt_lines(path, WorkloadError):
        domain = obj.get("domain")
        if not isinstance(domain, str) or not domain.split("/")[0]:
            raise WorkloadError(f"{path}:{lineno}: 'domain' must be a non-empty string")
        turns = obj.get("turns", [obj["prompt"]])
        if (not isinstance(turns, list) or not turns
                or not all(isinstance(t, str) and t.strip() for t in turns)):
            raise WorkloadError(f"{path}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
        rows.append(PromptRow(str(obj.get("id", f"{path.stem}/{lineno}")), domain.split("/")[0], tuple(turns)))
    return rows


def parse_domain_mix(text: str | None, available: Sequence[str]) -> dict[str, float]:
    """``code=0.25,math=0.75`` → weights normalised to sum 1; None → equal over ``available``."""
    if not text:
        return {d: 1.0 / len(available) for d in sorted(available)}
    weights: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep:
            raise WorkloadError(f"--domain-mix: expected DOMAIN=WEIGHT, got {part.strip()!r}")
        if name not in available:
            raise WorkloadError(f"--domain-mix: unknown domain {name!r}; the dataset has "
                                f"{', '.join(sorted(available))}")
        try:
            weight = float(value)
        except ValueError:
            raise WorkloadError(f"--domain-mix: weight of {name} must be a number, got {value!r}") from None
        if not np.isfinite(weight) or weight < 0:
            raise WorkloadError(f"--domain-mix: weight of {name} must be finite and >= 0, got {value}")
        if name in weights:
            raise WorkloadError(f"--domain-mix: {name} given twice")
        weights[name] = weight
    total = sum(weights.values())
    if total <= 0:
        raise WorkloadError("--domain-mix: the weights must sum to more than 0")
    return {d: w / total for d, w in weights.items() if w > 0}


def split_counts(num: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Largest-remainder rounding of ``num × weight`` (ties broken by domain name)."""
    names = sorted(weights)
    exact = [num * weights[d] for d in names]
    counts = [int(np.floor(x)) for x in exact]
    order = sorted(range(len(names)), key=lambda i: (-(exact[i] - counts[i]), names[i]))
    for i in order[:num - sum(counts)]:
        counts[i] += 1
    return dict(zip(names, counts))


def dataset_workload(rows: Mapping[str, Sequence[PromptRow]], num_prompts: int, mix: Mapping[str, float],
                     rng: np.random.Generator, *, max_tokens: int, multi_turn: bool = False) -> list[WorkItem]:
    """``num_prompts`` conversations mixed by ``mix``, in a seeded random order.

    An exact mix, not a lottery: ``num_prompts × weight`` is rounded with largest remainders, so
    an equal mix of 100 requests over 4 domains is exactly 25 each (the papers' cross-domain
    sampling); prompts are drawn without replacement per domain (re-shuffled when a domain runs
    out) and the whole list is shuffled. With ``multi_turn`` (MT-bench) a row with ``turns``
    becomes a conversation: the runner sends turn 2 after turn 1's answer, with the history;
    otherwise only the first turn is sent."""
    picked: list[PromptRow] = []
    for domain, count in split_counts(num_prompts, mix).items():
        pool = list(rows[domain])
        while count > 0:
            order = rng.permutation(len(pool))[:count]
            picked.extend(pool[i] for i in order)
            count -= len(order)
    picked = [picked[i] for i in rng.permutation(len(picked))]
    return [WorkItem(f"c{i:05d}", row.source_id, row.domain,
                     row.turns if multi_turn else row.turns[:1], None, max_tokens)
            for i, row in enumerate(picked)]


def spread_lengths(mean: int, range_ratio: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` lengths uniform in [mean·(1 − r), mean·(1 + r)] (vllm's ``--random-range-ratio``), each ≥ 1."""
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=size)


def random_workload(num_prompts: int, rng: np.random.Generator, *, input_len: int, output_len: int,
                    range_ratio: float = 0.0, token_low: int = 1000, token_high: int = 20000) -> list[WorkItem]:
    """Random token-id prompts: ids uniform in ``[token_low, token_high)``, lengths uniform in
    ``len·(1−r) .. len·(1+r)`` (``vllm bench serve``'s random dataset). They go to
    /v1/completions as token-id lists, so no tokenizer is needed here; ``token_high`` must not
    exceed the server's vocabulary."""
    if input_len < 1 or output_len < 1:
        raise WorkloadError("--random-input-len and --random-output-len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise WorkloadError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if not 0 <= token_low < token_high:
        raise WorkloadError(f"--random-token-range must satisfy 0 <= LOW < HIGH, got {token_low},{token_high}")

    in_lens = spread_lengths(input_len, range_ratio, num_prompts, rng)
    out_lens = spread_lengths(output_len, range_ratio, num_prompts, rng)
    return [WorkItem(f"c{i:05d}", f"random/{i}", "random", (),
                     tuple(int(t) for t in rng.integers(token_low, token_high, size=int(n_in))), int(n_out))
            for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens))]


CODE_EDITS = (
    "add a type hint to every local variable",
    "rename its parameters to longer, more descriptive names",
    "add a short comment above every line of its body",
    "make it raise ValueError when an argument has the wrong type",
    "add two more examples to its docstring",
    "write its body without using any loop",
)
"""The changes a code-editing request asks for (each keeps most of the function as it is)."""

CODE_EDIT_PROMPT = ("Here is a Python function:\n\n```python\n{code}```\n\nRewrite this function to {edit}. "
                    "Reply with the complete function, signature and docstring included, in one code block.")

TEMPLATES = {
    "code": "Write a Python function for the task below. Reply with one code block, then one sentence "
            "that explains it.\n\nTask:\n{question}",
    "math": "Solve the problem below step by step. End with a line of the form 'Answer: <number>'.\n\n"
            "Problem: {question}",
    "instruction": "Follow the instruction below. Begin your reply with 'Sure, here is' and keep it "
                   "short.\n\nInstruction: {question}",
    "chat": "Answer the question below in three short paragraphs.\n\nQuestion: {question}",
}
"""One instruction template per domain for the repeated-template workload (``{question}`` = the row)."""

WORKLOADS = ("chat", "multi-turn", "code-edit", "template")
"""The text workloads ``build_workload`` makes (``cosine-ray bench --workload``; loadgen's dataset
workload is ``chat``/``multi-turn``, plus ``code-edit`` and ``template``). ``chat`` is the four
domains in the dataset's mix; the workload of all kinds together, ``mixed``, is
``loadgen.tasks.mixed_workload``."""


def _strip_code_stub(prompt: str) -> str:
    head = "Complete the following Python function."
    code = prompt[len(head):] if prompt.startswith(head) else prompt
    code = code.strip("\n") + "\n"
    return code


def code_edit_workload(rows: Mapping[str, Sequence[PromptRow]], num_prompts: int, rng: np.random.Generator, *,
                       max_tokens: int, domain: str = "code") -> list[WorkItem]:
    """``num_prompts`` code-editing requests, seeded: each carries a function from the code prompts
    (a HumanEval stub: signature and docstring, the "Complete the following Python function."
    line dropped) and asks for one of ``CODE_EDITS`` with the whole function in the answer, so
    most of the answer repeats code the prompt holds, as in an editor's "change this code"."""
    pool = list(rows.get(domain, ()))
    if not pool:
        raise WorkloadError(f"the code-edit workload needs {domain!r} prompts; the dataset has "
                            f"{', '.join(sorted(rows)) or 'none'}")
    items = []
    order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-num_prompts // len(pool)))])
    for i in range(num_prompts):
        row = pool[int(order[i])]
        edit = CODE_EDITS[int(rng.integers(len(CODE_EDITS)))]
        text = CODE_EDIT_PROMPT.format(code=_strip_code_stub(row.turns[0]), edit=edit)
        items.append(WorkItem(f"c{i:05d}", f"{row.source_id}#edit", domain, (text,), None, max_tokens))
    return items


def template_workload(rows: Mapping[str, Sequence[PromptRow]], num_prompts: int, mix: Mapping[str, float],
                      rng: np.random.Generator, *, max_tokens: int, pool_size: int = 6,
                      zipf_s: float = 1.2) -> list[WorkItem]:
    """``num_prompts`` repeated-template requests mixed by ``mix``, seeded: many users asking the
    same kind of question. Each domain wraps its questions in one fixed instruction template
    (``TEMPLATES``), and draws them from a small pool with Zipf popularity (weight
    1/rank^``zipf_s``): the popular questions arrive again and again word for word, the rest
    share the template and the answer format. The pool of a domain is its first ``pool_size``
    rows of the split, so a warm-up set and a measured set built from the two halves never share
    a question."""
    if pool_size < 1:
        raise WorkloadError(f"pool size must be >= 1, got {pool_size}")
    picked: list[tuple[str, PromptRow]] = []
    for domain, count in split_counts(num_prompts, mix).items():
        pool = list(rows[domain])[:pool_size]
        weights = 1.0 / np.arange(1, len(pool) + 1) ** zipf_s
        draws = rng.choice(len(pool), size=count, p=weights / weights.sum())
        template = TEMPLATES.get(domain, "{question}")
        picked.extend((template.format(question=pool[int(j)].turns[0]), pool[int(j)]) for j in draws)
    picked = [picked[i] for i in rng.permutation(len(picked))]
    return [WorkItem(f"c{i:05d}", f"{row.source_id}#template", row.domain, (text,), None, max_tokens)
            for i, (text, row) in enumerate(picked)]


def build_workload(name: str, rows: Mapping[str, Sequence[PromptRow]], num_prompts: int,
                   mix: Mapping[str, float], rng: np.random.Generator, *, max_tokens: int) -> list[WorkItem]:
    """One of ``WORKLOADS`` over ``rows`` (one split of the dataset)."""
    if name == "chat":
        return dataset_workload(rows, num_prompts, mix, rng, max_tokens=max_tokens)
    if name == "multi-turn":
        multi = {d: [r for r in rs if len(r.turns) > 1] for d, rs in rows.items()}
        multi = {d: rs for d, rs in multi.items() if rs}
        if not multi:
            raise WorkloadError("the multi-turn workload needs rows with 'turns' (MT-bench)")
        return dataset_workload(multi, num_prompts, {d: 1.0 / len(multi) for d in sorted(multi)}, rng,
                                max_tokens=max_tokens, multi_turn=True)
    if name == "code-edit":
        return code_edit_workload(rows, num_prompts, rng, max_tokens=max_tokens)
    if name == "template":
        return template_workload(rows, num_prompts, mix, rng, max_tokens=max_tokens)
    raise WorkloadError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
