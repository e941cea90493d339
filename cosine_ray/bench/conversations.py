"""Conversations through an engine or HF transformers: every turn sent with the history
before it (turn k + 1 after turn k's answer), the answers kept token by token."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Sequence

from cosine_ray.bench.reference import hf_greedy


@dataclass
class Turn:
    """One request of a conversation as a system answered it."""

    token_ids: list[int]
    finish_reason: str | None = None
    stats: Any = None
    """The engine's ``RequestStats`` (None for HF)."""
    prompt_ids: tuple[int, ...] = ()
    """The request's prompt: the chat template over the turns so far and their answers."""


def encode_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat (``role``/``content`` messages) ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


async def run_conversations(engine: Any, conversations: Sequence[Sequence[str]], params: Any, concurrency: int,
                            tokenizer: Any) -> list[list[Turn]]:
    """Every conversation's turns in order, at most ``concurrency`` conversations at once,
    through the engine's loop (shut down at the end)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(turns: Sequence[str]) -> list[Turn]:
        async with sem:
            history: list[dict[str, str]] = []
            out = []
            for text in turns:
                history.append({"role": "user", "content": text})
                prompt = encode_messages(tokenizer, history)
                result = await engine.loop.generate_all(prompt, params)
                out.append(Turn(list(result.new_token_ids), result.finish_reason, result.stats, tuple(prompt)))
                history.append({"role": "assistant",
                                "content": tokenizer.decode(result.new_token_ids, skip_special_tokens=True)})
            return out
    try:
        return list(await asyncio.gather(*(one(c) for c in conversations)))
    finally:
        await engine.loop.shutdown()


def run_hf(model: Any, tokenizer: Any, conversations: Sequence[Sequence[str]], max_tokens: int,
           **kwargs: Any) -> list[list[Turn]]:
    """The same through HF transformers' greedy decoding, one conversation at a time;
    ``kwargs`` go to ``generate`` (``prompt_lookup_num_tokens``)."""
    outs = []
    for turns in conversations:
        history: list[dict[str, str]] = []
        conv = []
        for text in turns:
            history.append({"role": "user", "content": text})
            prompt = encode_messages(tokenizer, history)
            new = hf_greedy(model, prompt, max_tokens, **kwargs)
            conv.append(Turn(new, prompt_ids=tuple(prompt)))
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
