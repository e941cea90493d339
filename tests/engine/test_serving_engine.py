"""The serving engine's memory and batching (fakes only, ``tests/support/fakes.py``): prefix
caching, chunked prefill, preemption and the KV budget, each with the target's greedy text.

The table target reads a prefix-cache hit's context back from the blocks the engine names, so
a block table that points at the wrong or a corrupted block changes the text and fails here."""

from __future__ import annotations

import asyncio
import random

import pytest

from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.request import SamplingParams

from support.factories import engine_config
from support.fakes import VOCAB, AdversarialDrafter, OracleDrafter, TableTarget, drain  # noqa: E402


def make(target, *, drafters=None, kv_num_blocks=None, **config) -> EngineCore:
    drafters = [AdversarialDrafter("adv", target, confidence=0.6)] if drafters is None else drafters
    return EngineCore(engine_config(**config), target, drafters, vocab_size=VOCAB, kv_num_blocks=kv_num_blocks, seed=0)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def run(core, requests):
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    return asyncio.run(drain(core))


@pytest.mark.parametrize("caching", [True, False])
def test_a_shared_prompt_prefix_is_computed_once(caching):
    target = TableTarget()
    core = make(target, enable_prefix_caching=caching)
    system = tokens(40, seed=1)  # two full blocks of 16 and 8 tokens more
    prompts = {f"q{i}": system + tokens(5, seed=10 + i) for i in range(5)}
    greedy = SamplingParams(max_tokens=12)
    first, finals = run(core, [("q0", prompts["q0"], greedy)])
    rest, finals_rest = run(core, [(rid, p, greedy) for rid, p in prompts.items() if rid != "q0"])
    out = {**first, **rest}
    assert out == {rid: target.greedy(p, 12) for rid, p in prompts.items()}
    cached = 32 if caching else 0
    assert [finals_rest[rid].stats.num_cached_tokens for rid in ("q1", "q2", "q3", "q4")] == [cached] * 4
    assert finals["q0"].stats.num_cached_tokens == 0
    assert target.prefill_tokens == 45 + 4 * (45 - cached)
    assert core.kv.stats.hits == 4 * cached and core.kv.stats.queries == 5 * 45
    assert core.num_tracked_requests == 0 and core.kv.num_used_blocks == 0


def test_a_second_turn_reuses_the_first_turns_prompt_and_answer():
    target = TableTarget()
    core = make(target, drafters=[OracleDrafter("oracle", target)])
    turn1 = tokens(30, seed=2)
    answer, _ = run(core, [("t1", turn1, SamplingParams(max_tokens=20))])
    turn2 = turn1 + answer["t1"] + tokens(7, seed=3)
    second, finals = run(core, [("t2", turn2, SamplingParams(max_tokens=20))])
    assert second["t2"] == target.greedy(turn2, 20)
    # the first turn committed the KV of its prompt and all its answer but the last token: 49
    assert finals["t2"].stats.num_cached_tokens == 48


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_streaming():
    target = TableTarget()
    core = make(target, max_num_seqs=4, max_num_batched_tokens=16, num_speculative_tokens=3)
    scored = []
    score = target.score

    async def counting(items):
        scored.append(sum(len(it.token_ids) for it in items))
        return await score(items)

    target.score = counting
    long_prompt = tokens(100, seed=4)

    async def go():
        core.add_request("a", tokens(6, seed=5), SamplingParams(max_tokens=60))
        core.add_request("b", tokens(7, seed=6), SamplingParams(max_tokens=60))
        for _ in range(3):  # both decode before the long prompt comes
            await core.step()
        core.add_request("long", long_prompt, SamplingParams(max_tokens=5))
        gaps, got = {"a": 0, "b": 0}, {"a": [], "b": [], "long": []}
        prefill_steps = 0
        while core.has_work:
            outputs = {o.request_id: o for o in await core.step()}
            for rid in got:
                if rid in outputs:
                    got[rid] += outputs[rid].new_token_ids
            if not got["long"] and "long" in core.running:
                prefill_steps += 1
                for rid in ("a", "b"):  # a running stream gets a token in every step of the prefill
                    gaps[rid] = max(gaps[rid], 0 if rid in outputs or rid not in core.running else 1)
        return got, gaps, prefill_steps

    got, gaps, prefill_steps = asyncio.run(go())
    assert got["long"] == target.greedy(long_prompt, 5)
    assert got["a"][3:] and gaps == {"a": 0, "b": 0}
    assert prefill_steps >= 100 // 16  # ten or so chunks beside the two decodes
    assert max(scored) <= 16


def test_memory_pressure_preempts_and_every_request_finishes_with_its_text():
    target = TableTarget()
    # 10 blocks of 16 tokens; each request grows to 20 + 40 tokens (+ a tree): two or three fit
    core = make(target, kv_num_blocks=10, max_num_seqs=6, num_speculative_tokens=4)
    prompts = {f"r{i}": tokens(20, seed=20 + i) for i in range(6)}
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=7)
    requests = [(rid, p, SamplingParams(max_tokens=40)) for rid, p in prompts.items()] + [("s", prompts["r0"], seeded)]
    out, finals = run(core, requests)
    assert {rid: out[rid] for rid in prompts} == {rid: target.greedy(p, 40) for rid, p in prompts.items()}
    assert all(f.finish_reason == "length" and f.error is None for f in finals.values())
    assert core.scheduler.num_preemptions > 0
    assert sum(f.stats.num_preemptions for f in finals.values()) == core.scheduler.num_preemptions
    # a seeded request draws the same tokens whether or not it was preempted
    alone, _ = run(make(TableTarget(), kv_num_blocks=100), [("s", prompts["r0"], seeded)])
    assert out["s"] == alone["s"]
    assert core.num_tracked_requests == 0 and core.kv.num_used_blocks == 0


def test_requests_preempted_again_and_again_never_stall_the_engine():
    """Many requests admitted at once into a pool that holds about four of them, each preempted
    in turn: the preempted ones wait holding no blocks (their cached prefixes pinned by waiting
    requests once filled the pool with no request running, and the engine stalled)."""
    target = TableTarget()
    # 40 blocks of 16 tokens; each request grows to 64 + 96 tokens (+ a tree): about four fit
    core = make(target, kv_num_blocks=40, max_num_seqs=16, num_speculative_tokens=4)
    prompts = {f"r{i}": tokens(64, seed=60 + i) for i in range(16)}
    steps = 0
    step = core.step

    async def bounded(lane=None):
        nonlocal steps
        steps += 1
        assert steps < 5_000, (f"stalled: {len(core.running)} running, {len(core.pool.waiting)} waiting, "
                               f"{core.kv.num_used_blocks} blocks held, {core.kv.num_free_blocks} free")
        return await step(lane)

    core.step = bounded
    out, finals = run(core, [(rid, p, SamplingParams(max_tokens=96)) for rid, p in prompts.items()])
    assert out == {rid: target.greedy(p, 96) for rid, p in prompts.items()}
    assert all(f.finish_reason == "length" and f.error is None for f in finals.values())
    assert core.scheduler.num_preemptions >= 4
    assert core.num_tracked_requests == 0 and core.kv.num_used_blocks == 0


def test_only_a_request_that_can_never_fit_is_refused_up_front():
    core = make(TableTarget(), kv_num_blocks=4, num_speculative_tokens=4)
    with pytest.raises(ValueError, match="KV blocks of 16 tokens; the KV cache holds 4"):
        core.check_request(tokens(30, seed=1), SamplingParams(max_tokens=40))
    with pytest.raises(ValueError, match="KV cache holds 4"):
        core.add_request("big", tokens(30, seed=1), SamplingParams(max_tokens=40))
    core.check_request(tokens(30, seed=1), SamplingParams(max_tokens=20))  # 30 + 20 + 5 <= 64


def test_the_batch_is_bounded_by_the_kv_pool_not_only_by_max_num_seqs():
    target = TableTarget()
    core = make(target, kv_num_blocks=6, max_num_seqs=32, num_speculative_tokens=0)
    prompts = {f"r{i}": tokens(30, seed=40 + i) for i in range(8)}
    running = []
    step = core.step

    async def watching(lane=None):
        outputs = await step(lane)
        running.append(len(core.running))
        return outputs

    core.step = watching
    out, _ = run(core, [(rid, p, SamplingParams(max_tokens=10)) for rid, p in prompts.items()])
    assert out == {rid: target.greedy(p, 10) for rid, p in prompts.items()}
    assert 1 < max(running) <= 3  # 3 blocks each (30 + 10 tokens): the pool holds two or three
