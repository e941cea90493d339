"""Bounds on every request field that costs the server work, and the checks that need the model.

Each bound is a 400 naming its field, before any engine call (docs/api.md, Limits, lists them).
The list and string bounds are part of the request models (``serve.schemas``); here are the
numbers, the checks of nested structures (JSON schemas: size and depth), the duplicate
``logit_bias`` keys that JSON parsing would silently merge, and what needs the vocabulary: token
ids inside it, and a request whose end tokens (``stop_token_ids`` with ``min_tokens``) would mask
every token, which no sampling could then answer.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from cosine_ray.serve.errors import InvalidRequest

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
"""Longest stop string (the stream holds back up to this many characters minus one)."""
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
"""Most ``logit_bias`` entries (each is applied to every scored row)."""
MAX_MESSAGES = 2048
MAX_PROMPT_GENERATIONS = 256
"""Most generations one completions request may ask for: prompts × max(n, best_of). A batch of
prompts (``prompt`` as several strings or token-id lists) is one request whose choices are all
admitted together, so this also bounds the prompts of a batch."""
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 64 << 10
"""Largest JSON schema, as JSON text: a response format's, or all tools' parameters together."""
MAX_SCHEMA_DEPTH = 64
"""Deepest nesting of objects and arrays in a JSON schema (an object property nested in an
object property takes two levels: the schema and its ``properties``)."""
MAX_GRAMMAR_CHARS = 64 << 10
"""Largest regex or Lark grammar, and the largest ``choice`` list (its strings together)."""
MAX_CHOICE_STRINGS = 256
MAX_PROMPT_LOGPROBS_TOKENS = 1024
"""Longest prompt whose log-probabilities may be asked for (``prompt_logprobs``, or ``echo``
with ``logprobs``): the engine scores every prompt token over the whole vocabulary."""
MAX_USER_CHARS = 256


def json_depth(value: Any) -> int:
    """Nesting depth of objects and arrays (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_schema(schema: Any, param: str, *, num_chars: int | None = None) -> None:
    """400 naming ``param`` if the JSON schema (a parsed value, or JSON text) is too deep or too
    large (``num_chars``: its size as JSON text, when the caller knows it)."""
    too_deep = f"{param}: the JSON schema is nested more than {MAX_SCHEMA_DEPTH} deep"
    if isinstance(schema, str):
        check_schema_chars(len(schema) if num_chars is None else num_chars, param)
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise InvalidRequest(too_deep, param=param) from None
        except ValueError:
            raise InvalidRequest(f"{param}: the JSON schema is not valid JSON", param=param) from None
    if json_depth(schema) > MAX_SCHEMA_DEPTH:  # first: dumping a very deep value recurses
        raise InvalidRequest(too_deep, param=param)
    check_schema_chars(len(json.dumps(schema)) if num_chars is None else num_chars, param)


def check_schema_chars(num_chars: int, param: str) -> None:
    if num_chars > MAX_SCHEMA_CHARS:
        raise InvalidRequest(f"{param}: the JSON schema is {num_chars} characters; the limit is {MAX_SCHEMA_CHARS}",
                             param=param)


def check_grammar_text(text: str, param: str, what: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"{param}: the {what} is {len(text)} characters; the limit is {MAX_GRAMMAR_CHARS}",
                             param=param)


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def check_duplicate_keys(body: bytes) -> None:
    """400 if a JSON object of the request body holds one key twice (JSON parsers keep the last
    silently, so ``{"logit_bias": {"5": 100, "5": -100}}`` would lose a bias without a word)."""
    try:
        json.loads(body, object_pairs_hook=_unique_pairs)
    except _DuplicateKey as exc:
        param = "logit_bias" if exc.key.isdigit() else None
        raise InvalidRequest(f"the request body gives the key {exc.key[:64]!r} twice in one object",
                             param=param) from None
    except (ValueError, RecursionError):  # not JSON at all: the request model already said so
        return


def check_token_ids(ids: Iterable[int], vocab_size: int, param: str) -> None:
    for token in ids:
        if not 0 <= token < vocab_size:
            raise InvalidRequest(f"{param}: token id {token} is outside the vocabulary [0, {vocab_size})",
                                 param=param)


def check_vocabulary(req: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
    """The request's token ids are in the vocabulary, and its end tokens do not mask all of it:
    ``min_tokens`` holds back ``stop_token_ids`` (and EOS unless ``ignore_eos``), so if they are
    every token, no token could be generated before ``min_tokens`` (refused up front: the engine
    would find a row with nothing to sample)."""
    stop_ids = req.stop_token_ids or ()
    check_token_ids(stop_ids, vocab_size, "stop_token_ids")
    check_token_ids((t for t, _ in req.logit_bias), vocab_size, "logit_bias")
    if req.min_tokens > 0:
        ends = set(stop_ids) | (set() if req.ignore_eos else {t for t in eos_token_ids if 0 <= t < vocab_size})
        if len(ends) >= vocab_size:
            raise InvalidRequest("stop_token_ids (with EOS) name every token of the vocabulary, so with min_tokens "
                                 "> 0 no token could be generated; leave some out or set min_tokens to 0",
                                 param="stop_token_ids")


def check_prompt_logprobs(num_prompt_tokens: int, param: str) -> None:
    if num_prompt_tokens > MAX_PROMPT_LOGPROBS_TOKENS:
        raise InvalidRequest(f"{param}: prompt log-probabilities are served for prompts of at most "
                             f"{MAX_PROMPT_LOGPROBS_TOKENS} tokens; this prompt has {num_prompt_tokens}",
                             param=param)
