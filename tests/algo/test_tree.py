"""TokenTree: construction, queries and the attention mask against brute force."""

import itertools
import random

import pytest
import torch

from cosine_ray.algo.tree import TokenTree


def _node_token_path(tree: TokenTree, node: int) -> tuple[int, ...]:
    """Tokens from the root's first child down to ``node`` (root token excluded)."""
    return tuple(tree.token_ids[n] for n in tree.path_to(node)[1:])


def _random_paths(rng: random.Random, vocab: int = 4, num_paths: int = 6, max_len: int = 4):
    return [[rng.randrange(vocab) for _ in range(rng.randint(0, max_len))] for _ in range(num_paths)]


def test_from_paths_merges_shared_prefixes():
    tree = TokenTree.from_paths(9, [[1, 2, 3], [1, 2, 4], [5]])
    assert tree.token_ids == (9, 1, 2, 3, 4, 5)
    assert tree.parent_ids == (-1, 0, 1, 2, 2, 0)
    assert tree.depths() == [0, 1, 2, 3, 3, 1]


def test_from_paths_dedups_identical_paths_and_keeps_max_confidence():
    tree = TokenTree.from_paths(0, [[1, 2], [1, 2], [1]], confidences=[[0.5, 0.2], [0.7, 0.1], [0.6]])
    assert tree.token_ids == (0, 1, 2)
    assert tree.confidences == (1.0, 0.7, 0.2)


@pytest.mark.parametrize("seed", range(20))
def test_from_paths_siblings_unique_and_every_path_present(seed):
    rng = random.Random(seed)
    paths = _random_paths(rng)
    tree = TokenTree.from_paths(7, paths)
    for node in range(tree.num_nodes):
        kid_tokens = [tree.token_ids[c] for c in tree.children(node)]
        assert len(kid_tokens) == len(set(kid_tokens))
    node_paths = {_node_token_path(tree, n) for n in range(tree.num_nodes)}
    expected = {tuple(path[:d]) for path in paths for d in range(len(path) + 1)}
    assert node_paths == expected  # exactly the prefixes of the input paths, each once
    assert tree.num_nodes == len(expected)


@pytest.mark.parametrize("seed", range(20))
def test_from_paths_respects_max_nodes(seed):
    rng = random.Random(seed)
    paths = _random_paths(rng, num_paths=8)
    full = TokenTree.from_paths(0, paths)
    for max_nodes in range(0, full.num_draft_tokens + 2):
        tree = TokenTree.from_paths(0, paths, max_nodes=max_nodes)
        assert tree.num_draft_tokens == min(max_nodes, full.num_draft_tokens)
        # Insertion order is kept, so the budgeted tree is the first nodes of the full one.
        assert tree.token_ids == full.token_ids[:tree.num_nodes]
        assert tree.parent_ids == full.parent_ids[:tree.num_nodes]


def test_max_nodes_drops_the_subtree_of_a_dropped_node():
    tree = TokenTree.from_paths(0, [[1, 2], [3, 4, 5]], max_nodes=3)
    # Node "3" fits (3rd node); "4" does not, so "5" under it is dropped as well.
    assert tree.token_ids == (0, 1, 2, 3)
    assert tree.parent_ids == (-1, 0, 1, 0)


def test_chain_and_root_only():
    chain = TokenTree.chain(4, [5, 6, 7], confidences=[0.9, 0.8, 0.7])
    assert chain.parent_ids == (-1, 0, 1, 2)
    assert chain.path_to(3) == [0, 1, 2, 3]
    root = TokenTree.root_only(3)
    assert (root.num_nodes, root.num_draft_tokens, root.token_ids) == (1, 0, (3,))
    assert root.attention_mask().tolist() == [[True]]


def test_make_dummy_matches_docstring():
    tree = TokenTree.make_dummy()
    assert tree.depths() == [0, 1, 1, 2, 3]
    assert tree.children(0) == [1, 2]
    assert tree.children_lists() == [[1, 2], [3], [], [4], []]
    assert tree.path_to(4) == [0, 1, 3, 4]


@pytest.mark.parametrize("seed", range(20))
def test_attention_mask_is_ancestor_relation(seed):
    tree = TokenTree.from_paths(0, _random_paths(random.Random(seed)))
    mask = tree.attention_mask()  # [n, n]
    assert mask.dtype == torch.bool and mask.shape == (tree.num_nodes, tree.num_nodes)
    for i, j in itertools.product(range(tree.num_nodes), repeat=2):
        ancestor = i
        while ancestor not in (-1, j):
            ancestor = tree.parent_ids[ancestor]
        assert bool(mask[i, j]) == (ancestor == j), (i, j)


@pytest.mark.parametrize("seed", range(20))
def test_path_to_depths_children_consistent(seed):
    tree = TokenTree.from_paths(0, _random_paths(random.Random(seed)))
    depths = tree.depths()
    kids = tree.children_lists()
    for node in range(tree.num_nodes):
        path = tree.path_to(node)
        assert path[0] == 0 and path[-1] == node
        assert len(path) == depths[node] + 1
        assert all(tree.parent_ids[b] == a for a, b in zip(path, path[1:]))
        assert kids[node] == tree.children(node)
        assert tree.attention_mask()[node].nonzero().flatten().tolist() == path


def test_cumulative_confidences_is_product_along_path():
    tree = TokenTree.from_paths(0, [[1, 2], [1, 3], [4]], confidences=[[0.5, 0.4], [0.5, 0.2], [0.3]])
    cum = tree.cumulative_confidences()
    for node in range(tree.num_nodes):
        expected = 1.0
        for n in tree.path_to(node):
            expected *= tree.confidences[n]
        assert cum[node] == pytest.approx(expected)
    assert cum == pytest.approx([1.0, 0.5, 0.2, 0.1, 0.3])


def test_select_keeps_structure_and_reindexes():
    tree = TokenTree.make_dummy()
    sub = tree.select([3, 1])  # root is always kept
    assert sub.token_ids == (0, 10, 12)
    assert sub.parent_ids == (-1, 0, 1)
    assert sub.confidences == (1.0, 0.9, 0.8)
    assert tree.select(range(tree.num_nodes)) == tree
    assert tree.select([]) == TokenTree.root_only(0)
    with pytest.raises(ValueError, match="without its parent"):
        tree.select([3])


@pytest.mark.parametrize("token_ids, parent_ids, confidences", [
    ((), (), ()),                        # empty
    ((0, 1), (-1,), (1.0, 1.0)),         # length mismatch
    ((0, 1), (-1, 0), (1.0,)),           # confidences length mismatch
    ((0, 1), (0, 0), (1.0, 1.0)),        # root has a parent
    ((0, 1, 2), (-1, 2, 0), (1.0,) * 3),  # parent after child
    ((0, 1), (-1, 1), (1.0, 1.0)),       # self-parent
    ((0, 1), (-1, -1), (1.0, 1.0)),      # second root
])
def test_invalid_trees_raise(token_ids, parent_ids, confidences):
    with pytest.raises(ValueError):
        TokenTree(token_ids, parent_ids, confidences)
