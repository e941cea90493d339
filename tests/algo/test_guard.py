"""The speculation guard (issue 20): explore/exploit on the level of speculation converges to the
level with the best measured goodput, backs off to 0 when speculation does not pay, explores a
bounded share of steps, and does not flap on noise."""

from __future__ import annotations

import random

import pytest

from cosine_ray.algo.guard import LEVELS, SpeculationGuard


def drive(guard: SpeculationGuard, goodput: dict[float, float], steps: int, *, noise: float = 0.3,
          seed: int = 1) -> list[int]:
    """Run ``steps`` steps: a step at level κ commits about goodput[κ] tokens per request per
    plain-step unit of time (noisy, as single steps are: 1 to several tokens)."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        level = guard.choose()
        chosen.append(level)
        plain_steps = rng.uniform(0.8, 1.6)  # steps of different shapes take different times
        tokens = max(0.0, goodput[guard.levels[level]] * plain_steps * (1 + rng.uniform(-noise, noise)))
        guard.observe(level, tokens, plain_steps)
    return chosen


def test_settles_on_the_level_with_the_best_goodput():
    guard = SpeculationGuard(start=1)
    chosen = drive(guard, {0.0: 1.0, 0.5: 1.3, 1.0: 1.5, 1.5: 1.2}, 3000)
    assert guard.levels[guard.current] == 1.0
    late = chosen[1500:]
    # exploitation: the current level runs about 1 - ε of the steps; exploring costs the rest
    assert late.count(2) / len(late) == pytest.approx(0.9, abs=0.03)
    assert set(late) <= {1, 2, 3}  # exploring only ever visits neighbours


def test_backs_off_to_no_speculation_when_it_does_not_pay():
    guard = SpeculationGuard()  # starts at κ = 1, the models' word
    chosen = drive(guard, {0.0: 1.0, 0.5: 0.9, 1.0: 0.8, 1.5: 0.7}, 3000)
    assert guard.current == 0
    late = chosen[1500:]
    assert late.count(0) / len(late) == pytest.approx(0.9, abs=0.03)  # one neighbour: 0.5, one step in 10
    # what guarding costs once settled: ε × the gap to the neighbour, i.e. about 1 % here
    realised = sum({0: 1.0, 1: 0.9}[i] for i in late) / len(late)
    assert realised > 0.985


def test_moves_up_when_the_models_are_too_timid():
    guard = SpeculationGuard(start=0)
    drive(guard, {0.0: 1.0, 0.5: 1.2, 1.0: 1.35, 1.5: 1.5}, 4000)
    assert guard.current == 3


def test_does_not_flap_between_equal_levels():
    guard = SpeculationGuard()
    moves, last = 0, guard.current
    rng = random.Random(7)
    for _ in range(3000):
        level = guard.choose()
        guard.observe(level, 1.2 * (1 + rng.uniform(-0.5, 0.5)), 1.0)
        moves += guard.current != last
        last = guard.current
    assert moves <= 6


def test_explore_share_zero_never_leaves_the_current_level():
    guard = SpeculationGuard(explore_share=0.0)
    assert set(drive(guard, {0.0: 2.0, 0.5: 1.0, 1.0: 0.5, 1.5: 0.1}, 500)) == {guard.start}
    assert guard.current == guard.start  # without exploring there is nothing to compare against


def test_goodput_is_none_until_a_level_ran_and_bad_observations_are_ignored():
    guard = SpeculationGuard()
    assert all(guard.goodput(i) is None for i in range(len(LEVELS)))
    guard.observe(2, 3.0, 0.0)
    guard.observe(2, -1.0, 1.0)
    assert guard.goodput(2) is None
    guard.observe(2, 3.0, 2.0)
    assert guard.goodput(2) == pytest.approx(1.5)


@pytest.mark.parametrize("kwargs", [dict(levels=()), dict(start=4), dict(explore_share=1.0), dict(decay=0.0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SpeculationGuard(**kwargs)


def test_operating_goodput_is_the_current_levels_once_it_has_enough_steps_and_never_below_one():
    guard = SpeculationGuard(explore_share=0.0)
    assert guard.operating_goodput() == 1.0  # nothing measured: the LP's λ as it is
    for _ in range(5):
        guard.observe(guard.current, 1.8, 1.2)
    assert guard.operating_goodput() == 1.0  # fewer than min_steps (decayed) steps: not yet trusted
    for _ in range(40):
        guard.observe(guard.current, 1.8, 1.2)
    assert guard.operating_goodput() == pytest.approx(1.5)
    assert guard.operating_goodput() == pytest.approx(guard.goodput(guard.current))
    slow = SpeculationGuard(explore_share=0.0)
    for _ in range(40):
        slow.observe(slow.current, 0.9, 1.2)  # speculation losing: λ is never raised above the LP's
    assert slow.operating_goodput() == 1.0
