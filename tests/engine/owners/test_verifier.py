"""``Verifier`` alone, over the KV-protocol-checking ``TableTarget``: prompt chunks and trees in
one target call, greedy acceptance (argmax) and keyed acceptance (the plain keyed sample), the
KV to keep, requests that sit out, a lost target, and the verifier's busy clock."""

from __future__ import annotations

import asyncio

import pytest

from cosine_ray.algo.sampling import logits_to_probs, sample_keyed
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.tree_selection import SelectedTree
from cosine_ray.engine.types import Drafts, DraftTree, DraftingStats, StepBatch
from cosine_ray.engine.worker.clients import TargetUnavailable

from support.factories import Clock, make_kv, make_request, make_verifier
from support.fakes import TableTarget


def drafts_of(trees: dict[str, TokenTree]) -> Drafts:
    return Drafts({rid: DraftTree(SelectedTree(t, ("",) + ("d",) * t.num_draft_tokens, (1.0,) * t.num_nodes))
                   for rid, t in trees.items()}, DraftingStats())


def scheduled(kv, requests, trees=None, chunks=None) -> StepBatch:
    """What the scheduler hands on: each request's KV blocks for the step, and its prompt chunk
    (by default the rest of its context) or its tree's budget."""
    trees, chunks = trees or {}, dict(chunks or {})
    budgets = {rid: t.num_draft_tokens for rid, t in trees.items()}
    for r in requests:
        rid = r.request_id
        if rid in trees:
            kv.ensure(r, r.num_tokens + budgets[rid])
        else:
            chunks.setdefault(rid, r.num_tokens - r.num_computed_tokens)
            kv.ensure(r, r.num_computed_tokens + chunks[rid])
    return StepBatch(list(requests), budgets=budgets, chunks=chunks, epochs={r.request_id: r.kv_epoch for r in requests})


def verify(verifier, kv, requests, trees=None, chunks=None):
    return asyncio.run(verifier.verify(scheduled(kv, requests, trees, chunks), drafts_of(trees or {})))


def committed(verifier, kv, requests, verified):
    """What the engine does with a verified step: commit the KV, append the tokens."""
    verifier.target.commit(verified.commits)
    by_id = {r.request_id: r for r in requests}
    for outcome in verified.outcomes:
        r = by_id[outcome.request_id]
        r.output_token_ids.extend(outcome.new_token_ids)
        kv.commit(r, r.num_computed_tokens + len(outcome.keep))
    return verified


def keyed_token(target: TableTarget, request, context) -> int:
    """What plain sampling with the request's seed draws after ``context`` (at its length's position)."""
    probs = logits_to_probs(target.logits(context)[None], temperature=request.params.temperature)
    return int(sample_keyed(probs, seed=request.seed, positions=[len(context)])[0])


def prefilled(verifier, kv, requests):
    """The first step of fresh requests: their whole prompts, committed."""
    return committed(verifier, kv, requests, verify(verifier, kv, requests))


def test_a_prefill_yields_the_targets_first_token_and_keeps_the_whole_prompt():
    verifier, kv = make_verifier(), make_kv()
    target = verifier.target.inner
    greedy = make_request("g", (3, 1, 4, 1, 5))
    sampled = make_request("s", (9, 2, 6), temperature=1.0, seed=11)
    verified = prefilled(verifier, kv, [greedy, sampled])
    g, s = verified.outcomes
    assert g.is_prefill and s.is_prefill and g.result is None
    assert g.new_token_ids == (target.next_token([3, 1, 4, 1, 5]),) and g.keep == (0, 1, 2, 3, 4)
    assert s.new_token_ids == (keyed_token(target, sampled, [9, 2, 6]),) and s.keep == (0, 1, 2)
    assert verified.context_lens == (0, 0) and verified.num_new_tokens == (5, 3)
    assert target.batch_sizes == [2]  # one target call for the batch


def test_a_prompt_in_chunks_yields_its_token_after_the_last_chunk_only():
    verifier, kv = make_verifier(), make_kv()
    target = verifier.target.inner
    r = make_request("long", list(range(1, 21)))
    firsts = []
    for chunk in (8, 8, 4):
        outcome, = committed(verifier, kv, [r], verify(verifier, kv, [r], chunks={"long": chunk})).outcomes
        firsts.append((outcome.new_token_ids, outcome.keep))
    assert firsts[:2] == [((), tuple(range(8)))] * 2 and firsts[2][1] == (0, 1, 2, 3)
    assert firsts[2][0] == (target.next_token(list(range(1, 21))),) and r.num_computed_tokens == 20
    assert target.committed["long"] == list(range(1, 21))


def test_greedy_acceptance_takes_the_longest_matching_path_plus_the_bonus():
    verifier, kv = make_verifier(), make_kv()
    target = verifier.target.inner
    r = make_request("g", (3, 1, 4))
    prefilled(verifier, kv, [r])
    greedy = target.greedy(r.context_token_ids, 3)
    wrong = (greedy[2] + 1) % target.vocab
    tree = TokenTree.from_paths(r.output_token_ids[-1], [[greedy[0], greedy[1], wrong], [wrong]])
    verified = verify(verifier, kv, [r], {"g": tree})
    outcome, = verified.outcomes
    assert outcome.new_token_ids == tuple(greedy) and outcome.result.accepted_token_ids == tuple(greedy[:2])
    assert outcome.keep == (0,) + outcome.result.accepted_node_ids and len(outcome.keep) == 3
    assert verified.context_lens == (r.num_tokens - 1,) and verified.num_new_tokens == (tree.num_nodes,)
    committed(verifier, kv, [r], verified)  # the TableTarget checks the kept path is a root path
    assert target.committed["g"] == [3, 1, 4] + r.output_token_ids[:-1]


@pytest.mark.parametrize("right", [2, 0])
def test_keyed_acceptance_commits_what_plain_keyed_sampling_draws(right):
    verifier, kv = make_verifier(), make_kv()
    target = verifier.target.inner
    r = make_request("s", (5, 3), temperature=1.0, seed=123)
    prefilled(verifier, kv, [r])
    plain = []
    for _ in range(3):
        plain.append(keyed_token(target, r, r.context_token_ids + plain))
    draft = plain[:right] + [(plain[right] + 1) % target.vocab]  # right for `right` tokens, then wrong
    outcome, = verify(verifier, kv, [r], {"s": TokenTree.chain(r.output_token_ids[-1], draft)}).outcomes
    assert outcome.new_token_ids == tuple(plain[:right + 1])
    assert len(outcome.result.accepted_node_ids) == right


def test_aborted_requests_and_dropped_kv_sit_out_a_resumed_request_prefills_its_context():
    alive = {"live", "dropped", "resumed"}
    verifier, kv = make_verifier(is_live=alive.__contains__), make_kv()
    target = verifier.target.inner
    live, aborted = make_request("live", (3, 1)), make_request("aborted", (4, 4))
    dropped = make_request("dropped", (2, 2))
    resumed = make_request("resumed", (7, 1), output=(5, 6))
    resumed.num_computed_tokens = 0  # preempted: its KV was freed, its text kept
    batch = scheduled(kv, [live, aborted, dropped, resumed])
    dropped.kv_epoch += 1  # preempted (or a stage lost its KV) after the step was scheduled
    verified = asyncio.run(verifier.verify(batch, drafts_of({})))
    assert [o.request_id for o in verified.outcomes] == ["live", "resumed"]
    assert target.scored == {"live": 1, "resumed": 1}
    out = verified.outcomes[1]
    assert out.is_prefill and out.keep == (0, 1, 2, 3) and out.new_token_ids == (target.next_token([7, 1, 5, 6]),)
    nobody = make_verifier(is_live=lambda rid: False)
    empty = verify(nobody, kv, [make_request("x")])
    assert empty.outcomes == [] and not empty.lost and nobody.target.inner.batch_sizes == []


class LosingTarget(TableTarget):
    """Its stages are lost on the first call and come back."""

    async def score(self, items):
        raise TargetUnavailable("stage 1 died")

    async def recover(self, recovery_s: float) -> bool:
        return True


def test_a_lost_target_verifies_nothing_and_reports_the_loss():
    losses = []
    verifier = make_verifier(LosingTarget(), on_lost=lambda recovered, reason: losses.append((recovered, reason)))
    verified = verify(verifier, make_kv(), [make_request("r0")])
    assert verified.lost and verified.outcomes == [] and verified.commits == []
    assert losses == [(True, "stage 1 died")] and verifier.target.epoch == 1


class SlowTarget(TableTarget):
    """Each score call takes ``seconds`` on the test's clock."""

    def __init__(self, clock: Clock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds

    async def score(self, items):
        self.clock.now += self.seconds
        return await super().score(items)


def test_the_verify_time_and_the_verifiers_idle_share_come_from_the_clock():
    clock = Clock(100.0)
    verifier = make_verifier(SlowTarget(clock, 2.0), clock=clock)
    clock.now = 104.0  # idle for 4 s, then busy for 2
    verified = verify(verifier, make_kv(), [make_request("r0")])
    assert verified.verify_s == pytest.approx(2.0)
    assert verified.verifier_idle_fraction == pytest.approx(4.0 / 6.0)
