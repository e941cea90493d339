"""The profiling pass on the tiny model: it runs, fits, round-trips, loads, and the CLI."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from cosine_ray.algo.scheduling.latency_model import LatencyModel, llm_features
from cosine_ray.cli import main
from cosine_ray.engine import profile
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.models import kernels
from cosine_ray.models.linear import projection_kernel
from support.factories import Clock


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """The default location: the suite's own profile directory (conftest) taken away."""
    monkeypatch.setenv("COSINE_RAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(profile.PROFILE_DIR_ENV, raising=False)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tiny_profile(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram"), num_threads=1)
    return config, profile.run_profile(config, quick=True)


def test_quick_pass_measures_the_grid_and_fits(tiny_profile):
    config, model = tiny_profile
    grid = profile.ProfileGrid.for_mode(quick=True)
    verify = [s for s in model.llm_samples if s.context_lens != (0,)]
    prefills = [s for s in model.llm_samples if s.context_lens == (0,)]
    assert len(verify) == len(grid.batch_sizes) * len(grid.gammas) * len(grid.context_lens)
    assert len(prefills) == len(grid.context_lens)
    assert {len(s.context_lens) for s in verify} == set(grid.batch_sizes)
    assert set(model.ssm) == {"ngram"} and len(model.ssm_samples) == len(grid.batch_sizes) * 2
    assert model.model_name == "tiny-llama" and model.num_stages == 1 and model.num_threads == 1
    assert all(s.seconds > 0 for s in model.llm_samples + model.ssm_samples)
    # How well the fit predicts real timings is in the report (the tiny model's ~1 ms forwards
    # on a shared machine say little); here: its stated error is its samples', and the stored
    # fit is exactly the NNLS fit of the stored samples. Fit quality: the next test.
    errors = [abs(model.predict_llm(s.context_lens, s.num_new_tokens) / s.seconds - 1) for s in model.llm_samples]
    assert max(errors) == pytest.approx(model.llm.max_rel_error, rel=1e-6)
    refit = LatencyModel.fit(model.llm_samples, model.ssm_samples)
    assert refit.llm == model.llm and refit.ssm == model.ssm


COST_LAW = (1e-3, 2e-4, 5e-5, 0.0, 1e-7)
"""Seconds per regressor of T_llm (``llm_features``: 1, b, N, past the knee, attention)."""


def test_quick_pass_times_each_grid_point_and_the_fit_recovers_the_costs(tiny_checkpoint, monkeypatch):
    """A target whose forwards take COST_LAW's seconds on the profiler's clock (moved only by
    them): each sample's time is its own forward's, and the fit predicts every sample."""
    clock = Clock(0.0)

    def cost(context_lens, num_new_tokens) -> float:
        return sum(c * f for c, f in zip(COST_LAW, llm_features(context_lens, num_new_tokens)))

    class TimedWorker(profile.TargetWorker):
        def score(self, items, *args, **kwargs):
            clock.now += cost([i.start_position for i in items], [len(i.token_ids) for i in items])
            return super().score(items, *args, **kwargs)

    monkeypatch.setattr(profile, "TargetWorker", TimedWorker)
    monkeypatch.setattr(profile, "time", SimpleNamespace(perf_counter=clock))
    config = EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("none"), num_threads=1)
    model = profile.run_profile(config, quick=True)
    grid = profile.ProfileGrid.for_mode(quick=True)
    assert len(model.llm_samples) == (len(grid.batch_sizes) * len(grid.gammas) + 1) * len(grid.context_lens)
    assert [s.seconds for s in model.llm_samples] == pytest.approx(
        [cost(s.context_lens, s.num_new_tokens) for s in model.llm_samples], rel=1e-9)
    errors = [abs(model.predict_llm(s.context_lens, s.num_new_tokens) / s.seconds - 1) for s in model.llm_samples]
    assert max(errors) < 1e-6, errors
    # bigger batches cost more than one request (the fit is not degenerate)
    assert model.predict_llm([64] * 8, [9] * 8) > model.predict_llm([64], [1])


def test_profile_json_round_trips_through_the_default_path(tiny_profile, cache):
    config, model = tiny_profile
    path = profile.save_profile(model, profile.profile_path(config))
    assert path.parent == cache / "profiles" and path.name.startswith("tiny-llama-")
    kernel = projection_kernel("cpu")
    if kernel == "blocked":
        kernel += ("-fused" if kernels.fused_on("cpu") else "") + f"-{kernels.source_digest()}"
    assert f"-cpu-float32-s1-t1-d{profile.drafter_set_digest(config)}-k{kernel}.json" in path.name
    again = LatencyModel.from_json(path.read_text())
    assert again == model


def test_load_or_profile_loads_a_stored_profile_and_replaces_a_bad_one(tiny_profile, cache, monkeypatch):
    config, model = tiny_profile
    path = profile.save_profile(model, profile.profile_path(config))
    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: pytest.fail("should have loaded the file"))
    assert profile.load_or_profile(config) == model
    path.write_text("{broken")
    calls = []
    monkeypatch.setattr(profile, "run_profile", lambda cfg, quick: calls.append(quick) or model)
    assert profile.load_or_profile(config) == model and calls == [True]
    assert LatencyModel.from_json(path.read_text()) == model  # stored again
    # a profile that lacks a configured drafter is measured again
    with_more = EngineConfig(model=config.model, drafters=parse_drafters("ngram,self"), num_threads=1)
    profile.load_or_profile(with_more)
    assert calls == [True, True]


def test_profile_path_keys_the_drafter_set_and_threads(tiny_checkpoint, cache):
    """Different setups (drafter set, torch threads, stages) get different files; the same
    setup (drafters in any order) the same file."""
    def cfg(drafters="ngram", threads=1, stages=1):
        return EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters(drafters),
                            num_threads=threads, num_stages=stages)

    base = profile.profile_path(cfg())
    assert profile.profile_path(cfg()) == base
    assert profile.profile_path(cfg("ngram,retrieval:code")) == profile.profile_path(cfg("retrieval:code,ngram"))
    others = [cfg("ngram,retrieval"), cfg("none"), cfg(threads=2), cfg(stages=2), cfg("ngram,retrieval:code")]
    paths = {profile.profile_path(c) for c in others} | {base}
    assert len(paths) == len(others) + 1, paths
    assert all(p.parent == cache / "profiles" for p in paths)
    # no num_threads: keyed by the thread count this process runs with (what the pass would use)
    assert profile.profile_path(cfg(threads=None)) == profile.profile_path(cfg(threads=torch.get_num_threads()))
    # `cosine-ray serve` (default drafters) vs a Serve config with `ngram,retrieval`: two files
    assert profile.profile_path(cfg("default", stages=2)) != profile.profile_path(cfg("ngram,retrieval", stages=2))


def test_the_suite_has_its_own_profile_directory():
    """conftest names the variable by its value (it imports cosine_ray lazily): both agree."""
    assert os.environ.get(profile.PROFILE_DIR_ENV)
    assert profile.profile_dir() != profile.cache_root() / "profiles"


def test_the_profile_directory_can_be_set(tiny_checkpoint, cache, monkeypatch, tmp_path):
    config = EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram"), num_threads=1)
    default = profile.profile_path(config)
    monkeypatch.setenv(profile.PROFILE_DIR_ENV, str(tmp_path / "elsewhere"))
    moved = profile.profile_path(config)
    assert default.parent == cache / "profiles" and moved == tmp_path / "elsewhere" / default.name


def test_profile_path_keys_the_cpu_projection_kernel(tiny_checkpoint, cache, monkeypatch):
    """A profile measured with MKL projections is not reused by oneDNN ones (or back)."""
    config = EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram"), num_threads=1)
    names = {}
    for kernel in ("mkl", "onednn"):
        monkeypatch.setenv("COSINE_RAY_CPU_GEMM", kernel)
        names[kernel] = profile.profile_path(config).name
    assert names["mkl"].endswith("-kmkl.json")
    assert names["onednn"] != names["mkl"]
    if kernels.available():  # our kernels, with and without the fused layers
        monkeypatch.setenv("COSINE_RAY_CPU_GEMM", "blocked")
        digest = kernels.source_digest()
        assert profile.profile_path(config).name.endswith(f"-kblocked-fused-{digest}.json")
        monkeypatch.setenv(kernels.FUSED_ENV, "0")
        assert profile.profile_path(config).name.endswith(f"-kblocked-{digest}.json")


def test_two_setups_keep_their_own_profiles(tiny_profile, cache, monkeypatch):
    """Loading one setup's profile never re-profiles (or overwrites) another's: before the
    drafter set and threads were in the name, alternating two setups re-profiled every start."""
    config, model = tiny_profile
    setups = {"ngram, 1 thread": (config, model)}
    for label, other in (("no drafters", EngineConfig(model=config.model, drafters=(), num_threads=1)),
                         ("ngram, 2 threads", EngineConfig(model=config.model, drafters=config.drafters,
                                                           num_threads=2))):
        setups[label] = (other, LatencyModel.fit(model.llm_samples, model.ssm_samples, model_name=label,
                                                 num_threads=other.num_threads))
    paths = {label: profile.save_profile(m, profile.profile_path(c)) for label, (c, m) in setups.items()}
    assert len(set(paths.values())) == len(setups)
    monkeypatch.setattr(profile, "run_profile", lambda *a, **k: pytest.fail("re-profiled a stored setup"))
    for _ in range(2):  # alternate between the setups, as restarts of different servers do
        for label, (c, m) in setups.items():
            assert profile.load_or_profile(c) == m, label
    for label, (c, m) in setups.items():
        assert LatencyModel.from_json(paths[label].read_text()) == m, label


def test_cli_profile_writes_json(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "--model", str(tiny_checkpoint.path), "--drafters", "ngram", "--threads", "1",
                 "--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["model"] == "tiny-llama" and "ngram" in data["ssm"]
    printed = capsys.readouterr().out
    assert "measured ms" in printed and str(out) in printed


@pytest.mark.parametrize("argv", [
    ["profile", "--stages", "0"],
    ["profile", "--threads", "0"],
    ["profile", "--drafters", "bogus"],
    ["profile", "--model", "/nonexistent/model/dir"],
    ["profile", "--stages", "x"],
])
def test_cli_profile_bad_input_exits_2_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cosine-ray: error:") and len(err.splitlines()) == 1, err
