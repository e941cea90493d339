"""TreeSelection: union of drafters' paths, best nodes by cumulative confidence, and the LP's
price deciding γ on a drafted tree."""

import itertools
import random

import pytest

from cosine_ray.algo.adaptive import expected_gains
from cosine_ray.algo.tree_selection import TreePrice, build_tree
from cosine_ray.engine.drafters.base import DraftProposal
from cosine_ray.engine.owners.drafting import proposals_to_paths


def merge_proposals(root_token_id, proposals, budget, *, min_confidence=0.0):
    selected = build_tree(root_token_id, proposals_to_paths(proposals), budget, min_confidence=min_confidence)
    return selected.tree, list(selected.owners)


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


def test_union_is_the_merged_tree_with_the_first_owner_of_each_node():
    """build_tree merges in one pass: the same tree as ``TokenTree.from_paths`` (shared
    prefixes merged, highest confidence kept), each node owned by the first path reaching it."""
    import random

    from cosine_ray.algo.fusion import FusedPath
    from cosine_ray.algo.tree import TokenTree
    rng = random.Random(11)
    for _ in range(300):
        paths = []
        for _ in range(rng.randint(0, 4)):
            n = rng.randint(0, 5)
            paths.append(FusedPath(tuple(rng.randrange(3) for _ in range(n)),
                                   tuple(rng.choice([0.5, 1.0, rng.random()]) for _ in range(n)),
                                   tuple(rng.choice("ab") for _ in range(n)),
                                   tuple(rng.random() for _ in range(n)) if rng.random() < 0.5 else (),
                                   tuple(rng.random() < 0.5 for _ in range(n)) if rng.random() < 0.5 else ()))
        got = build_tree(9, paths, budget=100)
        assert got.tree == TokenTree.from_paths(9, [p.token_ids for p in paths], [p.confidences for p in paths])
        first: dict[tuple[int, ...], tuple[str, float, bool]] = {}
        for p in paths:
            raws = p.raw_confidences or p.confidences
            for d in range(len(p.token_ids)):
                first.setdefault(p.token_ids[:d + 1], (p.owners[d], raws[d], p.trunk_flags[d] if p.trunk_flags else True))
        for node in range(1, got.tree.num_nodes):
            prefix = tuple(got.tree.token_ids[k] for k in got.tree.path_to(node)[1:])
            assert (got.owners[node], got.raw_confidences[node], got.is_trunk(node)) == first[prefix]


@pytest.mark.parametrize("cut", [0.0, 0.3])
def test_cutting_a_selected_tree_equals_selecting_with_the_smaller_budget(cut):
    """TreeSelection cuts the drafted tree to γ_i with ``top`` instead of rebuilding it from
    the paths: every field must be what a build with budget γ_i gives."""
    import random
    rng = random.Random(7)
    for _ in range(200):
        props = [DraftProposal("r", [[rng.randrange(6) for _ in range(rng.randint(1, 4))]
                                     for _ in range(rng.randint(1, 3))], [], name)
                 for name in ("a", "b")]
        props = [DraftProposal("r", p.paths, [[rng.choice([0.2, 0.5, 0.9, rng.random()]) for _ in path]
                                             for path in p.paths], p.drafter) for p in props]
        paths = proposals_to_paths(props)
        big = rng.randint(0, 10)
        full = build_tree(0, paths, big, min_confidence=cut)
        for small in range(big + 2):
            assert full.top(small) == build_tree(0, paths, min(small, big), min_confidence=cut)


# ---- the LP's price: γ on the drafted tree ------------------------------------------------------

def brute_force_gamma(price, context_len, acceptance, gamma_max):
    """argmin over g of the full per-request objective of eq. 8 (constants included)."""
    gains = expected_gains(acceptance, gamma_max)
    b = price.batch_size

    def share(g):
        n = 1 + g
        return price.c_tok * n + price.c_attn * n * (context_len + n)

    values = [share(g) / b - price.lam * gains[g] for g in range(len(gains))]
    return min(range(len(values)), key=lambda g: (values[g], g))


@pytest.mark.parametrize("lam", [0.0, 1e-4, 2e-3, 5e-2])
@pytest.mark.parametrize("batch_size", [1, 4, 8])
def test_price_picks_the_argmin_of_the_per_request_objective(lam, batch_size):
    acceptance = [0.95, 0.9, 0.6, 0.5, 0.2, 0.05, 0.01]
    price = TreePrice(lam, batch_size, c_tok=1e-3, c_attn=2e-6)
    for context_len in (10, 300):
        for gamma_max in (0, 3, 7):
            assert price.gamma(context_len, acceptance, gamma_max) == \
                brute_force_gamma(price, context_len, acceptance, gamma_max)


def test_price_verifies_more_when_verify_time_is_cheaper():
    acceptance = [0.9, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05]
    gammas = [TreePrice(2e-3, 1, c_tok=c, c_attn=0.0).gamma(100, acceptance, 8) for c in (1e-2, 1e-3, 1e-4)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1], gammas
    assert TreePrice(0.0, 1, 1e-3, 0.0).gamma(100, acceptance, 8) == 0  # tokens worth nothing: no drafts
    assert TreePrice(10.0, 1, 1e-3, 0.0).gamma(100, acceptance, 8) == 8  # worth far more than a token: all


def batch_objective(price, requests, gammas):
    """Eq. 8's γ-dependent terms for one batch: attention and token terms per step share,
    less the price of the expected accepted tokens."""
    b = max(price.batch_size, 1)
    attn = sum((1 + g) * (ctx + 1 + g) for (ctx, _), g in zip(requests, gammas))
    tokens = price.token_seconds(price.base_tokens + sum(gammas))
    return (price.c_attn * attn + tokens) / b - price.lam * sum(gains[g] for (_, gains), g in zip(requests, gammas))


@pytest.mark.parametrize("knee, base", [(0, 3), (4, 3), (6, 3), (16, 12), (16, 20)])
@pytest.mark.parametrize("lam", [5e-4, 2e-3, 1e-2])
def test_joint_price_reaches_the_brute_force_optimum_of_the_batch(knee, base, lam):
    """With a knee a token's price depends on the batch's other nodes; the greedy allocation
    still finds the best joint γ (concave gains, convex cost)."""
    rng = random.Random(knee * 1000 + base + int(lam * 1e5))
    requests = []
    for ctx in (30, 200, 700):
        acceptance = sorted((rng.random() for _ in range(5)), reverse=True)
        requests.append((ctx, expected_gains(acceptance, 5)))
    price = TreePrice(lam, 3, c_tok=4e-4, c_attn=1e-6, c_knee=2e-3, knee_tokens=knee, base_tokens=base)
    got = price.gammas_for(requests)
    best = min(itertools.product(range(6), repeat=3), key=lambda gs: batch_objective(price, requests, gs))
    assert batch_objective(price, requests, got) == pytest.approx(batch_objective(price, requests, best), abs=1e-12)


def test_past_the_knee_the_batch_drafts_less_than_each_request_would_alone():
    acceptance = [0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    requests = [(100, expected_gains(acceptance, 8))] * 4
    cheap = TreePrice(1e-3, 4, c_tok=3e-4, c_attn=0.0, c_knee=0.0, knee_tokens=0, base_tokens=4)
    convex = TreePrice(1e-3, 4, c_tok=3e-4, c_attn=0.0, c_knee=2e-3, knee_tokens=12, base_tokens=4)
    alone = cheap.gammas_for(requests)
    joint = convex.gammas_for(requests)
    assert sum(alone) == 32  # every node pays at the cheap slope
    # beyond 12 tokens in the step a node costs 2.3 ms / 4 = λ·0.575: only nodes likelier than that
    assert joint == [5, 5, 5, 5], joint


def weighted_objective(price, requests, gammas, weights):
    b = max(price.batch_size, 1)
    attn = sum((1 + g) * (ctx + 1 + g) for (ctx, _), g in zip(requests, gammas))
    tokens = price.token_seconds(price.base_tokens + sum(gammas))
    return (price.c_attn * attn + tokens) / b - price.lam * sum(
        w * gains[g] for (_, gains), g, w in zip(requests, gammas, weights))


@pytest.mark.parametrize("weights", [(1.0, 0.0, 1.0), (0.3, 1.0, 0.05), (1.0, 1.0, 1.0)])
def test_weighted_tokens_reach_the_brute_force_optimum_and_weight_zero_drafts_nothing(weights):
    """The drain price (``engine.owners.scheduler``) weights each request's expected accepted tokens:
    the greedy allocation is still the joint optimum, a request worth nothing drafts nothing,
    and weights of one change nothing."""
    rng = random.Random(7)
    requests = []
    for ctx in (30, 200, 700):
        acceptance = sorted((rng.uniform(0.3, 1.0) for _ in range(5)), reverse=True)
        requests.append((ctx, expected_gains(acceptance, 5)))
    price = TreePrice(4e-3, 3, c_tok=4e-4, c_attn=1e-6, c_knee=2e-3, knee_tokens=6, base_tokens=3)
    got = price.gammas_for(requests, weights)
    best = min(itertools.product(range(6), repeat=3), key=lambda gs: weighted_objective(price, requests, gs, weights))
    assert weighted_objective(price, requests, got, weights) == pytest.approx(
        weighted_objective(price, requests, best, weights), abs=1e-12)
    assert all(g == 0 for g, w in zip(got, weights) if w == 0.0)
    if set(weights) == {1.0}:
        assert got == price.gammas_for(requests) and sum(got) > 0


@pytest.mark.parametrize("weight", [0.0, 0.05, 0.2, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("base_tokens", [1, 8, 20])
def test_node_can_pay_is_false_exactly_when_even_a_certain_node_is_left_out(weight, base_tokens):
    """``node_can_pay`` (the scheduler skips drafting where it is False) agrees with the
    selection itself on the best possible tree: nodes accepted for certain."""
    price = TreePrice(1e-3, 4, c_tok=3e-4, c_attn=1e-6, c_knee=2e-3, knee_tokens=12, base_tokens=base_tokens)
    certain = expected_gains([1.0] * 4, 4)
    chosen = price.gammas_for([(150, certain)], [weight])[0]
    assert price.node_can_pay(150, weight) == (chosen > 0)
