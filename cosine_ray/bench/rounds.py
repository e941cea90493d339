"""Interleaved rounds: on a machine whose speed drifts, systems compared in one run take turns,
round after round, and each ratio is taken within a round; the spread over rounds is the noise.

Orders: ``shuffle`` (each round in its own seeded order: no system always runs first or last),
``alternate`` (as given, then reversed, in turn) and ``fixed`` (as given every round).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
ORDERS = ("shuffle", "alternate", "fixed")


class Interleaving:
    """The order of each round's systems; ``shuffle`` draws every round's from one seeded
    generator, so a run's sequence of orders depends on its seed only."""

    def __init__(self, order: str = "shuffle", seed: int = 0) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
        self.kind = order
        self.rng = random.Random(seed)

    def order(self, items: Sequence[K], round_number: int) -> list[K]:
        """``items`` in the order round ``round_number`` (from 1) runs them."""
        items = list(items)
        if self.kind == "shuffle":
            self.rng.shuffle(items)
        elif self.kind == "alternate" and round_number % 2 == 0:
            items.reverse()
        return items


def round_order(items: Sequence[K], rounds: int, order: str = "shuffle", seed: int = 0) -> list[tuple[int, K]]:
    """(round, item) for every item in every round (rounds from 1), each round in its ``order``."""
    interleaving = Interleaving(order, seed)
    return [(r, item) for r in range(1, rounds + 1) for item in interleaving.order(items, r)]


def run_rounds(items: Sequence[K], rounds: int, run: Callable[[int, K], R], order: str = "shuffle",
               seed: int = 0) -> dict[K, list[R]]:
    """``run(round, item)`` for every item in every round, interleaved: each item's results in
    round order."""
    results: dict[K, list[R]] = {item: [] for item in items}
    for r, item in round_order(items, rounds, order, seed):
        results[item].append(run(r, item))
    return results


@dataclass(frozen=True)
class Spread:
    """Figures over rounds: their median and mean, and the lowest and highest as the band."""

    median: float
    mean: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        values = list(values)
        return cls(statistics.median(values), statistics.mean(values), min(values), max(values))

    def text(self, spec: str = ".2f") -> str:
        """``median (lowest-highest)``, each figure formatted with ``spec``: ``1.23 (1.10-1.31)``."""
        return f"{self.median:{spec}} ({self.low:{spec}}-{self.high:{spec}})"


def paired_ratios(values: Sequence[float], baselines: Sequence[float]) -> list[float]:
    """Each round's value over the same round's baseline."""
    return [v / b for v, b in zip(values, baselines)]
