"""``Speculator`` alone: ``draft`` asks the routed drafters, ``select`` makes one tree per
decoding request — rooted at its last token, within its budget, cut by the selection policy
(fixed, confidence cut, the LP's price with its probe steps), trimmed to Γ_max, a twin's
text whole."""

from __future__ import annotations

import asyncio

import pytest

from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.tree_selection import TreePrice
from cosine_ray.engine.modes.twins import TWIN
from cosine_ray.engine.types import Drafted, DraftingStats, Route, StepBatch

from support.factories import make_request, make_speculator
from support.fakes import AdversarialDrafter, OracleDrafter, TableTarget


def path(tokens, confidences, owner="d") -> FusedPath:
    return FusedPath(tuple(tokens), tuple(confidences), (owner,) * len(tokens))


def decodes(n: int, output=(9, 7)):
    return [make_request(f"r{i}", output=output) for i in range(n)]


def select(speculator, batch, paths_by_request):
    drafted = {rid: Drafted(paths) for rid, paths in paths_by_request.items()}
    return speculator.select(batch, drafted, DraftingStats())


def test_each_tree_is_rooted_at_the_last_token_within_its_budget_and_root_only_without_paths():
    speculator = make_speculator()
    a, b, c = decodes(3)
    prefill = make_request("p")
    batch = StepBatch([a, b, c, prefill], budgets={"r0": 2, "r1": 4, "r2": 4})
    drafts = select(speculator, batch, {"r0": [path([1, 2, 3, 4], [0.9] * 4)],
                                        "r1": [path([1, 2], [0.9] * 2), path([5], [0.5])]})
    trees = drafts.trees
    assert set(trees) == {"r0", "r1", "r2"}  # a prefill has no tree
    assert all(t.tree.token_ids[0] == 7 for t in trees.values())
    assert trees["r0"].tree.token_ids == (7, 1, 2)  # the budget cuts the path
    assert sorted(trees["r1"].tree.token_ids[1:]) == [1, 2, 5] and trees["r1"].tree.parent_ids[3] == 0
    assert trees["r2"].tree.num_draft_tokens == 0 and trees["r2"].full_gains == (0.0,)
    assert trees["r0"].full_gains[0] == 0.0 and len(trees["r0"].full_gains) == 3
    assert drafts.stats.num_drafted_nodes == 5 and speculator.verified_nodes == 5


def test_algorithm_2_trims_the_batch_to_total_gamma_max():
    speculator = make_speculator(total_gamma_max=7)
    requests = decodes(3)
    batch = StepBatch(requests, budgets={r.request_id: 4 for r in requests})
    drafts = select(speculator, batch, {r.request_id: [path([1, 2, 3, 4], [0.9] * 4)] for r in requests})
    assert [drafts.trees[r.request_id].tree.num_draft_tokens for r in requests] == [3, 2, 2]
    assert drafts.stats.num_drafted_nodes == 12
    assert speculator.drafted_nodes == 12 and speculator.verified_nodes == 7


@pytest.mark.parametrize("selection, kept", [("fixed", 3), ("cut", 2)])
def test_the_confidence_cut_drops_nodes_below_the_floor_fixed_selection_keeps_them(selection, kept):
    speculator = make_speculator(selection=selection, cut=0.25)
    r, = decodes(1)
    batch = StepBatch([r], budgets={"r0": 8})
    drafts = select(speculator, batch, {"r0": [path([1, 2, 3], [0.9, 0.5, 0.4])]})  # cumulative .9 .45 .18
    assert drafts.trees["r0"].tree.num_draft_tokens == kept


def priced_batch(lam: float, num_steps: int) -> tuple[StepBatch, dict]:
    r, = decodes(1)
    price = TreePrice(lam, batch_size=1, c_tok=0.01, c_attn=0.0, base_tokens=1)
    batch = StepBatch([r], budgets={"r0": 4}, price=price, num_steps={"r0": num_steps})
    return batch, {"r0": [path([1, 2, 3, 4], [0.9] * 4)]}


@pytest.mark.parametrize("lam, num_steps, gamma", [(1.0, 1, 4), (0.0, 1, 0), (0.0, 8, 1), (0.0, 16, 1)])
def test_the_price_chooses_gamma_and_a_probe_step_verifies_one_node(lam, num_steps, gamma):
    speculator = make_speculator(selection="priced")
    batch, paths = priced_batch(lam, num_steps)
    assert select(speculator, batch, paths).trees["r0"].tree.num_draft_tokens == gamma


def test_a_twins_text_is_verified_whole_whatever_the_price():
    speculator = make_speculator(selection="priced")
    batch, _ = priced_batch(0.0, 1)
    batch.budgets["r0"] = 3
    batch.twins = {"r0": (6, 5, 4)}
    tree = select(speculator, batch, {}).trees["r0"]
    assert tree.tree.token_ids == (7, 6, 5, 4) and tree.tree.parent_ids == (-1, 0, 1, 2)
    assert tree.selected.owners[1:] == (TWIN,) * 3


class RecordingOracle(OracleDrafter):
    """The oracle, remembering which requests it was asked about."""

    def __init__(self, name, target) -> None:
        super().__init__(name, target)
        self.asked: set[str] = set()

    async def propose(self, inputs):
        self.asked.update(i.request_id for i in inputs)
        return await super().propose(inputs)


def has_root_path(tree, tokens) -> bool:
    node = 0
    for tok in tokens:
        node = next((i for i in range(1, tree.num_nodes) if tree.parent_ids[i] == node and tree.token_ids[i] == tok), -1)
        if node < 0:
            return False
    return True


@pytest.mark.parametrize("fusion", ["confidence", "union"])
def test_draft_asks_the_routed_drafters_of_routed_requests_only(fusion):
    target = TableTarget()
    oracle, wrong = RecordingOracle("oracle", target), AdversarialDrafter("wrong", target, confidence=0.5)
    routed, unrouted = make_request("routed", (3, 1, 4), output=(1,)), make_request("unrouted", (9, 2), output=(6,))
    batch = StepBatch([routed, unrouted], budgets={"routed": 4, "unrouted": 4})
    route = Route(("oracle", "wrong"), "exploit")
    speculator = make_speculator([oracle, wrong], fusion=fusion)
    drafts = asyncio.run(speculator.draft(batch, {"routed": route}))
    tree = drafts.trees["routed"]
    assert oracle.asked == {"routed"} and wrong.num_calls >= 1
    assert tree.route is route and set(tree.answers) == {"oracle", "wrong"}
    assert drafts.trees["unrouted"].tree.num_draft_tokens == 0 and drafts.trees["unrouted"].route is None
    # the oracle's path (the target's greedy continuation) beats the wrong drafter's, γ = 4 nodes
    assert tree.tree.num_draft_tokens == 4
    assert has_root_path(tree.tree, target.greedy(routed.context_token_ids, 4))
    assert set(tree.selected.owners[1:]) == {"oracle"}
