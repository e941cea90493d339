"""Building an engine: ``build_engine(config, backend)`` and where its stages and drafters run.

The backend is chosen the way vLLM chooses an executor. ``InProcess`` (here) builds every stage
and drafter in this process and runs the stages one after another: ``LocalEngine``, and the
Serve engine's stages with ``cluster.stages_in_engine``. ``runtime.backend.ActorBackend`` gives
each stage and drafter a Ray actor (the engine package never imports Ray). Either way
``build_engine`` does the rest the same: the config resolved against the model's context, the
latency profile, the clients, the embeddings and domain classifier, the EOS ids, the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cosine_ray.engine.build import build_drafter, head_spec
from cosine_ray.engine.components import EMBEDDING_KEY, cosine_components
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.drafters.spec import DrafterSpec
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.owners.grammars import TokenizerLoader
from cosine_ray.engine.profile import load_or_profile
from cosine_ray.engine.worker.clients import DrafterClient, LocalDrafterClient, LocalTargetClient, TargetClient
from cosine_ray.engine.worker.features import FeatureStage, FeatureStore
from cosine_ray.engine.worker.target import TargetWorker, default_kv_tokens
from cosine_ray.engine.worker.threads import ThreadGovernor
from cosine_ray.models.loader import Checkpoint, eos_token_ids, load_target, resolve_checkpoint
from cosine_ray.models.weights.quant import as_dense


@dataclass
class StartedTarget:
    """The target as a backend started it: its client, and what building the drafters beside
    it needs while the engine is built (dropped afterwards)."""

    client: TargetClient
    weights: dict[str, Any] | None = None
    """The weights this process loaded for the stages (None: the stages are actors)."""
    features: FeatureStore | None = None
    """The store the last stage fills when it runs here and the drafter set has a feature head."""


class Backend(Protocol):
    """Where the target's stages and the drafters run."""

    stages_in_process: bool
    """The stages run one after another in this process (``SchedulerConfig.num_lanes``: 1)."""

    def target(self, config: EngineConfig, checkpoint: Checkpoint) -> StartedTarget:
        """The target's client for ``config`` (resolved): stages built here, or actors started."""
        ...

    def drafters(self, config: EngineConfig, checkpoint: Checkpoint, target: StartedTarget,
                 tokenizer: Any) -> list[DrafterClient]:
        """A client per drafter of ``config``, in its order (``tokenizer``: the target's, when
        the caller holds one)."""
        ...

    async def ready(self) -> None:
        """Until the stages serve (or the start fails)."""
        ...


class InProcess:
    """Every stage and drafter in this process (vLLM's single-process executor)."""

    stages_in_process = True

    def target(self, config: EngineConfig, checkpoint: Checkpoint) -> StartedTarget:
        """Every pipeline stage, run one after another; the last one fills the feature store
        when the drafter set has a head. On CUDA the graphs are captured here."""
        loaded = load_target(checkpoint, weights=config.weights, dtype=config.dtype, device=config.device,
                             num_stages=config.num_stages)
        stages = loaded.stages
        features = FeatureStore() if head_spec(config) is not None else None
        if features is not None:
            stages[-1] = FeatureStage.wrap(stages[-1], features)
        threads = torch.get_num_threads()
        governor = ThreadGovernor(threads) if config.device == "cpu" and threads > 1 else None
        worker = TargetWorker(stages, kv_cache_memory=config.kv_cache_memory, runner=config.runtime.runner,
                              external_blocks=True, governor=governor,
                              kv_token_budget=default_kv_tokens(config, checkpoint.config, stages[0].dtype))
        worker.capture_graphs(config)  # every bucket a step can reach, before the first request
        return StartedTarget(LocalTargetClient(worker), loaded.weights, features)

    def drafters(self, config: EngineConfig, checkpoint: Checkpoint, target: StartedTarget,
                 tokenizer: Any) -> list[DrafterClient]:
        return [self.drafter(spec, config, checkpoint, target, tokenizer) for spec in config.drafters]

    @staticmethod
    def drafter(spec: DrafterSpec, config: EngineConfig, checkpoint: Checkpoint, target: StartedTarget,
                tokenizer: Any) -> LocalDrafterClient:
        """Drafter ``spec`` in this process: beside stages built here it shares their weights
        (the target as its own drafter) and features (a head); else it loads what it needs."""
        return LocalDrafterClient(DrafterWorker(build_drafter(
            spec, target=checkpoint, config=config, target_state=target.weights, target_tokenizer=tokenizer,
            features=target.features)))

    async def ready(self) -> None:
        """Built stages serve at once."""


async def build_engine(config: EngineConfig, backend: Backend, *, checkpoint: Checkpoint | None = None,
                       tokenizer: Any = None, profile_if_missing: bool = False) -> EngineCore:
    """The engine core of ``config`` with its stages and drafters where ``backend`` puts them.

    ``tokenizer``: the target's, when the caller holds one (to encode prompts); None: the EOS id
    is read from the tokenizer's files, and the tokenizer (~100 MB) is loaded only when a
    request first asks for a grammar. ``profile_if_missing``: measure the latency profile now
    when none is stored for this setup (a server), before any stage holds the device's memory;
    otherwise the cost model starts from a default without one."""
    checkpoint = checkpoint or resolve_checkpoint(config.model, **config.checkpoint_args)
    config = config.resolved(context_len=checkpoint.config.max_position_embeddings,
                             stages_in_process=backend.stages_in_process)
    if profile_if_missing:
        load_or_profile(config, quick=True)
    target = backend.target(config, checkpoint)
    drafters = backend.drafters(config, checkpoint, target, tokenizer)
    embeddings = as_dense(target.weights[EMBEDDING_KEY]) if target.weights else None
    components = cosine_components(config, checkpoint, embeddings)
    await backend.ready()
    grammar_tokenizer = tokenizer if tokenizer is not None else (
        TokenizerLoader(checkpoint.load_tokenizer) if checkpoint.has_tokenizer else None)
    return EngineCore(config, target.client, drafters, vocab_size=checkpoint.config.vocab_size,
                      eos_token_ids=eos_token_ids(checkpoint, tokenizer),
                      kv_num_blocks=await target.client.kv_capacity(), tokenizer=grammar_tokenizer, **components)


def build_local_engine(config: EngineConfig, *, checkpoint: Checkpoint | None = None,
                       tokenizer: Any = None) -> EngineCore:
    """``build_engine`` on ``InProcess``, from synchronous code: nothing in process waits, so the
    coroutine runs to its end here without an event loop (also inside a running one)."""
    building = build_engine(config, InProcess(), checkpoint=checkpoint, tokenizer=tokenizer)
    try:
        building.send(None)
    except StopIteration as built:
        return built.value
    building.close()
    raise RuntimeError("building an in-process engine waited on something")

