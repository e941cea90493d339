"""The kind of request expertise routing sees: its domain and the traffic features that decide
which drafting expert wins.

A JSON-schema answer is won by the grammar's forced tokens and the context copy, an edit by its
prediction, an agent loop or a RAG answer by the copy of its own repeated context, a tenant's
traffic by what its earlier requests said; two requests of one domain may want different
experts. ``RequestKind`` names those features, and its ``prior_keys`` are the routing priors a
request starts from (``algo.routing``): the most specific first (with the tenant, then
without), then, not listed, the domain's and the global prior. Routing only chooses drafters,
so a kind never changes the text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

REPEAT_NGRAM = 4
"""n of ``repeated_ngram_share``: 4 tokens repeat by chance rarely, a copied phrase always."""
REPETITIVE_SHARE = 0.25
"""A prompt whose share of repeated n-grams is at least this is ``repetitive``."""
REPEAT_WINDOW = 4096
"""Only the prompt's last this many tokens are looked at (the cost is linear in them)."""


def repeated_ngram_share(token_ids: Sequence[int], n: int = REPEAT_NGRAM, window: int = REPEAT_WINDOW) -> float:
    """Share of the n-grams of the prompt's last ``window`` tokens that occurred earlier in it
    (0.0 when it has fewer than two n-grams): 0 for text that never repeats itself, about
    1 − 1/r for a text repeated r times."""
    if n < 1:
        raise ValueError(f"n={n}: use 1 or more")
    tokens = tuple(token_ids[-window:])
    total = len(tokens) - n + 1
    if total < 2:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeated = 0
    for i in range(total):
        gram = tokens[i:i + n]
        repeated += gram in seen
        seen.add(gram)
    return repeated / total


@dataclass(frozen=True, slots=True)
class RequestKind:
    """What routing knows of a request when it starts (see the module docstring)."""

    domain: str
    """The prompt's domain (``algo.domains``)."""
    grammar: bool = False
    """A grammar constrains the answer (structured outputs)."""
    prediction: bool = False
    """The client sent the text it expects (Predicted Outputs)."""
    repetitive: bool = False
    """The prompt repeats itself (``repeated_ngram_share`` ≥ ``REPETITIVE_SHARE``)."""
    tenant: str = ""
    """Whose traffic it is (the API key's name; "" for none)."""

    @classmethod
    def of(cls, domain: str, prompt_token_ids: Sequence[int], *, grammar: bool = False, prediction: bool = False,
           tenant: str = "") -> "RequestKind":
        return cls(domain, grammar, prediction, repeated_ngram_share(prompt_token_ids) >= REPETITIVE_SHARE, tenant)

    @property
    def flags(self) -> str:
        """``+grammar+prediction+repetitive`` for those that hold ("" for none)."""
        return "".join(f"+{name}" for name in ("grammar", "prediction", "repetitive") if getattr(self, name))

    def prior_keys(self) -> tuple[str, ...]:
        """The priors more specific than the domain's, the most specific first: the domain with
        its flags and tenant, then with its flags alone (none where there are no flags)."""
        base = self.domain + self.flags
        return ((f"{base}@{self.tenant}",) if self.tenant else ()) + ((base,) if self.flags else ())
