"""What one engine step did, as plain counters (vLLM's ``SpecDecodingStats`` idea).

The learner (``engine/owners/learner.py``) builds one ``StepStats`` per step; calibration, routing,
drafter feedback and the metrics exporter (``metrics/exporter.py``) all read the same object,
so every figure is counted once. Nothing here knows a metric name.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestStepStats:
    """One decoding request's verify step."""

    request_id: str
    domain: str
    num_draft_tokens: int = 0
    """Draft nodes verified (the tree's nodes minus the root)."""
    num_accepted_tokens: int = 0
    """Draft tokens accepted (bonus excluded)."""
    drafted_by: dict[str, int] = field(default_factory=dict)
    accepted_by: dict[str, int] = field(default_factory=dict)
    routed: tuple[tuple[str, str], ...] = ()
    """(drafter, mode) of each drafter routed to it this step; mode explore|exploit|random|shared."""
    fusion_picks: dict[str, int] = field(default_factory=dict)
    """Fused (trunk) tokens of this step's tree per drafter (eq. 4)."""
    fusion_picks_accepted: dict[str, int] = field(default_factory=dict)
    """The ones verification accepted."""


@dataclass(slots=True)
class StepStats:
    requests: list[RequestStepStats] = field(default_factory=list)
    """Decoding requests that were verified (prefills carry no speculation)."""
    routed: list[RequestStepStats] = field(default_factory=list)
    """Requests routed to drafters this step (also when the step was then lost)."""
    batch_size: int = 0
    """Decoding requests the scheduler put in this step's micro-batch (prefills excluded)."""
    gammas: list[int] = field(default_factory=list)
    """γ_i: draft nodes kept for each decoding request of the batch."""
    decision_s: float = 0.0
    """Scheduling decision (LP) + TreeSelection time."""
    verify_s: float = 0.0
    drafter_failures: list[str] = field(default_factory=list)
    """Drafter of each dropped call, malformed answer or failed feedback."""
    drafter_round_trips: int = 0
    """Fusion rounds that waited for a drafter (drafting latency in round trips)."""
    participation: int | None = None
    """Drafters routed per request after this step (None: not adaptive)."""
    verify_predicted_s: float = 0.0
    """What the cost model predicted for this verify forward (measured: ``verify_s``)."""
    expected_accepted: float = 0.0
    """Σ over the verified trees of their nodes' predicted acceptance (the gain model)."""
    num_accepted: int = 0
    """Draft tokens the verified trees really had accepted (bonus excluded)."""
    speculation_level: float | None = None
    """κ of the guard's current level after this step (None: no guard)."""

    @property
    def total_gamma(self) -> int:
        return sum(self.gammas)

    @property
    def is_speculating(self) -> bool:
        return self.total_gamma > 0
