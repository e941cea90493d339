"""Actors that a real two-node cluster cannot host (runtime/placement.py), on Ray's
``cluster_utils`` nodes on this machine: head 2 CPUs + ``datacenter_gpu: 2``, worker 2 CPUs +
``consumer_gpu: 8``, ``cluster.use_resources: true``, every drafter an actor.

* A stage no node can host: ``cosine-ray serve`` exits 2 at once, naming the stage, what it
  asks and what the nodes offer (before this check it waited silently, /health timing out).
* Five drafters asking 0.5 CPU each on the worker's 2 CPUs: the fifth can never start. The CLI
  says so and serves without it; the engine deployed without the CLI (``serve.run``, as
  ``serve deploy`` does) leaves it out by itself and starts instead of waiting for it.
* An application whose engine cannot start: one line with the replica's own error.

The cluster lives in a helper process (tests/support/two_node_cluster.py): this process stays on the
session's cluster. Tiny random-weight model with SmolLM2's tokenizer; outputs are compared
with transformers' greedy decoding.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("ray")

from support.cli_server import free_port, log_tail, stop_cli, wait_until_serving  # noqa: E402
from support.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model, pytest.mark.full]

HELPER = Path(__file__).parents[1] / "support" / "two_node_cluster.py"
HEAD = {"CPU": 2, "datacenter_gpu": 2}
WORKER = {"CPU": 2, "consumer_gpu": 8}
FIVE_DRAFTERS = "ngram,suffix:code,suffix:math,suffix:instruction,suffix:chat"
OFFERS = "node 1: CPU 2, datacenter_gpu 2; node 2: CPU 2, consumer_gpu 8"
READY_TIMEOUT_S = 420.0
PROMPT = "one two three four five six"
TOKENS = 12


@pytest.fixture(scope="module")
def two_nodes():
    """GCS address of the helper's cluster. Its temp dir is private (short: socket paths are
    limited), so the ``ray_current_cluster`` file other Ray users of the machine read is untouched."""
    tmp = tempfile.mkdtemp(prefix="rc", dir="/tmp")
    env = {**os.environ, "TMPDIR": tmp, "RAY_TMPDIR": tmp}
    proc = subprocess.Popen([sys.executable, str(HELPER), json.dumps(HEAD), json.dumps(WORKER)], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        assert line, f"the two-node cluster did not start (exit {proc.poll()})"
        yield json.loads(line)["address"]
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, real_checkpoint):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("placement") / "tiny-smollm2", tokenizer_from=real_checkpoint,
                                 seed=7)
    ids = ckpt.load_tokenizer()(PROMPT, add_special_tokens=True)["input_ids"]
    out = ckpt.load_hf_model().generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                        max_new_tokens=TOKENS, do_sample=False, num_beams=1, temperature=None,
                                        top_p=None, top_k=None, pad_token_id=0)[0, len(ids):].tolist()
    return ckpt, ckpt.load_tokenizer().decode(out, skip_special_tokens=True)


def engine_args(ckpt, **cluster) -> dict:
    return {"model": str(ckpt.path), "num_stages": 2, "drafters": FIVE_DRAFTERS,
            "cluster": {"use_resources": True, "drafters_in_engine": "none", **cluster}}


def serve_cmd(address: str, port: int, config: Path) -> list[str]:
    return [sys.executable, "-m", "cosine_ray.cli", "serve", "--address", address, "--port", str(port),
            "--config", str(config)]


def test_a_stage_no_node_can_host_stops_the_server_with_the_reason(two_nodes, tiny, tmp_path):
    config = tmp_path / "engine.json"  # YAML is a superset of JSON
    config.write_text(json.dumps(engine_args(tiny[0], num_cpus_per_actor=3)))
    start = time.monotonic()
    done = subprocess.run(serve_cmd(two_nodes, free_port(), config), capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    took = time.monotonic() - start
    print(f"[placement] unplaceable stage: exit {done.returncode} after {took:.1f} s: {done.stderr.strip()[-400:]}")
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("cosine-ray: error: cannot place the pipeline: stage 0 (cosine_ray:stage:0) asks CPU 3, "
                           "datacenter_gpu 1: no node has enough CPU"), last
    assert f"the cluster offers {OFFERS}" in last and "Traceback" not in done.stderr


def test_the_cli_serves_without_the_drafter_that_cannot_be_placed(two_nodes, tiny, tmp_path):
    ckpt, reference = tiny
    config = tmp_path / "engine.json"
    config.write_text(json.dumps(engine_args(ckpt)))
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_cmd(two_nodes, port, config), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        start = time.monotonic()
        wait_until_serving(proc, log_path, READY_TIMEOUT_S)
        print(f"[placement] served after {time.monotonic() - start:.1f} s without the fifth drafter")
        text = log_path.read_text(errors="replace")
        assert ("cosine-ray: note: serving without drafter suffix:chat: drafter suffix:chat (cosine_ray:drafter:4) "
                "asks CPU 0.5, consumer_gpu 1: the nodes that could host it are full") in text, log_tail(log_path)
        assert "serving without drafter suffix:instruction" not in text
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        # the CLI process only waits for Ctrl-C: the application was bound in a child, so it
        # never loaded torch (cli/serve_start.py)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "cosine_ray_stats": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference, r.text[:300]
    finally:
        stop_cli(proc)


def test_an_application_that_cannot_start_is_one_line_with_its_cause(two_nodes, tiny, tmp_path):
    config = tmp_path / "engine.json"
    config.write_text(json.dumps({"model": str(tiny[0].path), "num_stages": 1, "drafters": "retrieval:code",
                                  "datastore_dir": str(tmp_path / "no-stores")}))
    done = subprocess.run(serve_cmd(two_nodes, free_port(), config), capture_output=True, text=True, timeout=400,
                          stdin=subprocess.DEVNULL)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and last.startswith(
        "cosine-ray: error: the application did not start: ValueError: no datastore at"), done.stderr[-2000:]


DEPLOY_SCRIPT = """
import json, sys
from ray import serve
from cosine_ray.runtime.cluster import connect
from cosine_ray.serve.app import build_app
connect(sys.argv[1])
serve.start(http_options={"port": int(sys.argv[3])})
serve.run(build_app({"allow_unauthenticated": True, **json.loads(sys.argv[2])}), name="cosine_ray", route_prefix="/", blocking=False)
handle = serve.get_deployment_handle("cosine_ray_engine", app_name="cosine_ray")
print(json.dumps(handle.describe.remote().result(timeout_s=60)), flush=True)
serve.shutdown()
"""


def test_the_engine_alone_starts_without_the_drafter_that_cannot_be_placed(two_nodes, tiny):
    """No CLI check in front (``serve.run`` of the application builder): the engine's own."""
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", DEPLOY_SCRIPT, two_nodes, json.dumps(engine_args(tiny[0])),
                           str(free_port())], capture_output=True, text=True, timeout=READY_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)
    print(f"[placement] engine deployed without the CLI in {time.monotonic() - start:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith('{"model"')))
    assert info["drafters"] == ["ngram", "suffix:code", "suffix:math", "suffix:instruction"], info
    assert "serving without drafter suffix:chat" in done.stdout + done.stderr  # the engine's log, via log_to_driver
