"""What a chaos run asks: request shapes, each with one right answer on a lossless server.

A **shape** is a prompt from the packaged domains, an endpoint, ``max_tokens``, greedy decoding
or sampling with a fixed ``seed`` (sampling noise is keyed by seed and position, so a seeded
answer is reproducible too), and one **feature** of the API (``FEATURES``, in turn over the
shapes): ``plain``; ``n`` (``NUM_CHOICES`` choices; seeded ones differ, each keyed by seed + i);
``stop`` (``STOP`` strings); ``logprobs`` (top 2 per token, and one entry per token);
``json`` (a small JSON schema, chat); ``tools`` (a named function call, so its arguments
follow the function's schema, chat). Greedy shapes without a grammar (``independent``) have
references an independent run computes (``references.py``: Hugging Face transformers, fp32);
the others are checked against the server's own answer before the chaos.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from loadgen.workload import PromptRow

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SEEDED_TEMPERATURE = 0.8
PROBE_PROMPT = "The capital of France is"
FEATURES = ("plain", "n", "stop", "logprobs", "json", "tools")
CHAT_ONLY = frozenset({"json", "tools"})
NUM_CHOICES = 2
STOP = [".", "\n\n"]
TOP_LOGPROBS = 2
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
               "required": ["answer"], "additionalProperties": False}
TOOL = {"type": "function", "function": {
    "name": "look_up", "description": "Look a topic up in the encyclopedia.",
    "parameters": {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 40}},
                   "required": ["topic"], "additionalProperties": False}}}


def parse_features(text: str) -> tuple[str, ...]:
    """``all`` or a comma list of FEATURES (ValueError otherwise)."""
    if text.strip() == "all":
        return FEATURES
    names = tuple(dict.fromkeys(f.strip() for f in text.split(",") if f.strip()))
    bad = [f for f in names if f not in FEATURES]
    if bad or not names:
        raise ValueError(f"--features: unknown feature {bad[0] if bad else text!r}; "
                         f"choose from all, {', '.join(FEATURES)}")
    return names


@dataclass(frozen=True, slots=True)
class Shape:
    key: str
    domain: str
    path: str
    prompt: str
    max_tokens: int
    seed: int | None = None
    """None: greedy; else sampled at SEEDED_TEMPERATURE with this seed."""
    feature: str = "plain"

    @property
    def n(self) -> int:
        return NUM_CHOICES if self.feature == "n" else 1

    @property
    def stop(self) -> list[str]:
        return list(STOP) if self.feature == "stop" else []

    @property
    def independent(self) -> bool:
        """Greedy and unconstrained: an independent greedy run gives its answer."""
        return self.seed is None and self.feature not in CHAT_ONLY

    def body(self, model: str | None, *, stream: bool, request_id: str) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "stream": stream, "user": request_id,
                                "temperature": 0.0 if self.seed is None else SEEDED_TEMPERATURE}
        if self.seed is not None:
            body["seed"] = self.seed
        if model:
            body["model"] = model
        chat = self.path == CHAT
        body.update({"messages": [{"role": "user", "content": self.prompt}]} if chat else {"prompt": self.prompt})
        if stream:
            body["stream_options"] = {"include_usage": True}
        if self.n > 1:
            body["n"] = self.n
        if self.stop:
            body["stop"] = self.stop
        if self.feature == "logprobs":
            body.update({"logprobs": True, "top_logprobs": TOP_LOGPROBS} if chat else {"logprobs": TOP_LOGPROBS})
        elif self.feature == "json":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": JSON_SCHEMA}}
        elif self.feature == "tools":
            body.update(tools=[TOOL], tool_choice={"type": "function", "function": {"name": TOOL["function"]["name"]}})
        return body


def probe_shape(max_tokens: int = 4) -> Shape:
    return Shape("probe", "probe", COMPLETIONS, PROBE_PROMPT, max_tokens)


def build_shapes(rows: Mapping[str, Sequence[PromptRow]], num_shapes: int, rng: np.random.Generator, *,
                 max_tokens: int, seeded_fraction: float, completions_fraction: float,
                 features: Sequence[str] = ("plain",)) -> list[Shape]:
    """``num_shapes`` shapes: domains and features in turn, prompts drawn without replacement
    per domain."""
    domains = sorted(d for d, r in rows.items() if r)
    if not domains:
        raise ValueError("no prompt rows to build requests from")
    order = {d: list(rng.permutation(len(rows[d]))) for d in domains}
    shapes = []
    for i in range(num_shapes):
        domain = domains[i % len(domains)]
        if not order[domain]:
            order[domain] = list(rng.permutation(len(rows[domain])))
        row = rows[domain][order[domain].pop()]
        seeded = rng.random() < seeded_fraction
        path = COMPLETIONS if rng.random() < completions_fraction else CHAT
        feature = features[i % len(features)]
        shapes.append(Shape(f"s{i:03d}", domain, CHAT if feature in CHAT_ONLY else path, row.turns[0], max_tokens,
                            int(rng.integers(1, 2**31)) if seeded else None, feature))
    return shapes
