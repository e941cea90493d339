"""Shared fixtures (tiny random-weight checkpoints, the embedded real model, the session's Ray
cluster, seeds) and which tests a run takes.

Runs: ``python -m pytest`` is the fast run (unit and small integration tests); ``--full`` adds
the tests marked ``ray`` (a local Ray cluster), ``real_model`` (the embedded SmolLM2) and
``full`` (HTTP servers, subprocess CLIs, fuzzers, the soak, statistical sweeps); ``--run-slow``
adds the long variants marked ``slow``. A test declares its markers itself (per test or per
module); a test that uses the Ray or real-model fixtures without its marker is an error.

Threads: tests pin torch to ``COSINE_RAY_TEST_THREADS`` intra-op threads (default 1). On our
shared 2-core machines a second OpenMP thread is a disaster as soon as another process is busy
(measured: tiny-model forward 0.7 ms with 1 thread, 100 ms with 2; SmolLM2 one token 52 ms vs
150-900 ms), so one thread is both faster and far more stable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile

import pytest
import torch

TEST_THREADS = int(os.environ.get("COSINE_RAY_TEST_THREADS", "1"))
torch.set_num_threads(TEST_THREADS)

# Latency profiles: the session's own directory (``engine.profile.profile_dir``), set before any
# engine, server subprocess or Ray worker starts, so they all inherit it. An engine loads the
# profile it finds, so a developer's profiles would otherwise steer what the tests measure (CI
# starts without any), and the tests' profiles of temporary tiny models would pile up in
# ~/.cache/cosine_ray. A directory given from outside is kept.
PROFILE_DIR_ENV = "COSINE_RAY_PROFILE_DIR"  # engine.profile.PROFILE_DIR_ENV; cosine_ray is imported lazily here
_OWN_PROFILE_DIR = PROFILE_DIR_ENV not in os.environ
if _OWN_PROFILE_DIR:
    os.environ[PROFILE_DIR_ENV] = tempfile.mkdtemp(prefix="cosine_ray_test_profiles_")

TINY_VOCAB = 256

FULL_SUITE_MARKERS = ("ray", "real_model", "full")
FULL_SUITE_ENV = "COSINE_RAY_FULL_SUITE"
"""Tests with one of these markers run only with ``--full``."""
DECLARED_FIXTURES = {"ray_cluster": "ray", "real_checkpoint": "real_model", "real_hf_model": "real_model"}
"""Fixture -> the marker every test that uses it (directly or through another fixture) carries."""
_LEFT_OUT = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full", action="store_true", default=os.environ.get(FULL_SUITE_ENV) == "1",
                     help="the full suite: also run tests marked " + ", ".join(FULL_SUITE_MARKERS)
                          + f" (Ray clusters, the real model, servers, fuzzers, the soak); {FULL_SUITE_ENV}=1 "
                          "does the same (.ci/run sets it and runs the README's test command)")
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow")
    parser.addoption("--soak-seconds", type=float, default=420.0,
                     help="length of the serving soak test (tests/serve/test_reliability_serve.py)")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OWN_PROFILE_DIR:
        shutil.rmtree(os.environ[PROFILE_DIR_ENV], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _check_declared(items)
    if not config.getoption("--full"):
        left_out = {item for item in items if any(item.get_closest_marker(m) for m in FULL_SUITE_MARKERS)}
        if left_out:
            config.hook.pytest_deselected(items=[item for item in items if item in left_out])
            items[:] = [item for item in items if item not in left_out]
            config.stash[_LEFT_OUT] = True
    skip_slow = pytest.mark.skip(reason="slow test: pass --run-slow to run it")
    skip_gpu = pytest.mark.skip(reason="needs CUDA: no GPU is visible to this process")
    run_slow, has_gpu = config.getoption("--run-slow"), torch.cuda.is_available()
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(skip_slow)
        if item.get_closest_marker("gpu") and not has_gpu:
            item.add_marker(skip_gpu)


def _check_declared(items: list[pytest.Item]) -> None:
    """A test that starts Ray or loads the real model says so with its marker, so the fast run
    leaves it out (the fixtures named here are the ones that do)."""
    missing = [f"{item.nodeid}: uses {fixture}, mark it {marker}"
               for item in items for fixture, marker in DECLARED_FIXTURES.items()
               if fixture in getattr(item, "fixturenames", ()) and not item.get_closest_marker(marker)]
    if missing:
        raise pytest.UsageError("tests without the marker of what they use:\n  " + "\n  ".join(missing))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if config.stash.get(_LEFT_OUT, False):
        terminalreporter.write_line(f"fast run: tests marked {', '.join(FULL_SUITE_MARKERS)} were deselected; "
                                    "python -m pytest --full runs the full suite")


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Global RNGs seeded per test (code under test must still take explicit generators)."""
    torch.manual_seed(0)
    random.seed(0)


# ---- tiny checkpoints ------------------------------------------------------------------------

def _write_tiny(path, **kwargs):
    from support.tiny_checkpoint import write_tiny_checkpoint
    defaults = dict(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                    vocab_size=TINY_VOCAB, init_std=0.2)
    return write_tiny_checkpoint(path, **{**defaults, **kwargs})


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """4 layers, hidden 64, 4 heads / 2 KV heads, vocab 256, N(0, 0.2) weights, no tokenizer,
    no EOS: greedy decoding has no near-ties and runs to max_tokens."""
    return _write_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_checkpoint(tmp_path_factory):
    """Another tiny model with the same vocabulary (2 layers, other seed): a model drafter."""
    return _write_tiny(tmp_path_factory.mktemp("tiny-draft") / "tiny-draft", num_layers=2, seed=1)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
"""Small original length so llama3 scaling changes most of head_dim 16's frequencies."""


@pytest.fixture(scope="session")
def tiny_checkpoint_variants(tmp_path_factory):
    """name -> Checkpoint: qwen2 (q/k/v bias), mistral, llama3 rope scaling, tied embeddings."""
    from cosine_ray.models.loader import resolve_checkpoint

    root = tmp_path_factory.mktemp("tiny-variants")
    out = {
        "qwen2": _write_tiny(root / "qwen2", model_type="qwen2", seed=2),
        "mistral": _write_tiny(root / "mistral", model_type="mistral", seed=3),
        "tied": _write_tiny(root / "tied", tie_word_embeddings=True, seed=4),
    }
    llama3 = _write_tiny(root / "llama3", seed=5)
    cfg_file = llama3.path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rope_parameters"] = dict(LLAMA3_ROPE)
    cfg.pop("rope_scaling", None)
    cfg_file.write_text(json.dumps(cfg))
    out["llama3_rope"] = resolve_checkpoint(llama3.path)
    assert out["llama3_rope"].config.rope_scaling is not None
    assert out["qwen2"].config.attention_bias and out["tied"].config.tie_word_embeddings
    return out


# ---- the embedded real model -----------------------------------------------------------------

@pytest.fixture(scope="session")
def real_checkpoint():
    """SmolLM2-135M-Instruct (converted once into the cache; ~3 s when cached)."""
    from cosine_ray.models.loader import resolve_checkpoint
    return resolve_checkpoint("smollm2-135m")  # fetched and converted on first use; fails loudly


@pytest.fixture(scope="session")
def real_hf_model(real_checkpoint):
    """transformers' SmolLM2 in fp32 eval mode: the reference for real-model tests."""
    return real_checkpoint.load_hf_model()


# ---- one local Ray cluster for the whole session (runtime/ and serve/ tests) ------------------

RAY_NUM_CPUS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    """The GCS address of the session's local Ray cluster (``runtime.cluster.connect``: 4
    logical CPUs, namespace ``cosine_ray``, OMP_NUM_THREADS=1 in every worker). Actor start is
    slow on small machines (each actor process imports torch), so test modules keep their
    engines for the whole module."""
    import time

    import ray

    from cosine_ray.runtime.cluster import connect

    owner = not ray.is_initialized()
    if owner:
        start = time.perf_counter()
        connect(None, num_cpus=RAY_NUM_CPUS)
        print(f"\n[ray] local cluster up in {time.perf_counter() - start:.1f} s "
              f"({ray.get_runtime_context().gcs_address})", flush=True)
    yield ray.get_runtime_context().gcs_address
    if owner:
        from ray import serve
        try:
            serve.shutdown()  # the engine deployments take their stage and drafter actors with them
        finally:
            ray.shutdown()
