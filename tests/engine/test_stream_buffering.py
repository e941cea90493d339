"""A caller that reads a request's stream slowly costs the engine one pending output: what the
steps produce meanwhile is merged into it (``engine.mailbox``), not queued an item a step."""

from __future__ import annotations

import asyncio

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.loop import EngineLoop
from cosine_ray.engine.request import SamplingParams

from support.factories import engine_config
from support.fakes import VOCAB, TableTarget

SLOW, FAST = [3, 1, 4, 1, 5], [9, 2, 6]


def test_a_slow_reader_gets_the_steps_it_missed_as_one_output():
    target = TableTarget()
    core = EngineCore(engine_config(num_speculative_tokens=0), target, [], vocab_size=VOCAB, seed=0)
    loop = EngineLoop(core)
    fast_done = asyncio.Event()

    async def slow():
        outs = []
        async for out in loop.generate(SLOW, SamplingParams(max_tokens=30), "slow"):
            outs.append(out)
            if len(outs) == 1:
                await fast_done.wait()  # the client stopped reading while the engine stepped on
        return outs

    async def fast():
        outs = [out async for out in loop.generate(FAST, SamplingParams(max_tokens=20), "fast")]
        fast_done.set()
        return outs

    async def go():
        outs = await asyncio.gather(slow(), fast())
        await loop.shutdown()
        return outs

    slow_outs, fast_outs = asyncio.run(go())
    assert len(fast_outs) == 20  # a reader that keeps up gets every step
    tokens = [t for o in slow_outs for t in o.new_token_ids]
    assert tokens == target.greedy(SLOW, 30)
    # the steps the slow reader missed while the fast one ran (~19; one or two fewer when the fast
    # request joins the batch a step later, as the event loop orders the two): one output
    missed = slow_outs[1]
    assert len(missed.new_token_ids) >= 15 and missed.num_output_tokens == 1 + len(missed.new_token_ids)
    assert len(slow_outs) == 2 + 30 - missed.num_output_tokens  # then one a step again, as it reads
    assert slow_outs[-1].finished and slow_outs[-1].finish_reason == "length"
    assert loop.num_streams == 0
