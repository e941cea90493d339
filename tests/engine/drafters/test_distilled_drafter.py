"""Distilled domain drafters: the compact vocabulary's mapping, EasySpec's layer-parallel forward
(exact mode equal to the plain stage, fuzzy mode different), and lossless decoding either way."""

from __future__ import annotations

import json

import pytest
import torch

from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.drafters.base import ContinueQuery, DraftInput
from cosine_ray.engine.drafters.models.distilled import (DRAFTER_METADATA, DistilledConfig, DistilledDrafter,
                                                  LayerParallelStage, load_distilled)
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.llama import LlamaStage, StageBatch
from support.fakes import fuse_behind_leader

VOCAB = list(range(100, 164))  # target ids the drafter covers (compact ids 1..64)


@pytest.fixture(scope="module")
def compact_drafter_dir(tmp_path_factory):
    """A random 3-layer compact-vocabulary drafter for a 256-token target (tests/conftest.py's)."""
    from support.tiny_checkpoint import write_tiny_checkpoint
    folder = tmp_path_factory.mktemp("distilled") / "code"
    write_tiny_checkpoint(folder, num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=2,
                          vocab_size=len(VOCAB) + 1, seed=5, init_std=0.2)
    (folder / DRAFTER_METADATA).write_text(json.dumps({"kind": "domain", "domain": "code", "target": "tiny-llama",
                                                       "target_vocab_size": 256, "vocabulary": VOCAB}))
    return folder


def test_layer_parallel_exact_mode_is_the_plain_forward(compact_drafter_dir):
    from cosine_ray.models.loader import resolve_checkpoint
    ckpt = resolve_checkpoint(compact_drafter_dir)
    plain, par = LlamaStage(ckpt.config, ckpt.load_state_dict()), LayerParallelStage(ckpt.config, ckpt.load_state_dict())
    par.enable_layer_parallel()
    batch = StageBatch.from_chains(["a"], [[1, 5, 9, 2, 7]], [0], last_logits_only=False)
    outs = {}
    for name, stage, fuzzy in (("plain", plain, False), ("exact", par, False), ("fuzzy", par, True)):
        cache = stage.new_kv_cache()
        cache.allocate("a")
        stage.fuzzy = fuzzy
        outs[name] = stage.forward(batch, cache)
        stage.fuzzy = False
    assert torch.allclose(outs["plain"], outs["exact"], atol=1e-5)
    assert not torch.allclose(outs["plain"], outs["fuzzy"], atol=1e-3)  # stale inputs: another function


@pytest.mark.parametrize("layer_parallel", [False, True])
def test_vocabulary_mapping_and_calibration(compact_drafter_dir, layer_parallel):
    drafter = load_distilled(compact_drafter_dir, 256, config=DistilledConfig(layer_parallel=layer_parallel))
    context = (3, 100, 120, 250, 101)  # 3 and 250 are outside the vocabulary: read as compact id 0
    p = drafter.propose([DraftInput("r", context, 6)])[0]
    assert p.paths and all(t in VOCAB for path in p.paths for t in path) and p.num_draft_tokens <= 6
    # what the cache holds afterwards is exact: the context (and, sequential, the drafts) only
    held = drafter.cache.committed_length("r")
    assert held == (len(context) if layer_parallel else len(context) + len(p.paths[0]) - 1)
    chains = drafter.continue_chains([ContinueQuery("r", context, ((), (p.paths[0][0],)), 2, 3)])[0]
    assert [len(chain) for chain in chains] == [1, 1]  # one level a prefix, whatever the depth asked
    assert chains[0][0][0][0] == p.paths[0][0]
    # Continuing the top token is exact in either mode: the sequential drafter's second level.
    # The proposal's own second level is that too, sequentially; layer-parallel drafted it from
    # stale inputs (another function: test_layer_parallel_exact_mode_is_the_plain_forward).
    exact = load_distilled(compact_drafter_dir, 256).propose([DraftInput("r", context, 6)])[0].paths[0]
    assert len(p.paths[0]) == len(exact) == 6 and p.paths[0][0] == exact[0]
    assert chains[1][0][0][0] == exact[1]
    if not layer_parallel:
        assert p.paths[0] == exact
    drafter.release("r")
    assert drafter.num_tracked_requests == 0


@pytest.mark.parametrize("layer_parallel", [False, True])
def test_decoding_with_a_distilled_drafter_is_lossless(tiny_checkpoint, compact_drafter_dir, layer_parallel):
    prompts = [[100, 101, 102, 103], [5, 120, 130, 7, 140], [150, 151]]
    params = SamplingParams(max_tokens=24)
    plain = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=()))
    want = [o.new_token_ids for o in plain.generate(prompts, params)]
    engine = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path),
                                      drafters=parse_drafters(f"ngram,distilled:{compact_drafter_dir}"))
                         .replace(layer_parallel_drafting=layer_parallel))
    drafter = next(d for d in engine.drafters if isinstance(d, DistilledDrafter))
    assert drafter.config.layer_parallel == layer_parallel
    outs = engine.generate(prompts, params)
    assert [o.new_token_ids for o in outs] == want
    assert sum(o.stats.num_draft_tokens for o in outs) > 0



def test_fusion_costs_a_distilled_drafter_at_most_two_forwards_a_round(compact_drafter_dir):
    """Chains to the tree's depth at every call cost 8 + 7 + ... + 1 = 36 forwards for one
    request at depth 8 when fusion follows another drafter; one level a call costs the root's
    forward and then two a round (the trunk, the drafter's own branch), with the same answers
    as a fresh drafter gives each fused prefix. The leader's token 7 is outside the drafter's
    vocabulary, so the drafter never agrees with it."""
    drafter = load_distilled(compact_drafter_dir, 256, name="distilled")
    forwards = []
    inner = drafter._forward
    drafter._forward = lambda rids, chains, fuzzy: forwards.append(len(rids)) or inner(rids, chains, fuzzy)
    context, depth = (100, 120, 101, 130, 102), 8
    state = fuse_behind_leader(drafter, 7, context, depth)
    assert state.trunk == [7] * depth and state.trunk_owners == ["leader"] * depth  # premise: it lost every round
    assert len(forwards) <= 1 + 2 * (depth - 1), forwards
    fresh = load_distilled(compact_drafter_dir, 256, name="fresh")
    for level, (token, raw) in enumerate(state.answers["distilled"]):
        want = fresh.continue_drafts([ContinueQuery(f"f{level}", context, ((7,) * level,), 1, 1)])[0][0][0]
        assert token == want[0] and raw == pytest.approx(want[1], rel=1e-5)
