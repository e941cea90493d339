"""A guard that keeps speculation from costing more than it gains (explore/exploit on its level).

The price of a draft node is only as good as its two models (calibrated acceptance, measured
verify cost), and a systematic error in either makes speculation slower than not speculating.
So the level of speculation is learned from what it yields on this machine:

- a *level* κ (``LEVELS``) multiplies the price's λ: 0 is speculation off, 1 the price as the
  models say, 0.5 / 1.5 trust the gains less / more;
- a *bucket* is a power-of-two range of the step's rows (``bucket_of``), each with its own level;
- a step's *yield* is its committed tokens per request over its wall time in plain-decode steps
  of the same shape, so a bias of the cost model cancels (``rescale_times`` keeps the unit
  across refits); a level's *goodput* is the decayed ratio of its yields to its times;
- with probability ε a step explores a neighbouring level; the current level moves to one
  whose goodput is better by a margin and by a standard error of the difference (*evidence*).

The scheduler divides λ by the bucket's operating goodput G (``operating_goodput``). The rules,
the constants and why: docs/algorithms.md ("The speculation guard").
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

LEVELS = (0.0, 0.5, 1.0, 1.5)
"""κ: multiplier on the value of an expected accepted token (0 = speculation off)."""


def bucket_of(rows: int) -> int:
    """The guard's batch-size bucket of a step with ``rows`` requests: 1 for 1, 2 for 2-3, 3 for
    4-7, 4 for 8-15, 5 for 16-31, ... (a step of no rows counts as one)."""
    return max(int(rows), 1).bit_length()


def bucket_label(bucket: int) -> str:
    """``bucket_of``'s bucket as the rows it holds: "1", "2-3", "4-7", ..."""
    low = 1 << (bucket - 1)
    return str(low) if low == 1 else f"{low}-{2 * low - 1}"


@dataclass(slots=True)
class _Bucket:
    """One batch-size bucket's explore/exploit state."""
    current: int
    num_levels: int
    seen: int = 0
    """Steps observed in this bucket, any level (not decayed): its age."""
    yields: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)
    squares: list[list[float]] = field(default_factory=list)
    """Per level, decayed [Σ w·y², Σ w·t², Σ w·y·t, Σ w²]: the spread of its steps (*evidence*)."""

    def __post_init__(self) -> None:
        self.yields = [0.0] * self.num_levels
        self.times = [0.0] * self.num_levels
        self.steps = [0.0] * self.num_levels
        self.squares = [[0.0] * 4 for _ in range(self.num_levels)]

    def add(self, level: int, y: float, t: float, decay: float) -> None:
        """One step of yield y in normalised time t at ``level``; older steps decay."""
        self.yields[level] = decay * self.yields[level] + y
        self.times[level] = decay * self.times[level] + t
        self.steps[level] = decay * self.steps[level] + 1.0
        sq = self.squares[level]
        sq[0] = decay * sq[0] + y * y
        sq[1] = decay * sq[1] + t * t
        sq[2] = decay * sq[2] + y * t
        sq[3] = decay * decay * sq[3] + 1.0

    def goodput(self, level: int) -> float | None:
        return self.yields[level] / self.times[level] if self.times[level] > 0 else None

    def variance(self, level: int) -> float:
        """Variance of ``goodput(level)`` as a ratio estimate over the decayed steps (0 before any)."""
        t, w = self.times[level], self.steps[level]
        if not t > 0 or not w > 0:
            return 0.0
        r = self.yields[level] / t
        yy, tt, yt, w2 = self.squares[level]
        residual = max(yy - 2.0 * r * yt + r * r * tt, 0.0)  # Σ w·(y − R·t)²
        return residual * (w2 / w) / (t * t)


@dataclass(slots=True)
class SpeculationGuard:
    levels: tuple[float, ...] = LEVELS
    start: int = 2
    """Index of a new bucket's first current level (κ = 1: trust the models)."""
    explore_share: float = 0.1
    young_explore_share: float = 0.3
    young_steps: int = 60
    decay: float = 0.98
    min_steps: float = 12.0
    margin: float = 0.03
    confidence: float = 1.0
    """k: a move needs a lead of k standard errors of the difference of the two goodputs."""
    seed: int | None = 0
    _buckets: dict[int, _Bucket] = field(init=False)
    _last: int = field(init=False)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if not self.levels or not 0 <= self.start < len(self.levels):
            raise ValueError("need at least one level and 0 <= start < len(levels)")
        if not 0.0 <= self.explore_share < 1.0 or not 0.0 <= self.young_explore_share < 1.0 \
                or not 0.0 < self.decay <= 1.0 or self.young_steps < 0 or not self.confidence >= 0.0:
            raise ValueError("explore shares must be in [0, 1), decay in (0, 1], young_steps >= 0 "
                             "and confidence >= 0")
        self._buckets = {}
        self._last = 1
        self._rng = random.Random(self.seed)

    def _bucket(self, rows: int) -> _Bucket:
        key = bucket_of(rows)
        self._last = key
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = _Bucket(self.start, len(self.levels))
        return bucket

    @property
    def current(self) -> int:
        """The current level index of the bucket the last step chose or observed (1 row before any)."""
        bucket = self._buckets.get(self._last)
        return bucket.current if bucket is not None else self.start

    def current_level(self, rows: int = 1) -> int:
        """The current level index for steps of ``rows`` requests."""
        bucket = self._buckets.get(bucket_of(rows))
        return bucket.current if bucket is not None else self.start

    def levels_by_bucket(self) -> dict[str, float]:
        """κ of each bucket's current level, keyed by the rows it holds ("1", "2-3", ...)."""
        return {bucket_label(k): self.levels[b.current] for k, b in sorted(self._buckets.items())}

    def min_steps_for(self, rows: int) -> float:
        """Decayed steps a level needs in ``rows``' bucket before it is compared: ``min_steps``
        over √(the bucket's smallest row count), at least 3."""
        return max(3.0, self.min_steps / math.sqrt(1 << (bucket_of(rows) - 1)))

    def _others(self, bucket: _Bucket) -> list[int]:
        """The levels a bucket explores and may move to: all others while young, else neighbours."""
        if bucket.seen < self.young_steps:
            return [i for i in range(len(self.levels)) if i != bucket.current]
        return [i for i in (bucket.current - 1, bucket.current + 1) if 0 <= i < len(self.levels)]

    def choose(self, rows: int = 1) -> int:
        """The level index a step of ``rows`` requests runs at: its bucket's current one, or
        another (exploring: any while the bucket is young, else a neighbour)."""
        bucket = self._bucket(rows)
        share = self.young_explore_share if bucket.seen < self.young_steps else self.explore_share
        if len(self.levels) > 1 and self._rng.random() < share:
            return self._rng.choice(self._others(bucket))
        return bucket.current

    def goodput(self, level: int, rows: int = 1) -> float | None:
        """Yield per normalised second of a level in ``rows``' bucket, or None before any step
        ran at it there."""
        bucket = self._buckets.get(bucket_of(rows))
        return bucket.goodput(level) if bucket is not None else None

    def operating_goodput(self, rows: int = 1) -> float:
        """Goodput of the current level of ``rows``' bucket, at least 1 (1 until it has
        ``min_steps`` steps): how many plain-decode steps' worth of tokens a step yields at the
        operating point. The scheduler divides the LP's λ by it (see ``engine.owners.scheduler``)."""
        bucket = self._buckets.get(bucket_of(rows))
        if bucket is None:
            return 1.0
        g = bucket.goodput(bucket.current)
        if g is None or bucket.steps[bucket.current] < self.min_steps_for(rows):
            return 1.0
        return max(g, 1.0)

    def rescale_times(self, factor: Callable[[int], float]) -> None:
        """The unit of time changed: the cost model was refitted, so a plain-decode step of a
        bucket's rows is now predicted ``1 / factor(rows)`` times as long as before (``factor``
        = old prediction / new one, at the bucket's smallest row count). Every stored normalised
        time is re-expressed in the new unit, so steps observed before and after a refit (or
        under the start-up default, on a machine it does not describe) are compared alike."""
        for key, b in self._buckets.items():
            f = factor(1 << (key - 1))
            if not f > 0 or not math.isfinite(f) or f == 1.0:
                continue
            b.times = [t * f for t in b.times]
            for sq in b.squares:
                sq[1] *= f * f
                sq[2] *= f

    def observe(self, level: int, tokens_per_request: float, plain_steps: float, rows: int = 1) -> None:
        """One step of ``rows`` requests at ``level``: committed tokens per request, and its wall
        time in units of a predicted plain-decode step of the same shape."""
        if not plain_steps > 0 or tokens_per_request < 0:
            return
        b = self._bucket(rows)
        may_move_to = self._others(b)  # judged by the bucket's age before this step
        b.seen += 1
        b.add(level, tokens_per_request, plain_steps, self.decay)
        enough = self.min_steps_for(rows)
        if level == b.current or level not in may_move_to or b.steps[level] < enough \
                or b.steps[b.current] < enough:
            return
        lead = b.goodput(level) - b.goodput(b.current)
        if lead > b.goodput(b.current) * self.margin \
                and lead > self.confidence * math.sqrt(b.variance(level) + b.variance(b.current)):
            b.current = level
