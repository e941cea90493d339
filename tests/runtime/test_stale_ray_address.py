"""``runtime.cluster.connect(None)`` starts a fresh local cluster even when Ray has a stale
cluster address on record.

How Ray 2.60 finds "the" cluster when ``ray.init`` gets no address
(``ray._private.services.get_ray_address_from_environment``): ``RAY_ADDRESS`` if set, else the
address the last ``ray start`` wrote to ``<temp dir>/ray/ray_current_cluster`` (temp dir:
``RAY_TMPDIR``, default /tmp). A head that died without ``ray stop`` leaves that file behind,
and ``ray.init(num_cpus=...)`` then treats the dead address as an existing cluster: "When
connecting to an existing cluster, num_cpus and num_gpus must not be provided".

Each case runs in a subprocess with its own ``RAY_TMPDIR`` holding a fake record that points
at a port nobody listens on, so neither the machine's real /tmp/ray (other sessions' clusters)
nor this test session's own cluster is touched.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray")

pytestmark = [pytest.mark.ray]

SCRIPT = textwrap.dedent("""
    import sys
    import ray

    stale, how = sys.argv[1], sys.argv[2]
    if how == "ray.init":  # what connect(None) did before: ray.init without an address
        try:
            ray.init(num_cpus=1, include_dashboard=False)
        except Exception as exc:
            print("REFUSED", type(exc).__name__, str(exc).splitlines()[0], flush=True)
            sys.exit(3)
        print("STARTED", ray.get_runtime_context().gcs_address, flush=True)
        ray.shutdown()
        sys.exit(0)
    from cosine_ray.runtime.cluster import connect

    connect(None, num_cpus=1)
    address = ray.get_runtime_context().gcs_address
    assert address != stale, address

    @ray.remote(num_cpus=0)
    def answer():
        return 42

    print("STARTED", address, ray.get(answer.remote(), timeout=120), flush=True)
    ray.shutdown()
""")


@pytest.fixture()
def stale_record():
    """(env, stale address): RAY_TMPDIR is a short fresh directory (Ray's socket paths must
    stay under 108 bytes) whose ray/ray_current_cluster names a dead GCS."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        stale = f"127.0.0.1:{s.getsockname()[1]}"
    tmp = tempfile.mkdtemp(prefix="crst")
    (Path(tmp) / "ray").mkdir()
    (Path(tmp) / "ray" / "ray_current_cluster").write_text(stale)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, PYTHONUNBUFFERED="1")
    yield env, stale
    shutil.rmtree(tmp, ignore_errors=True)


def run(env: dict[str, str], stale: str, how: str, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, stale, how], env=env, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.mark.parametrize("record", ["file", "RAY_ADDRESS"])
def test_plain_ray_init_trips_over_a_stale_address(stale_record, record):
    """The reproduction: without address="local", Ray takes the dead address for a cluster."""
    env, stale = stale_record
    if record == "RAY_ADDRESS":
        (Path(env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster").unlink()
        env = {**env, "RAY_ADDRESS": stale}
    done = run(env, stale, "ray.init", timeout_s=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "When connecting to an existing cluster, num_cpus and num_gpus must not be provided" in done.stdout


def test_connect_without_address_starts_a_fresh_local_cluster(stale_record):
    """Both records at once (the file and RAY_ADDRESS): connect(None) ignores them, starts
    its own cluster, runs a task on it and shuts it down."""
    env, stale = stale_record
    done = run({**env, "RAY_ADDRESS": stale}, stale, "connect", timeout_s=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("STARTED")]
    _, address, answer = line.split()
    assert address != stale and answer == "42"
