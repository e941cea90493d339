"""``cosine-ray serve`` takes ``vllm serve``'s command line: the positional model, Hub ids (from
huggingface_hub's cache, offline here), ``--served-model-name``, ``--max-model-len``,
``--[no-]enable-prefix-caching``, ``--pipeline-parallel-size``, ``--seed``,
``--speculative-config``, ``--chat-template``, ``--tool-call-parser``; old spellings keep
working; every flag of every command has help; bad values are one line and exit 2. The console:
Serve's access log off (or once, at the proxy), warnings only from Ray's and Serve's processes,
the dashboard off unless asked for. No cluster is started: ``serve_plan`` and the start's Ray
entry points (recorded) are checked."""

from __future__ import annotations

import argparse
import json
import types

import pytest

from cosine_ray.cli import build_parser, main, package_version
from cosine_ray.cli import serve as serve_cli
from cosine_ray.cli import serve_start
from cosine_ray.cli.vllm_flags import speculative_settings
from cosine_ray.engine.config import config_from_dict
from support.hub_cache import write_checkpoint_cache


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)


@pytest.fixture
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint.path)


def plan(*argv: str) -> serve_cli.ServePlan:
    return serve_cli.serve_plan(build_parser().parse_args(["serve", *argv]))


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cosine-ray: error: "), err
    return err[0]


# ---- the command line ------------------------------------------------------------------------------

def parsers(parser: argparse.ArgumentParser, path: str = "cosine-ray"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_flag_of_every_command_has_help():
    walked = list(parsers(build_parser()))
    assert {"cosine-ray serve", "cosine-ray generate", "cosine-ray datastore build", "cosine-ray distill"} <= \
        {path for path, _ in walked}
    missing = [(path, action.option_strings or action.dest) for path, parser in walked
               for action in parser._actions
               if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()]
    assert not missing, missing


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"cosine-ray {package_version()}"
    from importlib.metadata import version
    assert package_version() == version("cosine_ray")


def test_the_positional_model_is_the_model(model, capsys):
    assert plan(model).engine["model"] == model
    assert plan("--model", model).engine["model"] == model
    assert plan(model, "--model", model).engine["model"] == model
    message = one_line_error(capsys, ["serve", model, "--model", "smollm2-135m"])
    assert "the model is given twice" in message


def test_vllms_engine_flags_map_onto_the_config(model):
    p = plan(model, "--max-model-len", "2048", "--no-enable-prefix-caching", "--pipeline-parallel-size", "3",
             "--seed", "7")
    assert p.engine["scheduler"]["max_model_len"] == 2048
    assert p.engine["scheduler"]["enable_prefix_caching"] is False
    assert p.engine["num_stages"] == 3 and p.engine["seed"] == 7
    config = config_from_dict(p.engine)  # what the engine replica builds
    assert (config.scheduler.max_model_len, config.num_stages, config.seed) == (2048, 3, 7)
    assert plan(model, "-pp", "1").engine["num_stages"] == 1
    assert plan(model, "--enable-prefix-caching").engine["scheduler"]["enable_prefix_caching"] is True
    default = plan(model)
    assert default.engine["seed"] is None and default.engine["scheduler"]["enable_prefix_caching"] is True
    assert default.engine["runtime"]["log_stats_interval_s"] == 5.0
    assert plan(model, "--disable-log-stats").engine["runtime"]["log_stats_interval_s"] == 0.0


def test_old_spellings_keep_working(model):
    p = plan(model, "--stages", "3", "--no-prefix-caching", "--max-batch-size", "4", "--drafters-in-engine", "none")
    assert p.engine["num_stages"] == 3 and p.engine["scheduler"]["enable_prefix_caching"] is False
    assert p.engine["scheduler"]["max_num_seqs"] == 4 and p.engine["cluster"]["drafters_in_engine"] == ()


def test_served_model_names_and_the_ingress_flags_reach_the_app(model, tmp_path):
    p = plan(model, "--served-model-name", "smol", "smol-chat", "--tool-call-parser", "llama3_json",
             "--enable-auto-tool-choice")
    assert p.app_args["served_model_names"] == ["smol", "smol-chat"]
    assert p.app_args["tool_call_parser"] == "llama3_json"
    assert "served_model_names" not in p.engine and "tool_call_parser" not in p.engine
    # the same as keys of an engine config file, which the flags override
    path = tmp_path / "engine.yaml"
    path.write_text(json.dumps({"model": model, "served_model_names": ["a"], "tool_call_parser": "mistral"}))
    from_file = plan("--config", str(path))
    assert from_file.app_args["served_model_names"] == ["a"] and from_file.app_args["tool_call_parser"] == "mistral"
    assert plan("--config", str(path), "--served-model-name", "b").app_args["served_model_names"] == ["b"]


@pytest.mark.parametrize("argv, message", [
    (["--served-model-name", "a", "a"], "--served-model-name gives a name twice"),
    (["--tool-call-parser", "pythonic"], "invalid choice: 'pythonic'"),
    (["--seed", "x"], "invalid int value: 'x'"),
    (["--max-model-len", "0"], "max_model_len must be >= 1"),
    (["--revision", "v1"], "is not a Hugging Face Hub id, so it has no revisions"),
    (["--dashboard", "--address", "10.0.0.1:6379"], "--dashboard starts Ray's dashboard with a local cluster"),
])
def test_bad_vllm_flags_are_one_line(model, capsys, argv, message):
    assert message in one_line_error(capsys, ["serve", model, *argv])


# ---- --speculative-config ---------------------------------------------------------------------------

@pytest.mark.parametrize("config, expected", [
    ({"method": "ngram", "num_speculative_tokens": 5}, {"drafters": "ngram", "num_speculative_tokens": 5}),
    ({"method": "suffix"}, {"drafters": "suffix"}),
    ({"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 3},
     {"drafters": "model:/m/draft", "num_speculative_tokens": 3}),
    ({"model": "org/draft"}, {"drafters": "model:org/draft"}),  # vLLM infers draft_model from a model
    ({"method": "cosine"}, {"drafters": "default"}),
    ({"method": "cosine", "drafters": "learning", "num_speculative_tokens": 0},
     {"drafters": "learning", "num_speculative_tokens": 0}),
])
def test_speculative_config_maps_onto_our_drafters(config, expected):
    assert speculative_settings(json.dumps(config)) == expected


def test_speculative_config_reaches_the_engine(model):
    p = plan(model, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    assert p.engine["drafters"] == "ngram" and p.engine["speculation"]["num_speculative_tokens"] == 4


@pytest.mark.parametrize("text, message", [
    ('{"method": "eagle", "model": "x"}', "method 'eagle' is not supported; cosine_ray drafts with ngram, suffix, "
                                          "draft_model, cosine"),
    ('{"method": "ngram", "prompt_lookup_max": 4}', "unknown key(s) prompt_lookup_max"),
    ('{"num_speculative_tokens": 4}', "it needs a method"),
    ('{"method": "draft_model"}', "method draft_model needs \"model\""),
    ('{"method": "ngram", "model": "x"}', "\"model\" goes with method draft_model"),
    ('{"method": "suffix", "drafters": "ngram"}', "\"drafters\" goes with method cosine"),
    ('{"method": "ngram", "num_speculative_tokens": -1}', "num_speculative_tokens must be an integer >= 0"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be an integer >= 0"),
    ("[1]", "must be a JSON object"),
    ("{method: ngram}", "is not valid JSON"),
])
def test_a_bad_speculative_config_is_one_line(model, capsys, text, message):
    assert message in one_line_error(capsys, ["serve", model, "--speculative-config", text])


def test_speculative_config_and_drafters_are_not_both_given(model, capsys):
    message = one_line_error(capsys, ["serve", model, "--speculative-config", '{"method": "ngram"}',
                                      "--drafters", "suffix"])
    assert "give --speculative-config or --drafters / --num-speculative-tokens, not both" in message


# ---- --chat-template --------------------------------------------------------------------------------

def test_a_chat_template_is_read_from_a_file_or_taken_inline(model, tmp_path, capsys):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert plan(model, "--chat-template", str(path)).app_args["chat_template"] == template
    assert plan(model, "--chat-template", template).app_args["chat_template"] == template
    assert "cannot read the template file" in one_line_error(
        capsys, ["serve", model, "--chat-template", str(tmp_path / "missing.jinja")])
    assert "the chat template is not valid Jinja (line 1" in one_line_error(
        capsys, ["serve", model, "--chat-template", "{% for m in messages %}{{ m }}"])


# ---- Hub ids --------------------------------------------------------------------------------------

def test_a_hub_id_is_served_from_the_cache_offline(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """The model is resolved in a child process (``python -m cosine_ray.models.loader``) that
    finds it where HF_HOME says; one line when it is not there."""
    write_checkpoint_cache(tmp_path / "home" / "hub", "cosine-test/tiny", tiny_checkpoint.path)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = plan("cosine-test/tiny", "--revision", "main")
    assert p.engine["model"] == "cosine-test/tiny" and p.engine["revision"] == "main"
    message = one_line_error(capsys, ["serve", "cosine-test/absent"])
    assert "model 'cosine-test/absent' is not in the Hugging Face cache" in message and "HF_HUB_OFFLINE=1" in message
    message = one_line_error(capsys, ["serve", "cosine-test/tiny", "--revision", "v2"])
    assert "model 'cosine-test/tiny' at revision 'v2' is not in the Hugging Face cache" in message


# ---- the console --------------------------------------------------------------------------------------

def test_the_console_is_quiet_by_default(model):
    quiet = plan(model).console
    assert quiet.serve_logging() == {"log_level": "WARNING", "enable_access_log": False}
    assert quiet.app_logging() == {"log_level": "INFO", "enable_access_log": False}  # the engine's stats line
    assert quiet.dashboard is False
    loud = plan(model, "--log-level", "debug", "--access-log", "--dashboard").console
    assert loud.serve_logging() == {"log_level": "DEBUG", "enable_access_log": True}  # once, at the proxy
    assert loud.app_logging() == {"log_level": "DEBUG", "enable_access_log": False}  # never twice
    assert loud.dashboard is True


def test_the_start_hands_the_console_settings_to_ray_and_serve(model, monkeypatch, capsys):
    """What ``run`` passes on: the dashboard and Ray's level to ray.init, the system's logging
    to serve.start, the replicas' to the deploying child's serve.run."""
    from ray import serve

    import cosine_ray.runtime.cluster as cluster

    calls: dict = {}
    monkeypatch.setattr(cluster, "connect", lambda address, **kw: calls.setdefault("connect", kw))
    monkeypatch.setattr(serve_cli, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(serve_start, "place_actors", lambda plan: plan)
    monkeypatch.setattr(serve_start, "Deployer", lambda: types.SimpleNamespace(cancel=lambda: None, cancelled=False))
    monkeypatch.setattr(serve_start, "deploy_in_child", lambda plan, deployer: calls.setdefault("deploy", plan))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.setdefault("start", kw))
    monkeypatch.setattr(serve, "delete", lambda name: None)
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr("ray.shutdown", lambda: None)
    monkeypatch.setattr(serve_cli, "signal", types.SimpleNamespace(signal=lambda *a: None, SIGINT=2, SIGTERM=15))
    monkeypatch.setattr(serve_cli, "threading", types.SimpleNamespace(
        Event=lambda: types.SimpleNamespace(wait=lambda: True, set=lambda: None, is_set=lambda: False)))
    assert main(["serve", model, "--access-log", "--dashboard"]) == 0
    assert calls["connect"]["include_dashboard"] is True and calls["connect"]["logging_level"] == "WARNING"
    assert calls["start"]["logging_config"] == {"log_level": "WARNING", "enable_access_log": True}
    assert calls["deploy"].console.app_logging() == {"log_level": "INFO", "enable_access_log": False}
    calls.clear()
    assert main(["serve", model]) == 0
    assert calls["connect"]["include_dashboard"] is False
    assert calls["start"]["logging_config"]["enable_access_log"] is False


def test_the_deploying_child_does_not_print_the_workers_lines_again(monkeypatch):
    """The CLI prints the workers' lines; the deploying child joins the same job on the same
    terminal without ``log_to_driver``, else every line showed twice during the start."""
    import io
    import logging
    import sys

    from ray import serve

    import cosine_ray.runtime.cluster as cluster
    import cosine_ray.serve.app as app

    seen: dict = {}
    monkeypatch.setattr(cluster, "connect", lambda address, **kw: seen.setdefault("connect", kw))
    monkeypatch.setattr(app, "build_app", lambda args: "APP")
    monkeypatch.setattr(serve, "run", lambda target, **kw: seen.setdefault("run", kw))
    monkeypatch.setattr(serve_start.signal, "signal", lambda *a: None)
    spec = {"address": "x:1", "app_args": {}, "name": "n", "route_prefix": "/", "error_file": "/dev/null",
            "logging_config": {"log_level": "INFO", "enable_access_log": False}, "log_level": "WARNING"}
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(spec)))
    serve_logger = logging.getLogger("ray.serve")
    monkeypatch.setattr(serve_logger, "level", serve_logger.level)  # main() sets it: put back afterwards
    assert serve_start.main() == 0
    assert seen["connect"] == {"logging_level": "WARNING", "log_to_driver": False}
    assert seen["run"]["logging_config"] == {"log_level": "INFO", "enable_access_log": False}
