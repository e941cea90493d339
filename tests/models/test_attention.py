"""Attention over the paged pool (``models.attention``) against a plain per-request reference
(each request's keys in one contiguous tensor, one SDPA call with its own mask), for mixed
steps: decodes, token trees, PipeDec layers (``extend``), fresh and continued long chains,
and requests whose blocks are scattered through the pool after others were freed. Also the
paged cache's block bookkeeping and budget."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cosine_ray.algo.tree import TokenTree
from cosine_ray.models.attention import BATCHED_MAX_NEW, _sdpa, attend, plan_attention
from cosine_ray.models.kv_cache import KVCache

LAYERS, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


def random_tree(n: int, g: torch.Generator) -> torch.Tensor:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return TokenTree(tuple(range(n)), tuple(parents), (1.0,) * n).attention_mask()


class Reference:
    """Every request's keys/values as contiguous lists; attention one request at a time."""

    def __init__(self):
        self.k: dict[str, list[torch.Tensor]] = {}
        self.v: dict[str, list[torch.Tensor]] = {}

    def step(self, rids, counts, masks, q, k, v, layer, committed, extend_from=None):
        out, offset = [], 0
        for rid, n, tree in zip(rids, counts, masks):
            ks = self.k.setdefault((rid, layer), [])
            vs = self.v.setdefault((rid, layer), [])
            base = committed[rid] if extend_from is None else extend_from[rid]
            del ks[base:], vs[base:]
            ks += list(k[offset:offset + n])
            vs += list(v[offset:offset + n])
            length = len(ks)
            mask = torch.ones(n, length, dtype=torch.bool)
            if tree is None:
                mask[:, length - n:] = torch.ones(n, n, dtype=torch.bool).tril_()
            else:
                mask[:, length - tree.shape[1]:] = tree
            keys = torch.stack(ks).transpose(0, 1)[None]
            values = torch.stack(vs).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[offset:offset + n].transpose(0, 1)[None], keys, values,
                                               attn_mask=mask, scale=0.3, enable_gqa=True)
            out.append(o[0].transpose(0, 1).reshape(n, HEADS * DIM))
            offset += n
        return torch.cat(out)


def run_step(cache, ref, rids, counts, masks, g, committed, *, extend=False, wide=False):
    total = sum(counts)
    q = torch.randn(total, HEADS, DIM, generator=g)
    k = torch.randn(total, KV_HEADS, DIM, generator=g)
    v = torch.randn(total, KV_HEADS, DIM, generator=g)
    extend_from = {r: cache.committed_length(r) + cache.num_speculative(r) for r in rids} if extend else None
    plan = plan_attention(rids, counts, masks, cache, extend=extend, device=torch.device("cpu"))
    for layer in range(LAYERS):
        got = attend(plan, cache, layer, q, k, v, scale=0.3, wide=wide)
        want = ref.step(rids, counts, masks, q, k, v, layer, committed, extend_from)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wide", [False, True], ids=["fp32", "float64"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_steps_equal_the_per_request_reference(block_size, wide):
    """Also with ``wide``: the native path's float64 attention, cast back to fp32."""
    g = torch.Generator().manual_seed(0)
    cache = KVCache(LAYERS, KV_HEADS, DIM, block_size=block_size, initial_capacity=8)
    ref = Reference()
    committed: dict[str, int] = {}
    # scatter later requests' blocks: fill with two requests, free one
    for rid in ("filler", "a", "b", "c", "d"):
        cache.allocate(rid)
        committed[rid] = 0
    run_step(cache, ref, ["filler"], [40], [None], g, committed, wide=wide)  # a long fresh chain: a single
    cache.commit("filler")
    run_step(cache, ref, ["a", "b"], [5, BATCHED_MAX_NEW + 3], [None, None], g, committed, wide=wide)  # prefills
    cache.commit_many([("a", None), ("b", None)])
    committed.update(a=5, b=BATCHED_MAX_NEW + 3, filler=40)
    cache.free("filler")
    run_step(cache, ref, ["c", "d"], [3, 1], [None, None], g, committed, wide=wide)  # into freed blocks
    cache.commit_many([("c", None), ("d", None)])
    committed.update(c=3, d=1)
    for step in range(4):
        # decodes, trees of several sizes, and a continued long chain (b), all in one step
        counts = [1, 6, BATCHED_MAX_NEW + 1 if step == 0 else 4, 2]
        masks = [None, random_tree(6, g), None if step == 0 else random_tree(4, g), random_tree(2, g)]
        run_step(cache, ref, ["d", "a", "b", "c"], counts, masks, g, committed, wide=wide)
        keeps = {"d": [0], "a": [0, 2], "b": list(range(counts[2])) if step == 0 else [0], "c": [0, 1]}
        cache.commit_many(keeps.items())
        for rid, keep in keeps.items():
            for layer in range(LAYERS):
                base = committed[rid]
                for key in (ref.k, ref.v):
                    level = key[(rid, layer)][base:]
                    key[(rid, layer)][base:] = [level[i] for i in keep]
            committed[rid] += len(keep)
    # decodes only (one batched call, no padding, no scatter), then one request alone (a view
    # of its consecutive slots when its blocks are in order)
    run_step(cache, ref, ["a", "b", "c", "d"], [1, 1, 1, 1], [None] * 4, g, committed, wide=wide)
    cache.commit_many((rid, None) for rid in "abcd")
    committed.update({rid: committed[rid] + 1 for rid in "abcd"})
    cache.allocate("e")
    committed["e"] = 0
    run_step(cache, ref, ["e"], [3], [None], g, committed, wide=wide)
    cache.commit("e")
    committed["e"] = 3
    run_step(cache, ref, ["e"], [3], [random_tree(3, g)], g, committed, wide=wide)
    for rid in ("a", "b", "c", "d"):
        assert cache.committed_length(rid) == committed[rid]
        for layer in range(LAYERS):
            keys, values = cache.view(rid, layer, committed[rid])
            torch.testing.assert_close(keys.transpose(0, 1), torch.stack(ref.k[(rid, layer)]), rtol=0, atol=0)
            torch.testing.assert_close(values.transpose(0, 1), torch.stack(ref.v[(rid, layer)]), rtol=0, atol=0)


def test_float64_attention_gives_a_row_what_it_gives_it_alone():
    """The native path's promise (tests/engine/test_native_weights.py): a decode row attended
    alone and the same row inside a padded, masked verify call (more query rows, keys past its
    own) come out bit for bit the same in fp32."""
    g = torch.Generator().manual_seed(3)
    length, pad, rows = 900, 5, 4
    keys = torch.randn(2, KV_HEADS, length + pad, DIM, generator=g)
    values = torch.randn(2, KV_HEADS, length + pad, DIM, generator=g)
    query = torch.randn(2, HEADS, rows, DIM, generator=g)
    mask = torch.rand(2, 1, rows, length + pad, generator=g) < 0.7
    mask[0, 0, 0] = False
    mask[0, 0, 0, :length] = True  # row (0, 0): exactly the first `length` keys
    together = _sdpa(query, keys, values, True, attn_mask=mask, scale=0.3, enable_gqa=True)
    alone = _sdpa(query[:1, :, :1], keys[:1, :, :length], values[:1, :, :length], True, scale=0.3, enable_gqa=True)
    assert together.dtype == torch.float32
    assert torch.equal(together[0, :, 0], alone[0, :, 0])
    want = F.scaled_dot_product_attention(query.double(), keys.double(), values.double(), attn_mask=mask,
                                          scale=0.3, enable_gqa=True)
    torch.testing.assert_close(together, want.float(), rtol=1e-6, atol=1e-6)


def test_cpu_groups_by_query_length():
    """On CPU the batched requests split into power-of-two buckets of new-token counts, so a
    token tree does not pad the decodes beside it; contiguous unpadded groups are slices; every
    layout equals the reference."""
    g = torch.Generator().manual_seed(2)
    cache = KVCache(LAYERS, KV_HEADS, DIM, block_size=4)
    ref = Reference()
    rids = ["a", "b", "c", "d", "e"]
    committed = {}
    for i, rid in enumerate(rids):
        cache.allocate(rid)
        committed[rid] = 0
        run_step(cache, ref, [rid], [3 + 2 * i], [None], g, committed)
        cache.commit(rid)
        committed[rid] = 3 + 2 * i
    layouts = {
        (2, 1, 1, 1, 1): [(4, 1, (2, 6)), (1, 2, (0, 2))],  # four decodes and the tree, as slices
        (1, 3, 1, 4, 1): [(3, 1, None), (2, 4, None)],  # decodes scattered; 3 and 4 share a bucket (padded)
        (1, 1, 1, 1, 1): [(5, 1, None)],  # one call for the whole batch
    }
    for counts, want in layouts.items():
        masks = [None if n == 1 else random_tree(n, g) for n in counts]
        plan = plan_attention(rids, list(counts), masks, cache, extend=False, device=torch.device("cpu"))
        assert [(grp.size, grp.max_new, grp.rows) for grp in plan.groups] == want
        run_step(cache, ref, rids, list(counts), masks, g, committed)
        cache.commit_many((rid, [0]) for rid in rids)
        for rid in rids:
            for layer in range(LAYERS):
                for key in (ref.k, ref.v):
                    del key[(rid, layer)][committed[rid] + 1:]
            committed[rid] += 1


def test_pipedec_layers_extend_the_level():
    """A PipeDec layer's mask covers the speculative level already there and the new nodes."""
    g = torch.Generator().manual_seed(1)
    cache = KVCache(LAYERS, KV_HEADS, DIM, block_size=4)
    ref = Reference()
    cache.allocate("r")
    committed = {"r": 0}
    run_step(cache, ref, ["r"], [7], [None], g, committed)
    cache.commit("r")
    committed["r"] = 7
    run_step(cache, ref, ["r"], [1], [torch.ones(1, 1, dtype=torch.bool)], g, committed, extend=True)
    layer2 = torch.tensor([[True, True, False, False], [True, False, True, False], [True, False, False, True]])[:, :4]
    run_step(cache, ref, ["r"], [3], [torch.cat([layer2[:, :1], torch.eye(3, dtype=torch.bool)], 1)], g, committed,
             extend=True)
    assert cache.num_speculative("r") == 4


def test_blocks_are_reused_and_the_pool_grows():
    cache = KVCache(1, 1, 2, block_size=4, initial_capacity=8)
    assert cache.num_blocks == 2
    cache.allocate("a")
    cache.reserve("a", 10)  # 3 blocks: the pool doubles
    assert cache.num_blocks == 4 and cache.num_free_blocks == 1
    cache.commit("a", [0, 1])  # 2 tokens: 1 block kept, 2 back
    assert cache.num_free_blocks == 3
    cache.rollback("a", 2)
    assert cache.num_free_blocks == 4
    cache.free("a")
    assert cache.num_free_blocks == 4


def test_a_budget_preallocates_and_refuses_past_it():
    cache = KVCache.for_budget(2, 2, 4, budget_bytes=3 * (2 * 2 * 2 * 4 * 4 * 4), block_size=4)
    assert cache.num_blocks == 3 and cache.max_blocks == 3
    cache.allocate("a")
    cache.reserve("a", 12)
    cache.allocate("b")
    with pytest.raises(MemoryError, match="budget holds 3"):
        cache.reserve("b", 1)
    with pytest.raises(ValueError, match="less than one block"):
        KVCache.for_budget(2, 2, 4, budget_bytes=10)


def test_commit_many_checks_everything_before_changing_anything():
    cache = KVCache(1, 1, 2, block_size=4)
    for rid in ("a", "b"):
        cache.allocate(rid)
        cache.reserve(rid, 3)
    with pytest.raises(IndexError):
        cache.commit_many([("a", [0, 1]), ("b", [5])])
    assert cache.committed_length("a") == 0 and cache.num_speculative("a") == 3


def test_eager_cuda_attention_leaves_out_cudnn_only():
    """The context an eager CUDA forward runs in turns cuDNN attention off and keeps the others
    (the flags are process-wide, so this runs without a GPU); elsewhere it changes nothing."""
    from cosine_ray.models.attention import eager_attention

    flags = (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.flash_sdp_enabled,
             torch.backends.cuda.mem_efficient_sdp_enabled, torch.backends.cuda.math_sdp_enabled)
    before = [f() for f in flags]
    with eager_attention(torch.device("cuda")):
        assert [f() for f in flags] == [False, True, True, True]
    assert [f() for f in flags] == before
    with eager_attention(torch.device("cpu")):
        assert [f() for f in flags] == before
