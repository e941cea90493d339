"""Factories: the target's stages, the drafters and the engine's settings from an EngineConfig.

Everything that builds a worker lives here, so the in-process engine (``engine.local``), the
profiler (``engine.profile``) and the Ray actors (``runtime``) build exactly the same things.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from cosine_ray.engine.config import EngineConfig, StepConfig
from cosine_ray.engine.drafters.spec import DOMAINS, DrafterSpec
from cosine_ray.engine.drafters.base import Drafter
from cosine_ray.engine.drafters.datastore import Datastore
from cosine_ray.engine.drafters.model import ModelDrafter, check_same_tokenizer
from cosine_ray.engine.drafters.ngram import NgramConfig, NgramDrafter
from cosine_ray.engine.drafters.retrieval import RetrievalConfig, RetrievalDrafter
from cosine_ray.engine.drafters.suffix import SuffixConfig, SuffixDrafter
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.models.config import stage_slices
from cosine_ray.models.llama import LlamaStage
from cosine_ray.models.loader import Checkpoint, resolve_checkpoint
from cosine_ray.models.native import load_weights

PACKAGED_DATASTORES = Path(__file__).resolve().parent.parent / "data" / "datastores"


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


def build_target_stages(checkpoint: Checkpoint, state_dict: dict[str, torch.Tensor],
                        num_stages: int, *, dtype: torch.dtype, device: str) -> list[LlamaStage]:
    return [LlamaStage(checkpoint.config, state_dict, a, b, dtype=dtype, device=device)
            for a, b in stage_slices(checkpoint.config.num_layers, num_stages)]


def build_drafter(spec: DrafterSpec, *, target: Checkpoint, target_state: dict[str, torch.Tensor],
                  target_tokenizer: Any, config: EngineConfig) -> Drafter:
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


def build_stage(config: EngineConfig, stage_index: int) -> LlamaStage:
    """Pipeline stage ``stage_index`` of ``config.num_stages``, built where it will run."""
    checkpoint = resolve_checkpoint(config.model)
    a, b = stage_slices(checkpoint.config.num_layers, config.num_stages)[stage_index]
    weights = load_weights(checkpoint, config.weights, device=config.device, dtype=config.dtype)
    return LlamaStage(checkpoint.config, weights, a, b,
                      dtype=getattr(torch, config.dtype), device=config.device)


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
    needs_model = spec.kind in ("self", "model")
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


def step_config_for(config: EngineConfig, checkpoint: Checkpoint) -> StepConfig:
    """The configured step settings, capped at the model's context length."""
    return dataclasses.replace(config.step, max_model_len=min(
        config.step.max_model_len, checkpoint.config.max_position_embeddings))


def kv_bytes_per_token(checkpoint: Checkpoint, dtype: str) -> int:
    """KV bytes one token takes over all layers (all stages together): m_i of eq. 7 per token."""
    cfg = checkpoint.config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * getattr(torch, dtype).itemsize
