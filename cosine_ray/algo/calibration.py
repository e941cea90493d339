"""Online confidence calibration: a drafter's raw probability → P(the target accepts the node).

Drafters report their own probability of each token (an n-gram count ratio, a datastore
frequency, a small model's softmax). These are on different scales and none is the
probability that the *target* agrees, which is what fusion's argmax (eq. 4), TreeSelection
and the scheduler's expected gains need. Per key, raw confidences are binned (``num_bins``
equal bins on [0, 1]); each bin keeps decayed counts of verified nodes and of accepted ones.

What a node's acceptance depends on besides its raw confidence (measured on the held-back
workload with the default drafters, 2-core CPU):

- its **drafter and the request's domain** (a retrieval expert is reliable on its own domain);
- its **role**: a *trunk* node (fusion's winner at its position) vs a *branch* (a token that
  lost fusion's argmax): branches were accepted about half as often as their raw confidence
  calibrated like trunk nodes predicted (0.18 observed vs 0.35 predicted);
- its **depth**: the first draft position is accepted less often than its confidence says and
  deep positions more often (0.37 vs 0.46 at depth 1, 0.85 vs 0.66 at depth 4: once a chain is
  right it tends to stay right).

So a node is calibrated along a chain of keys from coarse to fine (``node_levels``): drafter,
drafter#role, drafter@domain#role, drafter@domain#role#depth. The role comes before the domain
because branches are few (about one node in ten) and differ from trunk nodes more than domains
do: with the domain first, a branch key of one domain had too few observations to leave its
trunk-dominated parent. Measured on the held-back workload (default drafters, c=8, 2 threads,
branch nodes whose parent was accepted): predicted 0.31, accepted 0.12 with the domain first;
predicted 0.35, accepted 0.29 with the role first (trunk nodes 0.63 / 0.65 and 0.64 / 0.64).
Each level shrinks towards the level above it by ``prior_strength`` pseudo-observations, the
coarsest towards the raw confidence::

    value_0 = c
    value_k = (accepted_k,b + s·value_{k-1}) / (verified_k,b + s)     (b = c's bin)

so a fine key with few observations falls back to what its coarser keys know. A node counts
as verified only if its parent was accepted (its confidence is conditional on the parent
path). ``decay`` < 1 forgets old observations so calibration follows a changing workload.
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
