"""The cost model's measured token slope per batch-size bucket (``engine.owners.economics``): what the
scheduler prices a draft node's verify time at once a bucket has tree steps of several sizes."""

from __future__ import annotations

import random

import pytest

from cosine_ray.engine.owners.economics import SLOPE_CLAMP, SLOPE_MIN_WEIGHT, CostModel


def feed(costs: CostModel, rows: int, slope_s: float, steps: int, *, spread: bool = True, trees: bool = True,
         seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        new = [1 + (rng.randint(0, 6) if spread else 2) for _ in range(rows)]
        ctx = [rng.randint(100, 300) for _ in range(rows)]
        attention = costs.latency.c_attn * sum(n * (l + n) for l, n in zip(ctx, new))
        seconds = 0.05 + 0.003 * rows + slope_s * sum(new) + attention + rng.gauss(0, 2e-4)
        costs.observe_verify(ctx, new, seconds, trees=trees)


def test_each_bucket_measures_its_own_slope_once_it_has_steps_of_several_sizes():
    costs = CostModel()
    c_tok = costs.latency.c_tok
    assert costs.token_slope(8) is None
    feed(costs, 8, 1.3 * c_tok, int(SLOPE_MIN_WEIGHT) - 1)
    assert costs.token_slope(8) is None  # not enough steps yet
    feed(costs, 8, 1.3 * c_tok, 40, seed=1)
    assert costs.token_slope(8) == pytest.approx(1.3 * c_tok, rel=0.05)
    assert costs.token_slope(12) == costs.token_slope(8)  # same bucket (8-15)
    assert costs.token_slope(1) is None  # another bucket, nothing seen
    feed(costs, 1, 0.5 * c_tok, 60, seed=2)
    assert costs.token_slope(1) == pytest.approx(0.5 * c_tok, rel=0.1)


def test_no_slope_from_steps_of_one_size_from_prefills_or_out_of_bounds():
    costs = CostModel()
    c_tok = costs.latency.c_tok
    feed(costs, 8, 2 * c_tok, 60, spread=False)
    assert costs.token_slope(8) is None  # every step the same size: no slope to read
    feed(costs, 4, 2 * c_tok, 60, trees=False)
    assert costs.token_slope(4) is None  # steps with a prefill do not count
    feed(costs, 2, 100 * c_tok, 60)
    assert costs.token_slope(2) == pytest.approx(SLOPE_CLAMP[1] * costs.latency.c_tok)  # the refitted c_tok
