"""Ray Serve LLM's application shape (``llm_configs``) and served names: what the builders bind
(one engine deployment per model, its replicas and Serve settings, the ingress's names and
models), every refusal one clear message, and ``cosine-ray serve --config`` reading the shipped
deploy/llm_config.yaml. No Ray cluster starts here: a Serve application is built, not run
(tests/serve/test_llm_app_serve.py runs it)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cosine_ray.cli import build_parser
from cosine_ray.cli import serve as serve_cli
from cosine_ray.cli.args import CliError
from cosine_ray.serve.app import build_app, build_llm_app

REPO = Path(__file__).resolve().parents[2]
LLM_YAML = REPO / "deploy" / "llm_config.yaml"


def shipped_args() -> dict:
    (app,) = yaml.safe_load(LLM_YAML.read_text())["applications"]
    assert app["import_path"] == "cosine_ray.serve.app:build_llm_app"
    return copy.deepcopy(app["args"])


def engines(app) -> list:
    """The engine deployments bound into the ingress: the first, then ``more_models``'."""
    ingress = app._bound_deployment
    more = [m["engine"] for m in ingress.init_kwargs.get("more_models", [])]
    return [ingress.init_args[0], *more]


def test_the_shipped_llm_config_binds_one_engine_per_model_behind_one_ingress():
    app = build_llm_app({**shipped_args(), "allow_unauthenticated": True})
    ingress = app._bound_deployment
    assert ingress.name == "cosine_ray"
    assert ingress.init_kwargs["served_model_names"] == ["smol"]
    assert [m["names"] for m in ingress.init_kwargs["more_models"]] == [["smol-plain"]]
    deployments = [e._bound_deployment for e in engines(app)]
    assert [d.name for d in deployments] == ["cosine_ray_engine-smol", "cosine_ray_engine-smol-plain"]
    assert [d.num_replicas for d in deployments] == [1, 1]
    configs = [d.init_args[0] for d in deployments]
    assert [c["drafters"] for c in configs] == ["ngram,suffix", "none"]  # one with drafters, one without
    assert all(c["model"] == "smollm2-135m" and c["scheduler"] == {"max_model_len": 2048} for c in configs)
    assert ingress.init_args[1] == configs[0] and ingress.init_kwargs["more_models"][0]["config"] == configs[1]
    # build_app takes the same args
    same = build_app({**shipped_args(), "allow_unauthenticated": True})
    assert [e._bound_deployment.name for e in engines(same)] == [d.name for d in deployments]


def test_deployment_settings_runtime_env_and_the_ingress_replicas_are_applied():
    args = {"allow_unauthenticated": True, "ingress_deployment_config": {"num_replicas": 2}, "llm_configs": [{
        "model_loading_config": {"model_id": "org/model v2", "model_source": "smollm2-135m"},
        "runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}},
        "deployment_config": {"health_check_period_s": 3, "graceful_shutdown_timeout_s": 7}}]}
    app = build_llm_app(args)
    (engine,) = [e._bound_deployment for e in engines(app)]
    assert engine.name == "cosine_ray_engine-org_model_v2"
    assert engine._deployment_config.health_check_period_s == 3
    assert engine._deployment_config.graceful_shutdown_timeout_s == 7
    assert engine.ray_actor_options["runtime_env"] == {"env_vars": {"HF_HUB_OFFLINE": "1"}}
    assert app._bound_deployment.num_replicas == 2
    assert engine.init_args[0] == {"model": "smollm2-135m"}  # model_source is the model; nothing else set


def one(**entry) -> dict:
    return {"allow_unauthenticated": True,
            "llm_configs": [{"model_loading_config": {"model_id": "m"}, **entry}]}


@pytest.mark.parametrize("args, message", [
    (one(deployment_config={"num_replicas": 2}), r"num_replicas=2 asks for engine replicas beyond one; engine "
                                                 r"replicas are set in engine_kwargs: engine_replicas"),
    (one(deployment_config={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}),
     r"autoscaling_config.max_replicas=4 asks for engine replicas other than one"),
    (one(deployment_config={"autoscaling_config": {"min_replicas": 0}}), r"min_replicas=0"),
    (one(deployment_config={"autoscaling_config": {"max_replica": 1}}), r"unknown key\(s\) max_replica"),
    (one(deployment_config={"num_replicas": 1, "autoscaling_config": {}}), r"not both"),
    (one(deployment_config={"ray_actor_options": {"num_gpus": 1}}), r"ray_actor_options is not supported: the "
                                                                    r"engine's resources come from engine_kwargs"),
    (one(accelerator_type="A10G"), r"llm_configs\[0\].accelerator_type is not supported"),
    (one(lora_config={"max_num_adapters_per_replica": 2}), r"lora_config is not supported"),
    (one(engine_kwargs={"tensor_parallel_size": 2}), r"engine_kwargs: unknown key\(s\) tensor_parallel_size"),
    (one(engine_kwargs={"max_model_len": 5, "scheduler": {"max_model_len": 6}}), r"max_model_len is given twice"),
    (one(engine_kwargs={"model": "other"}), r"the model comes from model_loading_config.model_source"),
    (one(bogus=1), r"llm_configs\[0\]: unknown key\(s\) bogus"),
    ({"allow_unauthenticated": True, "llm_configs": [{"model_loading_config": {"model_source": "x"}}]},
     r"model_loading_config must be a mapping with model_id"),
    ({"allow_unauthenticated": True, "llm_configs": []}, r"llm_configs must be a non-empty list"),
    ({"allow_unauthenticated": True, "llm_configs": [{"model_loading_config": {"model_id": "m"}}] * 2},
     r"model_id 'm' is given to 2 llm_configs"),
    ({"allow_unauthenticated": True, "ingress_cls_config": {"ingress_cls": "x:Y"}, **one()},
     r"ingress_cls_config is not supported"),
    ({**one(), "served_model_names": ["x"]}, r"each model's name is its model_loading_config.model_id"),
    ({"llm_configs": [{"model_loading_config": {"model_id": "m"}}]}, r"^no API key"),
])
def test_what_is_not_honoured_is_refused_with_its_place(args, message, monkeypatch):
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)
    monkeypatch.delenv("COSINE_RAY_API_KEY_FILE", raising=False)
    with pytest.raises(ValueError, match=message):
        build_llm_app(args)


def test_an_llm_config_may_be_a_yaml_file(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump({"model_loading_config": {"model_id": "from-file", "model_source": "smollm2-135m"},
                                    "engine_kwargs": {"num_speculative_tokens": 4}}))
    app = build_llm_app({"allow_unauthenticated": True, "llm_configs": [str(path)]})
    assert app._bound_deployment.init_kwargs["served_model_names"] == ["from-file"]
    assert app._bound_deployment.init_args[1]["speculation"] == {"num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="cannot read"):
        build_llm_app({"allow_unauthenticated": True, "llm_configs": [str(tmp_path / "missing.yaml")]})


def test_build_app_passes_served_model_names_to_the_ingress():
    app = build_app({"num_stages": 1, "allow_unauthenticated": True, "served_model_names": ["smol", "gpt-x"]})
    assert app._bound_deployment.init_kwargs == {"served_model_names": ["smol", "gpt-x"]}
    assert app._bound_deployment.init_args[0]._bound_deployment.name == "cosine_ray_engine"
    assert build_app({"num_stages": 1, "allow_unauthenticated": True,
                      "served_model_names": "one"})._bound_deployment.init_kwargs == {"served_model_names": ["one"]}
    with pytest.raises(ValueError, match="served_model_names must be a list of non-empty names"):
        build_app({"num_stages": 1, "allow_unauthenticated": True, "served_model_names": [""]})


@pytest.mark.real_model  # serve_plan resolves each model (the embedded SmolLM2, cached)
def test_cosine_ray_serve_reads_the_llm_config_and_refuses_engine_flags(real_checkpoint, monkeypatch, tmp_path):
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)

    def plan(*argv: str) -> serve_cli.ServePlan:
        return serve_cli.serve_plan(build_parser().parse_args(["serve", "--config", str(LLM_YAML), *argv]))

    p = plan("--port", "8123", "--api-key", "k")
    assert [m.names for m in p.models] == [["smol"], ["smol-plain"]]
    assert p.app_args["llm_configs"] == shipped_args()["llm_configs"] and p.app_args["api_key"] == "k"
    assert (p.host, p.port, p.app_name, p.ignored) == ("127.0.0.1", 8123, "cosine_ray", [])
    assert p.engine["drafters"] == "ngram,suffix" and p.engine["scheduler"]["max_model_len"] == 2048
    assert serve_cli.local_cluster_cpus(*[m.config_data for m in p.models]) >= serve_cli.local_cluster_cpus(p.engine)
    for flag in (["--drafters", "ngram"], ["--stages", "2"], ["--model", "smollm2-135m"]):
        with pytest.raises(CliError, match=r"do not apply to a config with llm_configs"):
            plan(*flag)
    bare = tmp_path / "args.yaml"  # the builder's args alone, without a Serve config around them
    bare.write_text(yaml.safe_dump(shipped_args()))
    assert [m.names for m in serve_cli.serve_plan(build_parser().parse_args(
        ["serve", "--config", str(bare)])).models] == [["smol"], ["smol-plain"]]
    broken = tmp_path / "broken.yaml"
    args = shipped_args()
    args["llm_configs"][1]["deployment_config"] = {"num_replicas": 3}
    broken.write_text(yaml.safe_dump(args))
    with pytest.raises(CliError, match=r"^--config .*broken.yaml: llm_configs\[1\].deployment_config.num_replicas=3"):
        serve_cli.serve_plan(build_parser().parse_args(["serve", "--config", str(broken)]))
