"""The serving engine keeps the text lossless on the real forward and KV pool: prefix caching,
chunked prefill and preemption, each equal to HF transformers' greedy decoding (fp32) on the
tiny random model, with drafters whose trees are often rejected (their slots are written and
dropped next to shared blocks), and a seeded request reproducible under preemption."""

from __future__ import annotations

import asyncio

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return tiny_checkpoint.load_hf_model()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             num_beams=1, temperature=None, top_p=None, top_k=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """A 40-token shared prefix (two full blocks and 8 tokens) with distinct tails, then others."""
    g = torch.Generator().manual_seed(77)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    tails = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 9, 17, 30)]
    others = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 21, 44, 12)]
    return [shared + t for t in tails] + others


@pytest.fixture(scope="module")
def reference(hf, prompts) -> list[list[int]]:
    return [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def make(ckpt, draft_ckpt, **settings) -> LocalEngine:
    drafters = parse_drafters(f"ngram,model:{draft_ckpt.path}")  # a drafter that is mostly wrong
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=drafters, **settings), checkpoint=ckpt)


def run_waves(engine: LocalEngine, waves, params) -> dict[int, object]:
    async def go():
        outs = {}
        try:
            for wave in waves:
                results = await asyncio.gather(*(engine.loop.generate_all(prompt, params) for _, prompt in wave))
                outs.update({i: r for (i, _), r in zip(wave, results)})
        finally:
            await engine.loop.shutdown()
        return outs

    return asyncio.run(go())


@pytest.mark.parametrize("num_stages", [1, 2])
def test_prefix_cache_hits_keep_the_hf_greedy_text(tiny_checkpoint, tiny_draft_checkpoint, prompts, reference,
                                                   num_stages):
    engine = make(tiny_checkpoint, tiny_draft_checkpoint, num_stages=num_stages, kv_cache_memory="4MiB")
    indexed = list(enumerate(prompts))
    outs = run_waves(engine, [indexed[:1], indexed[1:]], SamplingParams(max_tokens=MAX_TOKENS))
    assert [outs[i].new_token_ids for i in range(len(prompts))] == reference
    assert [outs[i].stats.num_cached_tokens for i in range(1, 4)] == [32, 32, 32]  # the shared full blocks
    assert engine.core.kv.stats.hits >= 3 * 32
    # the same prompts again: each hits its own earlier blocks (all of them but the last token's)
    again = run_waves(engine, [indexed], SamplingParams(max_tokens=MAX_TOKENS))
    assert [again[i].new_token_ids for i in range(len(prompts))] == reference
    assert all(again[i].stats.num_cached_tokens >= 16 * ((len(p) - 1) // 16) for i, p in indexed)
    assert engine.target.num_cached_requests() == 0


def test_a_cpu_pool_without_a_budget_keeps_shared_prefixes_under_mixed_traffic(tiny_checkpoint, tiny_draft_checkpoint,
                                                                                hf):
    """CPU defaults (no ``kv_cache_memory``): requests behind one shared prompt alternate with
    requests behind prompts of their own, each alone. Every shared request after the first
    finds the shared blocks cached; a pool that reused freed blocks before it grew gave them
    to the distinct request in between."""
    g = torch.Generator().manual_seed(91)
    shared = torch.randint(0, 256, (48,), generator=g).tolist()  # three full blocks
    rows = []
    for i in range(4):
        rows.append(shared + torch.randint(0, 256, (5,), generator=g).tolist())
        rows.append(torch.randint(0, 256, (64,), generator=g).tolist())  # as many blocks as a shared one, and more
    engine = make(tiny_checkpoint, tiny_draft_checkpoint)
    outs = run_waves(engine, [[(i, p)] for i, p in enumerate(rows)], SamplingParams(max_tokens=MAX_TOKENS))
    assert [outs[i].new_token_ids for i in range(len(rows))] == [hf_greedy(hf, p, MAX_TOKENS) for p in rows]
    assert [outs[i].stats.num_cached_tokens for i in (2, 4, 6)] == [48, 48, 48]
    assert [outs[i].stats.num_cached_tokens for i in (0, 1, 3, 5, 7)] == [0] * 5


def test_chunked_prefill_keeps_the_hf_greedy_text(tiny_checkpoint, tiny_draft_checkpoint, prompts, reference):
    engine = make(tiny_checkpoint, tiny_draft_checkpoint, max_num_seqs=4, max_num_batched_tokens=8,
                  enable_prefix_caching=False)
    outs = run_waves(engine, [list(enumerate(prompts))], SamplingParams(max_tokens=MAX_TOKENS))
    assert [outs[i].new_token_ids for i in range(len(prompts))] == reference


@pytest.mark.parametrize("num_stages", [1, 2])
def test_preempted_requests_finish_with_the_hf_greedy_text(tiny_checkpoint, tiny_draft_checkpoint, prompts,
                                                           reference, num_stages):
    # 19 blocks of 16 tokens per stage: the eight requests (up to 84 + 40 tokens and a tree) take turns
    per_block = 16 * 2 * tiny_checkpoint.config.num_kv_heads * tiny_checkpoint.config.head_dim * 4
    layers = tiny_checkpoint.config.num_layers // num_stages
    engine = make(tiny_checkpoint, tiny_draft_checkpoint, num_stages=num_stages, max_num_seqs=8,
                  kv_cache_memory=20 * per_block * layers)
    assert engine.core.kv.capacity == 19
    outs = run_waves(engine, [list(enumerate(prompts))], SamplingParams(max_tokens=MAX_TOKENS))
    assert [outs[i].new_token_ids for i in range(len(prompts))] == reference
    assert engine.core.scheduler.num_preemptions > 0
    assert sum(outs[i].stats.num_preemptions for i in outs) == engine.core.scheduler.num_preemptions
    assert engine.target.num_cached_requests() == 0 and engine.core.kv.num_used_blocks == 0


def test_a_seeded_request_draws_the_same_text_when_preempted(tiny_checkpoint, tiny_draft_checkpoint, prompts):
    per_block = 16 * 2 * tiny_checkpoint.config.num_kv_heads * tiny_checkpoint.config.head_dim * 4
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11)
    tight = make(tiny_checkpoint, tiny_draft_checkpoint, max_num_seqs=8,
                 kv_cache_memory=20 * per_block * tiny_checkpoint.config.num_layers)
    roomy = make(tiny_checkpoint, tiny_draft_checkpoint)
    seeded = run_waves(tight, [list(enumerate(prompts))], params)
    alone = run_waves(roomy, [[(i, p)] for i, p in enumerate(prompts)], params)
    assert tight.core.scheduler.num_preemptions > 0
    assert [seeded[i].new_token_ids for i in range(len(prompts))] == [alone[i].new_token_ids for i in range(len(prompts))]
