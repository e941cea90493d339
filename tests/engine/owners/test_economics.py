"""``CostModel`` and ``predicted_gains`` alone: the latency fit is refitted from live verify
steps every ``REFIT_EVERY`` of them, and a request's gains before it drafts are its last
tree's curve. (The token slope per batch-size bucket: ``test_token_slope.py``.)"""

from __future__ import annotations

import pytest

from cosine_ray.engine.owners.economics import LIVE_SAMPLES, REFIT_EVERY, CostModel, predicted_gains

from support.factories import make_request


def feed(costs: CostModel, steps: int, ms_per_token: float) -> None:
    """Verify steps of one request at context 200 and 1..8 new tokens, ``ms_per_token`` each."""
    for i in range(steps):
        n = 1 + i % 8
        costs.observe_verify([200], [n], 0.02 + n * ms_per_token / 1e3)


def test_the_fit_is_refitted_every_refit_every_live_steps_towards_what_they_measure():
    costs = CostModel()
    start = costs.latency
    feed(costs, REFIT_EVERY - 1, 50.0)
    assert costs.latency is start  # not yet
    feed(costs, 1, 50.0)
    first = costs.latency
    assert first is not start and first.c_tok > start.c_tok
    feed(costs, LIVE_SAMPLES, 50.0)
    for n in (1, 4, 8):  # once live steps abound they outvote the start-up profile
        assert costs.latency.predict_llm([200], [n]) == pytest.approx(0.02 + n * 50e-3, rel=0.2)
    assert start.predict_llm([200], [8]) < 0.5 * (0.02 + 8 * 50e-3)  # which was far off


@pytest.mark.parametrize("budget, expected", [(0, (0.0,)), (2, (0.0, 0.9, 1.5)), (5, (0.0, 0.9, 1.5, 1.8, 1.8, 1.8))])
def test_predicted_gains_are_the_last_trees_curve_cut_or_held_flat_to_the_budget(budget, expected):
    request = make_request()
    assert predicted_gains(request, budget) == (0.0,) * (budget + 1)  # never drafted: nothing expected
    request.gain_curve = (0.0, 0.9, 1.5, 1.8)
    assert predicted_gains(request, budget) == expected
