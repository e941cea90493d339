"""The single-process engine: target stages, drafters and the engine core in one process."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

import torch

from cosine_ray.engine.backend import build_local_engine
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import NO_TENANT, RequestOutput, SamplingParams, Tenant
from cosine_ray.models.loader import Checkpoint, resolve_checkpoint


class LocalEngine:
    """Build everything from an EngineConfig; generate with ``generate`` or ``stream``."""

    def __init__(self, config: EngineConfig = EngineConfig(), *, checkpoint: Checkpoint | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.checkpoint = checkpoint or resolve_checkpoint(config.model, **config.checkpoint_args)
        self.tokenizer = self.checkpoint.load_tokenizer() if self.checkpoint.has_tokenizer else None
        self.core = build_local_engine(config, checkpoint=self.checkpoint, tokenizer=self.tokenizer)
        self.config = self.core.config
        """``config`` resolved for this model and device (``EngineConfig.resolved``)."""
        self.target = self.core.target.inner.worker
        """The stages (``TargetWorker``)."""
        self.drafters = [client.worker.drafter for client in self.core.drafters]
        self.loop = EngineLoop(self.core)

    def eos_token_ids(self) -> tuple[int, ...]:
        return self.core.eos_token_ids

    # ---- text ---------------------------------------------------------------------------
    def encode(self, prompt: str, *, chat: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.checkpoint.name} has no tokenizer; pass token ids")
        return encode_prompt(self.tokenizer, prompt, chat=chat)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ---- generation ---------------------------------------------------------------------
    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str | None = None, tenant: Tenant = NO_TENANT) -> AsyncIterator[RequestOutput]:
        return self.loop.generate(prompt_token_ids, params, request_id, tenant)

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
