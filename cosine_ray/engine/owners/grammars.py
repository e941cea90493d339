"""Grammars compiled once, off the event loop: what ``Constraints`` gives each request's matcher.

A ``StructuredOutput`` spec is compiled by llguidance into a matcher in a small pool of worker
threads (llguidance drops the GIL while it builds a grammar), once per distinct spec: an LRU
cache keyed by (kind, spec text) holds the compile (its pristine matcher, or its refusal), and
each request, each choice of an API request too, gets its own ``deep_copy()`` of the matcher.
A server awaits the compile (``prepare``) before the request enters the engine's pool, so the
step loop, which drives every other request, never waits on one.

Caps: a grammar past llguidance's size limits (``GRAMMAR_LIMITS``; its JSON-schema compiler has
its own) is refused as ``too_large``, one whose compile is not done within ``COMPILE_TIMEOUT_S``
as ``too_slow`` (the compile goes on in its thread and is cached when it ends; the tokenizer's
first load does not count); both, like a spec that does not compile, are ``RequestRefused``
naming the ``structured`` field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections import OrderedDict
from typing import Any, Callable

from cosine_ray.engine.request import RequestRefused, StructuredOutput

GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark")
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""JSON is written as ``json.dumps`` writes it (a schema's ``x-guidance`` may override): free
whitespace lets a model fill its tokens with blanks and never close the object."""
COMPILE_TIMEOUT_S = 10.0
"""Longest wait for a grammar's compile (from its submission): past it the request is refused."""
GRAMMAR_CACHE_SIZE = 64
"""Distinct specs whose compiled grammar (or refusal) is kept, least recently used dropped first."""
COMPILE_THREADS = 2
"""Worker threads that compile grammars (one slow compile does not hold up every other)."""
GRAMMAR_LIMITS = {"max_grammar_size": 200_000, "initial_lexer_fuel": 1_000_000, "max_lexer_states": 100_000}
"""llguidance's ``LLParserLimits`` for every grammar: its symbols, the fuel of building its
lexer (about 20 ms of work), the lexer states it may build (1-2 kB each) as masks are computed."""


class TokenizerLoader:
    """The target's HF tokenizer, loaded on first ``load()``."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load

    def load(self) -> Any:
        return self._load()


def _what(spec: StructuredOutput) -> str:
    return spec.kind.replace("_", " ")


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs into llguidance matchers for one tokenizer (the module
    docstring). ``tokenizer``: the HF tokenizer, a ``TokenizerLoader`` (a server loads the
    ~100 MB tokenizer only when a request first asks for a grammar), or an llguidance
    ``LLTokenizer``. The llguidance tokenizer is built once, on first use (about a second)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, timeout_s: float = COMPILE_TIMEOUT_S,
                 cache_size: int = GRAMMAR_CACHE_SIZE, threads: int = COMPILE_THREADS) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.num_compiles = 0
        """Specs compiled so far (a cache hit compiles nothing)."""
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._tokenizer_ready: concurrent.futures.Future | None = None
        self._cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar")

    @property
    def tokenizer(self) -> Any:
        """The llguidance tokenizer (built on first use, in whichever thread asks first)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf
                hf = self.hf_tokenizer
                if isinstance(hf, llguidance.LLTokenizer):
                    self._tokenizer = hf
                else:
                    if isinstance(hf, TokenizerLoader):
                        hf = hf.load()
                    self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
            return self._tokenizer

    # ---- what the engine asks ----------------------------------------------------------------
    async def prepare(self, spec: StructuredOutput) -> None:
        """Compile ``spec`` in a worker thread, or find it compiled; RequestRefused if it cannot
        be, or not within ``timeout_s``. Awaiting this never blocks the event loop."""
        if self._tokenizer is None:
            if self._tokenizer_ready is None or self._tokenizer_ready.cancelled():
                self._tokenizer_ready = self._executor.submit(lambda: self.tokenizer)
            await asyncio.shield(asyncio.wrap_future(self._tokenizer_ready))
        compiled = self._compiled(spec)
        try:  # shielded: a caller that leaves or times out never cancels a compile others share
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiled)), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow(spec) from None

    def check(self, spec: StructuredOutput) -> None:
        """RequestRefused naming the problem if ``spec`` cannot be compiled (compiled here and
        now unless it was already: for callers without an event loop to keep going)."""
        self._pristine(spec)

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh matcher for one request: a deep copy of the compiled one (compiled here and
        now if ``prepare`` did not run first)."""
        return self._pristine(spec).deep_copy()

    def _pristine(self, spec: StructuredOutput) -> Any:
        try:
            return self._compiled(spec).result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._too_slow(spec) from None

    def _too_slow(self, spec: StructuredOutput) -> RequestRefused:
        return RequestRefused(f"the {_what(spec)} was not compiled within {self.timeout_s:g} s", "structured",
                              "too_slow")

    def _compiled(self, spec: StructuredOutput) -> concurrent.futures.Future:
        """The compile of ``spec``: the cached one (a refusal is cached too), or a new one."""
        key = (spec.kind, spec.value)
        future = self._cache.get(key)
        if future is not None and not (future.cancelled() or future.done() and not isinstance(
                future.exception(), (type(None), RequestRefused))):  # an unexpected error is tried again
            self._cache.move_to_end(key)
            return future
        future = self._cache[key] = self._executor.submit(self._compile, spec)
        self.num_compiles += 1
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    # ---- in a worker thread ------------------------------------------------------------------
    def _compile(self, spec: StructuredOutput) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        matcher = LLMatcher(self.tokenizer, self.grammar(spec), log_level=0, limits=LLParserLimits(**GRAMMAR_LIMITS))
        if matcher.is_error():
            error = matcher.get_error().strip()
            if "too large" in error or "too big" in error:
                raise RequestRefused(f"the {_what(spec)} is too large to compile: {error}", "structured", "too_large")
            raise RequestRefused(f"the {_what(spec)} cannot be compiled: {error}", "structured")
        return matcher

    @staticmethod
    def grammar(spec: StructuredOutput) -> str:
        """The llguidance grammar of ``spec``; RequestRefused for a spec that is not even well formed."""
        from llguidance import LLMatcher, grammar_from

        if spec.kind == "json_schema":
            try:
                return LLMatcher.grammar_from_json_schema(spec.value, defaults=JSON_LAYOUT)
            except ValueError as exc:
                raise RequestRefused(f"the JSON schema is not valid JSON: {exc}", "structured") from None
        if spec.kind == "choice":
            try:
                choices = json.loads(spec.value)
            except ValueError:
                choices = None
            if not choices or not isinstance(choices, list) or not all(isinstance(c, str) and c for c in choices):
                raise RequestRefused("choice must be a non-empty list of non-empty strings", "structured")
            return grammar_from("choice", choices)
        if spec.kind in ("regex", "lark"):
            return grammar_from(spec.kind, spec.value)
        raise RequestRefused(f"unknown grammar kind {spec.kind!r} (one of {', '.join(GRAMMAR_KINDS)})", "structured")


class NoGrammars:
    """An engine without a tokenizer: a request with a grammar is refused."""

    num_compiles = 0

    async def prepare(self, spec: StructuredOutput) -> None:
        self.check(spec)

    def check(self, spec: StructuredOutput) -> None:
        raise RequestRefused("structured outputs need the model's tokenizer; this engine has none", "structured",
                             "unsupported")

    def matcher(self, spec: StructuredOutput) -> Any:
        self.check(spec)
