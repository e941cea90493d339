"""A request's prompt token ids: its messages through the chat template, or its prompt tokenized.

Tokenizing is the one piece of a request's work that grows with what the client sends, so it
runs off the event loop (a small thread pool: a large prompt being tokenized never freezes the
streams of other requests), and after a cheap bound: no token is longer than the tokenizer's
longest token (``longest_token_chars``), so a text of more than ``max_model_len`` × that many
characters cannot fit the context and is refused before it is tokenized at all.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from jinja2 import TemplateError

from cosine_ray.serve.text import tools
from cosine_ray.serve.errors import InvalidRequest
from cosine_ray.serve.schemas import ChatCompletionRequest, CompletionRequest
from cosine_ray.serve.state import ServerState

log = logging.getLogger(__name__)

T = TypeVar("T")
TOKENIZER_THREADS = 2
_pool: ThreadPoolExecutor | None = None


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in the tokenizer threads (the HF tokenizer's encode is safe to share)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="cosine_ray-tokenize")
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters any one token stands for (its stored form: a byte-level BPE token
    holds one character per byte, which bounds the characters it decodes to); None when the
    tokenizer cannot list its vocabulary."""
    try:
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max(len(p) for p in pieces if isinstance(p, str))
        return max(longest, *(len(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ()))
    except Exception:  # a tokenizer without that API (test fakes): no early bound
        return None


def check_length(state: ServerState, num_chars: int, param: str) -> None:
    """400 if a text of ``num_chars`` characters is sure to exceed the model's context."""
    longest = state.max_token_chars
    context = state.engine.max_model_len
    if longest and num_chars > context * longest:
        raise InvalidRequest(f"{param} holds {num_chars} characters: at least {-(-num_chars // longest)} tokens, "
                             f"more than the model's context of {context}", param=param)


async def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """The chat request's prompt token ids: its messages (and tools) through the chat template."""
    tokenizer = state.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(f"model {state.model_name} has no chat template; use /v1/completions",
                             param="messages")
    check_length(state, sum(len(m.content or "") for m in req.messages), "messages")
    messages, tool_list = tools.render(req, tokenizer)
    kwargs = {"tools": tool_list} if tool_list else {}
    try:
        ids = await off_loop(tokenizer.apply_chat_template, messages, add_generation_prompt=True, tokenize=True,
                             **kwargs)
    except TemplateError as exc:  # the template's own message for its users (e.g. role order)
        raise InvalidRequest(f"messages do not fit the model's chat template: {str(exc).splitlines()[0]}",
                             param="messages") from None
    except Exception:  # the tokenizer failed: say so without its internals
        log.warning("chat template or tokenizer failed", exc_info=True)
        raise InvalidRequest("messages could not be tokenized with the model's chat template",
                             param="messages") from None
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


async def completion_prompt(state: ServerState, req: CompletionRequest) -> list[int]:
    """The completion request's prompt token ids: its text tokenized, or its ids checked."""
    if isinstance(req.prompt, str):
        check_length(state, len(req.prompt), "prompt")
        encoded = await off_loop(state.tokenizer, req.prompt, add_special_tokens=True)
        ids = [int(t) for t in encoded["input_ids"]]
        if not ids:
            raise InvalidRequest("prompt encodes to no tokens", param="prompt")
        return ids
    context = state.engine.max_model_len
    if len(req.prompt) >= context:
        raise InvalidRequest(f"the prompt is {len(req.prompt)} tokens; the model's context is {context} tokens",
                             param="prompt")
    vocab_size = state.engine.vocab_size
    bad = [t for t in req.prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                             param="prompt")
    return list(req.prompt)
