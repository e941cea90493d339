"""Property tests (hypothesis) for the sampler, the token tree and greedy tree verification.

The example-based tests (test_sampling.py against HF's warpers, test_tree.py on seeded random
trees) pin exact values; these state invariants over arbitrary inputs:

* sampler: every filtered distribution is a distribution, keeps the argmax, respects top-k,
  and a sample never falls outside its support;
* tree: ``from_paths`` holds every (budget-permitting) path as a root path with unique
  siblings; ``attention_mask`` is the ancestor relation; ``select`` of an ancestor-closed set
  keeps every kept node's root path;
* greedy verification: the committed tokens are exactly what plain greedy decoding of the
  same logits would produce (lossless), whatever the tree.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cosine_ray.algo.sampling import logits_to_probs, make_generator, sample
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.verify import verify_greedy

VOCAB = 6
finite = st.floats(-30, 30, allow_nan=False, allow_infinity=False, width=32)
logit_rows = st.lists(st.lists(finite, min_size=VOCAB, max_size=VOCAB), min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(rows=logit_rows, temperature=st.floats(0.05, 2.0), top_k=st.integers(0, VOCAB + 2),
       top_p=st.floats(0.0, 1.0), seed=st.integers(0, 2**32))
def test_filtered_distribution_is_valid_and_sampling_stays_in_support(rows, temperature, top_k, top_p, seed):
    logits = torch.tensor(rows)
    probs = logits_to_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    assert probs.shape == logits.shape and torch.isfinite(probs).all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(rows)), rtol=0, atol=1e-5)
    # a most likely token is always kept (with exact ties, top-p may keep another one of them)
    kept_max = logits.masked_fill(probs == 0, -float("inf")).max(-1).values
    assert torch.equal(kept_max, logits.max(-1).values), "no most-likely token was kept"
    if top_k > 0:
        # ties at the k-th value are kept (HF semantics), so count distinct kept values
        for row_logits, row_probs in zip(logits, probs):
            kept = row_logits[row_probs > 0]
            kth = torch.topk(row_logits, min(top_k, VOCAB)).values[-1]
            assert (kept >= kth).all()
    tokens = sample(probs, generator=make_generator(seed))
    assert (probs.gather(1, tokens[:, None]) > 0).all(), "sampled a token outside the support"
    greedy = logits_to_probs(logits, temperature=0.0)
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(len(rows)))


paths_st = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=0, max_size=6)


@settings(max_examples=300, deadline=None)
@given(root=st.integers(0, VOCAB - 1), paths=paths_st, max_nodes=st.none() | st.integers(0, 12))
def test_from_paths_holds_every_path_with_unique_siblings(root, paths, max_nodes):
    tree = TokenTree.from_paths(root, paths, max_nodes=max_nodes)
    assert tree.token_ids[0] == root and tree.parent_ids[0] == -1
    if max_nodes is not None:
        assert tree.num_draft_tokens <= max_nodes
    kids = tree.children_lists()
    for node, children in enumerate(kids):
        tokens = [tree.token_ids[c] for c in children]
        assert len(tokens) == len(set(tokens)), f"node {node} has duplicate sibling tokens"
    root_paths = {tuple(tree.token_ids[n] for n in tree.path_to(node)[1:]) for node in range(tree.num_nodes)}
    for path in paths:  # every path is there up to the budget; a prefix of it at least
        prefixes = [tuple(path[:d]) for d in range(len(path) + 1)]
        present = [p for p in prefixes if p in root_paths]
        assert present == prefixes[:len(present)]
        if max_nodes is None:
            assert tuple(path) in root_paths
    mask = tree.attention_mask()
    for i in range(tree.num_nodes):
        assert set(torch.nonzero(mask[i]).flatten().tolist()) == set(tree.path_to(i))


@settings(max_examples=200, deadline=None)
@given(root=st.integers(0, VOCAB - 1), paths=paths_st, data=st.data())
def test_select_of_an_ancestor_closed_set_keeps_root_paths(root, paths, data):
    tree = TokenTree.from_paths(root, paths)
    chosen = data.draw(st.sets(st.integers(0, tree.num_nodes - 1)))
    closed = {a for n in chosen for a in tree.path_to(n)}
    sub = tree.select(sorted(closed))
    assert sub.num_nodes == len(closed | {0})
    old_paths = {tuple(tree.token_ids[a] for a in tree.path_to(n)) for n in closed | {0}}
    new_paths = {tuple(sub.token_ids[a] for a in sub.path_to(n)) for n in range(sub.num_nodes)}
    assert new_paths == old_paths


@settings(max_examples=300, deadline=None)
@given(root=st.integers(0, VOCAB - 1), paths=paths_st, seed=st.integers(0, 2**16))
def test_greedy_verification_commits_exactly_the_greedy_continuation(root, paths, seed):
    """A fixed context-dependent "model" (logits a function of the path so far): what the tree
    commits must equal greedy decoding of that model from the root, token by token."""
    table = torch.randn(VOCAB, VOCAB, 7, VOCAB, generator=torch.Generator().manual_seed(seed))

    def model_logits(context: tuple[int, ...]) -> torch.Tensor:
        prev = context[-2] if len(context) > 1 else 0
        return table[prev, context[-1], len(context) % 7]

    tree = TokenTree.from_paths(root, paths)
    rows = torch.stack([model_logits(tuple(tree.token_ids[a] for a in tree.path_to(n)))
                        for n in range(tree.num_nodes)])
    result = verify_greedy(tree, rows)
    context = (root,)
    expected = []
    for _ in range(len(result.new_token_ids)):
        expected.append(int(model_logits(context).argmax()))
        context += (expected[-1],)
    assert list(result.new_token_ids) == expected
    # the accepted nodes form a root path of the tree
    assert list(result.accepted_node_ids) == tree.path_to(result.accepted_node_ids[-1])[1:] \
        if result.accepted_node_ids else True
