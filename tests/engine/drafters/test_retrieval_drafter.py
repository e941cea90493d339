"""RetrievalDrafter: continue the context from a domain datastore."""

from __future__ import annotations

import random

import pytest

from support.drafter_protocol import assert_speaks_drafter_protocol  # noqa: E402
from cosine_ray.engine.drafters.base import DraftFeedback, DraftInput
from cosine_ray.engine.drafters.lookup.datastore import Datastore
from cosine_ray.engine.drafters.lookup.retrieval import RetrievalConfig, RetrievalDrafter

# "def f ( x ) : return x" style token streams.
SEQS = [
    [10, 11, 12, 13, 14, 15, 16, 13, 17],
    [20, 11, 12, 13, 14, 15, 18, 19],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39],
]

VOCAB_LIMIT = 1000


def make_drafter(seqs=SEQS, **config) -> RetrievalDrafter:
    store = Datastore.from_sequences(seqs, domain="code", model_name="m")
    return RetrievalDrafter(store, RetrievalConfig(**config))


def propose_one(drafter, context, budget, request_id="r0"):
    (proposal,) = drafter.propose([DraftInput(request_id, tuple(context), budget)])
    assert proposal.request_id == request_id
    return proposal


def check_invariants(proposal, budget):
    assert proposal.num_draft_tokens <= max(budget, 0)
    assert all(len(p) == len(c) and p for p, c in zip(proposal.paths, proposal.confidences))
    first_tokens = [p[0] for p in proposal.paths]
    assert len(set(first_tokens)) == len(first_tokens)
    assert all(0.0 <= c <= 1.0 for confs in proposal.confidences for c in confs)


def test_speaks_the_drafter_protocol_named_by_domain():
    drafter = make_drafter()
    contexts = [list(seq[: max(len(seq) // 2, 2)]) for seq in SEQS] + [[999]]
    assert assert_speaks_drafter_protocol(drafter, contexts, vocab_size=VOCAB_LIMIT) > 0
    assert drafter.name == "retrieval:code"
    store = Datastore.from_sequences(SEQS, domain="math", model_name="m")
    assert RetrievalDrafter(store, name="r").name == "r"


def test_proposes_the_stored_continuation():
    drafter = make_drafter()
    proposal = propose_one(drafter, [1, 2, 32, 33, 34], 4)
    assert proposal.paths == [[35, 36, 37, 38]]
    assert proposal.confidences == [[1.0] * 4]
    assert proposal.drafter == "retrieval:code"


def test_path_stops_at_the_end_of_the_stored_sequence():
    proposal = propose_one(make_drafter(), [5, 36, 37], 16)
    assert proposal.paths == [[38, 39]]


def test_branches_at_the_first_level_and_rematches_the_extended_suffix():
    drafter = make_drafter(max_branches=2)
    # (12, 13, 14, 15) → {16: 1, 18: 1}: two branches at 0.5, each followed through.
    proposal = propose_one(drafter, [99, 12, 13, 14, 15], 16)
    assert sorted(proposal.paths) == [[16, 13, 17], [18, 19]]
    assert all(confs[0] == pytest.approx(0.5) for confs in proposal.confidences)
    # After 16, the matched suffix (14, 15, 16) is unique in the datastore: confidence 1.
    path16 = proposal.paths.index([16, 13, 17])
    assert proposal.confidences[path16][1:] == [1.0, 1.0]
    check_invariants(proposal, 16)
    assert propose_one(make_drafter(max_branches=1), [99, 12, 13, 14, 15], 16).num_draft_tokens == 3


def test_longest_match_wins_over_shorter_ones():
    # (13, 14) alone is followed by 15 twice; (16, 13) only in sequence 0, followed by 17.
    proposal = propose_one(make_drafter(), [16, 13], 1)
    assert proposal.paths == [[17]]
    proposal = propose_one(make_drafter(), [0, 13, 14], 1)
    assert proposal.paths == [[15]] and proposal.confidences == [[1.0]]


def test_min_confidence_prunes_uncertain_tokens():
    seqs = [[1, 2, 3, 7], [1, 2, 4, 7], [1, 2, 5, 7]]
    assert propose_one(make_drafter(seqs, min_confidence=0.2), [9, 1, 2], 8).num_draft_tokens > 0
    assert propose_one(make_drafter(seqs, min_confidence=0.4), [9, 1, 2], 8).paths == []
    # Confident tokens followed by an uncertain one: (6, 1) → 2 always, (6, 1, 2) → 3/4/5.
    seqs = [[6, 1, 2, 3], [6, 1, 2, 4], [6, 1, 2, 5], [0, 6, 1]]
    proposal = propose_one(make_drafter(seqs, min_confidence=0.4), [0, 6], 8)
    assert proposal.paths == [[1, 2]]
    assert proposal.confidences == [[1.0, 1.0]]


def test_min_match_rejects_unigram_matches():
    context = [50, 51, 13]  # only the last token (13) occurs in the datastore
    assert propose_one(make_drafter(min_match=2), context, 4).paths == []
    assert propose_one(make_drafter(min_match=1, min_confidence=0.0), context, 4).num_draft_tokens > 0
    assert propose_one(make_drafter(), [13], 4).paths == []  # context shorter than min_match


@pytest.mark.parametrize("budget", [0, 1, 2, 3, 7])
def test_budget_respected(budget):
    proposal = propose_one(make_drafter(max_branches=2), [99, 12, 13, 14, 15], budget)
    check_invariants(proposal, budget)
    if budget == 0:
        assert proposal.paths == [] and proposal.confidences == []


def test_stateless_and_batched(tmp_path):
    store = Datastore.load(Datastore.from_sequences(SEQS, domain="code", model_name="m").save(tmp_path / "c.parquet"))
    drafter = RetrievalDrafter(store)
    inputs = [DraftInput("a", (32, 33), 2), DraftInput("b", (1, 2, 3), 2), DraftInput("c", (11, 12), 0)]
    proposals = drafter.propose(inputs)
    assert [p.request_id for p in proposals] == ["a", "b", "c"]
    assert proposals[0].paths == [[34, 35]]
    assert proposals[1].paths == [] and proposals[2].paths == []
    drafter.observe([DraftFeedback("a", 2, 2)])
    drafter.release("a")
    drafter.release("never-seen")
    assert drafter.propose(inputs[:1])[0].paths == [[34, 35]]


def test_random_contexts_keep_invariants():
    rng = random.Random(0)
    seqs = [[rng.randrange(10) for _ in range(rng.randint(1, 60))] for _ in range(8)]
    drafter = make_drafter(seqs, max_branches=3, min_confidence=0.0, count_smoothing=0.5)
    for _ in range(100):
        budget = rng.randint(0, 10)
        proposal = propose_one(drafter, [rng.randrange(10) for _ in range(rng.randint(0, 30))], budget)
        check_invariants(proposal, budget)


def test_index_is_extended_when_config_asks_for_longer_matches():
    store = Datastore.from_sequences(SEQS, domain="code", model_name="m", index_max_n=2)
    drafter = RetrievalDrafter(store, RetrievalConfig(max_n=5))
    assert store.continuation_index().max_n >= 5
    assert propose_one(drafter, [12, 13, 14, 15, 16], 1).paths == [[13]]


@pytest.mark.parametrize("kwargs", [
    {"min_match": 0}, {"min_match": 5, "max_n": 4}, {"max_n": 17}, {"max_branches": 0},
    {"min_confidence": -0.1}, {"min_confidence": 1.1}, {"count_smoothing": -0.5},
])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        RetrievalConfig(**kwargs)
