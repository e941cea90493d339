"""Token trees: the draft structure verified in one target forward.

A tree holds one request's speculation for one step. Node 0 is the *root*: the last
token already chosen by the target (committed text) whose KV has not been computed yet.
Every other node is a *draft* token; its parent is the token it continues.

::

        root (node 0, depth 0)       flattened, topological order:
        ├── "def" (1, depth 1)         token_ids  = [r, def, for, (, x]
        │   └── "(" (3, depth 2)       parent_ids = [-1, 0,   0,   1, 3]
        │       └── "x" (4, depth 3)   depths     = [0,  1,   1,   2, 3]
        └── "for" (2, depth 1)

Positions fed to the target are ``committed_length + depth``; a node attends to the whole
committed KV cache plus its ancestors and itself (``attention_mask``). The target's
logits at node u are its distribution for u's children, so verification walks from the
root down (``algo.verify``). Siblings never repeat a token (``from_paths`` merges shared
prefixes), so a path is identified by its token sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class TokenTree:
    token_ids: tuple[int, ...]
    """Token of each node; node 0 is the root (last committed token)."""
    parent_ids: tuple[int, ...]
    """Parent node of each node; -1 for the root; always smaller than the node's index."""
    confidences: tuple[float, ...]
    """Drafter's probability of each node's own token given its parent path (root: 1.0)."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if n == 0 or len(self.parent_ids) != n or len(self.confidences) != n:
            raise ValueError("token_ids, parent_ids and confidences must be non-empty and equal length")
        if self.parent_ids[0] != -1:
            raise ValueError("node 0 must be the root (parent -1)")
        for i in range(1, n):
            if not 0 <= self.parent_ids[i] < i:
                raise ValueError(f"node {i} has parent {self.parent_ids[i]}; parents must precede children")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def root_only(cls, root_token_id: int) -> "TokenTree":
        return cls((int(root_token_id),), (-1,), (1.0,))

    @classmethod
    def from_paths(
        cls,
        root_token_id: int,
        paths: Sequence[Sequence[int]],
        confidences: Sequence[Sequence[float]] | None = None,
        max_nodes: int | None = None,
    ) -> "TokenTree":
        """Merge draft paths (each a token sequence continuing the root) into one tree.

        Shared prefixes become shared nodes; a merged node keeps the highest confidence any
        path gave it. ``max_nodes`` counts draft nodes (root excluded): paths are inserted in
        order and a node that would exceed the budget is dropped with its subtree.
        """
        return cls.merge_paths(root_token_id, paths, confidences, max_nodes)[0]

    @classmethod
    def merge_paths(
        cls,
        root_token_id: int,
        paths: Sequence[Sequence[int]],
        confidences: Sequence[Sequence[float]] | None = None,
        max_nodes: int | None = None,
    ) -> tuple["TokenTree", list[list[int]]]:
        """``from_paths``, and for each path the node of each of its tokens (up to where the
        budget cut it), so callers can attach per-token data without walking the tree again."""
        token_ids = [int(root_token_id)]
        parent_ids = [-1]
        confs = [1.0]
        nodes: list[list[int]] = []
        child_index: dict[tuple[int, int], int] = {}
        budget = float("inf") if max_nodes is None else max_nodes
        for p, path in enumerate(paths):
            node = 0
            path_nodes: list[int] = []
            for d, tok in enumerate(path):
                tok = int(tok)
                conf = 1.0 if confidences is None else float(confidences[p][d])
                key = (node, tok)
                child = child_index.get(key)
                if child is None:
                    if len(token_ids) - 1 >= budget:
                        break
                    child = len(token_ids)
                    child_index[key] = child
                    token_ids.append(tok)
                    parent_ids.append(node)
                    confs.append(conf)
                else:
                    confs[child] = max(confs[child], conf)
                node = child
                path_nodes.append(node)
            nodes.append(path_nodes)
        return cls(tuple(token_ids), tuple(parent_ids), tuple(confs)), nodes

    @classmethod
    def chain(cls, root_token_id: int, draft_token_ids: Sequence[int],
              confidences: Sequence[float] | None = None) -> "TokenTree":
        return cls.from_paths(root_token_id, [list(draft_token_ids)],
                              None if confidences is None else [list(confidences)])

    @classmethod
    def make_dummy(cls) -> "TokenTree":
        """The tree drawn in the module docstring (root token 0)."""
        return cls((0, 10, 11, 12, 13), (-1, 0, 0, 1, 3), (1.0, 0.9, 0.5, 0.8, 0.7))

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    @property
    def num_draft_tokens(self) -> int:
        return len(self.token_ids) - 1

    def depths(self) -> list[int]:
        depths = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            depths[i] = depths[self.parent_ids[i]] + 1
        return depths

    def children(self, node: int) -> list[int]:
        return [i for i in range(node + 1, self.num_nodes) if self.parent_ids[i] == node]

    def children_lists(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes)]
        for i in range(1, self.num_nodes):
            kids[self.parent_ids[i]].append(i)
        return kids

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        path = []
        while node != -1:
            path.append(node)
            node = self.parent_ids[node]
        return path[::-1]

    def attention_mask(self) -> torch.Tensor:
        """``mask[i, j]`` is True when node j is node i or one of its ancestors.  # [n, n] bool"""
        n = self.num_nodes
        mask = np.zeros((n, n), dtype=np.bool_)  # rows built in numpy: a torch op per row costs
        parents = self.parent_ids               # host time the GPU then waits for
        mask[0, 0] = True
        for i in range(1, n):
            mask[i] = mask[parents[i]]
            mask[i, i] = True
        return torch.from_numpy(mask)

    def cumulative_confidences(self) -> list[float]:
        """Product of confidences along the path from the root (TreeSelection's score)."""
        cum = [1.0] * self.num_nodes
        for i in range(1, self.num_nodes):
            cum[i] = cum[self.parent_ids[i]] * self.confidences[i]
        return cum

    def select(self, keep: Sequence[int]) -> "TokenTree":
        """Sub-tree of the given nodes (ancestors of kept nodes must be kept too)."""
        keep_sorted = sorted(set(int(k) for k in keep) | {0})
        new_index = {old: new for new, old in enumerate(keep_sorted)}
        parents = []
        for old in keep_sorted:
            par = self.parent_ids[old]
            if par != -1 and par not in new_index:
                raise ValueError(f"node {old} kept without its parent {par}")
            parents.append(-1 if par == -1 else new_index[par])
        return TokenTree(tuple(self.token_ids[k] for k in keep_sorted), tuple(parents),
                         tuple(self.confidences[k] for k in keep_sorted))
