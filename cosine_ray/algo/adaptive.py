"""Adaptive speculation: how much to draft, from what the verifier and the drafts tell us.

Two knobs move with the load (CoSine §4.2, Algorithm 2):

- **γ_i per request** comes from the LP scheduler (``algo.scheduling.lp_schedule``): each request's
  draft tree gives an *expected gain* curve — the expected accepted tokens if its best g
  nodes are verified — and the LP weighs those gains against the measured cost of
  verifying more tokens. When the calibrated gains no longer pay for the verify time (a
  busy verifier, unpredictable text) γ_i goes to 0 and the request decodes plainly: that is
  how speculation turns itself down under load. ``expected_gains`` builds the curve.
- **Drafter participation** (drafters routed per request, k) follows the verifier:
  ``ParticipationController`` raises k while the verifier idles (spare verify capacity:
  more drafters give better trees for the same step time) and lowers it while the verifier
  is the bottleneck and the scheduler throws most drafted nodes away (drafting more only
  costs drafter time and transfer). Hysteresis over a window of steps keeps it from
  oscillating.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


def expected_gains(node_acceptance: Sequence[float], gamma_max: int) -> tuple[float, ...]:
    """``gains[g]`` = expected accepted draft tokens when the g best nodes are verified.

    ``node_acceptance`` holds, per draft node, the probability that it is accepted (the
    product of calibrated confidences along its path). The expected number of accepted
    nodes of a tree is the sum of these probabilities (linearity of expectation), and the
    best g nodes by that probability always include their ancestors, so the curve is the
    running sum of the sorted probabilities: nondecreasing and concave, as the LP needs.
    """
    ordered = sorted((min(max(p, 0.0), 1.0) for p in node_acceptance), reverse=True)[:max(gamma_max, 0)]
    gains = [0.0]
    for p in ordered:
        gains.append(gains[-1] + p)
    return tuple(gains)


@dataclass(slots=True)
class ParticipationController:
    min_drafters: int = 1
    max_drafters: int = 3
    initial: int = 2
    window: int = 16
    """Steps observed before each decision."""
    idle_high: float = 0.25
    """Verifier idle fraction above which participation rises."""
    idle_low: float = 0.05
    """Verifier idle fraction below which (with most drafts trimmed) participation falls."""
    trimmed_high: float = 0.6
    """Share of drafted nodes the scheduler dropped above which the drafts are surplus."""
    current: int = field(init=False)
    _idle: list[float] = field(default_factory=list)
    _trimmed: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0 <= self.min_drafters <= self.initial <= self.max_drafters:
            raise ValueError("need 0 <= min_drafters <= initial <= max_drafters")
        self.current = self.initial

    def observe(self, verifier_idle_fraction: float, trimmed_fraction: float) -> int:
        """Record one step; returns the participation for the next steps."""
        self._idle.append(verifier_idle_fraction)
        self._trimmed.append(trimmed_fraction)
        if len(self._idle) < self.window:
            return self.current
        idle = sum(self._idle) / len(self._idle)
        trimmed = sum(self._trimmed) / len(self._trimmed)
        self._idle.clear()
        self._trimmed.clear()
        if idle > self.idle_high and self.current < self.max_drafters:
            self.current += 1
        elif idle < self.idle_low and trimmed > self.trimmed_high and self.current > self.min_drafters:
            self.current -= 1
        return self.current
