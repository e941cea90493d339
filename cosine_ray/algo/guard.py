"""A guard that keeps speculation from costing more than it gains (explore/exploit on its level).

The scheduler prices draft nodes (``algo.tree_selection.TreePrice``): a node is verified when
its expected gain pays for its marginal verify time. That is only as good as its two models
(calibrated acceptance, measured verify cost); a systematic error in either makes speculation
slower than not speculating. So the level of speculation is itself learned from what it
yields on this machine:

- **levels** κ (``LEVELS``): a multiplier on the price's λ — 0 is speculation off (no drafting
  at all), 1 is the price as the models say, 0.5 / 1.5 trust the gains less / more;
- **operating goodput** G (``operating_goodput``): the current level's goodput, at least 1. The
  scheduler divides λ by it, so a token is valued at the time per token where the step runs
  (see ``engine.scheduler``); the levels then correct what the models still get wrong;
- **yield of a step**: committed tokens per request, divided by the step's wall time measured
  in *plain-decode steps of the same shape* (the cost model's prediction of a γ = 0 step for
  these requests and contexts). A step without speculation yields about 1; normalising by the
  plain step makes steps of different batch sizes and contexts comparable, and a bias of the
  cost model cancels (every level is divided by the same model);
- **explore**: each step runs at a neighbouring level (one below or one above, chosen at
  random) with probability ``explore_share`` (ε = 0.1), otherwise at the current level;
- **exploit**: per level, decayed sums of yield and time (``decay`` 0.98 per step of that
  level: a window of about 50 of its steps); when a neighbour has at least ``min_steps``
  (decayed) steps and its goodput (Σ yield / Σ normalised time) beats the current level's by
  more than ``margin`` (3 %), the current level moves there.

Why these numbers: ε = 0.1 bounds the cost of exploring at 10 % of the difference between
neighbouring levels (and a level that is clearly worse is visited only by exploration); a
50-step window reacts within a few seconds of decode on our CPU and a few hundred
milliseconds on a GPU, yet averages over the 1-to-9-token swings of single steps; the 3 %
margin keeps noise from flapping between levels. When speculation does not pay, the level
walks down to 0 and stays there, exploring 0.5 one step in 10 (level 0 has one neighbour).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

LEVELS = (0.0, 0.5, 1.0, 1.5)
"""κ: multiplier on the value of an expected accepted token (0 = speculation off)."""


@dataclass(slots=True)
class SpeculationGuard:
    levels: tuple[float, ...] = LEVELS
    start: int = 2
    """Index of the first current level (κ = 1: trust the models)."""
    explore_share: float = 0.1
    decay: float = 0.98
    min_steps: float = 12.0
    margin: float = 0.03
    seed: int | None = 0
    current: int = field(init=False)
    _yield: list[float] = field(init=False)
    _time: list[float] = field(init=False)
    _steps: list[float] = field(init=False)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        if not self.levels or not 0 <= self.start < len(self.levels):
            raise ValueError("need at least one level and 0 <= start < len(levels)")
        if not 0.0 <= self.explore_share < 1.0 or not 0.0 < self.decay <= 1.0:
            raise ValueError("explore_share must be in [0, 1) and decay in (0, 1]")
        self.current = self.start
        self._yield = [0.0] * len(self.levels)
        self._time = [0.0] * len(self.levels)
        self._steps = [0.0] * len(self.levels)
        self._rng = random.Random(self.seed)

    def choose(self) -> int:
        """The level index this step runs at: the current one, or a neighbour (exploring)."""
        if len(self.levels) > 1 and self._rng.random() < self.explore_share:
            neighbours = [i for i in (self.current - 1, self.current + 1) if 0 <= i < len(self.levels)]
            return self._rng.choice(neighbours)
        return self.current

    def goodput(self, level: int) -> float | None:
        """Yield per normalised second of a level, or None before any step ran at it."""
        return self._yield[level] / self._time[level] if self._time[level] > 0 else None

    def operating_goodput(self) -> float:
        """Goodput of the current level, at least 1 (1 until it has ``min_steps`` steps): how
        many plain-decode steps' worth of tokens a step yields at the operating point. The
        scheduler divides the LP's λ by it (see ``engine.scheduler``)."""
        g = self.goodput(self.current)
        if g is None or self._steps[self.current] < self.min_steps:
            return 1.0
        return max(g, 1.0)

    def observe(self, level: int, tokens_per_request: float, plain_steps: float) -> None:
        """One step at ``level``: committed tokens per request, and its wall time in units of a
        predicted plain-decode step of the same shape."""
        if not plain_steps > 0 or tokens_per_request < 0:
            return
        self._yield[level] = self.decay * self._yield[level] + tokens_per_request
        self._time[level] = self.decay * self._time[level] + plain_steps
        self._steps[level] = self.decay * self._steps[level] + 1.0
        if level == self.current or self._steps[level] < self.min_steps or self._steps[self.current] < self.min_steps:
            return
        if abs(level - self.current) == 1 and self.goodput(level) > self.goodput(self.current) * (1.0 + self.margin):
            self.current = level
