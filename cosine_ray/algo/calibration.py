"""Online confidence calibration: a drafter's raw probability → P(the target accepts it).

Drafters report their own probability of each token (an n-gram count ratio, a datastore
frequency, a small model's softmax). These are on different scales and none is the
probability that the *target* agrees, which is what fusion's argmax (eq. 4), TreeSelection
and the scheduler's expected gains need. Per drafter, raw confidences are binned
(``num_bins`` equal bins on [0, 1]); each bin keeps decayed counts of verified nodes and of
accepted ones, and the calibrated value is the bin's acceptance frequency shrunk towards
the raw confidence by ``prior_strength`` pseudo-observations::

    calibrated(c) = (accepted_b + s·c) / (verified_b + s)

A node counts as verified only if its parent was accepted (its confidence is conditional
on the parent path). ``decay`` < 1 forgets old observations so calibration follows a
changing workload.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ConfidenceCalibrator:
    num_bins: int = 10
    prior_strength: float = 8.0
    decay: float = 0.999
    """Per observation of a drafter, older counts of that drafter are multiplied by this."""
    _accepted: dict[str, list[float]] = field(default_factory=dict)
    _verified: dict[str, list[float]] = field(default_factory=dict)

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.num_bins), 0), self.num_bins - 1)

    def calibrate(self, drafter: str, confidence: float) -> float:
        verified = self._verified.get(drafter)
        if verified is None:
            return confidence
        b = self._bin(confidence)
        return (self._accepted[drafter][b] + self.prior_strength * confidence) / (verified[b] + self.prior_strength)

    def observe(self, drafter: str, confidence: float, accepted: bool) -> None:
        if drafter not in self._verified:
            self._verified[drafter] = [0.0] * self.num_bins
            self._accepted[drafter] = [0.0] * self.num_bins
        verified, acc = self._verified[drafter], self._accepted[drafter]
        if self.decay < 1.0:
            for i in range(self.num_bins):
                verified[i] *= self.decay
                acc[i] *= self.decay
        b = self._bin(confidence)
        verified[b] += 1.0
        if accepted:
            acc[b] += 1.0

    def table(self, drafter: str) -> list[tuple[float, float, float]]:
        """(bin centre, verified count, calibrated value at the centre) per bin, for reports."""
        out = []
        for b in range(self.num_bins):
            centre = (b + 0.5) / self.num_bins
            verified = self._verified.get(drafter, [0.0] * self.num_bins)[b]
            out.append((centre, verified, self.calibrate(drafter, centre)))
        return out
