"""Arrival offsets (seconds from the start of the run) for open-loop load.

One method covers every schedule: draw a renewal process with unit mean rate, then map it
through the inverse cumulative intensity Λ⁻¹ of the chosen rate schedule (time rescaling):

    gaps g_k ~ Gamma(shape=burstiness, scale=1/burstiness)     (burstiness 1 = exponential)
    u_k = g_0 + … + g_{k−1}      (u_0 = 0: the first request goes at t = 0, as in vllm)
    t_k = Λ⁻¹(u_k),  Λ(t) = ∫₀ᵗ λ(s) ds

With a constant rate λ this is exactly ``vllm bench serve``'s arrivals (Poisson for
burstiness 1, gamma otherwise; smaller burstiness = burstier). ``request_rate = inf`` sends
everything at t = 0 (then ``--max-concurrency`` makes it closed-loop). The rate schedules,
including the CoSine paper's three arrival modes, are ``ArrivalConfig``'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCHEDULES = ("constant", "low", "high", "fluctuating")


@dataclass(frozen=True, slots=True)
class ArrivalConfig:
    """The rate schedule λ(t). The CoSine paper (§6.3, Fig. 7) evaluates online serving under
    three arrival modes, "low, high and fluctuated", without giving rates or shapes. Our
    interpretation, with ``R = --request-rate``:

        low          constant λ = f·R           (f = low_fraction)
        high         constant λ = R
        fluctuating  λ(t) = R·(f + (1−f)·(1 − cos(2πt/P))/2): starts at the low rate f·R, peaks
                     at R at t = P/2, back to f·R at t = P (P = period_s)
        constant     λ = R (vllm's behaviour; the same process as ``high``)
    """

    request_rate: float = math.inf
    """Requests per second (the peak rate R for the CoSine schedules); inf = all at once."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular."""
    schedule: str = "constant"
    """constant | low | high | fluctuating (see the class docstring)."""
    low_fraction: float = 0.25
    """f: the low rate as a fraction of R (schedules low and fluctuating)."""
    period_s: float = 60.0
    """P: the period of the fluctuating schedule, in seconds."""

    def __post_init__(self) -> None:
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not (math.isfinite(self.burstiness) and self.burstiness > 0):
            raise ValueError(f"--burstiness must be a finite number > 0, got {self.burstiness}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not 0 < self.low_fraction <= 1:
            raise ValueError(f"--low-rate-fraction must be in (0, 1], got {self.low_fraction}")
        if not (math.isfinite(self.period_s) and self.period_s > 0):
            raise ValueError(f"--fluctuation-period must be > 0 seconds, got {self.period_s}")
        if self.schedule != "constant" and math.isinf(self.request_rate):
            raise ValueError(f"--schedule {self.schedule} needs a finite --request-rate (the peak rate)")

    def rate_at(self, t: np.ndarray | float) -> np.ndarray:
        """λ(t) in requests per second."""
        t = np.asarray(t, dtype=float)
        r, f = self.request_rate, self.low_fraction
        if self.schedule == "low":
            return np.full_like(t, f * r)
        if self.schedule == "fluctuating":
            return r * (f + (1 - f) * (1 - np.cos(2 * np.pi * t / self.period_s)) / 2)
        return np.full_like(t, r)

    def cumulative(self, t: np.ndarray) -> np.ndarray:
        """Λ(t): expected arrivals in [0, t]."""
        t = np.asarray(t, dtype=float)
        r, f, p = self.request_rate, self.low_fraction, self.period_s
        if self.schedule == "low":
            return f * r * t
        if self.schedule == "fluctuating":
            return r * (f * t + (1 - f) * (t / 2 - p / (4 * np.pi) * np.sin(2 * np.pi * t / p)))
        return r * t


def arrival_offsets(num: int, config: ArrivalConfig, rng: np.random.Generator) -> np.ndarray:
    """``num`` non-decreasing offsets in seconds, the first one 0."""
    if num <= 0:
        return np.zeros(0)
    if math.isinf(config.request_rate):
        return np.zeros(num)
    gaps = rng.gamma(shape=config.burstiness, scale=1.0 / config.burstiness, size=num - 1)
    units = np.concatenate([[0.0], np.cumsum(gaps)])
    return invert_cumulative(units, config)


def invert_cumulative(units: np.ndarray, config: ArrivalConfig, *, iters: int = 80) -> np.ndarray:
    """t with Λ(t) = u for every u: closed form for constant rates. For ``fluctuating``,
    Λ(t) = R·(f·t + (1−f)·(t/2 − P/(4π)·sin(2πt/P))) is strictly increasing and is inverted by
    vectorised bisection between u/R and u/(f·R)."""
    units = np.asarray(units, dtype=float)
    r, f = config.request_rate, config.low_fraction
    if config.schedule == "low":
        return units / (f * r)
    if config.schedule != "fluctuating":
        return units / r
    lo, hi = units / r, units / (f * r)  # λ ∈ [f·R, R] bounds Λ⁻¹
    for _ in range(iters):
        mid = (lo + hi) / 2
        below = config.cumulative(mid) < units
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return (lo + hi) / 2
