"""Online confidence calibration: a drafter's raw probability → P(the target accepts the node).

Drafters report their own probability of each token (an n-gram count ratio, a datastore
frequency, a small model's softmax); none is the probability that the *target* agrees, which
fusion's argmax (eq. 4), TreeSelection and the scheduler's gains need. A node's acceptance also
depends on its drafter and the request's domain, its *role* (trunk: fusion's winner; branch: a
token that lost) and its depth, so a node is calibrated along a chain of keys from coarse to
fine (``node_levels``): drafter, drafter#role, drafter@domain#role, drafter@domain#role#depth.
Per key, raw confidences fall into ``num_bins`` bins with decayed counts of verified and
accepted nodes, and each level shrinks towards the one above by ``prior_strength``::

    value_0 = c
    value_k = (accepted_k,b + s·value_{k-1}) / (verified_k,b + s)     (b = c's bin)

A node counts as verified only if its parent was accepted. ``TreeBias`` corrects the product of
calibrated conditionals along a path per domain. Why: docs/algorithms.md ("Confidence calibration").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

MAX_DEPTH_LEVEL = 4
"""Depths 4 and deeper share one calibration level."""


def node_levels(drafter: str, domain: str, depth: int, is_trunk: bool) -> tuple[str, ...]:
    """Calibration keys of a node, coarse to fine (``depth`` counts from 1 at the root's child)."""
    role = "trunk" if is_trunk else "branch"
    base = f"{drafter}@{domain}#{role}"
    return (drafter, f"{drafter}#{role}", base, f"{base}#d{min(max(depth, 1), MAX_DEPTH_LEVEL)}")


@dataclass(slots=True)
class ConfidenceCalibrator:
    num_bins: int = 10
    prior_strength: float = 8.0
    decay: float = 0.999
    """Per observation of a key, older counts of that key are multiplied by this."""
    _accepted: dict[str, list[float]] = field(default_factory=dict)
    _verified: dict[str, list[float]] = field(default_factory=dict)

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.num_bins), 0), self.num_bins - 1)

    def calibrate(self, levels: str | Sequence[str], confidence: float) -> float:
        """P(accepted) of a node with raw ``confidence``, along ``levels`` (coarse to fine; a
        single key is one level)."""
        b = self._bin(confidence)
        value = confidence
        for key in (levels,) if isinstance(levels, str) else levels:
            verified = self._verified.get(key)
            if verified is not None:
                value = (self._accepted[key][b] + self.prior_strength * value) / (verified[b] + self.prior_strength)
        return value

    def observe(self, levels: str | Sequence[str], confidence: float, accepted: bool) -> None:
        b = self._bin(confidence)
        for key in (levels,) if isinstance(levels, str) else levels:
            if key not in self._verified:
                self._verified[key] = [0.0] * self.num_bins
                self._accepted[key] = [0.0] * self.num_bins
            verified, acc = self._verified[key], self._accepted[key]
            if self.decay < 1.0:
                for i in range(self.num_bins):
                    verified[i] *= self.decay
                    acc[i] *= self.decay
            verified[b] += 1.0
            if accepted:
                acc[b] += 1.0

    def table(self, levels: str | Sequence[str]) -> list[tuple[float, float, float]]:
        """(bin centre, verified count of the finest key, calibrated value at the centre) per
        bin, for reports."""
        finest = levels if isinstance(levels, str) else levels[-1]
        out = []
        for b in range(self.num_bins):
            centre = (b + 0.5) / self.num_bins
            verified = self._verified.get(finest, [0.0] * self.num_bins)[b]
            out.append((centre, verified, self.calibrate(levels, centre)))
        return out


@dataclass(slots=True)
class TreeBias:
    """How far a tree's expected accepted tokens (the sum of its nodes' cumulative calibrated
    confidences) miss what verification accepts, per domain: a correction factor on the gains.

    ``ConfidenceCalibrator`` calibrates each node *given its parent accepted*, which is right
    on average, but the product of those conditionals along a path runs low: once a chain is
    right it stays right more often than independent depths say, so priced on the product the
    scheduler drafts too little. So each domain keeps decayed sums of expected and accepted draft
    tokens per verified tree, and the gains are scaled by their ratio (``scale``): each
    node's expected gain p becomes min(1, f·p), which keeps the gain curve nondecreasing and
    concave and its order, so TreeSelection still cuts trees by the same ranking.

    The factor only corrects upwards (``min_factor`` 1). The product's bias has one sign; a
    tree expected to yield *more* than it does comes from conditionals that lag a drafter
    whose reliability just changed, which calibration itself catches up with bin by bin, while
    this slower sum would carry the old figure on."""

    prior_tokens: float = 16.0
    """Pseudo-tokens on both sums (a factor of 1 until real evidence outweighs them)."""
    decay: float = 0.995
    """Per observation of a domain, its older sums are multiplied by this (a window of about
    200 verified trees)."""
    min_factor: float = 1.0
    max_factor: float = 2.0
    _sums: dict[str, list[float]] = field(default_factory=dict)

    def factor(self, domain: str) -> float:
        """f: the domain's accepted over expected draft tokens (with the prior), clamped."""
        expected, accepted = self._sums.get(domain, (0.0, 0.0))
        f = (accepted + self.prior_tokens) / (expected + self.prior_tokens)
        return min(max(f, self.min_factor), self.max_factor)

    def observe(self, domain: str, expected: float, accepted: int) -> None:
        """One verified tree: the sum of its nodes' cumulative confidences, and its accepted nodes."""
        sums = self._sums.setdefault(domain, [0.0, 0.0])
        sums[0] = self.decay * sums[0] + expected
        sums[1] = self.decay * sums[1] + accepted

    def scale(self, domain: str, node_acceptance: Sequence[float]) -> list[float]:
        """Each node's chance of acceptance, corrected: min(1, f·p)."""
        f = self.factor(domain)
        return [min(1.0, f * p) for p in node_acceptance]
