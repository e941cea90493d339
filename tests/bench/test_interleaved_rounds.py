"""``cosine_ray.bench.rounds``: the order systems take turns in, round after round, and the
arithmetic of what the rounds measured (median, mean, min-max, ratios paired by round)."""

from __future__ import annotations

import random

import pytest

from cosine_ray.bench.rounds import Interleaving, Spread, paired_ratios, round_order, run_rounds

WORK = [("none", 8), ("default", 8), ("fixed", 8)]


def test_every_round_runs_every_item_once_in_its_own_seeded_order():
    order = round_order(WORK, 4, "shuffle", seed=0)
    assert [r for r, _ in order] == [1] * 3 + [2] * 3 + [3] * 3 + [4] * 3
    for r in range(1, 5):
        assert sorted(w for k, w in order if k == r) == sorted(WORK)
    assert len({tuple(w for k, w in order if k == r) for r in range(1, 5)}) > 1  # not one fixed order
    assert round_order(WORK, 4, "shuffle", seed=0) == order and round_order(WORK, 4, "shuffle", seed=1) != order


def test_shuffled_rounds_draw_from_one_generator_seeded_once():
    """The sequence of orders is what one ``random.Random(seed)`` shuffling a fresh copy each
    round gives: a script that shuffles per concurrency within a round draws in that order too."""
    rng = random.Random(7)
    expected = []
    for _ in range(5):
        items = list(WORK)
        rng.shuffle(items)
        expected.append(items)
    interleaving = Interleaving("shuffle", seed=7)
    assert [interleaving.order(WORK, r) for r in range(1, 6)] == expected


def test_alternate_reverses_every_second_round_and_fixed_keeps_the_order():
    assert [w for _, w in round_order(["a", "b", "c"], 3, "alternate")] == list("abccbaabc")
    assert [w for _, w in round_order(["a", "b"], 2, "fixed")] == list("abab")
    assert Interleaving("alternate").order(("x", "y"), 2) == ["y", "x"]  # a tuple in, a new list out
    with pytest.raises(ValueError, match="order must be one of shuffle, alternate, fixed"):
        Interleaving("random")


def test_run_rounds_calls_in_the_interleaved_order_and_keeps_each_items_results_by_round():
    calls = []

    def run(rnd, item):
        calls.append((rnd, item))
        return f"{item}@{rnd}"

    results = run_rounds(["a", "b", "c"], 2, run, order="alternate")
    assert calls == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a")]
    assert results == {"a": ["a@1", "a@2"], "b": ["b@1", "b@2"], "c": ["c@1", "c@2"]}
    shuffled = run_rounds(WORK, 3, lambda rnd, item: rnd, seed=3)
    assert all(v == [1, 2, 3] for v in shuffled.values())


def test_spread_of_the_rounds():
    s = Spread.of([1.3, 1.1, 1.2, 1.6])
    assert (s.median, s.low, s.high) == (pytest.approx(1.25), 1.1, 1.6)
    assert s.mean == pytest.approx(1.3)
    assert s.text() == "1.25 (1.10-1.60)" and s.text(".1f") == "1.2 (1.1-1.6)"
    one = Spread.of([2.0])
    assert (one.median, one.mean, one.low, one.high) == (2.0, 2.0, 2.0, 2.0)
    with pytest.raises(ValueError):
        Spread.of([])


def test_ratios_pair_each_round_with_the_same_rounds_baseline():
    values, baselines = [130.0, 220.0, 150.0], [100.0, 200.0, 150.0]
    ratios = paired_ratios(values, baselines)
    assert ratios == pytest.approx([1.3, 1.1, 1.0])
    s = Spread.of(ratios)
    assert (s.median, s.low, s.high) == (pytest.approx(1.1), pytest.approx(1.0), pytest.approx(1.3))
    # not the ratio of the medians (150 / 150), which pairs one round's value with another's baseline
    assert Spread.of(values).median / Spread.of(baselines).median == pytest.approx(1.0)
