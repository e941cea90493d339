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
import inspect
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
        return max([longest, *(len(t) for t in getattr(tokenizer, "all_special_tokens", ()) or ())])
    except Exception:  # a tokenizer without that API (test fakes): no early bound
        return None


def check_length(state: ServerState, num_chars: int, param: str) -> None:
    """400 if a text of ``num_chars`` characters is sure to exceed the model's context."""
    longest = state.max_token_chars
    context = state.engine.max_model_len
    if longest and num_chars > context * longest:
        raise InvalidRequest(f"{param} holds {num_chars} characters: at least {-(-num_chars // longest)} tokens, "
                             f"more than the model's context of {context}", param=param)


async def chat_prompt(state: ServerState, req: ChatCompletionRequest, *, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, add_special_tokens: bool = False) -> list[int]:
    """The chat request's prompt token ids: its messages (and tools) through the chat template.
    The flags are vLLM's ``/tokenize`` fields: the assistant's turn opened (the default) or the
    last message left open, and the tokenizer's special tokens added on top of the template's."""
    tokenizer = state.tokenizer
    template = state.template
    if not template:
        raise InvalidRequest(f"model {state.model_name} has no chat template; use /v1/completions",
                             param="messages")
    check_length(state, sum(len(m.content or "") for m in req.messages), "messages")
    messages, tool_list = tools.render(req, tokenizer, state.chat_template)
    kwargs: dict[str, Any] = {"tools": tool_list} if tool_list else {}
    if state.chat_template:
        kwargs["chat_template"] = state.chat_template
    if continue_final_message:
        kwargs["continue_final_message"] = True
    kwargs.update(template_variables(tokenizer, req.chat_template_kwargs))
    try:
        ids = await off_loop(_apply_template, tokenizer, messages, add_generation_prompt, add_special_tokens, kwargs)
    except TemplateError as exc:  # the template's own message for its users (e.g. role order)
        raise InvalidRequest(f"messages do not fit the model's chat template: {(str(exc).splitlines() or [''])[0]}",
                             param="messages") from None
    except Exception:  # the tokenizer failed: say so without its internals
        log.warning("chat template or tokenizer failed", exc_info=True)
        raise InvalidRequest("messages could not be tokenized with the model's chat template",
                             param="messages") from None
    if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _apply_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    add_special_tokens: bool, kwargs: dict[str, Any]) -> Any:
    """The template's token ids; with ``add_special_tokens`` its text tokenized with them (HF's
    ``tokenize=True`` is the text tokenized without)."""
    if not add_special_tokens:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                             **kwargs)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **kwargs)
    return tokenizer(text, add_special_tokens=True)["input_ids"]


MAX_CHAT_TEMPLATE_CHARS = 1 << 20


def read_chat_template(value: str) -> str:
    """A chat template given as a file (its text) or as the template itself; ValueError (one
    line) for a missing file or a template Jinja cannot parse."""
    from pathlib import Path

    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    text = value
    if "{" not in value:  # a template has tags; a path has none
        path = Path(value).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the template file {value}: {getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip() or len(text) > MAX_CHAT_TEMPLATE_CHARS:
        raise ValueError(f"a chat template must be 1 to {MAX_CHAT_TEMPLATE_CHARS} characters, got {len(text)}")
    try:  # as transformers compiles it
        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
    return text


def template_variables(tokenizer: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as keywords of ``apply_chat_template``: 400 for a name that is one
    of its own arguments (``tokenize``, ``chat_template``, ...) or the conversation's."""
    if not given:
        return {}
    try:
        own = {name for name, param in inspect.signature(tokenizer.apply_chat_template).parameters.items()
               if param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD)}
    except (TypeError, ValueError):  # no signature to read
        own = set()
    clash = sorted((own | RESERVED_TEMPLATE_VARIABLES) & set(given))
    if clash:
        raise InvalidRequest(f"chat_template_kwargs may not set {clash[0]!r}: the server sets it",
                             param="chat_template_kwargs")
    return dict(given)


RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "conversation", "tools", "documents", "chat_template",
                                         "add_generation_prompt", "tokenize", "continue_final_message"})
"""What the server itself passes to the template (``apply_chat_template`` may name more)."""


async def completion_prompts(state: ServerState, req: CompletionRequest) -> list[list[int]]:
    """The completion request's prompts as token ids, in order: texts tokenized (a batch of texts
    in one call), token ids checked against the context and the vocabulary."""
    prompts = req.prompts
    texts = [p for p in prompts if isinstance(p, str)]
    for text in texts:
        check_length(state, len(text), "prompt")
    encoded = iter([])
    if texts:
        batch = await off_loop(state.tokenizer, texts if len(texts) > 1 else texts[0], add_special_tokens=True)
        ids = batch["input_ids"]
        encoded = iter(ids if len(texts) > 1 else [ids])
    out = []
    for prompt in prompts:
        ids = [int(t) for t in next(encoded)] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("prompt encodes to no tokens", param="prompt")
        check_prompt_ids(state, ids)
        out.append(ids)
    return out


def check_prompt_ids(state: ServerState, ids: list[int]) -> None:
    """400 unless the prompt fits the context and its ids are in the vocabulary."""
    context = state.engine.max_model_len
    if len(ids) >= context:
        raise InvalidRequest(f"the prompt is {len(ids)} tokens; the model's context is {context} tokens",
                             param="prompt")
    vocab_size = state.engine.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")
