"""What the engine core needs beyond its clients: embeddings, domain classifier, latency model."""

from __future__ import annotations

from typing import Any

import torch

from cosine_ray.algo.domains import DomainClassifier
from cosine_ray.algo.scheduling.latency_model import LatencyModel
from cosine_ray.algo.routing import normalise_embeddings
from cosine_ray.engine.build import datastore_path
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.spec import DOMAINS
from cosine_ray.engine.drafters.lookup.datastore import Datastore
from cosine_ray.engine.profile import profile_path
from cosine_ray.models.loader import Checkpoint

EMBEDDING_KEY = "model.embed_tokens.weight"


def cosine_components(config: EngineConfig, checkpoint: Checkpoint,
                      embeddings: torch.Tensor | None = None) -> dict[str, Any]:
    """Keyword arguments of ``EngineCore`` beyond its clients: the target's unit input
    embeddings (eq. 1 and the domain classifier; ``embeddings``: the table this process already
    holds, else read from the checkpoint), a prompt domain classifier fitted on the default
    domain datastores when this model has them, the measured latency model when a profile of
    this setup is on disk (``cosine-ray profile``, or ``load_or_profile`` before the engine is
    built; else none: the cost model starts from a default and refits from every verify step),
    and the KV bytes per token (the scheduler's memory)."""
    table = embeddings if embeddings is not None else checkpoint.load_tensor(EMBEDDING_KEY)
    unit = normalise_embeddings(table)
    paths = {d: datastore_path(checkpoint.name, d, config.datastore_dir) for d in DOMAINS}
    classifier = None
    if all(p.is_file() for p in paths.values()):
        classifier = DomainClassifier.fit(unit, {d: Datastore.load(p).sequences for d, p in paths.items()})
    # eq. 1 uses the *centred* embedding table. Raw embeddings share a common direction (two
    # random tokens mostly have a clearly positive cosine), so a confident but wrong drafter
    # scores almost as high as a right one in eq. 2. Centred, random pairs average 0 and half
    # clamp to 0.
    centred = normalise_embeddings(table - table.float().mean(0))
    path = profile_path(config)
    latency = LatencyModel.from_json(path.read_text(encoding="utf-8")) if path.is_file() else None
    return {"unit_embeddings": centred, "domain_classifier": classifier, "latency_model": latency,
            "kv_bytes_per_token": kv_bytes_per_token(checkpoint, config.dtype)}


def kv_bytes_per_token(checkpoint: Checkpoint, dtype: str) -> int:
    """KV bytes one token takes over all layers (all stages together): m_i of eq. 7 per token."""
    cfg = checkpoint.config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * getattr(torch, dtype).itemsize
