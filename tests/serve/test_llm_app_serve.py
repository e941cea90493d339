"""The shipped Ray Serve LLM config (deploy/llm_config.yaml: two names over the embedded
SmolLM2, one engine with drafters and one without) run for real, under Ray's own ``serve run``
and under ``cosine-ray serve --config``, each joining the session's cluster (only the port and
the API key are changed in the file): both names answer
behind the one ingress, each on its own engine deployment with its own drafters, with the same
greedy text (lossless), and ``/v1/models`` lists both with their ``max_model_len``.

One test for both runs, to keep CI time down: each starts two engines (a few minutes on 2 cores).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

ray = pytest.importorskip("ray")

from support.cli_server import free_port, log_tail, stop_cli  # noqa: E402
from support.engine_app import engine_call, force_cleanup  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model, pytest.mark.full]

LLM_YAML = Path(__file__).resolve().parents[2] / "deploy" / "llm_config.yaml"
KEY = "llm-app-test-key"
NAMES = {"smol": "cosine_ray_engine-smol", "smol-plain": "cosine_ray_engine-smol-plain"}
START_S = 900.0


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    """Until ``/health`` answers 200 (every engine ready); fails with the log's tail if the
    process exits, Serve gives the application up, or the deadline passes."""
    from ray import serve

    deadline = time.monotonic() + START_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} before serving:\n{log_tail(log_path)}")
        try:
            app = serve.status().applications.get("cosine_ray")
        except Exception:  # Serve not started yet
            app = None
        if app is not None and str(app.status).endswith("DEPLOY_FAILED"):
            pytest.fail(f"Serve could not deploy the application: {app.message}\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"not healthy after {START_S} s:\n{log_tail(log_path)}")
        time.sleep(1)


def check_each_name_answers(url: str) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # closed by its key
        cards = client.get("/v1/models").json()["data"]
        assert [(c["id"], c["max_model_len"]) for c in cards] == [("smol", 2048), ("smol-plain", 2048)]
        texts = {}
        for name, deployment in NAMES.items():
            r = client.post("/v1/completions", json={"model": name, "prompt": "one two three one two three one",
                                                     "max_tokens": 12, "temperature": 0, "cosine_ray_stats": True})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == name and body["usage"]["completion_tokens"] > 0
            texts[name] = body["choices"][0]["text"]
            drafters = engine_call("describe", deployment=deployment, timeout_s=60)["drafters"]
            assert (drafters == []) == (name == "smol-plain"), (name, drafters)
            if name == "smol-plain":
                assert body["cosine_ray"]["num_draft_tokens"] == 0
        assert texts["smol"] == texts["smol-plain"]  # drafters never change the greedy text
        r = client.post("/v1/completions", json={"model": "smol-large", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_ray_serve_llm_config_runs_under_serve_run_and_cosine_ray_serve(ray_cluster, tmp_path):
    config = yaml.safe_load(LLM_YAML.read_text())
    # the key in the args: `serve run` of a config file builds the application in the cluster,
    # whose nodes were not started with COSINE_RAY_API_KEY (the CLI takes it from its environment)
    (app,) = config["applications"]
    app["args"]["api_key"] = KEY
    env = {**os.environ, "COSINE_RAY_API_KEY": KEY, "PYTHONUNBUFFERED": "1"}
    cosine = shutil.which("cosine-ray")
    runs = {"serve run": lambda path, port: [shutil.which("serve") or "serve", "run", "--address", ray_cluster,
                                             str(path)],
            "cosine-ray serve": lambda path, port: ([cosine] if cosine else [sys.executable, "-m", "cosine_ray.cli"])
            + ["serve", "--config", str(path), "--address", ray_cluster, "--port", str(port)]}
    for label, command in runs.items():
        port = free_port()
        path = tmp_path / f"{label.replace(' ', '-')}.yaml"
        path.write_text(yaml.safe_dump({**config, "http_options": {**config["http_options"], "port": port}}))
        log_path = tmp_path / f"{label.replace(' ', '-')}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command(path, port), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", log_path)
            check_each_name_answers(f"http://127.0.0.1:{port}")
        except BaseException:
            print(f"--- {label} log ---\n{log_tail(log_path, 80)}")
            raise
        finally:
            stop_cli(proc)
            force_cleanup()  # serve run leaves Serve up on a joined cluster
