"""The engine's KV block tables and prefix cache (``engine.owners.kv.KVBlocks``), alone."""

from __future__ import annotations

import pytest

from cosine_ray.engine.owners.kv import KVBlocks, chain_hash
from cosine_ray.engine.request import Request, SamplingParams

BS = 4


def request(rid: str, prompt: list[int], output: list[int] = ()) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=64))
    r.output_token_ids = list(output)
    return r


def computed(kv: KVBlocks, r: Request) -> None:
    """As after a whole prefill: its context's KV is committed."""
    assert kv.ensure(r, r.num_tokens)
    kv.commit(r, r.num_tokens)


def test_tables_grow_and_trim_and_blocks_are_shared_by_reference():
    kv = KVBlocks(8, BS)
    a = request("a", list(range(10)))
    assert kv.ensure(a, 10) and len(a.block_table) == 3 and kv.num_free_blocks == 5
    assert kv.ensure(a, 17) and len(a.block_table) == 5  # a tree's slots
    kv.commit(a, 11)  # root + accepted path kept: the slots past them go back
    assert len(a.block_table) == 3 and kv.num_free_blocks == 5
    assert not kv.ensure(a, 40) and len(a.block_table) == 3  # all or nothing
    kv.free(a)
    assert a.block_table == [] and kv.num_free_blocks == 8 and kv.num_used_blocks == 0


def test_the_longest_cached_prefix_in_whole_blocks_never_the_last_token():
    kv = KVBlocks(16, BS)
    a = request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    computed(kv, a)  # blocks [1 2 3 4] [5 6 7 8] are full and committed; [9 10] is not
    kv.free(a)
    b = request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    assert kv.take_cached_prefix(b) == 8 and b.num_computed_tokens == 8 and b.stats.num_cached_tokens == 8
    assert b.block_table == a_table_prefix(kv, [1, 2, 3, 4, 5, 6, 7, 8])
    c = request("c", [1, 2, 3, 4, 5, 6, 7, 8])  # all cached, but its last token is computed
    assert kv.take_cached_prefix(c) == 4
    d = request("d", [9, 9, 9, 9, 5, 6, 7, 8, 1])  # the same second block after another first one
    assert kv.take_cached_prefix(d) == 0
    assert kv.stats.queries == 10 + 8 + 9 and kv.stats.hits == 8 + 4


def a_table_prefix(kv: KVBlocks, tokens: list[int]) -> list[int]:
    """The blocks that hold ``tokens`` (whole blocks), found by walking the chain."""
    blocks, prefix = [], 0
    for i in range(0, len(tokens), BS):
        key = (prefix, tuple(tokens[i:i + BS]))
        blocks.append(kv._block_of[key])
        prefix = chain_hash(*key)
    return blocks


def test_a_cached_block_is_kept_until_the_pool_needs_it_then_the_least_recent_goes():
    kv = KVBlocks(4, BS)
    old, new = request("old", [1, 1, 1, 1, 0]), request("new", [2, 2, 2, 2, 0])
    computed(kv, old)
    kv.free(old)
    computed(kv, new)
    kv.free(new)
    # a budget hands out never-used blocks first: both cached prefixes survive
    filler = request("f", [7] * 3)
    assert kv.ensure(filler, 3) and kv.stats.evictions == 0
    # then the pool reuses blocks without content first, then the least recently freed
    big = request("big", [8] * 8)
    assert kv.ensure(big, 8) and kv.stats.evictions == 1
    assert kv.take_cached_prefix(request("x", [1, 1, 1, 1, 9])) == 0  # "old" was evicted
    assert kv.take_cached_prefix(request("y", [2, 2, 2, 2, 9])) == 4  # "new" is still cached


def test_a_shared_block_is_freed_only_when_nobody_holds_it():
    kv = KVBlocks(6, BS)
    a = request("a", [1, 2, 3, 4, 5])
    computed(kv, a)
    b = request("b", [1, 2, 3, 4, 6])
    assert kv.take_cached_prefix(b) == 4 and b.block_table[0] == a.block_table[0]
    kv.free(a)
    assert kv.num_used_blocks == 1  # b still holds the shared block
    filler = request("f", [0] * 20)
    assert kv.ensure(filler, 20)  # every other block: the shared one is not evicted under b
    assert b.block_table[0] not in filler.block_table
    assert not kv.ensure(request("g", [0]), 1)


def test_draft_slots_and_uncommitted_tokens_never_enter_the_cache():
    kv = KVBlocks(None, BS)
    a = request("a", [1, 2, 3])
    assert kv.ensure(a, 3 + 9)  # a prompt and a 9-node tree past it
    kv.commit(a, 3)  # nothing accepted: no block is full of committed tokens
    assert kv._block_of == {} and len(a.block_table) == 1
    a.output_token_ids = [4, 5, 6]
    kv.commit(a, 5)  # the first block is full now
    assert list(kv._block_of.values()) == [a.block_table[0]]


def test_without_caching_nothing_is_looked_up_and_reset_forgets_everything():
    kv = KVBlocks(8, BS, caching=False)
    a = request("a", list(range(9)))
    computed(kv, a)
    kv.free(a)
    assert kv.take_cached_prefix(request("b", list(range(9)))) == 0
    on = KVBlocks(8, BS)
    c = request("c", list(range(9)))
    computed(on, c)
    on.reset([c])
    assert c.block_table == [] and c.num_computed_tokens == 0 and on.num_free_blocks == 8
    assert on.take_cached_prefix(request("d", list(range(9)))) == 0


def test_a_shared_prefix_survives_requests_with_other_prompts_in_between():
    """Mixed traffic: a shared system prompt, then a request with another one, then the shared
    one again. With room in the budget, the other request takes never-used blocks and the
    shared prefix is still cached (a pool that reused freed blocks before growing forgot it)."""
    kv = KVBlocks(64, BS)
    system, other = list(range(100, 120)), list(range(200, 220))  # five full blocks each
    first = request("s1", system + [1])
    computed(kv, first)
    kv.free(first)
    distinct = request("d", other + [2])
    assert kv.take_cached_prefix(distinct) == 0
    computed(kv, distinct)
    kv.free(distinct)
    again = request("s2", system + [3])
    assert kv.take_cached_prefix(again) == 20 and kv.stats.evictions == 0
    assert kv.take_cached_prefix(request("d2", other + [4])) == 20


def test_blocks_without_content_are_reused_before_never_used_ones():
    kv = KVBlocks(8, BS)
    a = request("a", [1, 2, 3])  # a partial block: nothing to cache
    computed(kv, a)
    kv.free(a)
    b = request("b", [5, 6])
    assert kv.ensure(b, 2) and b.block_table == [1]  # the stages' pools need not grow
    assert kv.num_free_blocks == 7


def test_eviction_follows_the_last_use_not_the_first_caching():
    kv = KVBlocks(3, BS)
    old, new = request("old", [1, 1, 1, 1, 0]), request("new", [2, 2, 2, 2, 0])
    computed(kv, old)
    kv.free(old)
    computed(kv, new)
    kv.free(new)
    hit = request("hit", [1, 1, 1, 1, 5])  # "old" is used again, after "new" was freed
    assert kv.take_cached_prefix(hit) == 4
    computed(kv, hit)
    kv.free(hit)
    filler = request("f", [7] * 8)  # two blocks: the empty one, then the least recently used
    assert kv.ensure(filler, 8) and kv.stats.evictions == 1
    assert kv.take_cached_prefix(request("x", [2, 2, 2, 2, 9])) == 0  # "new" went
    assert kv.take_cached_prefix(request("y", [1, 1, 1, 1, 9])) == 4  # "old", used last, stayed


def test_an_unbounded_pool_reuses_freed_blocks_before_growing():
    kv = KVBlocks(None, BS)
    a = request("a", [1] * 8)
    computed(kv, a)
    kv.free(a)
    b = request("b", [2] * 8)
    assert kv.ensure(b, 8) and sorted(b.block_table) == [1, 2]  # no new ids: the pool stays its size
    assert kv.num_free_blocks is None and kv.can_fit(10 ** 6)


def test_the_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        KVBlocks(0, BS)


def test_a_cpu_pool_without_a_budget_may_hold_a_share_of_the_available_memory(monkeypatch):
    import torch

    from cosine_ray.engine.worker import target
    from cosine_ray.models.config import ModelConfig
    from support.factories import engine_config

    assert 0 < target.available_memory_bytes() < 1 << 50
    model = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0)
    per_token = 4 * 2 * 2 * 8 * 4  # layers, keys and values, heads, dims, fp32 bytes
    monkeypatch.setattr(target, "available_memory_bytes", lambda: 10 ** 9)
    step = engine_config(max_model_len=512, num_speculative_tokens=8)
    assert target.default_kv_tokens(step, model, torch.float32) == int(target.CPU_KV_MEMORY_SHARE * 10 ** 9) // per_token
    monkeypatch.setattr(target, "available_memory_bytes", lambda: 1000)
    assert target.default_kv_tokens(step, model, torch.float32) == 512 + 8 + 1  # one whole request, at least
