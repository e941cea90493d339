"""Conversations through an engine or HF transformers: every turn sent with the history
before it (turn k + 1 after turn k's answer), the answers kept token by token. A turn that is a
``ScriptedTurn`` (the ``json``, ``edit``, ``rag`` and ``agent`` workloads) is sent as its script
says, with its prediction (``prediction``: the workload's, ``none``, or ``random`` words as long)
and its JSON schema as the request's grammar. HF transformers applies no grammar, so it runs no
turn with a schema (``has_grammar``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Sequence

from cosine_ray.bench.reference import hf_greedy
from loadgen.tasks import ScriptedTurn, useless_prediction

PREDICTIONS = ("workload", "none", "random")
"""What a scripted turn sends as its prediction: its own, none, or random words as long."""


@dataclass
class Turn:
    """One request of a conversation as a system answered it."""

    token_ids: list[int]
    finish_reason: str | None = None
    stats: Any = None
    """The engine's ``RequestStats`` (None for HF)."""
    prompt_ids: tuple[int, ...] = ()
    """The request's prompt: the chat template over the turns so far and their answers."""
    seconds: float = 0.0
    """Wall time of the request, from its submission to its last token."""
    prediction_ids: tuple[int, ...] = ()
    """The prediction it sent, as token ids (Predicted Outputs)."""


def encode_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat (``role``/``content`` messages) ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prediction_text(turn: ScriptedTurn, mode: str, seed: int) -> str:
    """The prediction a scripted turn sends under ``mode`` (``PREDICTIONS``)."""
    if mode not in PREDICTIONS:
        raise ValueError(f"prediction must be one of {', '.join(PREDICTIONS)}, got {mode!r}")
    if not turn.prediction or mode == "none":
        return ""
    return turn.prediction if mode == "workload" else useless_prediction(turn.prediction, seed)


def has_grammar(conversations: Sequence[Sequence[str | ScriptedTurn]]) -> bool:
    """Whether a turn of ``conversations`` constrains its answer by a JSON schema."""
    return any(isinstance(t, ScriptedTurn) and t.schema for conv in conversations for t in conv)


def turn_params(params: Any, turn: str | ScriptedTurn, prediction_ids: tuple[int, ...]) -> Any:
    """``params`` (``SamplingParams``) for one turn: with its prediction's ids, and its schema as
    the grammar of the answer."""
    from cosine_ray.engine.request import StructuredOutput
    changes: dict[str, Any] = {}
    if prediction_ids:
        changes["prediction"] = prediction_ids
    if isinstance(turn, ScriptedTurn) and turn.schema:
        changes["structured"] = StructuredOutput("json_schema", turn.schema)
    return dataclasses.replace(params, **changes) if changes else params


def prompt_of(tokenizer: Any, turn: str | ScriptedTurn, history: list[dict[str, str]]) -> list[int]:
    """A turn's prompt: a user turn after ``history`` (appended to it), or a scripted turn's chat."""
    if isinstance(turn, ScriptedTurn):
        return encode_messages(tokenizer, turn.chat)
    history.append({"role": "user", "content": turn})
    return encode_messages(tokenizer, history)


async def run_conversations(engine: Any, conversations: Sequence[Sequence[str | ScriptedTurn]], params: Any,
                            concurrency: int, tokenizer: Any, prediction: str = "workload") -> list[list[Turn]]:
    """Every conversation's turns in order, at most ``concurrency`` conversations at once,
    through the engine's loop (shut down at the end)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(index: int, turns: Sequence[str | ScriptedTurn]) -> list[Turn]:
        async with sem:
            history: list[dict[str, str]] = []
            out = []
            for k, turn in enumerate(turns):
                prompt = prompt_of(tokenizer, turn, history)
                text = prediction_text(turn, prediction, 1000 * index + k) if isinstance(turn, ScriptedTurn) else ""
                ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else ()
                start = time.perf_counter()
                result = await engine.loop.generate_all(prompt, turn_params(params, turn, ids))
                out.append(Turn(list(result.new_token_ids), result.finish_reason, result.stats, tuple(prompt),
                                time.perf_counter() - start, ids))
                if not isinstance(turn, ScriptedTurn):
                    history.append({"role": "assistant",
                                    "content": tokenizer.decode(result.new_token_ids, skip_special_tokens=True)})
            return out
    try:
        return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(conversations))))
    finally:
        await engine.loop.shutdown()


def run_hf(model: Any, tokenizer: Any, conversations: Sequence[Sequence[str | ScriptedTurn]], max_tokens: int,
           **kwargs: Any) -> list[list[Turn]]:
    """The same through HF transformers' greedy decoding, one conversation at a time (a
    scripted turn's prediction is not sent); ``kwargs`` go to ``generate`` (``prompt_lookup_num_tokens``).
    A turn with a schema is refused (ValueError): HF would decode it without the grammar."""
    if has_grammar(conversations):
        raise ValueError("HF transformers decodes without a grammar: a turn with a JSON schema cannot run on it")
    outs = []
    for turns in conversations:
        history: list[dict[str, str]] = []
        conv = []
        for turn in turns:
            prompt = prompt_of(tokenizer, turn, history)
            start = time.perf_counter()
            new = hf_greedy(model, prompt, max_tokens, **kwargs)
            conv.append(Turn(new, prompt_ids=tuple(prompt), seconds=time.perf_counter() - start))
            if not isinstance(turn, ScriptedTurn):
                history.append({"role": "assistant", "content": tokenizer.decode(new, skip_special_tokens=True)})
        outs.append(conv)
    return outs


def same_output(ours: Turn, ref: Turn) -> bool:
    """Our tokens equal the reference's (which stops at end-of-text or max_tokens like ours)."""
    n = len(ours.token_ids)
    return ours.token_ids == ref.token_ids[:n] and (n == len(ref.token_ids) or ours.finish_reason == "stop")


def count_tokens(outs: Sequence[Sequence[Turn]]) -> int:
    """Tokens generated over every turn of every conversation."""
    return sum(len(t.token_ids) for conv in outs for t in conv)


def later_turns(outs: Sequence[Sequence[Turn]], first: int = 1) -> tuple[int, float]:
    """(tokens, seconds) of the turns after each conversation's first ``first``: an agent loop
    once its context repeats itself (the seconds are the requests' own, so tokens per second
    of them is what a client saw at concurrency 1)."""
    turns = [t for conv in outs for t in conv[first:]]
    return sum(len(t.token_ids) for t in turns), sum(t.seconds for t in turns)


def prediction_counts(outs: Sequence[Sequence[Turn]]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens over every turn that sent a prediction, counted as
    the server's usage does (``serve.text.prediction``: the longest common subsequence)."""
    from cosine_ray.algo.subsequence import common_subsequence_length
    accepted = rejected = 0
    for conv in outs:
        for t in conv:
            if t.prediction_ids:
                a = common_subsequence_length(t.prediction_ids, t.token_ids)
                accepted, rejected = accepted + a, rejected + len(t.prediction_ids) - a
    return accepted, rejected
