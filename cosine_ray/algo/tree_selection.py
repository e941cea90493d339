"""TreeSelection: the union of the drafted paths as one token tree of at most γ_i draft nodes.

Paths (the fused trunk, fusion's branches, or whole-path proposals) are merged into one tree;
shared prefixes become one node. Each node carries its *owner* (the drafter whose token it
is), the owner's raw confidence, and its calibrated confidence; the product of calibrated
confidences along a node's path is its chance of acceptance (``SelectedTree.node_acceptance``).
Selection keeps the ``budget`` nodes with the highest such chance, none below a cut. A node's
cumulative confidence never exceeds its parent's, so ancestors always survive first.

How γ_i is chosen is the scheduler's business (``TreePrice``): eq. 8's objective
``T_ttl/b − λ·Σ gains_i(γ_i)`` is minimised over the γ_i of the whole batch once the trees are
in hand, where ``gains_i(γ)`` is the expected accepted tokens of request i's best γ nodes
(``expected_gains``, concave) and T_ttl's verify part is convex in the γ_i: each request's
attention grows with its own nodes, and the token terms ``c_tok·N + c_knee·max(N − K, 0)``
with the step's total N (``LatencyModel.token_seconds``). Concave gains against a convex
cost: taking nodes one at a time, always the one whose gain best pays for its own attention,
while that beats the token slope at the current N, reaches the optimum (``gammas_for``).
Without a knee the batch separates per request.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

from cosine_ray.algo.adaptive import expected_gains
from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.scheduling.latency_model import token_seconds
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

    ``gammas_for`` solves eq. 8 for a fixed batch of ``batch_size``: minimise over the γ_i
    ``(Σ_i c_attn·(1+γ_i)·(l_i+1+γ_i) + token_seconds(base_tokens + Σ_i γ_i)) / b − lam·Σ_i gains_i(γ_i)``
    (the terms that do not move with γ dropped), so a node is verified exactly when its
    expected gain pays for its marginal verify time at this batch."""

    lam: float
    """λ of eq. 8: seconds of (per-request-averaged) step time one expected accepted token is worth."""
    batch_size: int
    c_tok: float
    """Seconds per new token of the verify forward (latency model)."""
    c_attn: float
    """Seconds per (new token × key) of attention (latency model)."""
    c_knee: float = 0.0
    """Extra seconds per new token beyond ``knee_tokens`` in the forward (latency model)."""
    knee_tokens: int = 0
    """K of the latency model (0 = no knee)."""
    base_tokens: int = 0
    """New tokens the step verifies before any draft node: each decoding request's root and
    the prompts of the prefills that share its forward."""

    def token_seconds(self, num_tokens: int) -> float:
        return token_seconds(num_tokens, self.c_tok, self.c_knee, self.knee_tokens)

    def gamma(self, context_len: int, node_acceptance: Sequence[float], gamma_max: int) -> int:
        return self.gamma_for(context_len, expected_gains(node_acceptance, gamma_max))

    def gamma_for(self, context_len: int, gains: Sequence[float]) -> int:
        """One request's γ on its expected-gain curve (``expected_gains``)."""
        return self.gammas_for([(context_len, gains)])[0]

    def node_can_pay(self, context_len: int, weight: float = 1.0) -> bool:
        """Could a first draft node of this request pay at all: one accepted for certain
        (gain 1, the most a node gains), at the step's cheapest token slope? False means
        γ = 0 whatever the drafters propose, so drafting it is wasted host time."""
        b = max(self.batch_size, 1)
        slope = self.token_seconds(self.base_tokens + 1) - self.token_seconds(self.base_tokens)
        return self.lam * weight - (self.c_attn * _attention_added(context_len, 0) + slope) / b > 0

    def gammas_for(self, requests: Sequence[tuple[int, Sequence[float]]],
                   weights: Sequence[float] | None = None) -> list[int]:
        """γ_i per (context length, expected-gain curve), jointly: greedy on marginal values,
        exact for concave gains against convex costs (module docstring). Ties keep the smaller
        tree, and among requests the earlier one. ``weights`` (one per request, in [0, 1],
        default 1) scale what an accepted token of that request is worth."""
        b = max(self.batch_size, 1)
        lam, c_attn = self.lam, self.c_attn
        gammas = [0] * len(requests)
        worth = [lam] * len(requests) if weights is None else [lam * w for w in weights]

        def value(i: int) -> float:  # the next node's gain less its own attention, per step share
            ctx, gains = requests[i]
            g = gammas[i]
            return worth[i] * (gains[g + 1] - gains[g]) - c_attn * _attention_added(ctx, g) / b

        heap = [(-value(i), i) for i, (_, gains) in enumerate(requests) if len(gains) > 1]
        heapq.heapify(heap)
        num_tokens = self.base_tokens
        while heap:
            neg, i = heap[0]
            if -neg - (self.token_seconds(num_tokens + 1) - self.token_seconds(num_tokens)) / b <= 0:
                break  # the best node left does not pay, and the next tokens only cost more
            gammas[i] += 1
            num_tokens += 1
            if gammas[i] + 1 < len(requests[i][1]):
                heapq.heapreplace(heap, (-value(i), i))
            else:
                heapq.heappop(heap)
        return gammas


def _attention_added(context_len: int, gamma: int) -> int:
    """(new tokens × keys) a request's attention gains when its tree grows from γ to γ + 1
    nodes: (1 + γ) queries over (l + 1 + γ) keys become (2 + γ) over (l + 2 + γ)."""
    return (2 + gamma) * (context_len + 2 + gamma) - (1 + gamma) * (context_len + 1 + gamma)
