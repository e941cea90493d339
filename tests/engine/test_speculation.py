"""merge_proposals: union of drafters' paths, TreeSelection by cumulative confidence."""

from cosine_ray.engine.drafters.base import DraftProposal
from cosine_ray.engine.speculation import merge_proposals


def _props():
    return [DraftProposal("r", [[1, 2, 3], [4]], [[0.9, 0.8, 0.5], [0.3]], "a"),
            DraftProposal("r", [[1, 5]], [[0.6, 0.9]], "b")]


def test_union_keeps_every_path_and_first_owner():
    tree, owners = merge_proposals(0, _props(), budget=10)
    assert tree.num_draft_tokens == 5  # 1,2,3 / 4 / 5 under 1
    by_token = {tree.token_ids[i]: owners[i] for i in range(1, tree.num_nodes)}
    assert by_token == {1: "a", 2: "a", 3: "a", 4: "a", 5: "b"}
    assert tree.confidences[tree.token_ids.index(1)] == 0.9  # merged node keeps the highest


def test_budget_keeps_highest_cumulative_confidence_with_ancestors():
    tree, _ = merge_proposals(0, _props(), budget=3)
    # cumulative: 1:.9  2:.72  5:.81  3:.36  4:.3  -> keep 1, 5, 2
    assert sorted(tree.token_ids[1:]) == [1, 2, 5]
    for node in range(1, tree.num_nodes):
        assert tree.parent_ids[node] < node


def test_threshold_drops_unlikely_nodes():
    tree, _ = merge_proposals(0, _props(), budget=10, min_confidence=0.5)
    assert sorted(tree.token_ids[1:]) == [1, 2, 5]
    tree, _ = merge_proposals(0, _props(), budget=10, min_confidence=0.95)
    assert tree.num_draft_tokens == 0
