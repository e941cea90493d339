"""``cosine-ray serve --config``: the shipped deploy/engine.yaml and deploy/serve_config.yaml
describe exactly what ``cosine-ray serve`` runs without flags; a Ray Serve config is read
through its cosine_ray application; every bad config is one line and exit status 2. No Ray cluster is started here: ``run`` is checked with Ray's
entry points replaced by recorders."""

from __future__ import annotations

import dataclasses
import socket
import types
from pathlib import Path

import pytest
import yaml

from cosine_ray.cli import build_parser, main
from cosine_ray.cli import serve as serve_cli
from cosine_ray.cli import serve_start
from cosine_ray.engine.config import SECTIONS, EngineConfig, config_from_dict

REPO = Path(__file__).resolve().parents[2]
ENGINE_YAML = REPO / "deploy" / "engine.yaml"
SERVE_YAML = REPO / "deploy" / "serve_config.yaml"

pytestmark = pytest.mark.real_model  # serve_plan resolves the model (the embedded SmolLM2, cached)


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch, real_checkpoint):
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)


def plan(*argv: str) -> serve_cli.ServePlan:
    return serve_cli.serve_plan(build_parser().parse_args(["serve", *argv]))


def write(tmp_path: Path, data, name: str = "c.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def lanes(p: serve_cli.ServePlan) -> int:
    """The micro-batch lanes the engine replica runs for ``p``: its config resolved as the
    replica resolves it (one lane a stage actor, one in all for stages in the engine)."""
    config = config_from_dict(p.engine)
    return config.resolved(stages_in_process=config.cluster.stages_in_engine).scheduler.num_lanes


def serve_config(args: dict, **top) -> dict:
    return {"http_options": {"host": "0.0.0.0", "port": 8123}, **top,
            "applications": [{"name": "cosine_ray", "route_prefix": "/", "import_path": "cosine_ray.serve.app:build_app",
                              "args": args}]}


# ---- the shipped files ------------------------------------------------------------------------

def test_engine_yaml_is_what_serve_runs_without_flags():
    default = plan()
    from_file = plan("--config", str(ENGINE_YAML))
    assert from_file.engine == default.engine
    assert (from_file.host, from_file.port, from_file.app_args) == (default.host, default.port, default.app_args)
    # a local CPU cluster: the two stages in the engine, one lane
    assert default.engine["num_stages"] == 2 and lanes(default) == 1
    assert default.engine["cluster"]["stages_in_engine"] is True
    assert default.engine["model"] == "smollm2-135m"
    # every field of the engine config is written out, each with a comment
    text = ENGINE_YAML.read_text()
    data = yaml.safe_load(text)
    assert set(data) == {f.name for f in dataclasses.fields(EngineConfig)}
    for section, cls in SECTIONS.items():
        assert set(data[section]) == {f.name for f in dataclasses.fields(cls)}, section
    keyed = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert all("#" in line for line in keyed), [line for line in keyed if "#" not in line]
    # flags still override the file
    overridden = plan("--config", str(ENGINE_YAML), "--stages", "3", "--drafters", "ngram")
    assert overridden.engine["num_stages"] == 3 and overridden.engine["drafters"] == "ngram"


def test_enforce_eager_flag_sets_the_runner(tmp_path):
    assert plan().engine["runtime"]["runner"] == "auto"
    assert plan("--enforce-eager").engine["runtime"]["runner"] == "eager"
    from_file = write(tmp_path, {"num_stages": 1, "runtime": {"runner": "eager"}})
    assert plan("--config", from_file).engine["runtime"]["runner"] == "eager"  # absent flag: the file's value stands
    from cosine_ray.cli.args import engine_config_from_args
    for argv, runner in ((["generate", "hi"], "auto"), (["generate", "hi", "--enforce-eager"], "eager")):
        assert engine_config_from_args(build_parser().parse_args(argv)).runtime.runner == runner


def test_stages_in_engine_flag_runs_one_lane(tmp_path):
    """``--stages-in-engine``: the stages run one after another in the engine, so one micro-batch
    lane keeps the batch whole; a file's own ``num_lanes`` stands."""
    p = plan("--stages-in-engine")
    assert p.engine["cluster"]["stages_in_engine"] is True and p.engine["num_stages"] == 2
    assert p.engine["scheduler"]["num_lanes"] is None and lanes(p) == 1  # the replica resolves it
    actors = plan("--no-stages-in-engine")
    assert actors.engine["cluster"]["stages_in_engine"] is False and lanes(actors) == 2
    from_file = write(tmp_path, {"cluster": {"stages_in_engine": True}, "scheduler": {"num_lanes": 2}})
    assert plan("--config", from_file).engine["scheduler"]["num_lanes"] == 2


def test_stages_run_in_the_engine_by_default_only_on_a_local_cpu_cluster(tmp_path, monkeypatch):
    """Neither flag nor file: in the engine when serve starts a local cluster on CPU; one actor
    per stage when it joins a cluster (--address, or the file's cluster.address), runs on CUDA
    or places stages by resource (use_resources); a file's own setting and the flags win."""
    assert plan().engine["cluster"]["stages_in_engine"] is True
    joined = plan("--address", "10.0.0.1:6379")
    assert joined.engine["cluster"]["stages_in_engine"] is False and lanes(joined) == 2
    in_file = write(tmp_path, {"num_stages": 2, "cluster": {"address": "10.0.0.1:6379"}})
    assert plan("--config", in_file).engine["cluster"]["stages_in_engine"] is False
    monkeypatch.setattr(serve_cli, "check_local_device", lambda device: None)  # no GPU on this machine
    on_cuda = plan("--device", "cuda")
    assert on_cuda.engine["cluster"]["stages_in_engine"] is False and lanes(on_cuda) == 2
    placed = write(tmp_path, {"num_stages": 2, "cluster": {"use_resources": True}}, "placed.yaml")
    assert plan("--config", placed).engine["cluster"]["stages_in_engine"] is False
    said = write(tmp_path, {"num_stages": 2, "cluster": {"stages_in_engine": False}}, "said.yaml")
    # a Ray Serve config runs what `serve run` of it runs: stage actors where it does not say
    serve_file = write(tmp_path, serve_config({"num_stages": 2}), "serve.yaml")
    assert plan("--config", serve_file).engine["cluster"]["stages_in_engine"] is False
    assert plan("--config", said).engine["cluster"]["stages_in_engine"] is False
    assert plan("--address", "10.0.0.1:6379", "--stages-in-engine").engine["cluster"]["stages_in_engine"] is True


def test_an_engine_config_file_takes_the_ingress_args_too(tmp_path):
    """An engine config file is the application builder's ``args``: ingress args included."""
    p = plan("--config", write(tmp_path, {"num_stages": 1, "api_key": "k", "metrics_require_key": True}))
    assert p.engine["num_stages"] == 1 and lanes(p) == 1 and "api_key" not in p.engine
    assert (p.app_args["api_key"], p.app_args["metrics_require_key"]) == ("k", True)


def test_serve_config_yaml_is_the_same_application_as_serve():
    default = plan("--no-stages-in-engine")  # the documented difference: a cluster's stage actors
    from_file = plan("--config", str(SERVE_YAML))
    assert from_file.engine == default.engine
    assert from_file.app_args == default.app_args  # no ingress args: no key, like serve's default
    assert (from_file.host, from_file.port) == ("0.0.0.0", 8000)  # the documented difference
    assert (from_file.app_name, from_file.route_prefix, from_file.ignored) == ("cosine_ray", "/", [])
    local = plan("--config", str(SERVE_YAML), "--host", "127.0.0.1", "--port", "8200")
    assert (local.host, local.port) == ("127.0.0.1", 8200) and local.http_options["host"] == "127.0.0.1"
    # `serve run` builds the engine from the args alone: the same engine config
    from cosine_ray.engine.config import config_from_dict, config_to_dict
    from cosine_ray.serve.app import INGRESS_ARGS
    (app,) = yaml.safe_load(SERVE_YAML.read_text())["applications"]
    args = {k: v for k, v in app["args"].items() if k not in INGRESS_ARGS}
    assert config_to_dict(config_from_dict(args)) == default.engine


# ---- Serve configs -------------------------------------------------------------------------------

def test_serve_config_gives_engine_ingress_and_http_settings(tmp_path, monkeypatch):
    path = write(tmp_path, serve_config(
        {"model": "smollm2-135m", "drafters": "ngram", "num_stages": 1, "api_key": "file-key",
         "return_spec_stats": True, "max_pending_requests": 7, "scheduler": {"num_lanes": 1}},
        proxy_location="HeadOnly", logging_config={"encoding": "JSON"}))
    p = plan("--config", path)
    assert p.engine["drafters"] == "ngram" and p.engine["num_stages"] == 1 and p.engine["scheduler"]["num_lanes"] == 1
    assert "api_key" not in p.engine
    assert {k: p.app_args[k] for k in ("api_key", "return_spec_stats", "max_pending_requests")} == {
        "api_key": "file-key", "return_spec_stats": True, "max_pending_requests": 7}
    assert (p.host, p.port, p.proxy_location) == ("0.0.0.0", 8123, "HeadOnly")
    assert p.ignored == ["logging_config"]
    # flags beat the file; the env key beats the file's, the --api-key flag beats both
    monkeypatch.setenv("COSINE_RAY_API_KEY", "env-key")
    assert plan("--config", path).app_args["api_key"] == "env-key"
    p = plan("--config", path, "--api-key", "flag-key", "--port", "9001", "--max-pending-requests", "3")
    assert (p.app_args["api_key"], p.port, p.app_args["max_pending_requests"]) == ("flag-key", 9001, 3)


@pytest.mark.parametrize("apps, message", [
    ([{"name": "other", "import_path": "my.module:app"}],
     "no application has import_path cosine_ray.serve.app:build_app (found 'my.module:app')"),
    ([{"name": "a", "import_path": "cosine_ray.serve.app:build_app"},
      {"name": "b", "import_path": "cosine_ray.serve.app.build_app"}],
     "2 applications ('a', 'b') have import_path cosine_ray.serve.app:build_app"),
    ([], "no application has import_path"),
    ("nope", "`applications` must be a list"),
])
def test_serve_config_without_exactly_one_cosine_ray_app_exits_2(tmp_path, capsys, apps, message):
    path = write(tmp_path, {"applications": apps})
    assert main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cosine-ray: error: --config ") and message in err[0], err


# ---- every bad config: one line, exit 2 ---------------------------------------------------------

@pytest.mark.parametrize("content, message", [
    (None, "cannot read --config"),                                          # missing file
    ("DIR", "cannot read --config"),                                         # a directory
    ("model: [unclosed\n", "is not valid YAML"),
    ("- a\n- b\n", "must be a mapping of settings"),
    ("model: smollm2-135m\nbogus_key: 1\n", "unknown key(s) bogus_key"),
    ("scheduler:\n  bogus_key: 1\n", "unknown key(s) bogus_key in scheduler"),
    ("scheduler: 5\n", "'scheduler' must be a mapping"),
    ("max_batch_size: 4\n", "'max_batch_size' was renamed: use 'scheduler.max_num_seqs'"),
    ("step:\n  num_lanes: 2\n", "'step.num_lanes' moved: use 'scheduler.num_lanes'"),
    ("cluster: {drafters_in_router: none}\n", "'cluster.drafters_in_router' was renamed: use 'cluster.drafters_in_engine'"),
    ("num_stages: zero\n", "--config"),
    ("drafters: telepathy\n", "unknown drafter 'telepathy'"),
    ("runtime: {suffix_index_tokens: 0}\n", "suffix_index_tokens must be an integer >= 1"),
    ("model: /nonexistent/model/dir\n", "--config"),
    ("applications:\n  - import_path: cosine_ray.serve.app:build_app\n    args: {bogus: 1}\n",
     "unknown key(s) bogus"),
    ("applications:\n  - import_path: cosine_ray.serve.app:build_app\n    args: {max_body_bytes: big}\n",
     "max_body_bytes must be an integer >= 1"),
    ("http_options: {port: 70000}\napplications:\n  - import_path: cosine_ray.serve.app:build_app\n",
     "--port must be in 1..65535"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    if content is None:
        path = str(tmp_path / "missing.yaml")
    elif content == "DIR":
        path = str(tmp_path)
    else:
        path = write(tmp_path, content)
    assert main(["serve", "--config", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cosine-ray: error: ") and message in err[0], err


@pytest.mark.parametrize("argv, message", [
    (["--port", "0"], "--port must be in 1..65535"),
    (["--num-cpus", "0"], "--num-cpus must be >= 1"),
    (["--stages", "0"], "num_stages must be >= 1"),
    (["--drafters-in-engine", "bogus"], "drafters_in_engine: unknown kind(s) bogus"),
    (["--drafters-in-router", "none"], "--drafters-in-router was renamed: use --drafters-in-engine"),
    (["--drafters-in-router=none"], "--drafters-in-router was renamed: use --drafters-in-engine"),
])
def test_bad_flags_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_port_in_use_is_one_line_and_exit_2_before_ray_starts(capsys, monkeypatch):
    started = []
    monkeypatch.setattr("cosine_ray.runtime.cluster.connect", lambda *a, **k: started.append(a))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"port {port} on 127.0.0.1 is in use" in err[0], err
    assert not started


def test_an_unreachable_address_is_one_line_and_exit_2(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "--address", f"127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot reach the Ray cluster at 127.0.0.1:{port}" in err[0], err


# ---- run(): what reaches Ray Serve ----------------------------------------------------------------

def fake_ray(monkeypatch, calls: dict) -> None:
    """run()'s Ray entry points recorded in ``calls``, no cluster, no signal handlers, and a
    Ctrl-C at once after serving starts."""
    from ray import serve

    import cosine_ray.runtime.cluster as cluster

    monkeypatch.setattr(cluster, "connect", lambda address, num_cpus=None, **console: calls.setdefault("connect", address))
    monkeypatch.setattr(serve_cli, "check_port_free", lambda host, port: calls.setdefault("port", (host, port)))
    monkeypatch.setattr(serve_start, "place_actors", lambda plan: plan)  # no cluster to ask here
    monkeypatch.setattr(serve_start, "Deployer", lambda: types.SimpleNamespace(cancel=lambda: None, cancelled=False))
    monkeypatch.setattr(serve, "delete", lambda name: calls.setdefault("delete", name))
    monkeypatch.setattr(serve, "shutdown", lambda: None)
    monkeypatch.setattr("ray.shutdown", lambda: None)
    monkeypatch.setattr(serve_cli, "signal", types.SimpleNamespace(signal=lambda *a: None, SIGINT=2, SIGTERM=15))
    monkeypatch.setattr(serve_cli, "threading", types.SimpleNamespace(
        Event=lambda: types.SimpleNamespace(wait=lambda: True, set=lambda: None, is_set=lambda: False)))


def test_serve_failing_after_the_deploy_is_one_line_and_deletes_the_app(tmp_path, monkeypatch, capsys):
    """The deploy goes out before serve.start returns (ServeStart): a proxy that then never
    answers is exit 2 with one line, and the deployed application is deleted; bad settings
    refused before any controller exists stop the start before the deploy."""
    import threading

    import ray
    from ray import serve

    calls: dict = {}
    fake_ray(monkeypatch, calls)
    created, deployed = threading.Event(), threading.Event()

    def start(**options):
        created.set()
        assert deployed.wait(10), "the deploy never went out"
        raise TimeoutError("HTTP proxies not available after 60s.")

    def get_actor(name, namespace=None):
        if not created.is_set():
            raise ValueError(name)
        return object()

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(serve_start, "deploy_in_child", lambda plan, deployer: deployed.set())
    assert main(["serve", "--drafters", "ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cosine-ray: error: Serve's HTTP proxy did not start: TimeoutError: "
                   "HTTP proxies not available after 60s."], err
    assert calls["delete"] == "cosine_ray"

    def refused(**options):
        raise ValueError("1 validation error for HTTPOptions\nport: bad")

    calls.clear()
    deployed.clear()
    monkeypatch.setattr(serve, "start", refused)
    assert main(["serve", "--drafters", "ngram"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cosine-ray: error: Serve settings: 1 validation error for HTTPOptions"], err
    assert not deployed.is_set() and "delete" not in calls


def test_run_passes_the_serve_config_to_ray_serve(tmp_path, monkeypatch, capsys):
    """run() with Ray's entry points recorded: the file's http_options and proxy_location go to
    serve.start, the app's name and route prefix and its args + ingress args to the process that
    deploys it (``deploy_in_child``: build_app, then serve.run)."""
    from ray import serve

    calls: dict = {}
    fake_ray(monkeypatch, calls)
    monkeypatch.setattr(serve, "start", lambda **kw: calls.setdefault("start", kw))
    monkeypatch.setattr(serve_start, "deploy_in_child", lambda plan, deployer: calls.setdefault(
        "run", (("APP", plan.app_args), {"name": plan.app_name, "route_prefix": plan.route_prefix, "blocking": False})))
    path = write(tmp_path, {**serve_config({"drafters": "ngram", "api_key": "k"}, proxy_location="HeadOnly"),
                            "http_options": {"host": "0.0.0.0", "port": 8123, "request_timeout_s": 30}})
    data = yaml.safe_load(Path(path).read_text())
    data["applications"][0].update(name="mine", route_prefix="/llm")
    Path(path).write_text(yaml.safe_dump(data))
    assert main(["serve", "--config", path]) == 0
    assert calls["connect"] is None and calls["port"] == ("0.0.0.0", 8123)
    assert calls["start"] == {"http_options": {"host": "0.0.0.0", "port": 8123, "request_timeout_s": 30},
                              "proxy_location": "HeadOnly",
                              "logging_config": {"log_level": "WARNING", "enable_access_log": False}}
    (tag, app_args), kw = calls["run"]
    assert tag == "APP" and kw == {"name": "mine", "route_prefix": "/llm", "blocking": False}
    assert app_args["api_key"] == "k" and app_args["drafters"] == "ngram"
    assert calls["delete"] == "mine"
    assert "http://0.0.0.0:8123/llm/v1" in capsys.readouterr().out


def test_the_deploy_goes_out_once_the_controller_exists_not_after_the_proxy(monkeypatch):
    """``ServeStart``: serve.start runs in a thread; ``wait_for_controller`` returns while the
    HTTP proxy still starts (serve.start not yet returned), and ``result`` waits for the rest.
    A start that fails before any controller exists ends the wait and raises its error."""
    import threading

    import ray
    from ray import serve

    created, proxy_up, order = threading.Event(), threading.Event(), []

    def start(**options):
        order.append(("controller", options))
        created.set()
        assert proxy_up.wait(10), "the proxy never came up"
        order.append(("proxy", None))

    def get_actor(name, namespace=None):
        if not created.is_set():
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return object()

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(ray, "get_actor", get_actor)
    starting = serve_start.ServeStart(http_options={"port": 8123})
    starting.wait_for_controller()
    assert order == [("controller", {"http_options": {"port": 8123}})] and not starting.done.is_set()
    proxy_up.set()
    starting.result()
    assert [step for step, _ in order] == ["controller", "proxy"]

    def refused(**options):
        raise ValueError("bad http_options")

    created.clear()
    monkeypatch.setattr(serve, "start", refused)
    failed = serve_start.ServeStart(http_options={"port": -1})
    failed.wait_for_controller()  # returns: no controller will come
    with pytest.raises(ValueError, match="bad http_options"):
        failed.result()


# ---- placement before anything starts (runtime/placement.py) -----------------------------------

def test_place_actors_leaves_out_the_drafter_no_node_can_host(tmp_path, monkeypatch, capsys):
    """The two-node cluster of docs/chaos.md: the fifth drafter asking 0.5 CPU of a 2-CPU node
    is left out of what is deployed, with a note; the ingress args stay."""
    import cosine_ray.runtime.placement as placement
    monkeypatch.setattr(placement, "cluster_nodes", lambda: [{"CPU": 2.0, "datacenter_gpu": 2.0},
                                                             {"CPU": 2.0, "consumer_gpu": 8.0}])
    path = write(tmp_path, {"drafters": "ngram,suffix:code,suffix:math,suffix:instruction,suffix:chat",
                            "cluster": {"use_resources": True, "drafters_in_engine": "none"}, "api_key": "k"})
    placed = serve_start.place_actors(plan("--config", path))
    assert placed.engine["drafters"] == "ngram,suffix:code,suffix:math,suffix:instruction"
    assert placed.app_args["drafters"] == placed.engine["drafters"] and placed.app_args["api_key"] == "k"
    (note,) = capsys.readouterr().err.strip().splitlines()
    assert note.startswith("cosine-ray: note: serving without drafter suffix:chat: drafter suffix:chat "
                           "(cosine_ray:drafter:4) asks CPU 0.5, consumer_gpu 1"), note


def test_place_actors_stops_at_a_stage_no_node_can_host(tmp_path, monkeypatch):
    import cosine_ray.runtime.placement as placement
    monkeypatch.setattr(placement, "cluster_nodes", lambda: [{"CPU": 2.0, "consumer_gpu": 8.0}])
    path = write(tmp_path, {"cluster": {"use_resources": True}})
    with pytest.raises(serve_start.CliError, match=r"cannot place the pipeline: stage 0 \(cosine_ray:stage:0\) asks "
                                                 r"CPU 0.5, datacenter_gpu 1: no node has enough datacenter_gpu; "
                                                 r"the cluster offers node 1: CPU 2, consumer_gpu 8"):
        serve_start.place_actors(plan("--config", path))
