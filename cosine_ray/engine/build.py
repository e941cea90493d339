"""Factories of the workers an engine runs: a stage beside its feature head, and the drafters.

Everything that builds a drafter lives here, so the in-process engine and the Serve engine
(``engine.backend``), the profiler (``engine.profile``) and the Ray actors (``runtime``) build
exactly the same things. The target's stages come from ``models.loader.load_target``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.spec import DOMAINS, DrafterSpec
from cosine_ray.engine.drafters.base import Drafter
from cosine_ray.engine.drafters.lookup.datastore import Datastore
from cosine_ray.engine.drafters.models.distilled import (DRAFTER_METADATA, DistilledConfig, load_distilled,
                                                  tokenizer_fingerprint)
from cosine_ray.engine.drafters.models.model import ModelDrafter, check_same_tokenizer
from cosine_ray.engine.drafters.lookup.ngram import NgramConfig, NgramDrafter
from cosine_ray.engine.drafters.lookup.retrieval import RetrievalConfig, RetrievalDrafter
from cosine_ray.engine.drafters.lookup.suffix import SuffixConfig, SuffixDrafter
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.worker.features import FeatureStage, FeatureStore
from cosine_ray.models.llama import LlamaStage
from cosine_ray.models.embedded import packaged_name
from cosine_ray.models.loader import Checkpoint, build_stages, load_target, resolve_checkpoint

PACKAGED_DATASTORES = Path(__file__).resolve().parent.parent / "data" / "datastores"
PACKAGED_DRAFTERS = Path(__file__).resolve().parent.parent / "data" / "drafters"


def datastore_path(model_name: str, domain: str, root: str | Path | None = None) -> Path:
    return Path(root or PACKAGED_DATASTORES) / packaged_name(model_name) / f"{domain}.parquet"


def load_datastore(spec: DrafterSpec, model_name: str, root: str | Path | None = None) -> Datastore:
    """A datastore file, a domain's default datastore, or all default ones merged."""
    if spec.source.endswith(".parquet"):
        return Datastore.load(spec.source)
    domains = [spec.source] if spec.source else list(DOMAINS)
    paths = [datastore_path(model_name, d, root) for d in domains]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ValueError(f"no datastore at {missing[0]}; build it with `cosine-ray datastore build "
                         f"--domain {missing[0].stem} --prompts FILE` (or pass retrieval:FILE.parquet)")
    stores = [Datastore.load(p) for p in paths]
    if len(stores) == 1:
        return stores[0]
    return Datastore.from_sequences([s for ds in stores for s in ds.sequences], domain="mixed",
                                    model_name=model_name)


def drafter_folder(spec: DrafterSpec, model_name: str) -> Path:
    """A distilled drafter's or feature head's folder: for a domain (or ``head`` with no source)
    the one packaged for ``model_name``, else the one ``cosine-ray distill`` wrote to the cache;
    otherwise the given folder."""
    if (spec.kind == "head" and not spec.source) or (spec.kind == "distilled" and spec.source in DOMAINS):
        sub = spec.source or "head"
        from cosine_ray.models.loader import cache_root
        model_name = packaged_name(model_name)
        path = next((root / model_name / sub for root in (PACKAGED_DRAFTERS, cache_root() / "drafters")
                     if (root / model_name / sub / DRAFTER_METADATA).is_file()), PACKAGED_DRAFTERS / model_name / sub)
    else:
        path = Path(spec.source).expanduser()
    if not (path / DRAFTER_METADATA).is_file():
        raise ValueError(f"drafter {spec.name!r}: no distilled drafter at {path}; build one with `cosine-ray "
                         f"distill --model {model_name}` (docs/drafters.md) and pass its folder")
    return path


def check_distilled(folder: Path, name: str, target: Checkpoint, target_tokenizer: Any) -> None:
    """Refuse a distilled drafter made for another tokenizer than the target's."""
    meta = json.loads((folder / DRAFTER_METADATA).read_text())
    if int(meta.get("target_vocab_size", -1)) != int(target.config.vocab_size):
        raise ValueError(f"drafter {name!r} was distilled for a vocabulary of {meta.get('target_vocab_size')} "
                         f"tokens, the target has {target.config.vocab_size}; drafters must share the target's tokenizer")
    if target_tokenizer is not None and meta.get("tokenizer") not in (None, tokenizer_fingerprint(target_tokenizer)):
        raise ValueError(f"drafter {name!r} was distilled with another tokenizer than the target's "
                         f"({meta.get('target')}); drafters must share the target's tokenizer")


NGRAM_COPY_MIN_LEN = 4
"""The engine's n-gram drafter copies what followed an earlier match of the context's end of
at least this many tokens (one more than the 3-gram it looks up), ``NgramConfig.copy_min_len``."""

TOKENIZER_KINDS = ("model", "distilled", "head")
"""Drafter kinds checked against the target's tokenizer (a drafter must share it)."""


def build_drafter(spec: DrafterSpec, *, target: Checkpoint, config: EngineConfig,
                  target_state: dict[str, Any] | None = None, target_tokenizer: Any = None,
                  features: FeatureStore | None = None) -> Drafter:
    """The drafter ``spec`` of a ``target``. ``target_state``: the target's weights when this
    process loaded them for its stages (the target as its own drafter and a feature head share
    them; None: read here when needed); ``target_tokenizer``: the target's tokenizer when the
    caller holds one (None: loaded here for a drafter that must share it); ``features``: the
    store the last stage fills (a ``head`` drafter reads it)."""
    dtype = getattr(torch, config.dtype)
    if target_tokenizer is None and spec.kind in TOKENIZER_KINDS and target.has_tokenizer:
        target_tokenizer = target.load_tokenizer()
    # the engine smooths n-gram counts (a continuation seen once gets confidence 1/2, not 1):
    # with the tree's confidence cut this keeps one-off matches from filling it; a match of
    # NGRAM_COPY_MIN_LEN tokens or more copies what followed it, as long as the match justifies
    if spec.kind == "ngram":
        return NgramDrafter(NgramConfig(count_smoothing=1.0, copy_min_len=NGRAM_COPY_MIN_LEN), name=spec.name)
    if spec.kind == "retrieval":
        return RetrievalDrafter(load_datastore(spec, target.name, config.datastore_dir),
                                RetrievalConfig(count_smoothing=1.0), name=spec.name)
    if spec.kind == "suffix":
        return build_suffix_drafter(spec, target.name, config.datastore_dir,
                                    max_indexed_tokens=config.runtime.suffix_index_tokens,
                                    max_spec_tokens=config.speculation.long_draft_tokens)
    if spec.kind == "self":
        stage = (build_stages(target, target_state, dtype=dtype, device=config.device)[0] if target_state else
                 load_target(target, weights=config.weights, dtype=config.dtype, device=config.device).stages[0])
        return ModelDrafter(stage, name="self", runner=config.runtime.runner)
    if spec.kind == "distilled" or (spec.kind == "model" and (Path(spec.source) / DRAFTER_METADATA).is_file()):
        folder = drafter_folder(DrafterSpec("distilled", spec.source), target.name)
        check_distilled(folder, spec.name, target, target_tokenizer)
        return load_distilled(folder, int(target.config.vocab_size), dtype=dtype, device=config.device, name=spec.name,
                              config=DistilledConfig(layer_parallel=config.experiments.layer_parallel_drafting))
    if spec.kind == "head":
        from cosine_ray.engine.drafters.models.feature_head import load_feature_head
        folder = drafter_folder(spec, target.name)
        check_distilled(folder, spec.name, target, target_tokenizer)
        if features is None:
            raise ValueError(f"drafter {spec.name!r} reads the target's features: it is built beside the last "
                             f"stage (build_stage), or by the single-process engine")
        return load_feature_head(folder, target_state or target.load_state_dict(), features, name=spec.name)
    if spec.kind == "model":
        ckpt = resolve_checkpoint(spec.source)
        if ckpt.has_tokenizer:
            check_same_tokenizer(target_tokenizer, ckpt.load_tokenizer(), spec.name)
        elif ckpt.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"drafter {spec.name!r} has vocabulary {ckpt.config.vocab_size}, the target "
                             f"{target.config.vocab_size}; drafters must share the target's tokenizer")
        stage = load_target(ckpt, weights=config.weights, dtype=config.dtype, device=config.device).stages[0]
        return ModelDrafter(stage, name=spec.name, runner=config.runtime.runner)
    raise ValueError(f"unknown drafter kind {spec.kind!r}")


def build_stage(config: EngineConfig, stage_index: int) -> tuple[LlamaStage, DrafterWorker | None]:
    """Pipeline stage ``stage_index`` of ``config.num_stages``, built where it will run (a stage
    actor), and the feature head that drafts beside it: the last stage of a config with a
    ``head`` drafter hands its features to the head's store (``FeatureStage``), every other
    stage has none."""
    loaded = load_target(resolve_checkpoint(config.model, **config.checkpoint_args), weights=config.weights,
                         dtype=config.dtype, device=config.device, num_stages=config.num_stages,
                         stage_index=stage_index)
    (stage,) = loaded.stages
    head = head_spec(config)
    if head is None or not stage.is_last:
        return stage, None
    features = FeatureStore()
    return FeatureStage.wrap(stage, features), DrafterWorker(build_drafter(
        head, target=loaded.checkpoint, config=config, target_state=loaded.weights, features=features))


def head_spec(config: EngineConfig) -> DrafterSpec | None:
    """The config's feature head (at most one: it drafts from the last stage's features)."""
    heads = [s for s in config.drafters if s.kind == "head"]
    if len(heads) > 1:
        raise ValueError("at most one feature head a drafter set: it runs beside the last pipeline stage")
    return heads[0] if heads else None


def build_suffix_drafter(spec: DrafterSpec, model_name: str, datastore_dir: str | None = None, *,
                         max_indexed_tokens: int | None = None, max_spec_tokens: int | None = None) -> SuffixDrafter:
    """``suffix``: one index over every domain (with a per-request index too), seeded from all
    packaged datastores; ``suffix:DOMAIN``: a live expert of one domain, seeded from its
    datastore, learning only from that domain's finished requests (no per-request index: the
    shared n-gram drafter covers the request's own text); ``suffix:FILE.parquet``: a snapshot
    a server saved (``SuffixDrafter.save``). Confidences stay raw frequencies: calibration
    rescales them per domain, role and depth. ``max_indexed_tokens`` bounds each global index
    (``RuntimeConfig.suffix_index_tokens``; None: ``SuffixConfig``'s default); a draft path is
    at most ``max_spec_tokens`` long, and never shorter than ``SuffixConfig``'s default
    (``SpeculationConfig.long_draft_tokens``: what a request's budget can reach)."""
    caps = {} if max_indexed_tokens is None else {"max_indexed_tokens": max_indexed_tokens}
    if max_spec_tokens is not None:
        caps["max_spec_tokens"] = max(max_spec_tokens, SuffixConfig().max_spec_tokens)
    if spec.source.endswith(".parquet"):
        return SuffixDrafter.load(spec.source, SuffixConfig(**caps), name=spec.name)
    domains = [spec.source] if spec.source else [d for d in DOMAINS
                                                if datastore_path(model_name, d, datastore_dir).is_file()]
    stores = [Datastore.load(datastore_path(model_name, d, datastore_dir)) for d in domains
              if datastore_path(model_name, d, datastore_dir).is_file()]
    config = SuffixConfig(use_local=not spec.source, **caps)
    return SuffixDrafter.from_datastore(stores, config, name=spec.name, domain=spec.source or None)


def make_drafter_worker(spec: DrafterSpec, config: EngineConfig) -> DrafterWorker:
    """A drafter built where it will run (a drafter actor, or the engine for lookup drafters);
    it loads only what it needs."""
    return DrafterWorker(build_drafter(spec, target=resolve_checkpoint(config.model, **config.checkpoint_args),
                                     config=config))
