"""Lossless verification of a draft token tree against the target model.

Vocabulary (used throughout cosine_ray, after vLLM's ``RejectionSampler``): *draft* tokens are
the tree's non-root nodes; *accepted* tokens the draft tokens on the path verification keeps;
the *recovered* token is sampled from the residual distribution after every child of the last
accepted node was rejected; the *bonus* token is the target's token after the last accepted
node (the recovered token plays that role when there is one), so each verify emits exactly one
token that is not a draft; the *accepted length* is accepted draft tokens + 1, the tokens a
verify step commits.

``target_probs`` = p(x) in Leviathan et al. 2023. ``verify_keyed`` walks the tree like
``verify_greedy`` with the keyed sample of ``algo.sampling`` in place of the argmax, so a step
commits the plain keyed decode's next tokens for any tree (rejection sampling, whose text
depends on the drafts, is not used: a seeded request must not depend on them). Row u of ``target_probs`` is the target's distribution for
the token after node u; the root sits at ``root_position``. Why each rule is lossless:
docs/algorithms.md ("Lossless verification").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cosine_ray.algo.sampling import keyed_argmax, keyed_exponentials
from cosine_ray.algo.tree import TokenTree


@dataclass(frozen=True, slots=True)
class VerifyResult:
    accepted_node_ids: tuple[int, ...]
    """Tree node indices on the accepted path, root excluded, in depth order."""
    accepted_token_ids: tuple[int, ...]
    """Token of each accepted node."""
    bonus_token_id: int
    """The target's token after the last accepted node (a recovered token if all children failed)."""

    @property
    def accepted_length(self) -> int:
        """Accepted draft tokens + 1 (the bonus), as in vLLM's metrics."""
        return len(self.accepted_token_ids) + 1

    @property
    def new_token_ids(self) -> tuple[int, ...]:
        """Tokens this verify step commits: the accepted draft tokens, then the bonus."""
        return self.accepted_token_ids + (self.bonus_token_id,)

    @classmethod
    def make_dummy(cls) -> "VerifyResult":
        """Path root → "def" → "(" of ``TokenTree.make_dummy()``; "x" rejected, bonus 14."""
        return cls(accepted_node_ids=(1, 3), accepted_token_ids=(10, 12), bonus_token_id=14)


def _check_tree_rows(tree: TokenTree, rows: torch.Tensor, name: str) -> None:
    assert rows.ndim == 2, f"{name} must be [num_nodes, vocab], got shape {tuple(rows.shape)}"
    assert rows.shape[0] == tree.num_nodes, (
        f"{name} has {rows.shape[0]} rows for a tree of {tree.num_nodes} nodes")


def _child_by_token(tree: TokenTree) -> list[dict[int, int]]:
    kids: list[dict[int, int]] = [{} for _ in range(tree.num_nodes)]
    for node in range(1, tree.num_nodes):
        kids[tree.parent_ids[node]][tree.token_ids[node]] = node
    return kids


def _result(tree: TokenTree, accepted_node_ids: list[int], bonus_token_id: int) -> VerifyResult:
    return VerifyResult(tuple(accepted_node_ids),
                        tuple(tree.token_ids[n] for n in accepted_node_ids), int(bonus_token_id))


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> VerifyResult:
    """Longest path whose every token is the target's argmax at its parent, plus the bonus.

    ``target_logits  # [num_nodes, vocab]`` (probabilities work too: only the argmax is used;
    ties go to the first maximum, as ``torch.argmax``), or the argmax already taken
    ``# [num_nodes]`` int (what the last stage returns for greedy requests).
    """
    if target_logits.ndim == 1:
        assert target_logits.shape[0] == tree.num_nodes, (
            f"target token ids has {target_logits.shape[0]} entries for a tree of {tree.num_nodes} nodes")
        return verify_greedy_at(tree, target_logits.tolist().__getitem__)
    _check_tree_rows(tree, target_logits, "target_logits")
    target_token_ids = target_logits.argmax(dim=-1).tolist()  # [num_nodes]
    return verify_greedy_at(tree, target_token_ids.__getitem__)


def verify_greedy_at(tree: TokenTree, target_token_at: Callable[[int], int]) -> VerifyResult:
    """``verify_greedy`` with the target's token at a node computed on demand: from the root,
    follow the child whose token is ``target_token_at(node)`` (asked once per visited node, in
    depth order: each node asked is the child of the one asked before); the bonus is the
    target's token at the node where no child matches. A row's work is done only for the
    nodes on the accepted path and the bonus's."""
    child_by_token = _child_by_token(tree)
    node, accepted = 0, []
    while True:
        token = int(target_token_at(node))
        child = child_by_token[node].get(token)
        if child is None:
            return _result(tree, accepted, token)
        accepted.append(child)
        node = child


def verify_keyed(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [num_nodes, vocab]
    *,
    seed: int,
    root_position: int,
) -> VerifyResult:
    """Seeded verification: the committed tokens are exactly the plain keyed samples
    (``algo.sampling.sample_keyed`` with ``seed``) of the positions after the root, whatever
    the tree (module docstring). ``root_position`` is the absolute position of the root token
    (committed length - 1); row u draws position ``root_position + depth(u) + 1``."""
    _check_tree_rows(tree, target_probs, "target_probs")
    if root_position < 0:
        raise ValueError(f"root_position must be >= 0, got {root_position}")
    vocab = target_probs.shape[1]
    depths = tree.depths()

    def keyed_token(node: int) -> int:
        # The walk visits one node per depth, so each position's noise is generated once.
        exponentials = keyed_exponentials(seed, root_position + depths[node] + 1, vocab)  # [vocab]
        return int(keyed_argmax(target_probs[node:node + 1], exponentials[None])[0])

    return verify_greedy_at(tree, keyed_token)


