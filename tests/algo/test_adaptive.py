"""Expected-gain curves, participation control and online confidence calibration."""

import random

import pytest

from cosine_ray.algo.adaptive import ParticipationController, expected_gains
from cosine_ray.algo.calibration import ConfidenceCalibrator


def test_expected_gains_are_running_sums_of_sorted_node_probabilities():
    gains = expected_gains([0.5, 0.9, 0.25, 0.45], gamma_max=3)
    assert gains == pytest.approx((0.0, 0.9, 1.4, 1.85))
    assert expected_gains([], 4) == (0.0,)
    diffs = [b - a for a, b in zip(gains, gains[1:])]
    assert all(x >= y for x, y in zip(diffs, diffs[1:]))  # concave


def test_participation_rises_while_the_verifier_idles_and_falls_when_it_is_the_bottleneck():
    c = ParticipationController(min_drafters=1, max_drafters=3, initial=2, window=4)
    for _ in range(4):
        c.observe(0.5, 0.0)
    assert c.current == 3
    for _ in range(8):
        c.observe(0.5, 0.0)
    assert c.current == 3  # capped
    for _ in range(4):
        c.observe(0.0, 0.9)
    assert c.current == 2
    for _ in range(4):
        c.observe(0.0, 0.1)  # busy verifier but drafts are used: hold
    assert c.current == 2
    for _ in range(8):
        c.observe(0.01, 0.8)
    assert c.current == 1
    with pytest.raises(ValueError):
        ParticipationController(min_drafters=2, initial=1)


def test_calibration_learns_each_drafters_real_acceptance():
    cal = ConfidenceCalibrator(decay=1.0)
    assert cal.calibrate("ngram", 0.5) == 0.5  # no data: the raw value
    rng = random.Random(0)
    for _ in range(4000):  # ngram says 0.5 but is right 80 % of the time; retrieval says 0.9, right 30 %
        cal.observe("ngram", 0.5, rng.random() < 0.8)
        cal.observe("retrieval", 0.9, rng.random() < 0.3)
    assert cal.calibrate("ngram", 0.5) == pytest.approx(0.8, abs=0.03)
    assert cal.calibrate("retrieval", 0.9) == pytest.approx(0.3, abs=0.03)
    assert cal.calibrate("ngram", 0.05) == 0.05  # an unseen bin keeps the raw value


def test_calibration_forgets_with_decay():
    cal = ConfidenceCalibrator(decay=0.99)
    for _ in range(1000):
        cal.observe("d", 0.55, False)
    for _ in range(1000):
        cal.observe("d", 0.55, True)
    assert cal.calibrate("d", 0.55) > 0.95
