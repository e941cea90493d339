"""The feature head's plumbing: the last stage's features, their resolution to the accepted
path, the head's incremental rows against its training forward, and its proposals."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.algo.tree import TokenTree
from cosine_ray.engine.drafters.base import ContinueQuery, DraftInput
from cosine_ray.engine.drafters.models.feature_head import FeatureHeadDrafter, _within_budget
from cosine_ray.engine.drafters.models.head_model import FeatureHead, HeadConfig
from cosine_ray.engine.worker.features import FeatureRecord, FeatureStage, FeatureStore
from cosine_ray.engine.worker.scoring import ScoreItem, build_stage_batch
from cosine_ray.models.llama import LlamaStage


def _stage(ckpt):
    return LlamaStage(ckpt.config, ckpt.load_state_dict())


def test_feature_stage_logits_equal_the_plain_stage_and_records_every_row(tiny_checkpoint):
    plain, store = _stage(tiny_checkpoint), FeatureStore()
    tapped = FeatureStage.wrap(_stage(tiny_checkpoint), store)
    tree = TokenTree((9, 10, 11, 12), (-1, 0, 0, 1), (1.0,) * 4)
    outs = []
    for stage in (plain, tapped):
        cache = stage.new_kv_cache()
        for rid in ("a", "b"):
            cache.allocate(rid)
        outs.append(stage.forward(build_stage_batch([ScoreItem.prefill("a", [3, 4, 5, 6, 7]),
                                                     ScoreItem.prefill("b", [1, 2])]), cache))
        for rid in ("a", "b"):
            cache.commit(rid)
        outs.append(stage.forward(build_stage_batch([ScoreItem.for_tree("a", tree, 5)]), cache))
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    # the prompt's five rows and the tree's four: position 5 is the root, then the accepted 10, 12
    got = store.committed("a", [3, 4, 5, 6, 7, 9, 10, 12, 99])
    assert sorted(got) == [0, 1, 2, 3, 4, 5, 6, 7]
    # a feature is the LM head's input: the prompt's last feature gives the prompt's logits
    assert torch.allclose(tapped.lm_head(got[4][None]).float(), outs[0][:1], atol=1e-5)
    assert torch.allclose(tapped.lm_head(got[7][None]).float(), outs[1][3:4], atol=1e-5)
    assert store.committed("a", [3, 4, 5, 6, 7, 9]) == {}  # consumed
    assert sorted(store.committed("b", [1, 2, 8])) == [0, 1]


def test_store_resolves_the_accepted_path_only():
    store = FeatureStore()
    feats = torch.arange(5.0)[:, None].repeat(1, 3)
    tree = TokenTree((7, 1, 2, 3, 4), (-1, 0, 0, 1, 2), (1.0,) * 5)
    store.record("r", FeatureRecord((10, 11, 11, 12, 12), tree.token_ids, tree.attention_mask(), feats))
    context = [0] * 10 + [7, 2, 4, 8]  # root 7, then 2 (node 2), then 4 (node 4, child of 2), bonus 8
    got = store.committed("r", context)
    assert {p: float(f[0]) for p, f in got.items()} == {10: 0.0, 11: 2.0, 12: 4.0}


def test_store_drops_a_tree_whose_root_is_not_committed():
    store = FeatureStore()
    tree = TokenTree((7, 1), (-1, 0), (1.0, 1.0))
    store.record("r", FeatureRecord((3, 4), tree.token_ids, tree.attention_mask(), torch.zeros(2, 2)))
    assert store.committed("r", [0, 0, 0, 5, 1]) == {}


def _head_drafter(hidden=32, vocab=40, seed=0, store=None):
    gen = torch.Generator().manual_seed(seed)
    cfg = HeadConfig(hidden, 64, 4, 2, hidden // 4)
    head = FeatureHead(cfg)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    emb = torch.randn(vocab, hidden, generator=gen)
    return FeatureHeadDrafter(head, emb, emb.clone(), torch.arange(vocab), store or FeatureStore()), gen


def test_incremental_rows_equal_the_training_forward():
    drafter, gen = _head_drafter()
    tokens = torch.randint(0, 40, (20,), generator=gen)
    feats = torch.randn(20, 32, generator=gen)
    with torch.no_grad():
        full = drafter.head(drafter.embedding[tokens[1:]][None], feats[:-1][None], torch.arange(19)[None])[0]
    t = 12
    drafter.store.record("r", FeatureRecord(tuple(range(t)), tuple(tokens[:t].tolist()), None, feats[:t]))
    state = drafter._sync("r", tuple(tokens[:t + 1].tolist()))
    assert torch.allclose(state.root_g, full[t - 1], atol=1e-5)
    drafter.store.record("r", FeatureRecord((t, t + 1), tuple(tokens[t:t + 2].tolist()), None, feats[t:t + 2]))
    state = drafter._sync("r", tuple(tokens[:t + 3].tolist()))
    assert torch.allclose(state.root_g, full[t + 1], atol=1e-5)
    # a draft path's row reads its token and its parent's output: the training forward on the
    # same inputs (with the head's own outputs as features) gives the same output
    path = (int(tokens[t + 3]), int(tokens[t + 4]))
    drafter._ensure([(state, path)])
    with torch.no_grad():
        f2 = torch.cat([feats[:t + 2], state.root_g[None], state.draft[path[:1]].g[None]])
        emb = drafter.embedding[torch.cat([tokens[1:t + 3], torch.tensor(path)])]
        again = drafter.head(emb[None], f2[None], torch.arange(t + 4)[None])[0]
    assert torch.allclose(state.draft[path].g, again[-1], atol=1e-5)


def test_no_feature_no_draft_and_proposals_fit_the_budget():
    drafter, gen = _head_drafter()
    assert drafter.propose([DraftInput("r", (1, 2, 3), 8)])[0].paths == []
    assert drafter.continue_chains([ContinueQuery("r", (1, 2, 3), ((4,),), 2, 3)]) == [[[[]]]]
    drafter.store.record("r", FeatureRecord((0, 1), (1, 2), None, torch.randn(2, 32, generator=gen)))
    for budget in (1, 3, 8):
        p = drafter.propose([DraftInput("r", (1, 2, 3), budget)])[0]
        assert p.paths and p.num_draft_tokens <= budget
        assert all(0.0 <= c <= 1.0 for cs in p.confidences for c in cs)
    chains = drafter.continue_chains([ContinueQuery("r", (1, 2, 3), ((), (5,)), 2, 3)])[0]
    assert [len(levels) for levels in chains] == [3, 3] and all(len(c) == 2 for lv in chains for c in lv)
    drafter.release("r")
    assert drafter.num_tracked_requests == 0 and drafter.store.num_requests() == 0


def test_budget_counts_every_path_token():
    ranked = [(1,), (1, 2), (3,), (1, 2, 4), (1, 5), (3, 6)]
    leaves = _within_budget(ranked, 5)
    assert sum(len(p) for p in leaves) <= 5
    # (1, 5) branches off an inner node: a new path of 2 tokens, past the budget; (3, 6) extends a leaf
    assert set(leaves) == {(1, 2, 4), (3, 6)}


def test_one_feature_head_a_drafter_set(tiny_checkpoint):
    """A head drafts from the last stage's features: two would share one store, so the
    single-process engine refuses them as the stage actors do (``build.head_spec``)."""
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.local import LocalEngine

    with pytest.raises(ValueError, match="at most one feature head"):
        LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("head:a,head:b")))
