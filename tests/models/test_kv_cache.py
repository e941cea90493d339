"""KVCache: two-level (committed + speculative) per-request cache; unit tests and a property
test against a pure-Python list model of every request's contents."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cosine_ray.models.kv_cache import KVCache

LAYERS, HEADS, DIM = 2, 2, 3


def make_cache(**kwargs) -> KVCache:
    return KVCache(LAYERS, HEADS, DIM, **kwargs)


def token_kv(token: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct keys/values per (token, layer)  # each [HEADS, DIM]"""
    base = torch.arange(HEADS * DIM, dtype=torch.float32).view(HEADS, DIM)
    return base + 1000.0 * token + 100.0 * layer, -(base + 1000.0 * token + 100.0 * layer)


def write_level(cache: KVCache, rid: str, tokens: list[int]) -> int:
    """reserve + write every layer, as a forward does; returns the level's first slot."""
    slot = cache.reserve(rid, len(tokens))
    for layer in range(LAYERS):
        if tokens:
            kv = [token_kv(t, layer) for t in tokens]
            keys = torch.stack([k for k, _ in kv], dim=1)  # [HEADS, n, DIM]
            values = torch.stack([v for _, v in kv], dim=1)
            cache.write(rid, layer, slot, keys, values)
    return slot


def assert_contents(cache: KVCache, rid: str, tokens: list[int]) -> None:
    assert cache.committed_length(rid) == len(tokens)
    for layer in range(LAYERS):
        keys, values = cache.view(rid, layer, len(tokens))
        assert keys.shape == (HEADS, len(tokens), DIM)
        for i, t in enumerate(tokens):
            k, v = token_kv(t, layer)
            assert torch.equal(keys[:, i], k), f"layer {layer} slot {i}: expected token {t}"
            assert torch.equal(values[:, i], v)


# ---- unit tests ------------------------------------------------------------------------------

def test_allocate_free_and_bookkeeping():
    cache = make_cache()
    assert "a" not in cache and cache.request_ids == [] and cache.num_tokens() == 0
    cache.allocate("a")
    cache.allocate("b")
    assert "a" in cache and cache.request_ids == ["a", "b"]
    with pytest.raises(KeyError, match="already has a KV cache"):
        cache.allocate("a")
    assert cache.committed_length("a") == 0
    cache.free("a")
    cache.free("a")  # freeing twice (or an unknown id) is a no-op
    cache.free("never")
    assert cache.request_ids == ["b"]
    assert cache.bytes_per_token() == LAYERS * 2 * HEADS * DIM * 4
    assert make_cache(dtype=torch.float16).bytes_per_token() == LAYERS * 2 * HEADS * DIM * 2


def test_reserve_write_commit_all():
    cache = make_cache()
    cache.allocate("a")
    assert write_level(cache, "a", [1, 2, 3]) == 0
    assert cache.committed_length("a") == 0 and cache.num_tokens() == 3  # speculative counts
    cache.commit("a")
    assert_contents(cache, "a", [1, 2, 3])
    assert write_level(cache, "a", [4]) == 3
    cache.commit("a", None)
    assert_contents(cache, "a", [1, 2, 3, 4])


def test_commit_keep_compacts_path_and_drops_rest():
    cache = make_cache()
    cache.allocate("a")
    write_level(cache, "a", [1, 2])
    cache.commit("a")
    write_level(cache, "a", [10, 11, 12, 13, 14])  # a tree's nodes in node order
    cache.commit("a", [0, 2, 4])  # root, then a path skipping nodes 1 and 3
    assert_contents(cache, "a", [1, 2, 10, 12, 14])
    assert cache.num_tokens() == 5
    write_level(cache, "a", [20, 21, 22])
    cache.commit("a", [0, 1])  # a leading prefix stays in place
    assert_contents(cache, "a", [1, 2, 10, 12, 14, 20, 21])
    write_level(cache, "a", [30, 31, 32])
    cache.commit("a", [2, 0])  # any order: the kept slots land in the order given
    assert_contents(cache, "a", [1, 2, 10, 12, 14, 20, 21, 32, 30])
    write_level(cache, "a", [40])
    cache.commit("a", [])
    assert_contents(cache, "a", [1, 2, 10, 12, 14, 20, 21, 32, 30])


def extend_level(cache: KVCache, rid: str, tokens: list[int]) -> int:
    """extend + write every layer, as a PipeDec layer forward does; returns the first new slot."""
    slot = cache.extend(rid, len(tokens))
    for layer in range(LAYERS):
        kv = [token_kv(t, layer) for t in tokens]
        cache.write(rid, layer, slot, torch.stack([k for k, _ in kv], 1), torch.stack([v for _, v in kv], 1))
    return slot


def test_extend_grows_the_level_and_keep_commits_a_prefix_of_the_kept_slots():
    """PipeDec's two-level cache: layers appended one at a time; a hit commits the old root and
    keeps the new root's subtree speculative; a miss commits the old root and drops the rest."""
    cache = make_cache(initial_capacity=4)  # growth while extending keeps everything
    cache.allocate("a")
    write_level(cache, "a", [1, 2])
    cache.commit("a")
    assert extend_level(cache, "a", [10]) == 2  # the root
    assert extend_level(cache, "a", [20, 21]) == 3  # its children
    assert extend_level(cache, "a", [30, 31, 32]) == 5  # grandchildren (capacity 4 -> grown)
    assert cache.num_speculative("a") == 6 and cache.num_tokens() == 8
    cache.keep("a", [0, 2, 4, 5], num_committed=1)  # hit on 21: commit 10, keep 21, 31, 32
    assert cache.committed_length("a") == 3 and cache.num_speculative("a") == 3
    assert extend_level(cache, "a", [40]) == 6  # appended after the kept level
    cache.keep("a", [0], num_committed=1)  # miss: commit 21, drop the rest
    assert_contents(cache, "a", [1, 2, 10, 21])
    assert cache.num_speculative("a") == 0 and cache.num_tokens() == 4
    with pytest.raises(ValueError, match="cannot commit 2 of 1"):
        extend_level(cache, "a", [50])
        cache.keep("a", [0], num_committed=2)
    with pytest.raises(IndexError):
        cache.keep("a", [3], num_committed=0)


def test_extend_respects_max_tokens():
    cache = make_cache(max_tokens=4)
    cache.allocate("a")
    write_level(cache, "a", [1, 2])
    cache.commit("a")
    extend_level(cache, "a", [3])
    extend_level(cache, "a", [4])
    with pytest.raises(MemoryError, match="KV cache full"):
        cache.extend("a", 1)


def test_commit_keep_out_of_range():
    cache = make_cache()
    cache.allocate("a")
    write_level(cache, "a", [1, 2])
    with pytest.raises(IndexError, match="outside the speculative level"):
        cache.commit("a", [0, 2])
    with pytest.raises(IndexError):
        cache.commit("a", [-1])
    cache.commit("a", [1])
    assert_contents(cache, "a", [2])
    with pytest.raises(IndexError):  # no level open any more
        cache.commit("a", [0])


def test_rollback_and_truncate():
    cache = make_cache()
    cache.allocate("a")
    write_level(cache, "a", [1, 2, 3, 4, 5])
    cache.commit("a")
    write_level(cache, "a", [6, 7])
    cache.rollback("a", 2)  # also drops the open speculative level
    assert_contents(cache, "a", [1, 2, 3])
    assert cache.num_tokens() == 3
    with pytest.raises(ValueError, match="cannot roll back 4 of 3"):
        cache.rollback("a", 4)
    with pytest.raises(ValueError):
        cache.rollback("a", -1)
    cache.truncate("a", 1)
    assert_contents(cache, "a", [1])
    with pytest.raises(ValueError):
        cache.truncate("a", 2)
    write_level(cache, "a", [8])
    cache.commit("a")
    assert_contents(cache, "a", [1, 8])


def test_growth_keeps_committed_prefix():
    cache = make_cache(initial_capacity=2)
    cache.allocate("a")
    write_level(cache, "a", [1, 2])
    cache.commit("a")
    write_level(cache, "a", [3, 4, 5])  # 5 > 2 slots: grows to max(5, 4)
    cache.commit("a", [2, 0])
    assert_contents(cache, "a", [1, 2, 5, 3])
    write_level(cache, "a", list(range(10, 30)))
    cache.commit("a")
    assert_contents(cache, "a", [1, 2, 5, 3] + list(range(10, 30)))


def test_buffer_grown_under_inference_mode_can_be_compacted_outside():
    """A forward runs under torch.inference_mode (growth happens there); the engine commits
    outside it: compaction must still work on the grown buffer."""
    cache = make_cache(initial_capacity=2)
    cache.allocate("a")
    with torch.inference_mode():
        write_level(cache, "a", [1, 2, 3, 4, 5])
    cache.commit("a", [0, 3, 4])
    with torch.inference_mode():
        write_level(cache, "a", [6, 7, 8])
    cache.commit("a", [1, 2])
    cache.rollback("a", 1)
    assert_contents(cache, "a", [1, 4, 5, 7])


def test_max_tokens_counts_every_request_and_replaces_open_level():
    cache = make_cache(max_tokens=10)
    cache.allocate("a")
    cache.allocate("b")
    write_level(cache, "a", [1] * 6)
    cache.commit("a")
    with pytest.raises(MemoryError, match="11 tokens > max_tokens=10"):
        cache.reserve("b", 5)
    write_level(cache, "b", [2] * 4)  # 10: at the cap
    write_level(cache, "b", [3] * 3)  # re-opening b's level replaces its 4 slots, not adds
    assert cache.num_tokens() == 9
    with pytest.raises(MemoryError):
        cache.reserve("a", 2)  # a's own 6 committed + 2 + b's 3 speculative = 11
    cache.commit("b", [])
    cache.free("a")
    write_level(cache, "b", [4] * 10)
    assert cache.num_tokens() == 10


# ---- property test against a list model ------------------------------------------------------

REQUESTS = ("r0", "r1", "r2")

op_strategy = st.one_of(
    st.tuples(st.just("allocate"), st.sampled_from(REQUESTS)),
    st.tuples(st.just("free"), st.sampled_from(REQUESTS)),
    st.tuples(st.just("reserve"), st.sampled_from(REQUESTS), st.integers(0, 7)),
    st.tuples(st.just("commit_all"), st.sampled_from(REQUESTS)),
    st.tuples(st.just("commit_keep"), st.sampled_from(REQUESTS),
              st.lists(st.integers(0, 6), max_size=5, unique=True)),
    st.tuples(st.just("rollback"), st.sampled_from(REQUESTS), st.integers(0, 8)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, max_size=40), initial_capacity=st.integers(1, 6),
       max_tokens=st.one_of(st.none(), st.integers(0, 24)))
def test_cache_matches_list_model(ops, initial_capacity, max_tokens):
    cache = make_cache(initial_capacity=initial_capacity, max_tokens=max_tokens)
    committed: dict[str, list[int]] = {}
    speculative: dict[str, list[int]] = {}
    next_token = 0
    for op, rid, *args in ops:
        if op == "allocate":
            if rid in committed:
                with pytest.raises(KeyError):
                    cache.allocate(rid)
            else:
                cache.allocate(rid)
                committed[rid], speculative[rid] = [], []
        elif op == "free":
            cache.free(rid)
            committed.pop(rid, None)
            speculative.pop(rid, None)
        elif rid not in committed:
            continue  # operations on unknown requests are a caller bug (KeyError), not modelled
        elif op == "reserve":
            (n,) = args
            tokens = list(range(next_token, next_token + n))
            next_token += n
            total = sum(len(c) + len(s) for c, s in zip(committed.values(), speculative.values()))
            if max_tokens is not None and total - len(speculative[rid]) + n > max_tokens:
                with pytest.raises(MemoryError):
                    cache.reserve(rid, n)
            else:
                assert write_level(cache, rid, tokens) == len(committed[rid])
                speculative[rid] = tokens
        elif op == "commit_all":
            cache.commit(rid)
            committed[rid] += speculative[rid]
            speculative[rid] = []
        elif op == "commit_keep":
            (keep,) = args
            if any(k >= len(speculative[rid]) for k in keep):
                with pytest.raises(IndexError):
                    cache.commit(rid, keep)
            else:
                cache.commit(rid, keep)
                committed[rid] += [speculative[rid][k] for k in keep]
                speculative[rid] = []
        elif op == "rollback":
            (n,) = args
            if n > len(committed[rid]):
                with pytest.raises(ValueError):
                    cache.rollback(rid, n)
            else:
                cache.rollback(rid, n)
                del committed[rid][len(committed[rid]) - n:]
                speculative[rid] = []
        # after every operation the cache equals the model
        assert sorted(cache.request_ids) == sorted(committed)
        assert cache.num_tokens() == sum(len(c) + len(s) for c, s in zip(committed.values(),
                                                                         speculative.values()))
        for r in committed:
            assert_contents(cache, r, committed[r])
