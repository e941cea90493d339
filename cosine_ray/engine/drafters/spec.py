"""Which drafters a config names: ``DrafterSpec`` and the ``--drafters`` syntax."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DRAFTER_KINDS = ("none", "ngram", "retrieval", "suffix", "model", "self")
LEARNING_KINDS = ("suffix",)
"""Drafter kinds that learn from the requests the server finishes."""
DOMAINS = ("code", "math", "instruction", "chat")
DEFAULT_DRAFTERS = "ngram," + ",".join(f"retrieval:{d}" for d in DOMAINS)
"""CoSine's default speculation cluster: the context n-gram drafter and one retrieval
drafter per domain (expertise routing learns which serves which request)."""
LEARNING_DRAFTERS = "ngram," + ",".join(f"suffix:{d}" for d in DOMAINS)
"""The context n-gram drafter and one live suffix expert per domain: each is seeded from its
domain's datastore and keeps learning from the requests of its domain the server finishes."""


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    kind: str
    """ngram | retrieval | suffix | model | self (the target as its own drafter)."""
    source: str = ""
    """retrieval: a domain name, a datastore .parquet path, or "" for every default
    datastore merged; suffix: a domain name (a live expert of that domain, seeded from its
    datastore), a snapshot .parquet path, or "" (one index over every domain); model: a model
    spec (embedded name, HF dir or .gguf)."""

    @property
    def name(self) -> str:
        if self.kind in ("retrieval", "suffix"):
            if not self.source:
                return self.kind
            return f"{self.kind}:{Path(self.source).stem if self.source.endswith('.parquet') else self.source}"
        if self.kind == "model":
            return f"model:{Path(self.source).name or self.source}"
        return self.kind

    @property
    def learns(self) -> bool:
        """It learns from finished requests (the engine sends it their text)."""
        return self.kind in LEARNING_KINDS


def parse_drafters(text: str) -> tuple[DrafterSpec, ...]:
    """``"none"`` | ``"default"`` (DEFAULT_DRAFTERS) | ``"learning"`` (LEARNING_DRAFTERS) | comma
    list of ``ngram``, ``retrieval[:DOMAIN|:FILE.parquet]``, ``suffix[:DOMAIN|:FILE.parquet]``,
    ``model:SPEC``, ``self``. Raises ValueError naming the accepted forms."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    if text == "default":
        text = DEFAULT_DRAFTERS
    elif text == "learning":
        text = LEARNING_DRAFTERS
    specs = []
    for part in text.split(","):
        kind, _, source = part.strip().partition(":")
        if kind not in DRAFTER_KINDS or kind == "none":
            raise ValueError(f"unknown drafter {part.strip()!r}; use none, default, learning, or a comma list of "
                             f"ngram, retrieval[:DOMAIN|:FILE.parquet], suffix[:DOMAIN|:FILE.parquet], model:MODEL, self")
        if kind == "model" and not source:
            raise ValueError("drafter 'model' needs a model: model:smollm2-135m, model:/path/to/hf_dir "
                             "or model:/path/to/file.gguf")
        if kind in ("retrieval", "suffix") and source and source not in DOMAINS and not source.endswith(".parquet"):
            raise ValueError(f"{kind} drafter {source!r}: give a domain ({', '.join(DOMAINS)}) "
                             f"or a {'datastore' if kind == 'retrieval' else 'snapshot'} .parquet file")
        if kind in ("ngram", "self") and source:
            raise ValueError(f"drafter {kind!r} takes no argument (got {part.strip()!r})")
        specs.append(DrafterSpec(kind, source))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"drafter listed twice in {text!r}")
    return tuple(specs)
