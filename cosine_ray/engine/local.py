"""The single-process engine: target stages, drafters and the router in one process."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import torch

from cosine_ray.engine.config import DOMAINS, DrafterSpec, EngineConfig
from cosine_ray.engine.drafters.base import Drafter
from cosine_ray.engine.drafters.datastore import Datastore
from cosine_ray.engine.drafters.model import ModelDrafter, check_same_tokenizer
from cosine_ray.engine.drafters.ngram import NgramConfig, NgramDrafter
from cosine_ray.engine.drafters.retrieval import RetrievalConfig, RetrievalDrafter
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.engine.router import Router, RouterConfig
from cosine_ray.engine.speculation import LocalDrafterClient
from cosine_ray.engine.target import LocalTargetClient, StageWorker, TargetWorker
from cosine_ray.models.config import stage_slices
from cosine_ray.models.llama import LlamaStage
from cosine_ray.models.loader import Checkpoint, resolve_checkpoint

log = logging.getLogger(__name__)

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
    # 1/2, not 1): with RouterConfig.min_tree_confidence this keeps one-off matches from
    # filling the tree; a draft node costs ~1/7 of a decode step on CPU (DESIGN §8).
    if spec.kind == "ngram":
        return NgramDrafter(NgramConfig(count_smoothing=1.0), name=spec.name)
    if spec.kind == "retrieval":
        return RetrievalDrafter(load_datastore(spec, target.name, config.datastore_dir),
                                RetrievalConfig(count_smoothing=1.0), name=spec.name)
    if spec.kind == "self":
        return ModelDrafter(LlamaStage(target.config, target_state, dtype=dtype, device=config.device),
                            name="self")
    if spec.kind == "model":
        ckpt = resolve_checkpoint(spec.source)
        if ckpt.has_tokenizer:
            check_same_tokenizer(target_tokenizer, ckpt.load_tokenizer(), spec.name)
        elif ckpt.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"drafter {spec.name!r} has vocabulary {ckpt.config.vocab_size}, the target "
                             f"{target.config.vocab_size}; drafters must share the target's tokenizer")
        return ModelDrafter(LlamaStage(ckpt.config, ckpt.load_state_dict(), dtype=dtype, device=config.device),
                            name=spec.name)
    raise ValueError(f"unknown drafter kind {spec.kind!r}")


def make_stage_worker(config: EngineConfig, stage_index: int) -> StageWorker:
    """Pipeline stage ``stage_index`` of ``config.num_stages``, built where it will run."""
    checkpoint = resolve_checkpoint(config.model)
    a, b = stage_slices(checkpoint.config.num_layers, config.num_stages)[stage_index]
    stage = LlamaStage(checkpoint.config, checkpoint.load_state_dict(), a, b,
                       dtype=getattr(torch, config.dtype), device=config.device)
    return StageWorker(stage)


def make_drafter(spec: DrafterSpec, config: EngineConfig) -> Drafter:
    """A drafter built where it will run (a drafter actor); loads only what it needs."""
    checkpoint = resolve_checkpoint(config.model)
    needs_model = spec.kind in ("self", "model")
    return build_drafter(spec, target=checkpoint,
                         target_state=checkpoint.load_state_dict() if spec.kind == "self" else {},
                         target_tokenizer=checkpoint.load_tokenizer() if needs_model and checkpoint.has_tokenizer else None,
                         config=config)


def eos_token_ids(checkpoint: Checkpoint, tokenizer: Any) -> tuple[int, ...]:
    """End-of-sequence ids of the model config and of its tokenizer."""
    ids = set(checkpoint.config.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def router_config_for(config: EngineConfig, checkpoint: Checkpoint) -> RouterConfig:
    """The configured router settings, capped at the model's context length."""
    return dataclasses.replace(config.router, max_model_len=min(
        config.router.max_model_len, checkpoint.config.max_position_embeddings))


EMBEDDING_KEY = "model.embed_tokens.weight"


def cosine_components(config: EngineConfig, checkpoint: Checkpoint, embeddings: torch.Tensor | None = None,
                      *, run_profile_if_missing: bool = False) -> dict[str, Any]:
    """What the router needs beyond its clients: the target's unit input embeddings (eq. 1
    and the domain classifier), a prompt domain classifier fitted on the default domain
    datastores when this model has them, and the measured latency model: the profile on disk
    (``cosine-ray profile``), or a quick profiling pass now when ``run_profile_if_missing``
    (the server), else none (the planner starts from a default and refits from every verify
    step)."""
    from cosine_ray.algo.domains import DomainClassifier
    from cosine_ray.algo.latency_model import LatencyModel
    from cosine_ray.algo.routing import normalise_embeddings
    from cosine_ray.engine.profile import load_or_profile, profile_path

    table = embeddings if embeddings is not None else checkpoint.load_tensor(EMBEDDING_KEY)
    unit = normalise_embeddings(table)
    paths = {d: datastore_path(checkpoint.name, d, config.datastore_dir) for d in DOMAINS}
    classifier = None
    if all(p.is_file() for p in paths.values()):
        classifier = DomainClassifier.fit(unit, {d: Datastore.load(p).sequences for d, p in paths.items()})
    # NOTE(routing): eq. 1 uses the *centred* embedding table. Raw SmolLM2 embeddings share a
    # common direction: two random tokens have cosine 0.44 on average (98.6 % positive,
    # measured over 20,000 pairs), so a confident but wrong drafter scored almost as high as a
    # right one in eq. 2. Centred, random pairs average 0.00 and half clamp to 0.
    centred = normalise_embeddings(table - table.float().mean(0))
    if run_profile_if_missing:
        latency = load_or_profile(config, quick=True)
    else:
        path = profile_path(config)
        latency = LatencyModel.from_json(path.read_text(encoding="utf-8")) if path.is_file() else None
    return {"unit_embeddings": centred, "domain_classifier": classifier, "latency_model": latency}


class LocalEngine:
    """Build everything from an EngineConfig; generate with ``generate`` or ``stream``."""

    def __init__(self, config: EngineConfig = EngineConfig(), *, checkpoint: Checkpoint | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.checkpoint = checkpoint or resolve_checkpoint(config.model)
        self.tokenizer = self.checkpoint.load_tokenizer() if self.checkpoint.has_tokenizer else None
        state = self.checkpoint.load_state_dict()
        dtype = getattr(torch, config.dtype)
        self.target = TargetWorker(build_target_stages(self.checkpoint, state, config.num_stages,
                                                       dtype=dtype, device=config.device))
        self.drafters = [build_drafter(s, target=self.checkpoint, target_state=state,
                                       target_tokenizer=self.tokenizer, config=config)
                         for s in config.drafters]
        self.router = Router(router_config_for(config, self.checkpoint), LocalTargetClient(self.target),
                             [LocalDrafterClient(d) for d in self.drafters],
                             vocab_size=self.checkpoint.config.vocab_size,
                             eos_token_ids=eos_token_ids(self.checkpoint, self.tokenizer),
                             **cosine_components(config, self.checkpoint, state[EMBEDDING_KEY]))
        self.loop = EngineLoop(self.router)

    def eos_token_ids(self) -> tuple[int, ...]:
        return self.router.eos_token_ids

    # ---- text ---------------------------------------------------------------------------
    def encode(self, prompt: str, *, chat: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.checkpoint.name} has no tokenizer; pass token ids")
        return encode_prompt(self.tokenizer, prompt, chat=chat)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ---- generation ---------------------------------------------------------------------
    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        return self.loop.generate(prompt_token_ids, params, request_id)

    def generate(self, prompts_token_ids: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run a batch to completion (synchronous helper for scripts and tests)."""
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts_token_ids)

        async def run() -> list[RequestOutput]:
            try:
                return await asyncio.gather(*(self.loop.generate_all(p, sp)
                                              for p, sp in zip(prompts_token_ids, params_list)))
            finally:
                await self.loop.shutdown()

        return asyncio.run(run())


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool = True) -> list[int]:
    """Token ids of a user prompt: through the model's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    return [int(t) for t in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
