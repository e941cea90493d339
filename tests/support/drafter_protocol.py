"""Protocol conformance of a drafter, judged by the engine's own validators: what
``gather_proposals`` and ``fuse_drafts`` would drop is a failure here. Shared by the drafter
test modules (a runtime ``isinstance`` against the Protocol only checks that the methods exist)."""

from __future__ import annotations

from typing import Sequence

from cosine_ray.engine.drafters.base import ContinueQuery, DraftFeedback, DraftInput
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.owners.drafting import is_valid_candidates, is_valid_chains, is_valid_proposal


def assert_speaks_drafter_protocol(drafter, contexts: Sequence[Sequence[int]], vocab_size: int) -> int:
    """Every answer of ``drafter`` on ``contexts`` is well formed; returns how many draft tokens
    it proposed (a caller asserts the drafter had something to say)."""
    inputs = [DraftInput(f"p{i}", tuple(c), budget) for i, c in enumerate(contexts) for budget in (0, 1, 6)]
    proposals = drafter.propose(inputs)
    assert isinstance(proposals, list) and len(proposals) == len(inputs)
    for item, proposal in zip(inputs, proposals):
        assert is_valid_proposal(proposal, item, vocab_size), (item, proposal)
        if item.max_draft_tokens == 0:
            assert proposal.num_draft_tokens == 0
    drafted = sum(p.num_draft_tokens for p in proposals)
    queries = [ContinueQuery(f"c{i}", tuple(c), ((), (int(c[-1]),)), k=2, depth=4) for i, c in enumerate(contexts)]
    answers = drafter.continue_drafts(queries)
    assert isinstance(answers, list) and len(answers) == len(queries)
    for q, per_prefix in zip(queries, answers):
        assert isinstance(per_prefix, list) and len(per_prefix) == len(q.prefixes)
        assert all(is_valid_candidates(cands, q.k, vocab_size) for cands in per_prefix), per_prefix
    chains = DrafterWorker(drafter).continue_chains(queries)
    assert len(chains) == len(queries)
    assert all(is_valid_chains(c, q, vocab_size) for c, q in zip(chains, queries)), chains
    drafter.observe([DraftFeedback(item.request_id, 1, 0) for item in inputs])
    for rid in {i.request_id for i in inputs} | {q.request_id for q in queries}:
        drafter.release(rid)
    return drafted
