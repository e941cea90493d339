"""Engine configuration: which target, which drafters, how to batch and speculate."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cosine_ray.engine.router import RouterConfig

DRAFTER_KINDS = ("none", "ngram", "retrieval", "model", "self")
DOMAINS = ("code", "math", "instruction", "chat")


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    kind: str
    """ngram | retrieval | model | self (the target as its own drafter)."""
    source: str = ""
    """retrieval: a domain name, a datastore .parquet path, or "" for every default
    datastore merged; model: a model spec (embedded name, HF dir or .gguf)."""

    @property
    def name(self) -> str:
        if self.kind == "retrieval":
            if not self.source:
                return "retrieval"
            return f"retrieval:{Path(self.source).stem if self.source.endswith('.parquet') else self.source}"
        if self.kind == "model":
            return f"model:{Path(self.source).name or self.source}"
        return self.kind


def parse_drafters(text: str) -> tuple[DrafterSpec, ...]:
    """``"none"`` | comma list of ``ngram``, ``retrieval[:DOMAIN|:FILE.parquet]``,
    ``model:SPEC``, ``self``. Raises ValueError naming the accepted forms."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    specs = []
    for part in text.split(","):
        kind, _, source = part.strip().partition(":")
        if kind not in DRAFTER_KINDS or kind == "none":
            raise ValueError(f"unknown drafter {part.strip()!r}; use none, or a comma list of ngram, "
                             f"retrieval[:DOMAIN|:FILE.parquet], model:MODEL, self")
        if kind == "model" and not source:
            raise ValueError("drafter 'model' needs a model: model:smollm2-135m, model:/path/to/hf_dir "
                             "or model:/path/to/file.gguf")
        if kind == "retrieval" and source and source not in DOMAINS and not source.endswith(".parquet"):
            raise ValueError(f"retrieval drafter {source!r}: give a domain ({', '.join(DOMAINS)}) "
                             f"or a datastore .parquet file")
        if kind in ("ngram", "self") and source:
            raise ValueError(f"drafter {kind!r} takes no argument (got {part.strip()!r})")
        specs.append(DrafterSpec(kind, source))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"drafter listed twice in {text!r}")
    return tuple(specs)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2-135m"
    """Target model: embedded name, Hugging Face directory or .gguf file."""
    drafters: tuple[DrafterSpec, ...] = field(default_factory=lambda: parse_drafters("ngram,retrieval"))
    """Speculation sources; () = plain decoding."""
    num_stages: int = 1
    """Contiguous layer slices of the target (pipeline stages)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    dtype: str = "float32"
    """float32 | bfloat16 | float16 (bf16/fp16 only make sense on CUDA)."""
    device: str = "cpu"
    num_threads: int | None = None
    """torch intra-op threads for this process; None leaves torch's default."""
    datastore_dir: str | None = None
    """Where default retrieval datastores live; None = the packaged ones."""

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r}: use float32, bfloat16 or float16")
