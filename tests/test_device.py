"""``device`` and ``dtype`` everywhere: the names are checked in the config,
``--device``/``--dtype`` reach ``generate``, ``bench``, ``profile`` and ``serve``, asking for
CUDA where this process has none is one line and exit 2 (before any model loads), a joined
cluster without GPUs is refused, and stage and drafter actors ask Ray for a GPU on CUDA.

CUDA's presence is simulated by replacing ``torch.cuda.device_count`` and
``torch.backends.cuda.is_built``, so each branch runs on any machine; what needs a real GPU is
in ``tests/engine/test_gpu.py`` (marked ``gpu``)."""

from __future__ import annotations

import pytest
import torch

from cosine_ray.cli import main
from cosine_ray.cli.args import CliError
from cosine_ray.cli.serve import check_cluster_gpus
from cosine_ray.engine.config import EngineConfig, config_from_dict
from cosine_ray.models.device import check_device_name, device_unavailable, require_device
from cosine_ray.runtime.placement import actor_options


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n, built=True): make this process see n CUDA GPUs (a CUDA build when built)."""
    def set_gpus(n: int, built: bool = True) -> None:
        monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: built)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_gpus


@pytest.mark.parametrize("name", ["cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_names_accepted(name):
    assert check_device_name(name) == name
    assert EngineConfig(device=name).device == name


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:-1", "cuda:01", "CUDA", "mps", "", 0, None, "cpu:0"])
def test_device_names_refused(name):
    with pytest.raises(ValueError, match="use cpu, cuda or cuda:N"):
        check_device_name(name)
    with pytest.raises(ValueError, match="use cpu, cuda or cuda:N"):
        config_from_dict({"device": name})


def test_dtype_names():
    for dtype in ("float32", "bfloat16", "float16"):
        assert EngineConfig(dtype=dtype).dtype == dtype
    for dtype in ("fp32", "bf16", "float64", "int8"):
        with pytest.raises(ValueError, match="use float32, bfloat16, float16"):
            EngineConfig(dtype=dtype)


def test_availability_branches(gpus):
    assert device_unavailable("cpu") is None
    gpus(0, built=False)
    assert "built without CUDA" in device_unavailable("cuda")
    gpus(0)
    assert "no CUDA GPU is visible" in device_unavailable("cuda:0")
    gpus(2)
    assert device_unavailable("cuda") is None and device_unavailable("cuda:1") is None
    assert "only 2 CUDA GPU(s) are visible (cuda:0..cuda:1)" in device_unavailable("cuda:2")
    with pytest.raises(ValueError, match="only 2"):
        require_device("cuda:5")


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cosine-ray: error: "), err
    return err[0]


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--max-tokens", "2"],
    ["bench", "--prompts-per-domain", "1", "--max-tokens", "2"],
    ["profile", "--quick"],
])
def test_cli_asking_for_cuda_without_it_is_one_line_and_exit_2(argv, gpus, capsys, monkeypatch):
    loaded = []
    monkeypatch.setattr("cosine_ray.models.loader.resolve_checkpoint", lambda *a, **k: loaded.append(a))
    gpus(0)
    assert main([*argv, "--device", "cuda"]) == 2
    assert "device 'cuda': no CUDA GPU is visible to this process; use --device cpu" in one_line_error(capsys)
    gpus(1)
    assert main([*argv, "--device", "cuda:1"]) == 2
    assert "only 1 CUDA GPU(s) are visible" in one_line_error(capsys)
    assert main([*argv, "--device", "tpu"]) == 2
    assert "device 'tpu': use cpu, cuda or cuda:N" in one_line_error(capsys)
    assert main([*argv, "--dtype", "fp8"]) == 2
    assert "invalid choice: 'fp8'" in one_line_error(capsys)
    assert not loaded  # refused before any model was looked up


@pytest.mark.real_model
def test_serve_asking_for_cuda_without_it_is_one_line_and_exit_2(real_checkpoint, gpus, capsys, tmp_path,
                                                                   monkeypatch):
    started = []
    monkeypatch.setattr("cosine_ray.runtime.cluster.connect", lambda *a, **k: started.append(a))
    gpus(0)
    assert main(["serve", "--device", "cuda"]) == 2
    assert "no CUDA GPU is visible" in one_line_error(capsys)
    config = tmp_path / "engine.yaml"
    config.write_text("device: cuda:0\ndtype: bfloat16\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "device 'cuda:0': no CUDA GPU is visible" in one_line_error(capsys)
    assert not started
    gpus(1)  # with a GPU the same file passes the check, and --dtype overrides the file's
    from cosine_ray.cli import build_parser
    from cosine_ray.cli.serve import serve_plan
    plan = serve_plan(build_parser().parse_args(["serve", "--config", str(config), "--dtype", "float16"]))
    assert plan.engine["device"] == "cuda:0" and plan.engine["dtype"] == "float16"


def test_a_joined_cluster_without_gpus_is_refused():
    engine = {"device": "cuda", "cluster": {"address": "10.0.0.1:6379"}}
    with pytest.raises(CliError, match="the Ray cluster at 10.0.0.1:6379 has no GPU"):
        check_cluster_gpus(engine, {"CPU": 16.0, "memory": 1e10})
    check_cluster_gpus(engine, {"CPU": 16.0, "GPU": 8.0})
    check_cluster_gpus({**engine, "device": "cpu"}, {"CPU": 16.0})


@pytest.mark.parametrize("role", ["stage", "drafter"])
def test_actors_ask_for_a_gpu_on_cuda_only(role):
    assert actor_options(role, 0, EngineConfig(device="cuda"))["num_gpus"] == 1
    assert actor_options(role, 1, EngineConfig(device="cuda:1"))["num_gpus"] == 1
    assert "num_gpus" not in actor_options(role, 0, EngineConfig(device="cpu"))


# ---- the KV pool's memory budget -----------------------------------------------------------------

def test_kv_cache_memory_is_a_byte_count():
    assert EngineConfig(kv_cache_memory="512MiB").kv_cache_memory == 512 * 2**20
    assert EngineConfig(kv_cache_memory="1.5GB").kv_cache_memory == 1_500_000_000
    assert EngineConfig(kv_cache_memory=4096).kv_cache_memory == 4096
    assert EngineConfig().kv_cache_memory is None
    for bad in ("2 parsecs", "GiB", 0, -5, True, "-1GiB"):
        with pytest.raises(ValueError, match="kv_cache_memory must be"):
            config_from_dict({"kv_cache_memory": bad})


def test_kv_budgets_per_stage(monkeypatch):
    from types import SimpleNamespace

    from cosine_ray.engine.worker.target import CUDA_KV_MEMORY_SHARE, kv_budgets
    cpu, gpu0, gpu1 = (SimpleNamespace(device=torch.device(d)) for d in ("cpu", "cuda:0", "cuda:1"))
    assert kv_budgets([cpu, cpu], None) == [None, None]  # CPU: the pool grows as needed
    assert kv_budgets([cpu, gpu0], 10**6) == [10**6, 10**6]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: ((10_000 if d.index == 0 else 4_000), 80_000))
    share = CUDA_KV_MEMORY_SHARE
    assert kv_budgets([gpu0, gpu0, gpu1], None) == [int(share * 5_000), int(share * 5_000), int(share * 4_000)]


def test_an_engine_on_a_budget_preallocates_and_decodes_the_same(tiny_checkpoint):
    from cosine_ray.engine.config import parse_drafters
    from cosine_ray.engine.local import LocalEngine
    from cosine_ray.engine.request import SamplingParams

    prompts = [[5, 17, 42], list(range(30, 70))]
    params = SamplingParams(max_tokens=20)

    def run(**kw):
        engine = LocalEngine(EngineConfig(model=str(tiny_checkpoint.path), drafters=parse_drafters("ngram,self"),
                                          num_stages=2, **kw), checkpoint=tiny_checkpoint)
        return engine, [o.new_token_ids for o in engine.generate(prompts, params)]

    engine, budgeted = run(kv_cache_memory="1MiB")
    caches = [s.cache for s in engine.target.stages]
    assert all(c.max_blocks == c.num_blocks for c in caches)  # allocated at start, never grown
    per_block = caches[0].bytes_per_token() * caches[0].block_size
    assert caches[0].num_blocks == 2**20 // per_block
    assert all(c.num_free_blocks == c.num_blocks for c in caches)  # every block back after the requests
    assert budgeted == run()[1]
