"""Factories: the target's stages, the drafters and the engine's settings from an EngineConfig.

Everything that builds a worker lives here, so the in-process engine (``engine.local``), the
profiler (``engine.profile``) and the Ray actors (``runtime``) build exactly the same things.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.spec import DOMAINS, DrafterSpec
from cosine_ray.engine.drafters.base import Drafter
from cosine_ray.engine.drafters.datastore import Datastore
from cosine_ray.engine.drafters.distilled import (DRAFTER_METADATA, DistilledConfig, load_distilled,
                                                  tokenizer_fingerprint)
from cosine_ray.engine.drafters.model import ModelDrafter, check_same_tokenizer
from cosine_ray.engine.drafters.ngram import NgramConfig, NgramDrafter
from cosine_ray.engine.drafters.retrieval import RetrievalConfig, RetrievalDrafter
from cosine_ray.engine.drafters.suffix import SuffixConfig, SuffixDrafter
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.worker.features import FeatureStage, FeatureStore
from cosine_ray.engine.worker.target import TargetWorker, default_kv_tokens
from cosine_ray.engine.worker.threads import ThreadGovernor
from cosine_ray.models.config import stage_slices
from cosine_ray.models.llama import LlamaStage
from cosine_ray.models.loader import Checkpoint, resolve_checkpoint
from cosine_ray.models.native import load_weights

PACKAGED_DATASTORES = Path(__file__).resolve().parent.parent / "data" / "datastores"
PACKAGED_DRAFTERS = Path(__file__).resolve().parent.parent / "data" / "drafters"


def datastore_path(model_name: str, domain: str, root: str | Path | None = None) -> Path:
    return Path(root or PACKAGED_DATASTORES) / model_name / f"{domain}.parquet"


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


def build_target(config: EngineConfig, checkpoint: Checkpoint,
                 state: dict[str, torch.Tensor]) -> tuple[TargetWorker, FeatureStore | None]:
    """Every pipeline stage of ``config`` in this process, run one after another (the in-process
    engine; the Serve engine with ``cluster.stages_in_engine``), and the store a feature head
    drafts from when the drafter set has one (the last stage fills it)."""
    stages = build_target_stages(checkpoint, state, config.num_stages, dtype=getattr(torch, config.dtype),
                                 device=config.device)
    features = FeatureStore() if head_spec(config) is not None else None
    if features is not None:
        stages[-1] = FeatureStage.wrap(stages[-1], features)
    threads = torch.get_num_threads()
    governor = ThreadGovernor(threads) if config.device == "cpu" and threads > 1 else None
    worker = TargetWorker(stages, kv_cache_memory=config.kv_cache_memory, runner=config.runner,
                          external_blocks=True, kv_token_budget=default_kv_tokens(config.step, checkpoint.config, stages[0].dtype),
                          governor=governor)
    return worker, features


def build_target_stages(checkpoint: Checkpoint, state_dict: dict[str, torch.Tensor],
                        num_stages: int, *, dtype: torch.dtype, device: str) -> list[LlamaStage]:
    return [LlamaStage(checkpoint.config, state_dict, a, b, dtype=dtype, device=device)
            for a, b in stage_slices(checkpoint.config.num_layers, num_stages)]


def drafter_folder(spec: DrafterSpec, model_name: str) -> Path:
    """A distilled drafter's or feature head's folder: for a domain (or ``head`` with no source)
    the one packaged for ``model_name``, else the one ``cosine-ray distill`` wrote to the cache;
    otherwise the given folder."""
    if (spec.kind == "head" and not spec.source) or (spec.kind == "distilled" and spec.source in DOMAINS):
        sub = spec.source or "head"
        from cosine_ray.models.loader import cache_root
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


def build_drafter(spec: DrafterSpec, *, target: Checkpoint, target_state: dict[str, torch.Tensor],
                  target_tokenizer: Any, config: EngineConfig, features: FeatureStore | None = None) -> Drafter:
    """``features``: the store the last stage fills (a ``head`` drafter reads it)."""
    dtype = getattr(torch, config.dtype)
    # NOTE(lead): the engine smooths n-gram counts (a continuation seen once gets confidence
    # 1/2, not 1): with the tree's confidence cut this keeps one-off matches from filling it.
    if spec.kind == "ngram":
        return NgramDrafter(NgramConfig(count_smoothing=1.0), name=spec.name)
    if spec.kind == "retrieval":
        return RetrievalDrafter(load_datastore(spec, target.name, config.datastore_dir),
                                RetrievalConfig(count_smoothing=1.0), name=spec.name)
    if spec.kind == "suffix":
        return build_suffix_drafter(spec, target.name, config.datastore_dir,
                                    max_indexed_tokens=config.experiments.suffix_index_tokens)
    if spec.kind == "self":
        return ModelDrafter(LlamaStage(target.config, target_state, dtype=dtype, device=config.device),
                            name="self", runner=config.runner)
    if spec.kind == "distilled" or (spec.kind == "model" and (Path(spec.source) / DRAFTER_METADATA).is_file()):
        folder = drafter_folder(DrafterSpec("distilled", spec.source), target.name)
        check_distilled(folder, spec.name, target, target_tokenizer)
        return load_distilled(folder, int(target.config.vocab_size), dtype=dtype, device=config.device, name=spec.name,
                              config=DistilledConfig(layer_parallel=config.experiments.layer_parallel_drafting))
    if spec.kind == "head":
        from cosine_ray.engine.drafters.feature_head import load_feature_head
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
        weights = load_weights(ckpt, config.weights, device=config.device, dtype=config.dtype)
        return ModelDrafter(LlamaStage(ckpt.config, weights, dtype=dtype, device=config.device),
                            name=spec.name, runner=config.runner)
    raise ValueError(f"unknown drafter kind {spec.kind!r}")


def build_stage(config: EngineConfig, stage_index: int) -> tuple[LlamaStage, DrafterWorker | None]:
    """Pipeline stage ``stage_index`` of ``config.num_stages``, built where it will run, and the
    feature head that drafts beside it: the last stage of a config with a ``head`` drafter hands
    its features to the head's store (``FeatureStage``), every other stage has none."""
    checkpoint = resolve_checkpoint(config.model)
    a, b = stage_slices(checkpoint.config.num_layers, config.num_stages)[stage_index]
    weights = load_weights(checkpoint, config.weights, device=config.device, dtype=config.dtype)
    stage = LlamaStage(checkpoint.config, weights, a, b, dtype=getattr(torch, config.dtype), device=config.device)
    head = head_spec(config)
    if head is None or not stage.is_last:
        return stage, None
    features = FeatureStore()
    return FeatureStage.wrap(stage, features), build_head(head, config, checkpoint, weights, features)


def build_head(spec: DrafterSpec, config: EngineConfig, checkpoint: Checkpoint, state: dict[str, torch.Tensor],
               features: FeatureStore) -> DrafterWorker:
    """The feature head ``spec``, drafting from ``features``, which the last stage beside it fills
    (in a stage actor, ``build_stage``; in the Serve engine with ``cluster.stages_in_engine``)."""
    tokenizer = checkpoint.load_tokenizer() if checkpoint.has_tokenizer else None
    return DrafterWorker(build_drafter(spec, target=checkpoint, target_state=state, target_tokenizer=tokenizer,
                                       config=config, features=features))


def head_spec(config: EngineConfig) -> DrafterSpec | None:
    """The config's feature head (at most one: it drafts from the last stage's features)."""
    heads = [s for s in config.drafters if s.kind == "head"]
    if len(heads) > 1:
        raise ValueError("at most one feature head a drafter set: it runs beside the last pipeline stage")
    return heads[0] if heads else None


def build_suffix_drafter(spec: DrafterSpec, model_name: str, datastore_dir: str | None = None, *,
                         max_indexed_tokens: int | None = None) -> SuffixDrafter:
    """``suffix``: one index over every domain (with a per-request index too), seeded from all
    packaged datastores; ``suffix:DOMAIN``: a live expert of one domain, seeded from its
    datastore, learning only from that domain's finished requests (no per-request index: the
    shared n-gram drafter covers the request's own text); ``suffix:FILE.parquet``: a snapshot
    a server saved (``SuffixDrafter.save``). Confidences stay raw frequencies: calibration
    rescales them per domain, role and depth. ``max_indexed_tokens`` bounds each global index
    (``EngineConfig.suffix_index_tokens``; None: ``SuffixConfig``'s default)."""
    caps = {} if max_indexed_tokens is None else {"max_indexed_tokens": max_indexed_tokens}
    if spec.source.endswith(".parquet"):
        return SuffixDrafter.load(spec.source, SuffixConfig(**caps), name=spec.name)
    domains = [spec.source] if spec.source else [d for d in DOMAINS
                                                if datastore_path(model_name, d, datastore_dir).is_file()]
    stores = [Datastore.load(datastore_path(model_name, d, datastore_dir)) for d in domains
              if datastore_path(model_name, d, datastore_dir).is_file()]
    config = SuffixConfig(use_local=not spec.source, **caps)
    return SuffixDrafter.from_datastore(stores, config, name=spec.name, domain=spec.source or None)


def make_drafter_worker(spec: DrafterSpec, config: EngineConfig) -> DrafterWorker:
    """A drafter built where it will run (a drafter actor, or the engine for lookup
    drafters); loads only what it needs."""
    checkpoint = resolve_checkpoint(config.model)
    needs_model = spec.kind in ("self", "model", "distilled")
    return DrafterWorker(build_drafter(
        spec, target=checkpoint, target_state=load_weights(checkpoint, config.weights, device=config.device, dtype=config.dtype)
        if spec.kind == "self" else {},
        target_tokenizer=checkpoint.load_tokenizer() if needs_model and checkpoint.has_tokenizer else None,
        config=config))


def eos_token_ids(checkpoint: Checkpoint, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids of the model config and of its tokenizer."""
    ids = set(checkpoint.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def kv_bytes_per_token(checkpoint: Checkpoint, dtype: str) -> int:
    """KV bytes one token takes over all layers (all stages together): m_i of eq. 7 per token."""
    cfg = checkpoint.config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * getattr(torch, dtype).itemsize
