"""Tool calls in a model's text, in the forms chat templates train models to write: text in,
the calls and the remaining content out (``TOOL_CALL_PARSERS``, chosen by name as vLLM's
``--tool-call-parser``):

* ``hermes`` (the default; Qwen, Hermes, and what ``serve.text.tools`` asks a model without a tool
  template for): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
  anywhere in the text.
* ``llama3_json`` (Llama 3.1-3.3): the answer is a JSON object ``{"name": ..., "parameters":
  {...}}`` (or ``"arguments"``), possibly after ``<|python_tag|>``, several separated by ``;``.
* ``mistral`` (Mistral 7B v0.3 and its template): ``[TOOL_CALLS]`` then a JSON list of
  ``{"name", "arguments"}``. The marker is a special token, so a decode that skips special
  tokens drops it: a text that *begins* with such a list is read as calls too.

A call counts only when its name is one of the request's tools (when they are given) and its
JSON is whole; otherwise the text stays content. For streaming, ``call_start`` says where calls
begin (the content before it can be sent) and ``held_back`` how much of the text's end could
still begin one.
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Collection

HERMES_OPEN = "<tool_call>"
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ID_CHARS = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: Any
    """The arguments as the model wrote them: an object, or a JSON text."""
    call_id: str | None = None
    """An id the model wrote with the call (Mistral's templates carry one), else None."""


Extracted = tuple[str | None, list[ParsedCall]]
"""(the content left when the calls are taken out, or None if none is left; the calls)."""


@dataclass(frozen=True, slots=True)
class ToolCallParser:
    """One format: how to extract its calls, and what may begin one (for streaming)."""

    name: str
    extract: Callable[[str, Collection[str] | None], Extracted]
    """(text, the tools' names or None for any name) → (content, calls); no calls: (text, [])."""
    markers: tuple[str, ...]
    """Strings that begin calls wherever they appear."""
    leading: str = ""
    """A character that begins calls when it is the text's first non-space one."""
    new_call_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}"
    """An id for a call the model gave none (the format's own id rules)."""

    def call_start(self, text: str, start: int = 0) -> int:
        """Where calls begin in ``text`` (at or after ``start``), or -1: none so far."""
        hits = [i for i in (text.find(m, start) for m in self.markers) if i >= 0]
        first = len(text) - len(text.lstrip())
        if self.leading and first >= start and text[first:first + 1] == self.leading:
            hits.append(first)
        return min(hits, default=-1)

    def held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that may still begin a call."""
        if self.leading and not text.strip():
            return len(text)
        for k in range(min(max(map(len, self.markers)), len(text)), 0, -1):
            if any(m.startswith(text[-k:]) for m in self.markers):
                return k
        return 0


def _is_call(obj: Any, names: Collection[str] | None, arguments_key: str = "arguments") -> bool:
    return (isinstance(obj, dict) and isinstance(obj.get("name"), str)
            and (names is None or obj["name"] in names)
            and isinstance(obj.get(arguments_key, {}), (dict, str)))


def _content(*parts: str) -> str | None:
    return "".join(parts).strip() or None


def extract_hermes(text: str, names: Collection[str] | None) -> Extracted:
    calls = []
    for block in HERMES_CALL.findall(text):
        try:
            obj = json.loads(block)
        except ValueError:
            continue
        if _is_call(obj, names):
            calls.append(ParsedCall(obj["name"], obj.get("arguments", {})))
    if not calls:
        return text, []
    return _content(HERMES_CALL.sub("", text)), calls


def _json_values(text: str, start: int, separator: str | None) -> tuple[list[Any], int]:
    """The JSON values at ``text[start:]`` (one, or several joined by ``separator``) and where
    they end; ValueError if there is none."""
    decoder = json.JSONDecoder()
    values = []
    at = start
    while True:
        at += len(text[at:]) - len(text[at:].lstrip())
        value, at = decoder.raw_decode(text, at)
        values.append(value)
        rest = text[at:].lstrip()
        if not separator or not rest.startswith(separator):
            return values, at
        at = len(text) - len(rest) + len(separator)


def extract_llama3_json(text: str, names: Collection[str] | None) -> Extracted:
    before, tag, body = text.partition(PYTHON_TAG)
    if not tag:
        before, body = "", text
        if not body.lstrip().startswith("{"):
            return text, []
    try:
        objects, end = _json_values(body, 0, ";")
    except ValueError:
        return text, []
    calls = []
    for obj in objects:
        key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
        if not _is_call(obj, names, key):
            return text, []
        calls.append(ParsedCall(obj["name"], obj.get(key, {})))
    return _content(before, body[end:]), calls


def extract_mistral(text: str, names: Collection[str] | None) -> Extracted:
    before, marker, body = text.partition(MISTRAL_TOOL_CALLS)
    if not marker:  # the marker was a special token the decode left out: a list at the start
        before, body = "", text
        if not body.lstrip().startswith("["):
            return text, []
    try:
        (value,), end = _json_values(body, 0, None)
    except ValueError:
        return text, []
    items = value if isinstance(value, list) else [value]
    if not items or not all(_is_call(item, names) for item in items):
        return text, []
    calls = [ParsedCall(item["name"], item.get("arguments", {}),
                        item["id"] if isinstance(item.get("id"), str) else None) for item in items]
    return _content(before, body[end:]), calls


def _mistral_call_id() -> str:
    """Mistral's templates take 9 letters or digits as a call id, nothing else."""
    return "".join(random.choices(MISTRAL_ID_CHARS, k=9))


TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": ToolCallParser("hermes", extract_hermes, (HERMES_OPEN,)),
    "llama3_json": ToolCallParser("llama3_json", extract_llama3_json, (PYTHON_TAG,), leading="{"),
    "mistral": ToolCallParser("mistral", extract_mistral, (MISTRAL_TOOL_CALLS,), leading="[",
                              new_call_id=_mistral_call_id),
}
DEFAULT_TOOL_CALL_PARSER = "hermes"


def tool_call_parser(name: str) -> ToolCallParser:
    """The parser called ``name``; ValueError naming the known ones."""
    try:
        return TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}") from None
