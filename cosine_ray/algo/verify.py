"""Lossless verification of a draft token tree against the target model.

Vocabulary (used throughout cosine_ray, after vLLM's ``RejectionSampler``): *draft* tokens are
the tree's non-root nodes; *accepted* tokens the draft tokens on the path verification keeps;
the *recovered* token is sampled from the residual distribution after every child of the last
accepted node was rejected; the *bonus* token is the target's token after the last accepted
node (the recovered token plays that role when there is one), so each verify emits exactly one
token that is not a draft; the *accepted length* is accepted draft tokens + 1, the tokens a
verify step commits.

``target_probs`` = p(x) and ``draft_probs`` = q(x) in Leviathan et al. 2023 and SpecInfer (Miao
et al. 2024), whose multi-candidate rule ``verify_stochastic`` implements; a child without a
draft distribution is a point mass. ``verify_keyed`` walks the tree like ``verify_greedy`` with
the keyed sample of ``algo.sampling`` in place of the argmax, so a step commits the plain keyed
decode's next tokens for any tree. Row u of ``target_probs`` is the target's distribution for
the token after node u; the root sits at ``root_position``. Why each rule is lossless:
docs/algorithms.md ("Lossless verification").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

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
        return _walk(tree, target_logits.tolist().__getitem__)
    _check_tree_rows(tree, target_logits, "target_logits")
    target_token_ids = target_logits.argmax(dim=-1).tolist()  # [num_nodes]
    return _walk(tree, target_token_ids.__getitem__)


def _walk(tree: TokenTree, target_token_at: Callable[[int], int]) -> VerifyResult:
    """From the root, follow the child whose token is the target's token at the current node
    (``target_token_at(node)``, asked once per visited node, in depth order); the bonus is the
    target's token at the node where no child matches."""
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

    return _walk(tree, keyed_token)


def _sample_index(weights: torch.Tensor, total: float, uniform: float) -> int | None:
    """Inverse-CDF draw from non-negative ``weights  # [vocab]`` of mass ``total``.

    Returns None when the weights are all zero (a residual emptied by float rounding).
    """
    cdf = weights.cumsum(0, dtype=torch.float64)  # [vocab]
    index = int(torch.searchsorted(cdf, uniform * total, right=True))
    if index >= weights.numel():  # ``total`` rounded above the cumulative sum
        nonzero = weights.nonzero()
        return int(nonzero[-1]) if len(nonzero) else None
    return index


def verify_stochastic(
    tree: TokenTree,
    target_probs: torch.Tensor,  # [num_nodes, vocab]
    *,
    generator: torch.Generator,
    draft_probs: Sequence[torch.Tensor | None] | None = None,  # num_nodes x ([vocab] | None)
) -> VerifyResult:
    """SpecInfer multi-candidate rejection sampling over ``tree``; lossless (module docstring).

    ``draft_probs[c]`` is the distribution token c was sampled from, given its parent path and
    its earlier siblings (e.g. without-replacement sampling zeroes their tokens); None, or no
    ``draft_probs`` at all, means a point mass on the token (deterministic drafter). Entry 0
    (the root) is ignored. All randomness comes from ``generator``.
    """
    _check_tree_rows(tree, target_probs, "target_probs")
    vocab = target_probs.shape[1]
    if draft_probs is not None:
        assert len(draft_probs) == tree.num_nodes, (
            f"draft_probs has {len(draft_probs)} entries for a tree of {tree.num_nodes} nodes")
        for c in range(1, tree.num_nodes):
            if draft_probs[c] is not None:
                assert draft_probs[c].shape == (vocab,), (
                    f"draft_probs[{c}] must be [{vocab}], got {tuple(draft_probs[c].shape)}")
    if tree.num_draft_tokens and not 0 <= min(tree.token_ids[1:]) <= max(tree.token_ids[1:]) < vocab:
        raise ValueError(f"draft token ids must lie in [0, {vocab}); got {tree.token_ids[1:]}")

    # One coin per node: coins[c] decides child c (each node is tried at most once) and coins[0]
    # draws the bonus, so a call consumes the same amount of the generator stream every time.
    coins = torch.rand(tree.num_nodes, generator=generator, dtype=torch.float64).tolist()
    children = tree.children_lists()

    # NOTE(verify): walk down from the root. At node u the residual r starts as p(·|u); each
    # child c (token x, draft q_c) is accepted with min(1, r(x)/q_c(x)); a rejection replaces r
    # by norm(max(0, r - q_c)), which for a point mass is r with x zeroed. After an acceptance we
    # restart at c; when all children fail, the bonus (recovered) token is drawn from r.
    # r is kept unnormalised: ``weights`` (a row of target_probs until a q-rule rejection makes
    # a private float64 copy) minus the point-mass tokens listed in ``zeroed``, of mass
    # ``total``. Point-mass rejections, the common deterministic-drafter case, copy nothing.
    node, accepted = 0, []
    while True:
        weights = target_probs[node]  # [vocab]
        is_private, zeroed = False, []
        total = float(weights.sum(dtype=torch.float64))
        if not total > 0.0:
            raise ValueError(f"target_probs[{node}] is not a distribution (sums to {total})")
        for child in children[node]:
            token = tree.token_ids[child]
            draft_row = None if draft_probs is None else draft_probs[child]  # [vocab] | None
            draft_prob = 0.0 if draft_row is None else float(draft_row[token])
            mass = float(weights[token])  # siblings differ, so token is not in ``zeroed``
            if draft_row is None or draft_prob <= 0.0:
                # Point mass. (A q_c with q_c(x) = 0 cannot have produced x; verifying x as a
                # point mass stays lossless given the tree, so we fall back to it.)
                if coins[child] * total < mass:  # u < r(x)
                    break
                zeroed.append(token)
                total -= mass
            else:
                if coins[child] * draft_prob * total < mass:  # u < r(x) / q_c(x)
                    break
                if not is_private:
                    weights, is_private = weights.to(torch.float64, copy=True), True
                if zeroed:
                    weights[zeroed], zeroed = 0.0, []
                # total * max(0, r/total - q_c): the same distribution, still unnormalised.
                weights.sub_(draft_row, alpha=total).clamp_(min=0.0)
                total = float(weights.sum())
            if not total > 0.0:
                # r <= q_c everywhere means r == q_c (both sum to 1), and then every x ~ q_c is
                # accepted with probability 1: rejection has probability 0. Reaching here is
                # only float rounding (e.g. r(x) = 1 - 1e-8 stored as just under q_c(x)); the
                # target row is the closest valid distribution to continue from.
                weights, is_private, zeroed = target_probs[node], False, []
                total = float(weights.sum(dtype=torch.float64))
        else:
            if zeroed:
                weights = weights.clone() if is_private else weights.to(torch.float64, copy=True)
                weights[zeroed] = 0.0
            bonus = _sample_index(weights, total, coins[0])
            if bonus is None:  # float-rounding leftovers only, as above
                weights = target_probs[node]
                bonus = _sample_index(weights, float(weights.sum(dtype=torch.float64)), coins[0])
            return _result(tree, accepted, bonus)
        accepted.append(child)
        node = child


def verify_chain(
    draft_token_ids: Sequence[int],
    target_probs: torch.Tensor,  # [k+1, vocab]
    *,
    generator: torch.Generator,
    draft_probs: torch.Tensor | None = None,  # [k, vocab]
) -> VerifyResult:
    """``verify_stochastic`` for a single chain of k draft tokens (node ids 1..k)."""
    k = len(draft_token_ids)
    assert target_probs.ndim == 2 and target_probs.shape[0] == k + 1, (
        f"target_probs must be [{k + 1}, vocab], got {tuple(target_probs.shape)}")
    tree = TokenTree.chain(-1, draft_token_ids)  # root token is irrelevant to verification
    rows = None
    if draft_probs is not None:
        assert draft_probs.shape == (k, target_probs.shape[1]), (
            f"draft_probs must be [{k}, {target_probs.shape[1]}], got {tuple(draft_probs.shape)}")
        rows = [None, *draft_probs.unbind(0)]
    return verify_stochastic(tree, target_probs, generator=generator, draft_probs=rows)
