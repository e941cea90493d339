"""The measures ``benchmarks/sim/sim_validation.py`` feeds the simulator, on hand-made records
(the script's real runs are its own benchmark; here only its arithmetic is checked)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "sim" / "sim_validation.py"
_spec = importlib.util.spec_from_file_location("sim_validation", _PATH)
sim_validation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_validation)

PROMPT = (1, 2, 3)
TEXT = list(range(100, 140))


def _recorder() -> SimpleNamespace:
    """Drafter ``a`` at 10 steps: depth 1 always right (confidence 0.9), depth 2 right (0.8) at
    every other step, else wrong (0.1). Drafter ``b`` proposes at half of those steps, one right
    token (0.5)."""
    a, b = [], []
    for k, done in enumerate(range(0, 20, 2)):
        context = PROMPT + tuple(TEXT[:done])
        second = (TEXT[done + 1], 0.8) if k % 2 == 0 else (999, 0.1)
        a.append((context, ((TEXT[done], 0.9), second)))
        b.append((context, ((TEXT[done], 0.5),) if k % 2 == 0 else None))
    return SimpleNamespace(proposals={"a": a, "b": b})


def test_acceptance_coverage_and_sharpness_from_the_engine_steps():
    out, rho = sim_validation.measure_acceptance(_recorder(), [list(PROMPT)], [TEXT], ["code"], 3)
    a, b = out["a"], out["b"]
    assert a["acceptance"]["code"]["by_depth"][:2] == [1.0, 0.5]
    assert a["acceptance"]["code"]["coverage"] == 1.0
    assert a["acceptance"]["default"]["by_depth"][:2] == [1.0, 0.5]
    assert a["sharpness"] == pytest.approx((9 + 4) / 15 - 0.1, abs=1e-4)  # mean right − mean wrong
    assert b["acceptance"]["code"]["coverage"] == 0.5
    assert b["acceptance"]["code"]["by_depth"][0] == 1.0
    assert b["sharpness"] == 0.3  # never wrong: no spread to measure, the simulator's default
    assert rho == 0.0  # both always right together: no variance left to share


def test_a_request_is_found_by_its_prompt_and_scored_against_its_own_text():
    """Token 501 follows the math prompt (7, 8) ⊕ 500 but not the code prompt: the same token is
    right five times for one request and wrong five times for the other."""
    other_prompt, other_text = (7, 8), [500, 501, 502]
    records = [(other_prompt + (500,), ((501, 0.9),))] * 5 + [(PROMPT, ((501, 0.9),))] * 5
    out, _ = sim_validation.measure_acceptance(SimpleNamespace(proposals={"a": records}),
                                               [list(PROMPT), list(other_prompt)], [TEXT, other_text],
                                               ["code", "math"], 2)
    skill = out["a"]["acceptance"]
    assert skill["math"]["by_depth"][0] == 1.0
    assert skill["code"]["by_depth"][0] == 0.0
    assert skill["default"]["by_depth"][0] == 0.5


def test_tpot_pooled_and_spread():
    got = sim_validation.tpot_spread([(0.02, 11), (0.04, 21), (0.5, 1)])  # the 1-token request has no TPOT
    assert got["tpot_pooled_ms"] == pytest.approx(1e3 * (0.02 * 10 + 0.04 * 20) / 30)
    assert got["tpot_cv"] == pytest.approx(0.01 / 0.03)


def test_alphas_fall_back_to_the_pooled_domains_then_the_last_measured():
    assert sim_validation.alphas_of([[8, 10], [1, 2], [0, 0]], [0.5, 0.6, 0.0]) == [0.8, 0.6, 0.6]
