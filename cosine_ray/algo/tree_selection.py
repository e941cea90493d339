"""TreeSelection: the union of the drafted paths as one token tree of at most γ_i draft nodes.

Paths (the fused trunk, fusion's branches, or whole-path proposals) are merged into one tree;
shared prefixes become one node. Each node carries its *owner* (the drafter whose token it
is), the owner's raw confidence, and its calibrated confidence; the product of calibrated
confidences along a node's path is its chance of acceptance (``SelectedTree.node_acceptance``).
Selection keeps the ``budget`` nodes with the highest such chance, none below a cut. A node's
cumulative confidence never exceeds its parent's, so ancestors always survive first.

How γ_i is chosen is the scheduler's business (``TreePrice``): eq. 8's objective
``T_ttl/b − λ·Σ gains_i(γ_i)`` separates per request once the batch is fixed, so with the
tree in hand each request takes the γ that minimises ``share_i(γ)/b − λ·gains_i(γ)``, where
``share_i`` is its part of the verify time (``LatencyModel.request_llm_seconds``) and
``gains_i(γ)`` the expected accepted tokens of its best γ nodes (``expected_gains``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from cosine_ray.algo.adaptive import expected_gains
from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.tree import TokenTree


@dataclass(frozen=True, slots=True)
class SelectedTree:
    tree: TokenTree
    """Confidences are the calibrated ones (what selection and the scheduler use)."""
    owners: tuple[str, ...]
    """Drafter of each node ("" for the root)."""
    raw_confidences: tuple[float, ...]
    """The owner's own probability of each node (root: 1.0)."""
    trunk_flags: tuple[bool, ...] = ()
    """Per node: a trunk node (fusion's winner, or a drafter's own best path) or a branch
    (root: True); () = all trunk. Calibration learns the two separately."""

    def is_trunk(self, node: int) -> bool:
        return not self.trunk_flags or self.trunk_flags[node]

    def node_acceptance(self) -> list[float]:
        """Cumulative (calibrated) confidence of each draft node: its chance of acceptance."""
        return self.tree.cumulative_confidences()[1:]

    @classmethod
    def root_only(cls, root_token_id: int) -> "SelectedTree":
        return cls(TokenTree.root_only(root_token_id), ("",), (1.0,))

    def top(self, budget: int, min_confidence: float = 0.0) -> "SelectedTree":
        """The ``budget`` draft nodes with the highest cumulative confidence, none below
        ``min_confidence`` (ties: the earlier node). ``cum[child] <= cum[parent]`` and parents
        have smaller indices, so the kept set always holds every kept node's ancestors; and
        ``t.top(a).top(b) == t.top(b)`` for b ≤ a (how TreeSelection cuts a tree to γ_i)."""
        cum = self.tree.cumulative_confidences()
        eligible = [i for i in range(1, len(cum)) if cum[i] >= min_confidence]
        if len(eligible) == len(cum) - 1 <= budget:
            return self
        # stable: among equal confidences the earlier node first (reverse keeps stability)
        kept = sorted(sorted(eligible, key=cum.__getitem__, reverse=True)[:max(budget, 0)])
        owners, raw, flags = self.owners, self.raw_confidences, self.trunk_flags
        return SelectedTree(self.tree.select(kept), ("",) + tuple(owners[k] for k in kept),
                            (1.0,) + tuple(raw[k] for k in kept),
                            (True,) + (tuple(flags[k] for k in kept) if flags else (True,) * len(kept)))


def build_tree(root_token_id: int, paths: Sequence[FusedPath], budget: int, *,
               min_confidence: float = 0.0) -> SelectedTree:
    """The union of ``paths`` as one tree of at most ``budget`` draft nodes.

    All paths are merged (shared prefixes become one node, keeping the highest confidence),
    then the ``budget`` draft nodes with the highest cumulative confidence (the product
    along their path) survive, none below ``min_confidence``. A node's owner is the drafter
    of the first path that reached it (list the fused trunk first)."""
    full, nodes = TokenTree.merge_paths(root_token_id, [p.token_ids for p in paths], [p.confidences for p in paths])
    owner = [""] * full.num_nodes
    raw = [1.0] * full.num_nodes
    trunk = [True] * full.num_nodes
    for p, path_nodes in zip(paths, nodes):
        raws = p.raw_confidences or p.confidences
        flags = p.trunk_flags or (True,) * len(p.token_ids)
        for node, who, r, flag in zip(path_nodes, p.owners, raws, flags):
            if not owner[node]:
                owner[node], raw[node], trunk[node] = who, r, flag
    union = SelectedTree(full, tuple(owner), tuple(raw), tuple(trunk))
    return union.top(budget, min_confidence)


@dataclass(frozen=True, slots=True)
class TreePrice:
    """The scheduler's exchange rate between verify time and expected accepted tokens.

    ``gamma`` solves one request's part of eq. 8 for a fixed batch of ``batch_size``:
    ``argmin_g  (c_req + c_tok·(1+g) + c_attn·(1+g)·(l+1+g)) / b  −  lam · gains(g)``.
    The constant terms do not change the argmin, so a node is verified exactly when its
    expected gain pays for its marginal verify time at this batch."""

    lam: float
    """λ of eq. 8: seconds of (per-request-averaged) step time one expected accepted token is worth."""
    batch_size: int
    c_tok: float
    """Seconds per new token of the verify forward (latency model)."""
    c_attn: float
    """Seconds per (new token × key) of attention (latency model)."""

    def gamma(self, context_len: int, node_acceptance: Sequence[float], gamma_max: int) -> int:
        return self.gamma_for(context_len, expected_gains(node_acceptance, gamma_max))

    def gamma_for(self, context_len: int, gains: Sequence[float]) -> int:
        """``gamma`` on the tree's expected-gain curve (``expected_gains``) when it is at hand."""
        b = max(self.batch_size, 1)
        best, best_value = 0, 0.0
        for g in range(1, len(gains)):
            n = 1 + g
            marginal = (self.c_tok * g + self.c_attn * (n * (context_len + 1 + g) - (context_len + 1))) / b
            value = marginal - self.lam * gains[g]
            if value < best_value:  # ties keep the smaller tree
                best, best_value = g, value
        return best
