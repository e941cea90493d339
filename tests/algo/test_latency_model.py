"""Latency models: the NNLS fits recover known coefficients, predictions, JSON round trip."""

from __future__ import annotations

import json
import random

import pytest

from cosine_ray.algo.scheduling.latency_model import LatencyModel, LinearFit, LlmSample, SsmSample, llm_features

TRUE_LLM = (0.040, 0.0008, 0.0025, 0.0, 2e-6)  # c0, c_req, c_tok, c_knee, c_attn (no knee)
TRUE_SSM = {"ngram": (0.0003, 0.00005, 0.00002), "model:x": (0.004, 0.001, 0.003)}


def synthetic_samples(noise: float, seed: int = 0) -> tuple[list[LlmSample], list[SsmSample]]:
    rng = random.Random(seed)
    llm = []
    for b in (1, 2, 4, 8):
        for gamma in (0, 2, 4, 8):
            for ctx in (32, 256, 1024):
                lens = tuple(ctx + rng.randint(0, 16) for _ in range(b))
                new = tuple(1 + gamma for _ in range(b))
                exact = sum(c * f for c, f in zip(TRUE_LLM, llm_features(lens, new)))
                llm.append(LlmSample(lens, new, exact * (1 + rng.gauss(0, noise))))
    ssm = []
    for name, coefs in TRUE_SSM.items():
        for b in (1, 2, 4, 8):
            for per in (1, 4, 8):
                exact = coefs[0] + coefs[1] * b + coefs[2] * b * per
                ssm.append(SsmSample(name, b, b * per, exact * (1 + rng.gauss(0, noise))))
    return llm, ssm


def test_fit_recovers_known_coefficients_from_noisy_samples():
    llm, ssm = synthetic_samples(noise=0.01)
    model = LatencyModel.fit(llm, ssm, model_name="synthetic")
    for got, want in zip(model.llm.coefs, TRUE_LLM):
        assert got == pytest.approx(want, rel=0.15), model.llm.coefs
    for name, coefs in TRUE_SSM.items():
        for got, want in zip(model.ssm[name].coefs, coefs):
            assert got == pytest.approx(want, rel=0.15), (name, model.ssm[name].coefs)
    assert model.llm.r2 > 0.99 and model.llm.max_rel_error < 0.05
    assert model.llm.num_samples == len(llm)
    assert model.knee_tokens == 0  # a straight curve keeps no knee


def knee_samples(knee: int, c_knee: float, noise: float, seed: int = 0) -> list[LlmSample]:
    """T_llm of a roofline: tokens are cheap up to ``knee`` in a forward and dear beyond."""
    rng = random.Random(seed)
    out = []
    for b in (1, 2, 4, 8, 16):
        for gamma in (0, 1, 2, 4, 8):
            lens = tuple(200 + rng.randint(0, 16) for _ in range(b))
            new = tuple(1 + gamma for _ in range(b))
            exact = sum(c * f for c, f in zip((0.050, 0.004, 0.0005, c_knee, 1e-6), llm_features(lens, new, knee)))
            out.append(LlmSample(lens, new, exact * (1 + rng.gauss(0, noise))))
    return out


def test_fit_finds_the_knee_of_a_convex_token_cost_and_prices_tokens_at_its_slope():
    model = LatencyModel.fit(knee_samples(16, 0.0015, noise=0.01))
    assert model.knee_tokens == 16
    assert model.c_tok == pytest.approx(0.0005, rel=0.5) and model.c_knee == pytest.approx(0.0015, rel=0.15)
    # the next token's cost: c_tok below the knee, c_tok + c_knee beyond it
    assert model.token_slope(4) == pytest.approx(model.c_tok)
    assert model.token_slope(16) == pytest.approx(model.c_tok + model.c_knee)
    assert model.token_seconds(40) == pytest.approx(model.c_tok * 40 + model.c_knee * 24)
    # the tangent touches T_llm at its point and stays below it elsewhere (convexity)
    for at in (8, 16, 40):
        c0, slope = model.tangent(at)
        line = lambda n: c0 + slope * n  # noqa: E731
        assert line(at) == pytest.approx(model.c0 + model.token_seconds(at))
        assert all(line(n) <= model.c0 + model.token_seconds(n) + 1e-12 for n in range(1, 200))
    # the straight fit of the same data misprices both ends, as measured on our CPU
    straight = LinearFit.fit([s.features() for s in knee_samples(16, 0.0015, 0.01)],
                             [s.seconds for s in knee_samples(16, 0.0015, 0.01)])
    assert straight.coefs[2] > 1.5 * model.c_tok and straight.coefs[2] < model.c_tok + model.c_knee
    assert model.llm.rel_sse < 0.5 * straight.rel_sse


def test_a_knee_needs_samples_on_both_sides_and_a_real_gain():
    few = [LlmSample((100,), (n,), 0.05 + 0.001 * n + 0.002 * max(n - 8, 0)) for n in (1, 2, 4, 16)]
    assert LatencyModel.fit(few).knee_tokens == 0  # 4 samples: fewer than KNEE_MIN_SIDE on each side
    enough = few + [LlmSample((100,), (n,), 0.05 + 0.001 * n + 0.002 * max(n - 8, 0)) for n in (3, 24, 32)]
    assert LatencyModel.fit(enough).knee_tokens == 8


def test_fit_is_exact_without_noise_and_coefficients_stay_nonnegative():
    llm, ssm = synthetic_samples(noise=0.0)
    model = LatencyModel.fit(llm, ssm)
    assert model.llm.max_rel_error < 1e-9
    assert all(c >= 0 for c in model.llm.coefs)
    # data that would want a negative intercept get 0 instead (NNLS)
    rows = [LlmSample((0,), (n,), 0.001 * n - 0.0005) for n in (1, 2, 4, 8, 16)]
    fit = LatencyModel.fit(rows).llm
    assert min(fit.coefs) >= 0.0


def test_predictions_match_the_formulas():
    model = LatencyModel.fit(*synthetic_samples(noise=0.0))
    c0, c_req, c_tok, c_knee, c_attn = model.llm.coefs
    assert (c0, c_req, c_tok, c_knee, c_attn) == (model.c0, model.c_req, model.c_tok, model.c_knee, model.c_attn)
    lens, gammas = [100, 300], [2, 0]
    expected = c0 + 2 * c_req + c_tok * 4 + c_attn * (3 * 103 + 1 * 301)
    assert model.predict_llm(lens, [1 + g for g in gammas]) == pytest.approx(expected)
    assert model.predict_llm([], []) == 0.0
    # the paper's T_llm(b, l, Γ) with l = max context bounds the varlen time from above
    assert model.predict_llm_paper(2, 300, 2, gamma_max=2) >= model.predict_llm(lens, [3, 1])
    # T_ssm: zero when nothing drafts; max over drafters in parallel, sum in sequence
    assert model.predict_ssm_step(0, 0) == 0.0
    a = model.predict_ssm("ngram", 2, 8)
    b = model.predict_ssm("model:x", 2, 8)
    assert model.predict_ssm_step(2, 8) == pytest.approx(max(a, b))
    assert model.predict_ssm_step(2, 8, parallel=False) == pytest.approx(a + b)
    assert model.predict_step(lens, gammas) == pytest.approx(
        model.predict_ssm_step(1, 2) + model.predict_llm(lens, [3, 1]))
    with pytest.raises(KeyError, match="profiled"):
        model.predict_ssm("nope", 1, 1)


def test_json_round_trip_keeps_everything():
    model = LatencyModel.fit(*synthetic_samples(noise=0.02), model_name="m", device="cpu",
                             dtype="float32", num_stages=2, num_threads=2)
    again = LatencyModel.from_json(model.to_json())
    assert again == model
    assert again.predict_llm([10, 20], [3, 5]) == model.predict_llm([10, 20], [3, 5])
    data = json.loads(model.to_json())
    assert data["schema_version"] == 2 and data["num_stages"] == 2 and set(data["ssm"]) == set(TRUE_SSM)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: "not json {", "not valid JSON"),
    (lambda d: [1, 2], "must be a JSON object"),
    (lambda d: {**d, "schema_version": 99}, "schema_version"),
    (lambda d: {k: v for k, v in d.items() if k != "model"}, "'model'"),
    (lambda d: {**d, "num_stages": 0}, "num_stages"),
    (lambda d: {**d, "llm": {**d["llm"], "coefs": {"c0": 1.0}}}, "llm.coefs"),
    (lambda d: {**d, "llm": {**d["llm"], "coefs": {**d["llm"]["coefs"], "c_tok": -1.0}}}, ">= 0"),
    (lambda d: {**d, "ssm": {"ngram": {**d["ssm"]["ngram"], "r2": "high"}}}, "ssm.ngram.r2"),
    (lambda d: {**d, "samples": {"llm": [{"context_lens": [1]}]}}, "malformed sample"),
])
def test_malformed_json_is_rejected_with_a_clear_error(mutate, message):
    data = json.loads(LatencyModel.default().to_json())
    bad = mutate(data)
    text = bad if isinstance(bad, str) else json.dumps(bad)
    with pytest.raises(ValueError, match=message):
        LatencyModel.from_json(text)


def test_a_version_1_profile_loads_as_the_same_straight_model():
    model = LatencyModel.fit(*synthetic_samples(noise=0.02))
    data = json.loads(model.to_json())
    data["schema_version"] = 1
    del data["knee_tokens"]
    del data["llm"]["coefs"]["c_knee"]
    old = LatencyModel.from_dict(data)
    assert old.knee_tokens == 0 and old.c_knee == 0.0
    assert old.predict_llm([10, 20], [3, 5]) == pytest.approx(model.predict_llm([10, 20], [3, 5]))
    with pytest.raises(ValueError, match="knee_tokens"):
        LatencyModel.from_dict({**json.loads(model.to_json()), "knee_tokens": -1})


def test_samples_and_fits_validate_their_input():
    with pytest.raises(ValueError):
        LlmSample((1, 2), (1,), 0.1)
    with pytest.raises(ValueError):
        LlmSample((1,), (0,), 0.1)
    with pytest.raises(ValueError):
        SsmSample("ngram", 1, 1, float("nan"))
    with pytest.raises(ValueError):
        LatencyModel.fit([])
    with pytest.raises(ValueError):
        LinearFit.fit([], [])


def test_default_is_the_design_section_8_fit():
    model = LatencyModel.default()
    assert model.model_name == "design-section-8" and "ngram" in model.ssm
    # measured: SmolLM2 one token at a 256-token context ≈ 57-62 ms, 16 requests × 1 token 186 ms
    assert 0.04 < model.predict_llm([256], [1]) < 0.09
    assert 0.13 < model.predict_llm([256] * 16, [1] * 16) < 0.25
