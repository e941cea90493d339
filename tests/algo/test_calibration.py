"""Confidence calibration along coarse-to-fine keys (drafter, role, domain, depth)."""

from __future__ import annotations

import random

import pytest

from cosine_ray.algo.calibration import ConfidenceCalibrator, node_levels


def feed(cal: ConfidenceCalibrator, levels, confidence: float, rate: float, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        cal.observe(levels, confidence, rng.random() < rate)


def test_an_unobserved_key_is_the_raw_confidence():
    cal = ConfidenceCalibrator()
    assert cal.calibrate(node_levels("ngram", "code", 1, True), 0.73) == 0.73


def test_a_key_learns_the_acceptance_frequency_of_its_bin():
    cal = ConfidenceCalibrator(decay=1.0)
    levels = node_levels("ngram", "code", 1, True)
    feed(cal, levels, 0.95, rate=0.2, n=2000)
    assert cal.calibrate(levels, 0.95) == pytest.approx(0.2, abs=0.04)
    assert cal.calibrate(levels, 0.55) == pytest.approx(0.55)  # another bin: nothing learned there


def test_trunk_and_branch_learn_apart_and_share_what_the_drafter_knows():
    cal = ConfidenceCalibrator(decay=1.0)
    trunk, branch = node_levels("r", "code", 1, True), node_levels("r", "code", 1, False)
    feed(cal, trunk, 0.85, rate=0.7, n=3000, seed=1)
    feed(cal, branch, 0.85, rate=0.1, n=3000, seed=2)
    assert cal.calibrate(trunk, 0.85) == pytest.approx(0.7, abs=0.05)
    assert cal.calibrate(branch, 0.85) == pytest.approx(0.1, abs=0.05)
    # a depth never seen falls back to its role's level, not to the raw confidence
    assert cal.calibrate(node_levels("r", "code", 3, False), 0.85) == pytest.approx(0.1, abs=0.05)
    # another domain falls back to the drafter's level for that role, not to the mix of roles:
    # branches are few, so what one domain's branches taught serves the others
    assert cal.calibrate(node_levels("r", "math", 1, True), 0.85) == pytest.approx(0.7, abs=0.05)
    assert cal.calibrate(node_levels("r", "math", 1, False), 0.85) == pytest.approx(0.1, abs=0.05)
    # the coarsest key, the drafter alone, holds the mix of both roles
    assert 0.3 < cal.calibrate(node_levels("r", "math", 1, True)[:1], 0.85) < 0.5


def test_depths_four_and_deeper_share_a_level():
    assert node_levels("d", "x", 4, True) == node_levels("d", "x", 9, True)
    assert node_levels("d", "x", 3, True) != node_levels("d", "x", 4, True)
    assert node_levels("d", "x", 2, True)[:3] == node_levels("d", "x", 2, True)[:3]


def test_decay_follows_a_changing_workload():
    cal = ConfidenceCalibrator(decay=0.99)
    levels = node_levels("ngram", "chat", 2, True)
    feed(cal, levels, 0.6, rate=0.9, n=1000, seed=3)
    assert cal.calibrate(levels, 0.6) > 0.8
    feed(cal, levels, 0.6, rate=0.1, n=1000, seed=4)  # the drafter got worse
    assert cal.calibrate(levels, 0.6) < 0.2


def test_tree_bias_scales_gains_by_what_verification_accepted_per_domain():
    from cosine_ray.algo.calibration import TreeBias

    bias = TreeBias(prior_tokens=4.0, decay=1.0)
    assert bias.factor("code") == 1.0 and bias.scale("code", [0.5, 0.2]) == [0.5, 0.2]
    for _ in range(20):  # trees expected to yield 2 tokens yield 3
        bias.observe("code", 2.0, 3)
    assert bias.factor("code") == (60 + 4) / (40 + 4)
    assert bias.factor("math") == 1.0  # another domain keeps its own sums
    scaled = bias.scale("code", [0.9, 0.6, 0.3])
    assert scaled[0] == 1.0 and scaled[1] > scaled[2]  # capped at 1, order kept
    assert scaled[2] == 0.3 * bias.factor("code")
    for _ in range(200):  # trees that yield less than expected: no correction downwards
        bias.observe("math", 1.0, 0)
    assert bias.factor("math") == bias.min_factor == 1.0
