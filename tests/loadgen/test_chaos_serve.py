"""Three minutes of ``cosine-loadgen chaos`` against the real ``cosine-ray serve`` (a
CI-sized run; ``docs/chaos.md`` has the 30-minute one).

The server is the real CLI on the session Ray cluster (``--address``, like the reliability
soak in tests/serve/test_reliability_serve.py): a tiny random-weight model with SmolLM2's
tokenizer (the claims are about serving, and a tiny model keeps 2 cores responsive under 8
clients), 2 pipeline stages, two drafters each in an actor of its own. The chaos command joins
it by URL, so the deployment it kills in is the session cluster's Serve application: a stage,
a drafter, the engine replica, the HTTP proxy, any Ray worker (SIGKILL) and a paused process,
each kind in turn, every 15 s for 150 s of load from 8 clients (streaming and not, greedy and
seeded, chat and completions, every API feature of the shapes, some leaving early). It must
end with the client's and the server's record of the request ids agreeing (none lost, none
answered twice), every greedy answer equal to the tiny model's own fp32 decoding in
transformers and every other answer to the server's from before the chaos, no 5xx but 503, no
failure outside a fault, every fault recovered, the engine idle after. That the same verdict
fails on a lost, duplicated, hung or wrong request is shown in test_chaos_audit.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from loadgen.chaos import audit as audit_mod
from loadgen.chaos.deploy import Deployment, DeploymentOptions
from loadgen.chaos.faults import Injector
from loadgen.chaos.run import ChaosConfig, ChaosRun
from loadgen.chaos.shapes import build_shapes
from loadgen.chaos.traffic import Mix
from loadgen.cli import main
from loadgen.launcher import ServerProcess, free_port
from loadgen.workload import DEFAULT_DATASET_DIR, load_rows

ray = pytest.importorskip("ray")

from support.engine_app import our_actors  # noqa: E402
from support.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model, pytest.mark.full]

REPO = Path(__file__).resolve().parents[2]
KINDS = ("stage", "drafter", "engine", "proxy", "worker", "pause")
READY_TIMEOUT_S = 360.0


@pytest.fixture(scope="module")
def server(ray_cluster, real_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("chaos")
    ckpt = write_tiny_checkpoint(root / "tiny-smollm2", tokenizer_from=real_checkpoint, seed=7)
    port = free_port()
    cmd = [sys.executable, "-m", "cosine_ray.cli", "serve", "--address", ray_cluster, "--port", str(port),
           "--model", str(ckpt.path), "--stages", "2", "--drafters", "ngram,suffix:code",
           "--drafters-in-engine", "none", "--max-batch-size", "8"]
    proc = ServerProcess("cosine-ray", cmd, f"http://127.0.0.1:{port}", root / "serve.log",
                         ready_timeout_s=READY_TIMEOUT_S, cwd=REPO)
    proc.checkpoint = ckpt.path  # its fp32 greedy decoding is the independent reference
    with proc:
        proc.wait_ready()
        yield proc
    deadline = time.monotonic() + 60
    while (left := our_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"actors left after the server stopped: {left}"


def test_three_minutes_of_chaos_lose_nothing(server, tmp_path, capsys):
    out_dir = tmp_path / "chaos"
    rc = main(["chaos", "--url", server.url, "--duration", "150", "--clients", "8", "--kill-every", "15",
               "--kinds", ",".join(KINDS), "--order", "cycle", "--pause-seconds", "5", "--num-shapes", "12",
               "--max-tokens", "12", "--request-timeout", "120", "--recovery-timeout", "240", "--seed", "3",
               "--memory-interval", "5", "--memory-warmup", "30", "--memory-min-span", "60", "--slope-bound", "inf",
               "--reference-model", str(server.checkpoint), "--output-dir", str(out_dir)])
    out, err = capsys.readouterr()
    print(out[-6000:])
    data = json.loads((out_dir / "chaos.json").read_text())
    audit, faults = data["audit"], data["faults"]
    print(f"[chaos] {audit['requests']} requests: {audit['outcomes']}; errors seen: {audit['errors_by_kind']}; "
          f"recoveries (s): {data['recovery_s_by_kind']}")
    try:
        assert (audit["lost"], audit["duplicated"], audit["hung"]) == (0, 0, 0), audit
        assert (audit["wrong_text"], audit["server_errors"], audit["unclear_errors"]) == (0, 0, 0), audit["problems"]
        assert audit["ledger"]["is_consistent"] and audit["outcomes"].get("ok", 0) > 100
        assert audit["server_ledger"]["error"] is None and audit["server_ledger"]["entries"] > 100
        assert audit["failed_outside_faults"]["ok"], audit["failed_outside_faults"]
        assert len(data["independent_references"]) > 0  # greedy shapes checked against HF, not the server
        assert audit["outcomes"].get("disconnected", 0) > 0  # callers that left early were in the mix
        assert {f["kind"] for f in faults} == set(KINDS), [f["kind"] for f in faults]  # each kind at least once
        assert all(f["recovery_s"] is not None for f in faults), faults
        assert any(f["in_flight"] and f["failed"] for f in faults if f["kind"] == "engine")  # premise: kills hit requests
        assert data["verdict"]["idle_after"]["idle"], data["verdict"]
        assert rc == 0 and data["verdict"]["ok"], err
    except AssertionError:  # what the server said while it happened: the logs go with the temp dir
        print_server_complaints(server.log_path)
        raise
    for name in ("chaos.png", "ledger.jsonl", "calls.jsonl", "memory.csv"):
        assert (out_dir / name).stat().st_size > 0


def print_server_complaints(log_path: Path, limit: int = 200) -> None:
    """The server log's last ``limit`` warning, error and traceback lines (its actors' included)."""
    marks = ("WARNING", "ERROR", "Traceback", "Error:", "error:")
    lines = [ln for ln in Path(log_path).read_text(errors="replace").splitlines() if any(m in ln for m in marks)]
    print(f"[chaos] server log {log_path}: last {min(limit, len(lines))} of {len(lines)} warning/error lines")
    for line in lines[-limit:]:
        print(line[:400])


class IngressKiller(Injector):
    """The worker kind, aimed: it kills only the Serve ingress replica (``ray::ServeReplica``
    of the ``cosine_ray`` deployment), the process whose loss Serve's proxy answered with a bare
    500 (or a cut stream) before ``serve/guards/proxy_guard.py``."""

    def candidates(self, kind: str):
        return [p for p in self.find() if p.role == "ingress"]


def test_a_killed_ingress_replica_is_a_clean_503_never_a_500(server):
    cfg = ChaosConfig(duration_s=45, clients=6, kill_every_s=15, kinds=("worker",), max_kills=2,
                      request_timeout_s=120, recovery_timeout_s=240, mix=Mix(0.5, 0.0), memory_interval_s=60, seed=5)
    rows = load_rows(DEFAULT_DATASET_DIR, "second-half")
    shapes = build_shapes(rows, 6, np.random.default_rng(5), max_tokens=48, seeded_fraction=0.3,
                          completions_fraction=0.5)
    with Deployment(DeploymentOptions(url=server.url)) as dep:
        injector = IngressKiller(dep.processes, np.random.default_rng(5), log=print)
        result = asyncio.run(ChaosRun(cfg, server.url, shapes, find=dep.processes, injector=injector,
                                      log=print).main())
    verdict = audit_mod.audit(result.calls, result.ledger, result.references, result.faults, result.server,
                              shapes=shapes)
    lost_replica = [c for c in result.calls if c.error and "replica handling this request was lost" in c.error]
    print(f"[chaos] ingress killed {len(result.faults)} times: {verdict['outcomes']}, {verdict['errors_by_kind']}")
    # the next kill waits for the last recovery, which may outlast the run on a busy machine
    roles = [t["role"] for f in result.faults for t in f.targets]
    assert roles and set(roles) == {"ingress"}, roles
    assert all(f.recovered_t is not None for f in result.faults)
    assert lost_replica, "premise: the kills caught requests inside the replica"
    assert verdict["server_errors"] == verdict["unclear_errors"] == 0, verdict["problems"]
    assert verdict["ok"], verdict
