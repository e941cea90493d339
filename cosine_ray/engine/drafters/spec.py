"""Which drafters a config names: ``DrafterSpec`` and the ``--drafters`` syntax."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DRAFTER_KINDS = ("none", "ngram", "retrieval", "suffix", "model", "self", "distilled", "head")
LEARNING_KINDS = ("suffix",)
"""Drafter kinds that learn from the requests the server finishes."""
DOMAINS = ("code", "math", "instruction", "chat")
DEFAULT_DRAFTERS = "ngram," + ",".join(f"retrieval:{d}" for d in DOMAINS)
"""CoSine's default speculation cluster: the context n-gram drafter and one retrieval
drafter per domain (expertise routing learns which serves which request)."""
LEARNING_DRAFTERS = "ngram," + ",".join(f"suffix:{d}" for d in DOMAINS)
"""The context n-gram drafter and one live suffix expert per domain: each is seeded from its
domain's datastore and keeps learning from the requests of its domain the server finishes."""
DISTILLED_DRAFTERS = "ngram,head," + ",".join(f"distilled:{d}" for d in DOMAINS)
"""The context n-gram drafter, the feature head on the target's own features, and one domain
drafter distilled from the target per domain (``cosine-ray distill``; docs/drafters.md)."""
NAMED_SETS = {"default": DEFAULT_DRAFTERS, "learning": LEARNING_DRAFTERS, "distilled": DISTILLED_DRAFTERS}


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    kind: str
    """ngram | retrieval | suffix | model | self (the target as its own drafter) | distilled (a
    domain drafter from ``cosine-ray distill``) | head (a feature head from it)."""
    source: str = ""
    """retrieval: a domain name, a datastore .parquet path, or "" for every default
    datastore merged; suffix: a domain name (a live expert of that domain, seeded from its
    datastore), a snapshot .parquet path, or "" (one index over every domain); model: a model
    spec (embedded name, HF dir or .gguf); distilled: a domain (the packaged drafter of the
    target) or a drafter folder; head: "" (the packaged head of the target) or a head folder."""

    @property
    def name(self) -> str:
        if self.kind in ("retrieval", "suffix"):
            if not self.source:
                return self.kind
            return f"{self.kind}:{Path(self.source).stem if self.source.endswith('.parquet') else self.source}"
        if self.kind == "model":
            return f"model:{Path(self.source).name or self.source}"
        if self.kind == "distilled":
            return f"distilled:{self.source if self.source in DOMAINS else Path(self.source).name}"
        if self.kind == "head" and self.source:
            return f"head:{Path(self.source).name}"
        return self.kind

    @property
    def learns(self) -> bool:
        """It learns from finished requests (the engine sends it their text)."""
        return self.kind in LEARNING_KINDS


def parse_drafters(text: str) -> tuple[DrafterSpec, ...]:
    """``"none"`` | a named set (``default``, ``learning``, ``distilled``: ``NAMED_SETS``) | comma
    list of ``ngram``, ``retrieval[:DOMAIN|:FILE.parquet]``, ``suffix[:DOMAIN|:FILE.parquet]``,
    ``model:SPEC``, ``self``, ``distilled:DOMAIN|:FOLDER``, ``head[:FOLDER]``. Raises ValueError
    naming the accepted forms."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    text = NAMED_SETS.get(text, text)
    specs = []
    for part in text.split(","):
        kind, _, source = part.strip().partition(":")
        if kind not in DRAFTER_KINDS or kind == "none":
            raise ValueError(f"unknown drafter {part.strip()!r}; use none, {', '.join(NAMED_SETS)}, or a comma list "
                             f"of ngram, retrieval[:DOMAIN|:FILE.parquet], suffix[:DOMAIN|:FILE.parquet], model:MODEL, "
                             f"self, distilled:DOMAIN|:FOLDER, head[:FOLDER]")
        if kind == "model" and not source:
            raise ValueError("drafter 'model' needs a model: model:smollm2-135m, model:/path/to/hf_dir "
                             "or model:/path/to/file.gguf")
        if kind in ("retrieval", "suffix") and source and source not in DOMAINS and not source.endswith(".parquet"):
            raise ValueError(f"{kind} drafter {source!r}: give a domain ({', '.join(DOMAINS)}) "
                             f"or a {'datastore' if kind == 'retrieval' else 'snapshot'} .parquet file")
        if kind == "distilled" and not source:
            raise ValueError(f"drafter 'distilled' needs a domain ({', '.join(DOMAINS)}) or a folder written by "
                             f"`cosine-ray distill`")
        if kind in ("ngram", "self") and source:
            raise ValueError(f"drafter {kind!r} takes no argument (got {part.strip()!r})")
        specs.append(DrafterSpec(kind, source))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"drafter listed twice in {text!r}")
    return tuple(specs)
