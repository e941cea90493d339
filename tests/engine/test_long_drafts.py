"""Long drafts where matches are long: the n-gram drafter's copies follow their match length,
a request's draft budget follows how deep its drafters reached (up to
``speculation.long_draft_tokens``), the price decides how much of it to verify, and a tree
longer than the step runner's largest bucket runs eagerly with the same text."""

from __future__ import annotations

import random

import pytest
import torch
from support.drafter_protocol import assert_speaks_drafter_protocol

from cosine_ray.engine.build import NGRAM_COPY_MIN_LEN, build_drafter, build_suffix_drafter
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.drafters.base import ContinueQuery, DraftInput, continue_chains
from cosine_ray.engine.drafters.lookup.ngram import NgramConfig, NgramDrafter
from cosine_ray.engine.drafters.spec import DrafterSpec
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.runner import GRAPH_NEW_TOKENS

SPAN = tuple(range(10, 50))  # 40 distinct tokens


def copying(**kw) -> NgramDrafter:
    return NgramDrafter(NgramConfig(count_smoothing=1.0, copy_min_len=4, **kw))


def chain_tokens(chain):
    return [level[0][0] for level in chain if level]


def test_a_copy_is_as_long_as_its_match_justifies():
    d = copying(max_spec_factor=2.0, max_spec_offset=0.0)
    for matched in (4, 6, 9):
        context = (1, 2) + SPAN + (3, 4) + SPAN[:matched]
        (chain,), = d.continue_chains([ContinueQuery(f"r{matched}", context, ((),), 1, depth=40)])
        copied = 2 * matched
        assert chain_tokens(chain)[:copied] == list(SPAN[matched:matched + copied])
        confs = [level[0][1] for level in chain[:copied]]
        assert confs == pytest.approx([(matched + i) / (matched + i + 1) for i in range(copied)])
        # past the copy the n-gram model goes on, at its own (smoothed count) confidence
        assert chain[copied][0][1] == pytest.approx(0.5)


def test_a_short_match_drafts_as_the_n_gram_model_does():
    context = (1, 2) + SPAN + (3, 4) + SPAN[:3]  # matched 3 < copy_min_len 4: no copy
    q = [ContinueQuery("r", context, ((),), 1, depth=8)]
    assert copying().continue_chains(q) == NgramDrafter(NgramConfig(count_smoothing=1.0)).continue_chains(q)


def test_the_longest_recent_match_is_copied():
    # SPAN[:6] occurs twice: once followed by 91..., later (the most recent) by 92...; the end
    # of the context matches the first occurrence 2 tokens longer
    context = (7, 8) + SPAN[:6] + (91, 91, 91) + (0,) + SPAN[:6] + (92, 92, 92) + (5, 7, 8) + SPAN[:6]
    (chain,), = copying().continue_chains([ContinueQuery("r", context, ((),), 1, depth=3)])
    assert chain_tokens(chain) == [91, 91, 91]


def test_copies_overlap_themselves_as_a_repeated_pattern_does():
    context = (5,) + (1, 2, 3, 4) * 3
    (chain,), = copying(max_spec_factor=1.0).continue_chains([ContinueQuery("r", context, ((),), 1, depth=12)])
    assert chain_tokens(chain)[:11] == [1, 2, 3, 4] * 2 + [1, 2, 3]


def test_copy_chains_are_what_it_answers_level_by_level():
    rng = random.Random(3)
    d = copying()
    compared = 0
    for i in range(40):
        base = [rng.randrange(30) for _ in range(rng.randrange(5, 40))]
        context = tuple(base + base[:rng.randrange(4, len(base))] + [rng.randrange(30) for _ in range(rng.randrange(3))])
        prefixes = ((), (context[-1],), tuple(rng.randrange(30) for _ in range(rng.randrange(1, 4))))
        for k, depth in ((1, 1), (1, 12), (2, 24)):
            q = [ContinueQuery(f"r{i}", context, prefixes, k, depth=depth)]
            own = d.continue_chains(q)
            assert own == continue_chains(d, q)
            compared += sum(len(chain) for chain in own[0])
    assert compared > 1000


def test_copying_speaks_the_drafter_protocol_and_proposes_the_copy():
    d = copying()
    contexts = [(1, 2) + SPAN + (3,) + SPAN[:5], (4, 5, 6, 7) * 4, (9,)]
    assert assert_speaks_drafter_protocol(d, contexts, vocab_size=100) > 0
    (proposal,) = d.propose([DraftInput("p", contexts[0], 6)])
    assert proposal.paths[0] == list(SPAN[5:11])


def test_the_engine_builds_copying_n_grams_and_long_suffix_drafts():
    config = EngineConfig().replace(long_draft_tokens=48)
    ngram = build_drafter(DrafterSpec("ngram"), target=None, config=config)
    assert ngram.config.copy_min_len == NGRAM_COPY_MIN_LEN
    # a suffix expert of a model without datastores: an empty index, drafting up to the cap
    assert build_suffix_drafter(DrafterSpec("suffix", "code"), "no-such-model",
                                max_spec_tokens=48).config.max_spec_tokens == 48


# ---- budgets ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (6, 19)]


def engine(ckpt, drafters="ngram", **settings) -> LocalEngine:
    return LocalEngine(EngineConfig(model=str(ckpt.path), drafters=parse_drafters(drafters)).replace(
        max_num_seqs=4, **settings), checkpoint=ckpt)


def spy_budgets(eng: LocalEngine) -> list[dict[str, int]]:
    seen, schedule = [], eng.core.scheduler.schedule

    def spy(lane):
        batch = schedule(lane)
        seen.append(dict(batch.budgets))
        return batch
    eng.core.scheduler.schedule = spy
    return seen


def test_a_budget_doubles_while_its_drafts_fill_it_and_stays_within_its_bounds(tiny_checkpoint, prompts):
    plain = [o.new_token_ids for o in engine(tiny_checkpoint, "none").generate(prompts, SamplingParams(max_tokens=96))]
    eng = engine(tiny_checkpoint, num_speculative_tokens=4, long_draft_tokens=24)
    budgets = spy_budgets(eng)
    outs = eng.generate(prompts, [SamplingParams(max_tokens=96, prediction=tuple(p)) for p in plain])
    assert [o.new_token_ids for o in outs] == plain
    given = [g for step in budgets for g in step.values() if g]
    assert max(given) == 24 and min(given) >= 1
    assert {4, 8, 16} <= set(given)  # 4 → 8 → 16 → 24 as the prediction's chains fill each budget
    assert eng.core.scheduler.max_budget == 24


@pytest.mark.parametrize("settings", [{"adaptive": False}, {"scheduler": "fcfs"}, {"long_draft_tokens": 2}])
def test_fixed_budgets_and_short_caps_stay_at_gamma_max(tiny_checkpoint, prompts, settings):
    eng = engine(tiny_checkpoint, num_speculative_tokens=4, **settings)
    budgets = spy_budgets(eng)
    eng.generate(prompts, SamplingParams(max_tokens=48, prediction=tuple(range(40))))
    assert eng.core.scheduler.max_budget == 4
    assert max(g for step in budgets for g in step.values()) == 4


def test_a_tree_past_the_largest_bucket_runs_eagerly_with_the_same_text(tiny_checkpoint, prompts):
    """On the fixed-shape runner (the CUDA graph path run eagerly on CPU), a step whose tree has
    more rows than ``GRAPH_NEW_TOKENS``' largest bucket runs eagerly; the text is unchanged."""
    plain = [o.new_token_ids for o in engine(tiny_checkpoint, "none").generate(prompts, SamplingParams(max_tokens=96))]
    eng = engine(tiny_checkpoint, runner="static", long_draft_tokens=64)
    budgets = spy_budgets(eng)
    outs = eng.generate(prompts, [SamplingParams(max_tokens=96, prediction=tuple(p)) for p in plain])
    assert [o.new_token_ids for o in outs] == plain
    assert max(g for step in budgets for g in step.values()) + 1 > GRAPH_NEW_TOKENS[-1]
    stats = eng.target.stages[0].runner.stats
    assert stats["static"] > 0 and stats["eager"] > 0
