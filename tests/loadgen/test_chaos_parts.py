"""The chaos command's parts without a server: roles from command lines, node specs, the
memory slopes, the flags."""

from __future__ import annotations

import os
import time

import pytest

from loadgen.chaos.cluster import NodeSpec
from loadgen.chaos.faults import parse_kinds
from loadgen.chaos.memory import MemoryLog, Sample, slope_mib_per_min
from loadgen.chaos.procs import classify, cpu_seconds, descendants, memory_mib, process_table, read_proc
from loadgen.cli import main

SESSION = "/tmp/rcabc/session_2026-12-01_17-27-06_123456_789"


@pytest.mark.parametrize("cmdline, role", [
    # the raylet's later arguments name the agents' scripts: it is still the raylet
    (f"/v/ray/core/src/ray/raylet/raylet --raylet_socket_name={SESSION}/sockets/raylet --store_socket_name=x "
     f"--object_manager_port=0 --dashboard_agent_command=/v/bin/python -u /v/ray/dashboard/agent.py "
     f"--runtime_env_agent_command=/v/bin/python -u /v/ray/_private/runtime_env/agent/main.py", "raylet"),
    (f"/v/ray/core/src/ray/gcs/gcs_server --log_dir={SESSION}/logs", "gcs"),
    ("ray::StageHost.forward", "stage"),
    ("ray::DrafterHost", "drafter"),
    ("ray::ServeReplica:cosine_ray:cosine_ray_engine.handle_request_with_rejection", "engine"),
    ("ray::ServeReplica:cosine_ray:cosine_ray", "ingress"),
    ("ray::ProxyActor", "proxy"),
    ("ray::ServeController.listen_for_change", "serve_controller"),
    ("ray::DashboardAgent", "dashboard_agent"),
    ("ray::RuntimeEnvAgent", "runtime_env_agent"),
    ("ray::IDLE", "idle_worker"),
    ("ray::SomethingElse", "worker"),
    ("/v/bin/python /v/ray/dashboard/dashboard.py --host=127.0.0.1", "dashboard"),
    ("/v/bin/python -u /v/ray/autoscaler/_private/monitor.py --logs-dir=x", "autoscaler_monitor"),
    ("/v/bin/python -u /v/ray/_private/log_monitor.py --session-dir=x", "log_monitor"),
    ("/v/bin/python /v/bin/cosine-ray serve --port 8000", "server_cli"),
    ("python -m cosine_ray.cli serve --port 8000", "server_cli"),
    ("/v/bin/python -m cosine_ray.cli.serve_start", "server_deploy"),
    ("/usr/bin/vim notes.txt", "other"),
])
def test_roles_from_command_lines(cmdline, role):
    assert classify(cmdline) == role


def test_this_process_and_its_memory_are_read_from_proc():
    me = read_proc(os.getpid())
    assert me is not None and me.pid == os.getpid() and me.key == f"{me.pid}@{me.start}"
    table = process_table()
    assert me.pid in table and all(p.ppid != 0 or p.pid == 1 for p in descendants(table, [me.ppid]))
    m = memory_mib(os.getpid())
    assert m["rss"] > 10 and (m.get("pss") is None or 0 < m["pss"] <= m["rss"])
    assert memory_mib(2**22 + 12345) is None  # no such process


def test_cpu_seconds_of_a_process_grow_with_its_work():
    before = cpu_seconds(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 CPU-seconds of this process's own work
        pass
    after = cpu_seconds(os.getpid())
    assert before is not None and after - before >= 0.2  # clock ticks: 10 ms each
    assert cpu_seconds(2**22 + 12345) is None


def test_node_specs():
    spec = NodeSpec.parse("CPU=2,datacenter_gpu=2")
    assert spec == NodeSpec(2.0, {"datacenter_gpu": 2.0}) and spec.describe() == "CPU=2,datacenter_gpu=2"
    for bad in ("datacenter_gpu=2", "CPU=two", "CPU", "CPU=-1"):
        with pytest.raises(ValueError):
            NodeSpec.parse(bad)


def test_kinds():
    assert parse_kinds("all")[-1] == "node" and parse_kinds("stage, engine,stage") == ("stage", "engine")
    with pytest.raises(ValueError, match="unknown kind"):
        parse_kinds("stage,gpu")


def sample(t: float, key: str, rss: float, role: str = "stage", age: float | None = None) -> Sample:
    return Sample(t, key, int(key.split("@")[0]), role, t if age is None else age, rss, None, None)


def test_slopes_per_process_and_pooled_per_role():
    log = MemoryLog()
    # one process growing 1 MiB/min for 20 minutes; two short-lived ones flat at different levels
    log.samples += [sample(60.0 * i, "1@1", 100.0 + i) for i in range(21)]
    log.samples += [sample(600 + 30.0 * i, "2@2", 500.0, "drafter", age=400 + 30.0 * i) for i in range(6)]
    log.samples += [sample(800 + 30.0 * i, "3@3", 900.0, "drafter", age=400 + 30.0 * i) for i in range(6)]
    rows = {r["process"]: r for r in log.slopes(run_warmup_s=300, warmup_s=300, min_span_s=300)}
    assert rows["1@1"]["judged"] and rows["1@1"]["rss_slope"] == pytest.approx(1.0)
    assert not rows["2@2"]["judged"] and rows["2@2"]["rss_slope"] is None  # 150 s of samples
    pooled = log.pooled_slopes(run_warmup_s=300, warmup_s=300)
    # within each drafter flat, though their levels differ by 400 MiB: pooled slope 0, not a rise
    assert pooled["drafter"]["rss_slope"] == pytest.approx(0.0) and pooled["drafter"]["processes"] == 2
    assert slope_mib_per_min([0, 60, 120], [10, 10.5, 11]) == pytest.approx(0.5)


@pytest.mark.parametrize("argv, message", [
    (["--url", "http://127.0.0.1:1", "--head-node", "CPU=2"], "not both"),
    (["--worker-node", "CPU=2"], "--worker-node needs --head-node"),
    (["--kinds", "node"], "the node kind needs a worker node"),
    (["--launch", "cosine-ray serve"], "must contain {port}"),
    (["--stream-fraction", "1.5"], "--stream-fraction must be in [0, 1]"),
    (["--head-node", "GPU=1"], "give the node's CPU=N"),
    (["--url", "http://example.com:8000"], "not a local address"),
    (["--features", "plain,telepathy"], "--features: unknown feature 'telepathy'"),
    (["--max-failed-fraction", "1.5"], "--max-failed-fraction must be in [0, 1]"),
    (["--reference-model", "/no/such/model"], "not a Hugging Face model directory"),
])
def test_bad_flags_are_one_line(argv, message, capsys, tmp_path):
    rc = main(["chaos", *argv, "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc in (1, 2) and len(err) == 1 and message in err[0], err
    assert rc == (1 if "local address" in message else 2)


def test_shapes_take_the_features_in_turn_and_say_what_they_send():
    import numpy as np

    from loadgen.chaos.shapes import CHAT, FEATURES, JSON_SCHEMA, STOP, build_shapes, parse_features
    from loadgen.workload import DEFAULT_DATASET_DIR, load_rows

    assert parse_features("all") == FEATURES and parse_features("n, stop,n") == ("n", "stop")
    shapes = build_shapes(load_rows(DEFAULT_DATASET_DIR, "second-half"), 12, np.random.default_rng(0), max_tokens=8,
                          seeded_fraction=0.0, completions_fraction=1.0, features=FEATURES)
    assert [s.feature for s in shapes] == list(FEATURES) * 2
    bodies = {s.feature: s.body("m", stream=True, request_id="r") for s in shapes}
    assert bodies["n"]["n"] == 2 and "n" not in bodies["plain"] and bodies["stop"]["stop"] == STOP
    assert bodies["logprobs"]["logprobs"] == 2  # completions: top-k as an integer
    assert bodies["json"]["response_format"]["json_schema"]["schema"] == JSON_SCHEMA
    assert bodies["tools"]["tool_choice"]["function"]["name"] == bodies["tools"]["tools"][0]["function"]["name"]
    by_feature = {s.feature: s for s in shapes}
    assert by_feature["json"].path == by_feature["tools"].path == CHAT  # grammars go to chat
    assert [f for f, s in by_feature.items() if s.independent] == ["plain", "n", "stop", "logprobs"]


def test_references_are_cut_at_the_stop_string_the_server_would_find():
    from loadgen.chaos.references import cut

    assert cut("It is red. It is big.", [".", "\n\n"]) == "It is red"
    assert cut("no stop here", ["."]) == "no stop here"
