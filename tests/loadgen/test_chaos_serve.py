"""Three minutes of ``cosine-loadgen chaos`` against the real ``cosine-ray serve`` (issue 64's
CI-sized run; ``docs/chaos.md`` has the 30-minute one).

The server is the real CLI on the session Ray cluster (``--address``, like the reliability
soak in tests/serve/test_reliability_serve.py): a tiny random-weight model with SmolLM2's
tokenizer (the claims are about serving, and a tiny model keeps 2 cores responsive under 8
clients), 2 pipeline stages, two drafters each in an actor of its own. The chaos command joins
it by URL, so the deployment it kills in is the session cluster's Serve application: a stage,
a drafter, the engine replica, the HTTP proxy, any Ray worker (SIGKILL) and a paused process,
each kind in turn, every 15 s for 150 s of load from 8 clients (streaming and not, greedy and
seeded, chat and completions, some leaving early). It must end with every request accounted
for exactly once, every answer equal to the server's own answer from before the chaos, no 5xx
but 503, every fault recovered, the engine idle after. That the same verdict fails on a lost,
duplicated, hung or wrong request is shown in test_chaos_audit.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from loadgen.cli import main
from loadgen.launcher import ServerProcess, free_port

ray = pytest.importorskip("ray")

from engine_app import our_actors  # noqa: E402
from tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray]

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
               "--output-dir", str(out_dir)])
    out, err = capsys.readouterr()
    print(out[-6000:])
    data = json.loads((out_dir / "chaos.json").read_text())
    audit, faults = data["audit"], data["faults"]
    print(f"[chaos] {audit['requests']} requests: {audit['outcomes']}; errors seen: {audit['errors_by_kind']}; "
          f"recoveries (s): {data['recovery_s_by_kind']}")
    assert (audit["lost"], audit["duplicated"], audit["hung"]) == (0, 0, 0), audit
    assert (audit["wrong_text"], audit["server_errors"], audit["unclear_errors"]) == (0, 0, 0), audit["problems"]
    assert audit["ledger"]["is_consistent"] and audit["outcomes"].get("ok", 0) > 100
    assert audit["outcomes"].get("disconnected", 0) > 0  # callers that left early were in the mix
    assert {f["kind"] for f in faults} == set(KINDS), [f["kind"] for f in faults]  # each kind at least once
    assert all(f["recovery_s"] is not None for f in faults), faults
    assert any(f["in_flight"] and f["failed"] for f in faults if f["kind"] == "engine")  # premise: kills hit requests
    assert data["verdict"]["idle_after"]["idle"], data["verdict"]
    assert rc == 0 and data["verdict"]["ok"], err
    for name in ("chaos.png", "ledger.jsonl", "calls.jsonl", "memory.csv"):
        assert (out_dir / name).stat().st_size > 0
