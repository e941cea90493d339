"""vLLM's ``SamplingParams`` for the offline API, mapped onto the engine's own
(``engine.request.SamplingParams``).

The fields and defaults are vLLM's (``max_tokens=16``, ``temperature=1.0``), so a vLLM script
keeps its meaning. Every field is either honoured or, for the vLLM fields the engine has no
rule for, refused with a ValueError naming it unless it keeps its default: nothing is silently
ignored. A name neither vLLM nor we know is a TypeError, as for any Python call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping, Sequence

from cosine_ray.engine.request import SamplingParams as EngineSamplingParams
from cosine_ray.engine.request import StructuredOutput

_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one grammar the output must follow."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict or its JSON text)."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: Sequence[str] | None = None
    """The output is one of these strings."""
    grammar: str | None = None
    """A Lark (or GBNF) grammar."""
    json_object: bool | None = None
    """Any JSON object."""

    def __post_init__(self) -> None:
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(_STRUCTURED_KINDS)}; "
                             f"got {', '.join(given) or 'none'}")

    def to_engine(self) -> StructuredOutput:
        if self.json is not None:
            return StructuredOutput("json_schema", self.json if isinstance(self.json, str) else json.dumps(self.json))
        if self.json_object:
            return StructuredOutput("json_schema", json.dumps({"type": "object"}))
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.choice is not None:
            return StructuredOutput("choice", json.dumps(list(self.choice)))
        return StructuredOutput("lark", self.grammar)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample each prompt's completions (vLLM's fields and defaults)."""

    n: int = 1
    """Completions per prompt; each is its own engine request with its own sampling key
    (``seed + i`` when ``seed`` is given)."""
    max_tokens: int | None = 16
    """Tokens to generate at most; None: what the context leaves after the prompt."""
    temperature: float = 1.0
    """0 = greedy (token-identical to the target's own greedy decoding)."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 = off."""
    min_p: float = 0.0
    """Refused unless 0 (the engine has no min-p rule)."""
    seed: int | None = None
    """Keys the sampling noise: the same seed gives the same text, with or without speculation."""
    stop: str | Sequence[str] | None = None
    """Stop strings: the text ends before the first one, the token ids and log-probabilities at
    the token that completed it."""
    stop_token_ids: Sequence[int] | None = None
    """Finish at these tokens (kept in ``token_ids``)."""
    ignore_eos: bool = False
    """Do not finish at EOS (exactly ``max_tokens`` tokens unless a stop comes first)."""
    min_tokens: int = 0
    """EOS and ``stop_token_ids`` cannot come before this many tokens."""
    logprobs: int | None = None
    """Each generated token's log-probability and this many most likely alternatives."""
    prompt_logprobs: int | None = None
    """The same for every prompt token but the first."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """The penalties (0.0 / 1.0 = off), applied at every draft-tree node from its own path."""
    logit_bias: Mapping[int, float] | None = None
    """Token id → bias in [-100, 100] added to the logits."""
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None
    """A grammar the output must follow (a ``StructuredOutputsParams`` or its fields as a dict)."""
    include_stop_str_in_output: bool = False
    """Refused unless False: the text always ends before the stop string."""
    skip_special_tokens: bool = True
    """Refused unless True: special tokens are always left out of the text."""
    spaces_between_special_tokens: bool = True
    """Refused unless True."""
    detokenize: bool = True
    """Refused unless True."""
    best_of: int | None = None
    """Refused unless None or ``n`` (no ranking of extra completions offline)."""
    truncate_prompt_tokens: int | None = None
    """Refused unless None."""
    allowed_token_ids: Sequence[int] | None = None
    """Refused unless None."""
    bad_words: Sequence[str] | None = None
    """Refused unless None."""
    logits_processors: Any = None
    """Refused unless None."""
    guided_decoding: Any = None
    """Refused unless None (vLLM's older name: use ``structured_outputs``)."""
    extra_args: Mapping[str, Any] | None = None
    """Refused unless None."""
    _engine: EngineSamplingParams = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, allowed in _REFUSED.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is not supported "
                                 f"(only {' or '.join(repr(a) for a in allowed)})")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if self.best_of not in (None, self.n):
            raise ValueError(f"SamplingParams.best_of={self.best_of!r} is not supported (only None or n)")
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise ValueError(f"SamplingParams.max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop must be non-empty strings, got {s!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"SamplingParams.seed must be None or an integer, got {self.seed!r}")
        structured = self.structured_outputs
        if isinstance(structured, Mapping):
            structured = StructuredOutputsParams(**structured)
        elif structured is not None and not isinstance(structured, StructuredOutputsParams):
            raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams or a dict of its "
                             f"fields, got {type(structured).__name__}")
        bias = self.logit_bias or {}
        if not isinstance(bias, Mapping) or not all(isinstance(k, int) and not isinstance(k, bool)
                                                    and isinstance(v, (int, float)) and -100 <= v <= 100
                                                    for k, v in bias.items()):
            raise ValueError("SamplingParams.logit_bias must map token ids (int) to biases in [-100, 100]")
        top_k = 0 if self.top_k == -1 else self.top_k
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"SamplingParams.temperature must be a finite number, got {self.temperature!r}")
        try:  # the engine's own checks, once, here: a bad value fails where it was written
            engine = EngineSamplingParams(
                max_tokens=self.max_tokens or 1, temperature=float(self.temperature), top_p=float(self.top_p),
                top_k=top_k, seed=self.seed, stop_token_ids=tuple(int(t) for t in self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos), min_tokens=self.min_tokens,
                presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
                repetition_penalty=float(self.repetition_penalty),
                logit_bias=tuple((int(k), float(v)) for k, v in bias.items()), logprobs=self.logprobs,
                prompt_logprobs=self.prompt_logprobs,
                structured=None if structured is None else structured.to_engine())
        except (TypeError, ValueError) as exc:
            raise ValueError(f"SamplingParams: {exc}") from None
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        object.__setattr__(self, "_engine", engine)

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or ())

    def engine_params(self, max_tokens: int, choice: int = 0) -> EngineSamplingParams:
        """The engine's parameters for completion ``choice`` with ``max_tokens`` (the context
        decides it when ``self.max_tokens`` is None): choice i samples with ``seed + i``."""
        seed = None if self.seed is None else (self.seed + choice) % 2**64
        return replace(self._engine, max_tokens=max_tokens, seed=seed)


_REFUSED: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0), "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "detokenize": (True,),
    "truncate_prompt_tokens": (None,), "allowed_token_ids": (None,), "bad_words": (None,),
    "logits_processors": (None,), "guided_decoding": (None,), "extra_args": (None,),
}
"""vLLM fields the engine has no rule for, and the values that ask for nothing."""
assert set(_REFUSED) <= {f.name for f in fields(SamplingParams)}
