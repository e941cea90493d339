"""The engine a benchmark measures: its config, the one place it is built and warmed, and a
batch of requests through it."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Sequence

from cosine_ray.engine.config import DEFAULT_DRAFTERS, EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import RequestOutput, SamplingParams

DEFAULT_MODEL = "smollm2-135m"
"""The embedded model every benchmark measures unless told otherwise."""


def engine_config(drafters: str = DEFAULT_DRAFTERS, *, model: str = DEFAULT_MODEL, **settings: Any) -> EngineConfig:
    """``model`` with ``drafters`` (a ``--drafters`` value) and ``settings`` (names as
    ``EngineConfig.replace`` takes them: its fields, the experiments' and the cluster's)."""
    return EngineConfig(model=model, drafters=parse_drafters(drafters)).replace(**settings)


def start_engine(config: EngineConfig, *, checkpoint: Any = None, warmup: Sequence[Sequence[int]] = (),
                 warmup_tokens: int = 4, concurrency: int = 8) -> LocalEngine:
    """The in-process engine of ``config`` (``checkpoint``: the target, already resolved),
    then, given ``warmup`` prompts, run on them (``warmup_tokens`` each, ``concurrency`` at
    once) so that no first-call cost lands in a measured run."""
    engine = LocalEngine(config, checkpoint=checkpoint)
    if warmup:
        run_batch(engine, warmup, SamplingParams(max_tokens=warmup_tokens), concurrency)
    return engine


def run_batch(engine: LocalEngine, prompts: Sequence[Sequence[int]], params: SamplingParams,
              concurrency: int) -> tuple[list[RequestOutput], float]:
    """Every prompt through the engine's loop, at most ``concurrency`` at once: the outputs in
    prompt order and the batch's wall seconds."""
    async def go() -> list[RequestOutput]:
        sem = asyncio.Semaphore(concurrency)

        async def one(ids: Sequence[int]) -> RequestOutput:
            async with sem:
                return await engine.loop.generate_all(ids, params)
        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await engine.loop.shutdown()

    start = time.perf_counter()
    outs = asyncio.run(go())
    return outs, time.perf_counter() - start
