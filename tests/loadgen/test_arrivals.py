"""Arrival processes: rates, burstiness, the CoSine schedules, seeding. Tolerances are ≥ 3σ of the
sampling error for the sizes used (stated per test)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.arrivals import ArrivalConfig, arrival_offsets, invert_cumulative


def offsets(n: int, seed: int = 0, **kw) -> np.ndarray:
    return arrival_offsets(n, ArrivalConfig(**kw), np.random.default_rng(seed))


def test_infinite_rate_sends_everything_at_once():
    assert list(offsets(5)) == [0.0] * 5
    assert offsets(0).size == 0


def test_poisson_rate_and_exponential_gaps():
    t = offsets(4001, request_rate=5.0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    # mean gap 0.2 s; std of the mean over 4000 gaps = 0.2/sqrt(4000) = 0.0032 → ±0.01 is ~3σ
    assert gaps.mean() == pytest.approx(0.2, abs=0.01)
    # exponential: coefficient of variation 1 (sd of the CV estimate ≈ 0.016 here)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.06)


@pytest.mark.parametrize("burstiness, cv", [(0.25, 2.0), (4.0, 0.5)])
def test_gamma_burstiness_changes_variability_not_rate(burstiness, cv):
    gaps = np.diff(offsets(8001, request_rate=10.0, burstiness=burstiness))
    assert gaps.mean() == pytest.approx(0.1, rel=0.06)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # gamma CV = 1/sqrt(shape)


def test_seed_determinism():
    a, b = offsets(50, seed=7, request_rate=3.0), offsets(50, seed=7, request_rate=3.0)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, offsets(50, seed=8, request_rate=3.0))


def test_low_and_high_schedules():
    low = np.diff(offsets(4001, request_rate=8.0, schedule="low", low_fraction=0.25))
    high = np.diff(offsets(4001, request_rate=8.0, schedule="high"))
    assert low.mean() == pytest.approx(1 / 2.0, rel=0.05)   # f·R = 2 req/s
    assert high.mean() == pytest.approx(1 / 8.0, rel=0.05)


def test_fluctuating_inverts_the_cumulative_rate_exactly():
    cfg = ArrivalConfig(request_rate=4.0, schedule="fluctuating", low_fraction=0.25, period_s=10.0)
    units = np.linspace(0, 200, 1001)
    t = invert_cumulative(units, cfg)
    assert np.allclose(cfg.cumulative(t), units, atol=1e-9)
    assert np.all(np.diff(t) > 0)
    # λ starts at f·R and peaks at R at P/2
    assert cfg.rate_at(0.0) == pytest.approx(1.0) and cfg.rate_at(5.0) == pytest.approx(4.0)
    # Λ over one period = R·P·(f + (1−f)/2) = 4·10·0.625 = 25
    assert cfg.cumulative(np.array(10.0)) == pytest.approx(25.0)


def test_fluctuating_arrivals_follow_the_rate():
    """Counts in the low quarter-periods vs the high ones, over 40 periods (P = 10 s)."""
    t = offsets(20000, request_rate=4.0, schedule="fluctuating", low_fraction=0.25, period_s=10.0)
    t = t[t < 400.0]
    phase = (t % 10.0) / 10.0
    low = np.sum((phase < 0.125) | (phase >= 0.875))   # around t ≡ 0
    high = np.sum((phase >= 0.375) & (phase < 0.625))  # around t ≡ P/2
    cfg = ArrivalConfig(request_rate=4.0, schedule="fluctuating", low_fraction=0.25, period_s=10.0)
    expect_low = 40 * 2 * float(cfg.cumulative(np.array(1.25)))
    expect_high = 40 * float(cfg.cumulative(np.array(6.25)) - cfg.cumulative(np.array(3.75)))
    # Poisson counts: sd = sqrt(n); n ≈ 115 → 3σ = 28 %, n ≈ 385 → 3σ = 15 %, n ≈ 1000 → 3σ = 9.5 %
    assert low == pytest.approx(expect_low, rel=0.3)
    assert high == pytest.approx(expect_high, rel=0.16)
    assert high > 2 * low  # expected ratio 3.35
    assert len(t) == pytest.approx(40 * 25, rel=0.1)


@pytest.mark.parametrize("kw, message", [
    ({"request_rate": -1.0}, "--request-rate must be > 0"),
    ({"request_rate": 0.0}, "--request-rate must be > 0"),
    ({"request_rate": math.nan}, "--request-rate"),
    ({"request_rate": 1.0, "burstiness": 0.0}, "--burstiness"),
    ({"request_rate": 1.0, "schedule": "weekly"}, "--schedule"),
    ({"schedule": "fluctuating"}, "finite --request-rate"),
    ({"request_rate": 1.0, "schedule": "low", "low_fraction": 0.0}, "--low-rate-fraction"),
    ({"request_rate": 1.0, "schedule": "fluctuating", "period_s": -5.0}, "--fluctuation-period"),
])
def test_bad_configs(kw, message):
    with pytest.raises(ValueError, match=message):
        ArrivalConfig(**kw)
