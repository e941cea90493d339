"""What a step costs and what drafting gains: the two models the scheduler decides with.

- ``CostModel`` holds the measured latency model (T_llm, T_ssm; ``algo.scheduling.latency_model``):
  the start-up profile (``cosine-ray profile``) refitted every ``REFIT_EVERY`` verify steps
  from the profile's samples plus the last ``LIVE_SAMPLES`` live ones, so the scheduler
  follows the machine's real speed (other load, thermal limits, the thread count this process
  really runs with). Once ``LIVE_SAMPLES // 4`` live steps exist, each profile sample weighs
  ``BASE_WEIGHT`` of a live one: the profile still covers shapes the live traffic has not
  shown, but no longer outvotes what this machine is doing now.
- ``predicted_gains`` predicts a request's expected-gain curve (expected accepted draft tokens
  for its best g nodes) before it drafts: the calibrated curve of its last drafted tree
  (``Request.gain_curve``), which is what the LP batch decision (eq. 8) needs.

The scheduler reads both; the learner updates them after each verify step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from cosine_ray.algo.guard import bucket_of
from cosine_ray.algo.scheduling.latency_model import LatencyModel, LlmSample, llm_features

if TYPE_CHECKING:
    from cosine_ray.engine.request import Request

REFIT_EVERY = 16
LIVE_SAMPLES = 256
BASE_WEIGHT = 0.1
SLOPE_DECAY = 0.98
"""Per tree step of a batch-size bucket, its older samples weigh this much less (a window of
about 50 steps)."""
SLOPE_MIN_WEIGHT = 16.0
"""Decayed samples a bucket needs before its measured slope prices nodes."""
SLOPE_MIN_SPREAD = 1.5
"""Standard deviation of the new tokens per step (tokens) the samples need: a slope needs
steps of different sizes."""
SLOPE_CLAMP = (0.25, 4.0)
"""The measured slope is kept within these multiples of the fit's ``c_tok`` (a guard
against a few outliers, not a prior)."""


@dataclass(slots=True)
class _SlopeSums:
    """Decayed least-squares sums of (x = new tokens, y = seconds less attention) of one bucket."""

    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = SLOPE_DECAY
        self.w, self.x, self.y = d * self.w + 1.0, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    def slope(self) -> float | None:
        if self.w < SLOPE_MIN_WEIGHT:
            return None
        var = self.xx / self.w - (self.x / self.w) ** 2
        if var < SLOPE_MIN_SPREAD ** 2:
            return None
        return (self.xy / self.w - (self.x / self.w) * (self.y / self.w)) / var


class CostModel:
    def __init__(self, latency_model: LatencyModel | None = None) -> None:
        self.latency = latency_model or LatencyModel.default()
        """The current fit; replaced by each refit (read it, do not keep it)."""
        self._base = self.latency
        self._live: deque[LlmSample] = deque(maxlen=LIVE_SAMPLES)
        self._since_refit = 0
        self._slopes: dict[int, _SlopeSums] = {}
        """Per batch-size bucket (``algo.guard.bucket_of``): tree steps' seconds against their new tokens."""

    def token_slope(self, rows: int) -> float | None:
        """Seconds one more new token adds to a tree step of ``rows`` requests, as this bucket's
        recent tree steps measure it (their time less the fit's attention term, regressed on
        their new tokens); None until the bucket has enough steps of different sizes. The
        scheduler prices draft nodes at it (``engine.owners.scheduler``)."""
        sums = self._slopes.get(bucket_of(rows))
        slope = sums.slope() if sums is not None else None
        if slope is None:
            return None
        lo, hi = SLOPE_CLAMP
        c_tok = self.latency.c_tok
        return min(max(slope, lo * c_tok), hi * c_tok) if c_tok > 0 else max(slope, 0.0)

    def observe_verify(self, context_lens: Sequence[int], num_new_tokens: Sequence[int], seconds: float, *,
                       trees: bool = False) -> None:
        """One verify forward's shape and wall time; ``trees``: a step of decoding requests only
        (no prefill), which also measures its batch-size bucket's token slope."""
        self._live.append(LlmSample(tuple(context_lens), tuple(num_new_tokens), seconds))
        if trees and num_new_tokens:
            _, _, n_tok, _, attention = llm_features(context_lens, num_new_tokens)
            self._slopes.setdefault(bucket_of(len(num_new_tokens)), _SlopeSums()).add(
                n_tok, seconds - self.latency.c_attn * attention)
        self._since_refit += 1
        if self._since_refit >= REFIT_EVERY:
            self._since_refit = 0
            base = self._base
            base_weight = BASE_WEIGHT if len(self._live) >= LIVE_SAMPLES // 4 else 1.0
            self.latency = LatencyModel.fit(
                list(base.llm_samples) + list(self._live), base.ssm_samples, model_name=base.model_name,
                device=base.device, dtype=base.dtype, num_stages=base.num_stages, num_threads=base.num_threads,
                llm_weights=[base_weight] * len(base.llm_samples) + [1.0] * len(self._live))


def predicted_gains(request: "Request", budget: int) -> tuple[float, ...]:
    """Expected accepted draft tokens with γ = 0..budget (``gains[0] = 0``): the calibrated
    curve of the request's last drafted tree, what the batch decision needs before this
    step's tree exists."""
    curve = request.gain_curve[:budget + 1]
    return curve + (curve[-1],) * (budget + 1 - len(curve))
