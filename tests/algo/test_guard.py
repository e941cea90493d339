"""The speculation guard: explore/exploit on the level of speculation converges to the
level with the best measured goodput, backs off to 0 when speculation does not pay, explores a
bounded share of steps, does not flap on noise, and learns one level per batch-size bucket."""

from __future__ import annotations

import random

import pytest

from cosine_ray.algo.guard import LEVELS, SpeculationGuard, bucket_label, bucket_of


def drive(guard: SpeculationGuard, goodput: dict[float, float], steps: int, *, noise: float = 0.3,
          seed: int = 1, rows: int = 1) -> list[int]:
    """Run ``steps`` steps: a step at level κ commits about goodput[κ] tokens per request per
    plain-step unit of time (noisy, as single steps are: 1 to several tokens)."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        level = guard.choose(rows)
        chosen.append(level)
        plain_steps = rng.uniform(0.8, 1.6)  # steps of different shapes take different times
        tokens = max(0.0, goodput[guard.levels[level]] * plain_steps * (1 + rng.uniform(-noise, noise)))
        guard.observe(level, tokens, plain_steps, rows)
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
    guard = SpeculationGuard(explore_share=0.0, young_explore_share=0.0)
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


@pytest.mark.parametrize("kwargs", [dict(levels=()), dict(start=4), dict(explore_share=1.0), dict(decay=0.0),
                                    dict(young_explore_share=-0.1), dict(young_steps=-1)])
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


def test_buckets_are_powers_of_two_of_the_rows():
    assert [bucket_of(r) for r in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert [bucket_label(b) for b in (1, 2, 3, 4, 5)] == ["1", "2-3", "4-7", "8-15", "16-31"]


def test_each_batch_size_learns_its_own_level():
    """One request gains from speculating, sixteen lose: interleaved steps of both sizes (a
    single request between bursts of 16) settle on κ = 1.5 for 1 row and κ = 0 for 16, where a
    single level for all sizes could suit only one of them."""
    guard = SpeculationGuard()
    small = {0.0: 1.0, 0.5: 1.5, 1.0: 1.8, 1.5: 2.0}
    large = {0.0: 1.0, 0.5: 0.93, 1.0: 0.88, 1.5: 0.8}
    for i in range(40):
        drive(guard, small, 60, seed=2 * i, rows=1)
        drive(guard, large, 30, seed=2 * i + 1, rows=16)
    assert guard.levels[guard.current_level(1)] == 1.5
    assert guard.levels[guard.current_level(16)] == 0.0
    assert guard.current_level(20) == guard.current_level(16)  # 16-31 rows: one bucket
    assert guard.levels_by_bucket() == {"1": 1.5, "16-31": 0.0}
    assert guard.operating_goodput(1) == pytest.approx(guard.goodput(3, 1))
    assert guard.operating_goodput(16) == 1.0  # never below 1
    assert guard.current_level(4) == guard.start  # a bucket never seen: the models' word, κ = 1


def test_a_young_bucket_explores_more_then_settles_to_the_usual_share():
    guard = SpeculationGuard(young_steps=60)
    flat = {k: 1.0 for k in LEVELS}  # no level better: the current one stays, only exploring moves
    chosen = drive(guard, flat, 1060, rows=16, noise=0.0)
    young, old = chosen[:60], chosen[60:]
    assert sum(c != guard.start for c in young) / 60 == pytest.approx(0.3, abs=0.12)
    assert sum(c != guard.start for c in old) / 1000 == pytest.approx(0.1, abs=0.03)
    assert guard.current == guard.start


def test_a_young_bucket_jumps_past_a_local_optimum_an_old_one_walks_into():
    """κ = 1 beats both its neighbours but speculation off beats all: a young bucket, which
    explores and moves to any level, finds κ = 0 within its youth; with no youth (neighbours
    only, the rule once a bucket is old) the guard stays at κ = 1."""
    goodput = {0.0: 1.0, 0.5: 0.6, 1.0: 0.7, 1.5: 0.6}
    young = SpeculationGuard()
    drive(young, goodput, 60, rows=16, noise=0.1)
    assert young.levels[young.current_level(16)] == 0.0
    assert young.min_steps_for(16) == 3.0 and young.min_steps_for(1) == young.min_steps
    no_youth = SpeculationGuard(young_steps=0)
    drive(no_youth, goodput, 600, rows=16, noise=0.1)
    assert no_youth.levels[no_youth.current_level(16)] == 1.0


def test_a_levels_variance_is_the_ratio_estimates():
    """Without decay the variance is the textbook ratio estimate's, Σ (y − R·t)² / (Σ t)²; with
    decay each step's weight enters squared, and Σ w² is kept exactly."""
    rng = random.Random(3)
    steps = [(rng.uniform(0.5, 3.0), rng.uniform(0.8, 1.6)) for _ in range(30)]
    flat = SpeculationGuard(decay=1.0, explore_share=0.0, young_explore_share=0.0)
    for y, t in steps:
        flat.observe(flat.start, y, t)
    bucket = flat._buckets[1]
    r = sum(y for y, _ in steps) / sum(t for _, t in steps)
    assert bucket.variance(flat.start) == pytest.approx(
        sum((y - r * t) ** 2 for y, t in steps) / sum(t for _, t in steps) ** 2)
    decayed = SpeculationGuard(decay=0.9, explore_share=0.0, young_explore_share=0.0)
    for y, t in steps:
        decayed.observe(decayed.start, y, t)
    b = decayed._buckets[1]
    w = [0.9 ** (len(steps) - 1 - i) for i in range(len(steps))]
    assert b.squares[decayed.start][3] == pytest.approx(sum(x * x for x in w))
    rw = sum(x * y for x, (y, _) in zip(w, steps)) / sum(x * t for x, (_, t) in zip(w, steps))
    spread = sum(x * (y - rw * t) ** 2 for x, (y, t) in zip(w, steps))  # Σ w·(y − R·t)²
    assert b.variance(decayed.start) == pytest.approx(  # each w² as Σ w² / Σ w (the module's note)
        spread * (sum(x * x for x in w) / sum(w)) / sum(x * t for x, (_, t) in zip(w, steps)) ** 2)
    assert b.variance(0) == 0.0  # a level that never ran has no spread (and no goodput)
    same = SpeculationGuard(decay=1.0, explore_share=0.0, young_explore_share=0.0)
    for _ in range(10):
        same.observe(same.start, 1.5, 1.0)
    assert same._buckets[1].variance(same.start) == pytest.approx(0.0, abs=1e-12)


def count_moves(confidence: float, seed: int, steps: int = 300) -> int:
    guard = SpeculationGuard(confidence=confidence, seed=seed)
    rng = random.Random(seed)
    moves, last = 0, guard.current_level(8)
    for _ in range(steps):
        level = guard.choose(8)
        plain_steps = rng.uniform(0.8, 1.6)
        guard.observe(level, 1.3 * plain_steps * (1 + rng.uniform(-0.5, 0.5)), plain_steps, 8)
        moves += guard.current_level(8) != last
        last = guard.current_level(8)
    return moves


def test_at_eight_rows_equal_levels_need_evidence_not_a_lucky_step():
    """At 8 rows a level is compared after about 4 decayed steps, where one lucky
    step is a 3 % lead. Requiring a lead of a standard error as well halves the moves between
    levels that are equal (noisy steps, ±50 %), over 40 seeded runs of 300 steps."""
    with_margin_only = sum(count_moves(0.0, seed) for seed in range(40))
    with_evidence = sum(count_moves(1.0, seed) for seed in range(40))
    assert with_evidence <= 0.6 * with_margin_only
    assert with_margin_only >= 60  # the noise this guards against is there to be guarded against


def test_with_evidence_required_a_better_level_is_still_found_at_eight_rows():
    found = 0
    for seed in range(40):
        guard = SpeculationGuard(seed=seed)
        drive(guard, {0.0: 1.0, 0.5: 1.1, 1.0: 1.2, 1.5: 1.45}, 300, noise=0.5, seed=seed, rows=8)
        found += guard.levels[guard.current_level(8)] == 1.5
    assert found >= 36


def test_confidence_must_not_be_negative():
    with pytest.raises(ValueError):
        SpeculationGuard(confidence=-1.0)


def test_rescaled_times_read_as_if_observed_in_the_new_unit():
    """A refit of the cost model changes the unit of the stored times (plain-decode steps of the
    old model): after ``rescale_times(f)`` each bucket's goodput and its variance are those of the
    same steps observed with every time multiplied by f(its smallest row count)."""
    rng = random.Random(5)
    steps = [(rows, level, rng.uniform(0.5, 3.0), rng.uniform(0.8, 1.6))
             for _ in range(40) for rows in (1, 8) for level in (1, 2)]
    factor = {1: 0.25, 8: 3.0}
    rescaled, direct = (SpeculationGuard(explore_share=0.0, young_explore_share=0.0, margin=10.0)
                        for _ in range(2))
    for rows, level, y, t in steps:
        rescaled.observe(level, y, t, rows)
        direct.observe(level, y, t * factor[rows], rows)
    rescaled.rescale_times(lambda rows: factor[rows])
    for rows in (1, 8):
        for level in (1, 2):
            assert rescaled.goodput(level, rows) == pytest.approx(direct.goodput(level, rows))
            b, d = rescaled._buckets[bucket_of(rows)], direct._buckets[bucket_of(rows)]
            assert b.variance(level) == pytest.approx(d.variance(level))
    before = rescaled.goodput(2, 1)
    rescaled.rescale_times(lambda rows: float("nan"))  # an unusable factor leaves the times alone
    assert rescaled.goodput(2, 1) == before
