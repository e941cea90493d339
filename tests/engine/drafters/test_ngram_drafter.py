"""NgramDrafter: prompt lookup over the request's own context."""

from __future__ import annotations

import random

import pytest

from support.drafter_protocol import assert_speaks_drafter_protocol  # noqa: E402
from cosine_ray.engine.drafters.base import DraftFeedback, DraftInput
from cosine_ray.engine.drafters.lookup.ngram import NgramConfig, NgramDrafter, grow_paths


def propose_one(drafter: NgramDrafter, context, budget: int, request_id: str = "r0"):
    (proposal,) = drafter.propose([DraftInput(request_id, tuple(context), budget)])
    assert proposal.request_id == request_id
    return proposal


def check_invariants(proposal, budget: int) -> None:
    assert proposal.num_draft_tokens <= max(budget, 0)
    assert len(proposal.paths) == len(proposal.confidences)
    assert all(len(p) == len(c) and p for p, c in zip(proposal.paths, proposal.confidences))
    first_tokens = [p[0] for p in proposal.paths]
    assert len(set(first_tokens)) == len(first_tokens)
    assert all(0.0 <= c <= 1.0 for confs in proposal.confidences for c in confs)


def test_speaks_the_drafter_protocol_with_its_name():
    drafter = NgramDrafter()
    contexts = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 2, 3, 1, 2, 4, 1, 2], [9]]
    assert assert_speaks_drafter_protocol(drafter, contexts, vocab_size=16) > 0
    assert drafter.num_tracked_requests == 0  # released
    assert drafter.name == "ngram"
    assert NgramDrafter(name="ngram:ctx").name == "ngram:ctx"


def test_single_repeat_copies_the_following_span():
    # (5, 6, 7) occurred at the start, followed by 8 9; re-lookup keeps matching it.
    context = [5, 6, 7, 8, 9, 5, 6, 7]
    proposal = propose_one(NgramDrafter(), context, 3)
    assert proposal.paths == [[8, 9, 5]]
    assert proposal.confidences == [[1.0, 1.0, 1.0]]
    assert proposal.drafter == "ngram"


def test_counts_give_confidences_and_branches():
    # Suffix (5, 1, 2) never occurred; (1, 2) occurred three times: → 3, 4, 3.
    context = [7, 1, 2, 3, 8, 1, 2, 4, 9, 1, 2, 3, 5, 1, 2]
    proposal = propose_one(NgramDrafter(NgramConfig(max_branches=2)), context, 2)
    # Budget 2: "3" (2/3), then (1, 2, 3) → {8: 1, 5: 1} gives 5 (cumulative 1/3), which ties
    # with branch "4" (1/3); ties keep the earlier branch.
    assert proposal.paths == [[3, 5]]
    assert proposal.confidences[0] == pytest.approx([2 / 3, 0.5])

    wide = propose_one(NgramDrafter(NgramConfig(max_branches=2)), context, 8)
    assert [p[0] for p in wide.paths] == [3, 4]
    assert wide.confidences[0][:2] == pytest.approx([2 / 3, 0.5])
    assert wide.paths[0][1] == 5  # most recent of the tied continuations of (1, 2, 3)
    assert wide.confidences[1][0] == pytest.approx(1 / 3)
    check_invariants(wide, 8)


def test_budget_goes_to_the_most_likely_nodes():
    # (1, 2) → {3: 3, 4: 1}; after 3 the context continues deterministically with 0.
    context = [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 4, 6, 1, 2, 3, 0, 1, 2]
    drafter = NgramDrafter(NgramConfig(max_n=2))
    small = propose_one(drafter, context, 2)
    assert small.paths == [[3, 0]]  # cumulative 0.75, 0.75 beat branch 4 at 0.25
    assert small.confidences[0] == pytest.approx([0.75, 1.0])
    # Along branch 3 every visit of (1, 2) multiplies by 0.75: depth 16 is the first node
    # below branch 4's 0.25 (0.75 ** 5), so budget 16 stays on branch 3 and 17 opens branch 4.
    assert [len(p) for p in propose_one(drafter, context, 16).paths] == [16]
    large = propose_one(drafter, context, 17)
    assert [p[0] for p in large.paths] == [3, 4]
    assert [len(p) for p in large.paths] == [16, 1]
    assert large.confidences[1] == pytest.approx([0.25])
    check_invariants(large, 17)


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 5, 8, 16])
def test_budget_respected(budget):
    context = [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2, 5, 1, 2] * 3
    proposal = propose_one(NgramDrafter(NgramConfig(max_branches=3)), context, budget)
    check_invariants(proposal, budget)
    if budget == 0:
        assert proposal.paths == [] and proposal.confidences == []


def test_no_match_and_tiny_contexts_give_empty_proposals():
    drafter = NgramDrafter()
    assert propose_one(drafter, [1, 2, 3, 4, 5], 8).paths == []
    assert propose_one(drafter, [7], 8, "r1").paths == []
    assert propose_one(drafter, [], 8, "r2").paths == []


def test_min_n_two_ignores_single_token_matches():
    context = [4, 9, 1, 4]  # only the unigram (4) repeats
    assert propose_one(NgramDrafter(NgramConfig(min_n=1)), context, 4).paths[0][0] == 9
    assert propose_one(NgramDrafter(NgramConfig(min_n=2)), context, 4).paths == []


def test_min_confidence_stops_paths():
    context = [1, 2, 3, 1, 2, 4, 1, 2]  # (1, 2) → {3: 1, 4: 1}
    drafter = NgramDrafter(NgramConfig(max_n=2, min_confidence=0.6))
    assert propose_one(drafter, context, 8).paths == []


def test_count_smoothing_discounts_rare_continuations():
    context = [5, 6, 7, 8, 5, 6, 7]
    proposal = propose_one(NgramDrafter(NgramConfig(count_smoothing=1.0)), context, 1)
    assert proposal.paths == [[8]]
    assert proposal.confidences == [[pytest.approx(0.5)]]


def test_batch_keeps_order_and_request_ids():
    drafter = NgramDrafter()
    inputs = [DraftInput("a", (1, 2, 1), 2), DraftInput("b", (3, 4, 5), 2), DraftInput.make_dummy("c", 4)]
    proposals = drafter.propose(inputs)
    assert [p.request_id for p in proposals] == ["a", "b", "c"]
    assert proposals[0].paths == [[2, 1]]
    assert proposals[1].paths == []
    assert proposals[2].paths == [[3, 1, 2, 3]]  # dummy (1, 2, 3, 1, 2), budget 4


def test_incremental_updates_match_a_fresh_drafter():
    rng = random.Random(0)
    tokens = [rng.randrange(6) for _ in range(300)]
    incremental = NgramDrafter(NgramConfig(max_n=4, max_branches=3))
    length = 5
    while length <= len(tokens):
        ctx = tokens[:length]
        got = propose_one(incremental, ctx, 6)
        want = propose_one(NgramDrafter(NgramConfig(max_n=4, max_branches=3)), ctx, 6)
        assert got.paths == want.paths
        assert got.confidences == want.confidences
        check_invariants(got, 6)
        length += rng.randint(1, 5)


def test_non_extension_context_rebuilds():
    drafter = NgramDrafter()
    propose_one(drafter, [1, 2, 3, 1, 2, 3, 1, 2], 4)
    # Same request id, unrelated context (not an extension): must behave like a fresh drafter.
    other = [9, 8, 7, 9, 8]
    assert propose_one(drafter, other, 4).paths == propose_one(NgramDrafter(), other, 4).paths
    # Shorter context (rollback) and a diverging prefix of the same length.
    shorter = [9, 8, 7]
    assert propose_one(drafter, shorter, 4).paths == []
    diverged = [9, 8, 6, 9, 8]
    assert propose_one(drafter, diverged, 4).paths == [[6, 9, 8, 6]]


def test_release_frees_state_and_observe_is_harmless():
    drafter = NgramDrafter()
    propose_one(drafter, [1, 2, 1], 2, "a")
    propose_one(drafter, [1, 2, 1], 2, "b")
    assert drafter.num_tracked_requests == 2
    drafter.observe([DraftFeedback("a", 2, 1)])
    drafter.release("a")
    assert drafter.num_tracked_requests == 1
    drafter.release("a")  # idempotent
    drafter.release("never-seen")
    drafter.release("b")
    assert drafter.num_tracked_requests == 0


def test_tracked_requests_are_capped_lru():
    drafter = NgramDrafter(NgramConfig(max_tracked_requests=2))
    for rid in ("a", "b", "a", "c"):
        propose_one(drafter, [1, 2, 1], 2, rid)
    assert drafter.num_tracked_requests == 2
    assert set(drafter._indexes) == {"a", "c"}  # "b" was least recently used


def test_random_contexts_keep_invariants():
    rng = random.Random(1)
    drafter = NgramDrafter(NgramConfig(max_n=4, max_branches=3, count_smoothing=0.5))
    for trial in range(50):
        ctx = [rng.randrange(8) for _ in range(rng.randint(0, 200))]
        budget = rng.randint(0, 12)
        proposal = propose_one(drafter, ctx, budget, f"r{trial % 5}")
        check_invariants(proposal, budget)


def test_grow_paths_restores_tail_and_trims_best_first():
    table = {(0,): [(1, 0.6), (2, 0.4)], (1,): [(3, 0.5)], (3,): [(4, 1.0)], (2,): [(5, 0.9)]}

    def lookup(tail, k):
        return table.get((tail[-1],), [])[:k]

    tail = [0]
    paths, confs = grow_paths(lookup, tail, 3, max_branches=2, min_confidence=0.0)
    assert tail == [0]
    # cumulative: 1 → .6, 3 → .3, 4 → .3 ; 2 → .4, 5 → .36: best three are 1, 2, 5.
    assert paths == [[1], [2, 5]]
    assert confs == [[0.6], [0.4, 0.9]]
    assert grow_paths(lookup, tail, 0, max_branches=2, min_confidence=0.0) == ([], [])


@pytest.mark.parametrize("kwargs", [
    {"min_n": 0}, {"min_n": 3, "max_n": 2}, {"max_n": 17}, {"max_branches": 0},
    {"min_confidence": -0.1}, {"min_confidence": 1.5}, {"count_smoothing": -1.0},
    {"max_tracked_requests": 0},
])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        NgramConfig(**kwargs)


def test_protocol_check_catches_a_malformed_drafter():
    """The conformance check can fail: a confidence above 1 is something fusion would drop."""
    class Overconfident(NgramDrafter):
        def continue_drafts(self, queries):
            return [[[(tok, conf * 1.5) for tok, conf in cands] for cands in per_prefix]
                    for per_prefix in super().continue_drafts(queries)]

    with pytest.raises(AssertionError):
        assert_speaks_drafter_protocol(Overconfident(), [[5, 6, 7, 8, 9, 5, 6, 7]], vocab_size=16)
