"""Chained fusion answers: the same fused trees with fewer drafter round trips.

``continue_chains`` answers several fusion rounds ahead along the drafter's own top tokens;
``fuse_drafts`` uses those answers until fusion's trunk leaves a chain. The claims: a chain is
exactly what ``continue_drafts`` answers level by level (real n-gram, retrieval and model
drafters), and fusion over chain-capable clients builds the identical state (trunk, branches,
per-depth answers) as over plain clients, with fewer calls.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from cosine_ray.algo.fusion import FusionState
from cosine_ray.engine.drafters.base import ContinueQuery, continue_chains
from cosine_ray.engine.drafters.lookup.datastore import Datastore
from cosine_ray.engine.drafters.models.model import ModelDrafter
from cosine_ray.engine.drafters.lookup.ngram import NgramDrafter
from cosine_ray.engine.drafters.lookup.retrieval import RetrievalDrafter
from cosine_ray.engine.build import PACKAGED_DATASTORES
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.owners.drafting import fuse_drafts
from cosine_ray.engine.worker.clients import LocalDrafterClient
from cosine_ray.models.llama import LlamaStage
from support.fakes import fuse_behind_leader

DOMAINS = ("code", "math", "instruction", "chat")


@pytest.fixture(scope="module")
def stores():
    return {d: Datastore.load(PACKAGED_DATASTORES / "smollm2-135m" / f"{d}.parquet") for d in DOMAINS}


def real_contexts(stores, n_per_domain: int = 4, seed: int = 0) -> list[tuple[int, ...]]:
    """Cuts of the datastores' own sequences, every fourth one with a token changed near the
    end, so that drafters agree for a while and then part."""
    rng = random.Random(seed)
    out = []
    for d in DOMAINS:
        for seq in rng.sample(stores[d].sequences, n_per_domain):
            ctx = list(seq[:rng.randrange(24, min(len(seq), 120))])
            if rng.random() < 0.25:
                ctx[-3] = rng.randrange(100, 20000)
            out.append(tuple(ctx))
    return out


class PlainClient:
    """The same drafter behind a client without ``continue_chains``: one position per call,
    as before chains."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name
        self.calls = 0

    async def continue_drafts(self, queries):
        self.calls += 1
        return self.drafter.continue_drafts(queries)


def real_drafters(stores):
    return [NgramDrafter()] + [RetrievalDrafter(stores[d]) for d in DOMAINS]


def test_a_chain_is_what_continue_drafts_answers_level_by_level(stores, tiny_draft_checkpoint):
    model = ModelDrafter(LlamaStage(tiny_draft_checkpoint.config, tiny_draft_checkpoint.load_state_dict()),
                         name="draft")
    contexts = real_contexts(stores)
    checked = 0
    for drafter in real_drafters(stores) + [model]:
        vocab = 256 if drafter is model else None
        ctxs = [tuple(t % 256 for t in c) for c in contexts] if vocab else contexts
        queries = [ContinueQuery(f"r{i}", c, ((), (c[-1],)), 1, depth=6) for i, c in enumerate(ctxs)]
        chains = continue_chains(drafter, queries)
        for q, per_prefix in zip(queries, chains):
            for prefix, chain in zip(q.prefixes, per_prefix):
                assert 1 <= len(chain) <= q.depth
                assert len(chain) == q.depth or not chain[-1], "a chain ends early only where the drafter had nothing"
                prefix = tuple(prefix)
                for cands in chain:  # every level again on its own, one position
                    alone = drafter.continue_drafts([ContinueQuery(q.request_id, q.context_token_ids, (prefix,), 1)])
                    assert [t for t, _ in alone[0][0]] == [t for t, _ in cands]  # model: KV vs fresh run
                    assert [c for _, c in alone[0][0]] == pytest.approx([c for _, c in cands], rel=1e-4)
                    checked += 1
                    if not cands:
                        break
                    prefix += (cands[0][0],)
    assert checked > 200


def test_the_n_gram_and_retrieval_drafters_own_chains_equal_the_level_by_level_ones(stores):
    """Their ``continue_chains`` walks each chain in one pass (``ngram.walk_chains``); it must
    answer exactly what ``base.continue_chains`` builds from ``continue_drafts``, for every k,
    depth (0 included) and prefix, on real contexts and datastores."""
    contexts = real_contexts(stores, seed=3)
    rng = random.Random(4)
    compared = 0
    for drafter in real_drafters(stores):
        for i, c in enumerate(contexts):
            prefixes = ((), (c[-1],), tuple(rng.choice(c) for _ in range(rng.randrange(1, 5))))
            for k, depth in ((1, 0), (1, 1), (1, 6), (3, 8), (2, 24)):
                q = [ContinueQuery(f"r{i}", c, prefixes, k, depth=depth)]
                own = drafter.continue_chains(q)
                assert own == continue_chains(drafter, q)
                compared += sum(len(chain) for chain in own[0])
    assert compared > 2000


def fuse(clients, contexts, depth):
    states = {f"r{i}": FusionState(tuple(c.name for c in clients), depth) for i in range(len(contexts))}
    calls = asyncio.run(fuse_drafts({c.name: c for c in clients}, states,
                                    {f"r{i}": c for i, c in enumerate(contexts)}, deadline_s=30.0, vocab_size=49152))
    return states, calls


@pytest.mark.parametrize("batch", [1, 4, 24])
def test_chained_fusion_builds_the_same_trees_with_fewer_drafter_calls(stores, batch):
    contexts = real_contexts(stores, n_per_domain=6, seed=1)[::24 // batch]
    chained_states, chained = fuse([LocalDrafterClient(DrafterWorker(d)) for d in real_drafters(stores)], contexts, 8)
    plain_clients = [PlainClient(d) for d in real_drafters(stores)]
    plain_states, plain = fuse(plain_clients, contexts, 8)
    for rid, state in plain_states.items():
        other = chained_states[rid]
        assert other.paths() == state.paths() and other.answers == state.answers, rid
    assert plain.calls == sum(c.calls for c in plain_clients)
    assert chained.rounds == plain.rounds == plain.calling_rounds >= 4
    assert sum(len(s.trunk) for s in plain_states.values()) >= 3 * len(contexts), "premise: fusion had work to do"
    assert chained.calls < plain.calls and chained.calling_rounds <= plain.calling_rounds, (chained, plain)
    print(f"\n[chains] {len(contexts)} requests, 5 drafters, depth 8: {plain.rounds} rounds; drafter calls "
          f"{plain.calls} in {plain.calling_rounds} rounds one position at a time -> {chained.calls} in "
          f"{chained.calling_rounds} with chains")



def test_fusion_costs_a_model_drafter_at_most_two_forwards_a_round(tiny_draft_checkpoint):
    """A model drafter answers one level a call (each level is a forward): fusion that follows
    another drafter every round costs it the root's forward and two a round after, not a chain
    to the tree's depth at every call (8 + 7 + ... + 1 = 36 at depth 8)."""
    model = ModelDrafter(LlamaStage(tiny_draft_checkpoint.config, tiny_draft_checkpoint.load_state_dict()),
                         name="draft")
    forwards = []
    inner = model.runner.forward
    model.runner.forward = lambda batch, cache: forwards.append(1) or inner(batch, cache)
    depth = 8
    state = fuse_behind_leader(model, 3, (5, 17, 42, 9, 77, 130), depth)
    assert state.trunk_owners == ["leader"] * depth and all(t != 3 for t, _ in state.answers["draft"]), state.answers
    assert len(forwards) <= 1 + 2 * (depth - 1), len(forwards)
