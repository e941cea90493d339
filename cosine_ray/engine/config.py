"""Engine configuration: which target, which drafters, how to batch and speculate."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from cosine_ray.engine.router import RouterConfig

DRAFTER_KINDS = ("none", "ngram", "retrieval", "model", "self")
DOMAINS = ("code", "math", "instruction", "chat")
DEFAULT_DRAFTERS = "ngram," + ",".join(f"retrieval:{d}" for d in DOMAINS)
"""CoSine's default speculation cluster: the context n-gram drafter and one retrieval
drafter per domain (the expertise router learns which serves which request)."""


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
    """``"none"`` | ``"default"`` (DEFAULT_DRAFTERS) | comma list of ``ngram``,
    ``retrieval[:DOMAIN|:FILE.parquet]``, ``model:SPEC``, ``self``. Raises ValueError naming
    the accepted forms."""
    text = text.strip()
    if text in ("", "none"):
        return ()
    if text == "default":
        text = DEFAULT_DRAFTERS
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
class ClusterConfig:
    """How the Ray runtime places and supervises actors (ignored by the local engine)."""

    address: str | None = None
    """Ray cluster to join (``auto``, ``HOST:PORT``, ``ray://...``); None starts a local one."""
    use_resources: bool = False
    """Stages ask for the custom resource ``datacenter_gpu`` and drafters for
    ``consumer_gpu`` (advertise them with ``ray start --resources=...``)."""
    num_cpus_per_actor: float = 0.5
    """Ray CPU reservation of each stage/drafter actor (the router reserves none)."""
    threads_per_actor: int = 1
    """torch intra-op threads inside each actor, so actors do not fight over cores."""
    stage_deadline_s: float = 60.0
    """A stage-chain forward slower than this counts as a lost stage (re-prefill)."""
    drafter_max_restarts: int = -1
    """Ray restarts of a drafter actor (-1 = unlimited); a drafter killed for good is respawned."""
    stage_max_restarts: int = -1
    drafters_in_router: tuple[str, ...] = ("ngram", "retrieval")
    """Drafter kinds that run inside the router actor instead of an actor of their own: the
    n-gram and retrieval drafters are table lookups (no model, no GPU) that take micro-
    seconds, while a round trip to another process costs a millisecond or more per fusion
    round. ``()`` (CLI ``--drafters-in-router none``) gives every drafter its own actor."""

    def __post_init__(self) -> None:
        in_router = self.drafters_in_router
        if isinstance(in_router, str):
            in_router = () if in_router.strip() in ("", "none") else [k.strip() for k in in_router.split(",")]
        object.__setattr__(self, "drafters_in_router", tuple(in_router))
        known = DRAFTER_KINDS[1:]  # without "none"
        unknown = sorted(set(self.drafters_in_router) - set(known))
        if unknown:
            raise ValueError(f"drafters_in_router: unknown kind(s) {', '.join(unknown)}; "
                             f"use none or a comma list of {', '.join(known)}")
        if self.num_cpus_per_actor < 0 or self.threads_per_actor < 1:
            raise ValueError("num_cpus_per_actor must be >= 0 and threads_per_actor >= 1")
        if self.stage_deadline_s <= 0:
            raise ValueError("stage_deadline_s must be > 0")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2-135m"
    """Target model: embedded name, Hugging Face directory or .gguf file."""
    drafters: tuple[DrafterSpec, ...] = field(default_factory=lambda: parse_drafters(DEFAULT_DRAFTERS))
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
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r}: use float32, bfloat16 or float16")


def _build(cls: type, data: dict[str, Any], where: str):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in {where}; known: {', '.join(sorted(names))}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def config_from_dict(data: dict[str, Any] | None) -> EngineConfig:
    """EngineConfig from plain data (YAML file, Serve ``args``); ValueError names bad keys.

    ``drafters`` may be a string (``"ngram,retrieval"``) or a list of such names;
    ``router`` and ``cluster`` are nested mappings of RouterConfig / ClusterConfig fields.
    """
    data = dict(data or {})
    if not isinstance(data, dict):
        raise ValueError("the config must be a mapping")
    drafters = data.pop("drafters", None)
    router = data.pop("router", None) or {}
    cluster = data.pop("cluster", None) or {}
    if not isinstance(router, dict) or not isinstance(cluster, dict):
        raise ValueError("'router' and 'cluster' must be mappings")
    if drafters is not None:
        if isinstance(drafters, (list, tuple)):
            drafters = ",".join(str(d) for d in drafters) or "none"
        data["drafters"] = parse_drafters(str(drafters))
    data["router"] = _build(RouterConfig, router, "router")
    data["cluster"] = _build(ClusterConfig, cluster, "cluster")
    return _build(EngineConfig, data, "the config")


def config_to_dict(config: EngineConfig) -> dict[str, Any]:
    out = {f.name: getattr(config, f.name) for f in fields(config)}
    out["drafters"] = ",".join(s.kind + (f":{s.source}" if s.source else "") for s in config.drafters) or "none"
    out["router"] = {f.name: getattr(config.router, f.name) for f in fields(config.router)}
    out["cluster"] = {f.name: getattr(config.cluster, f.name) for f in fields(config.cluster)}
    return out


def load_config_file(path: str) -> EngineConfig:
    import yaml
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is not None and not isinstance(data, dict):
        raise ValueError(f"config {path} must be a mapping of settings")
    return config_from_dict(data)
