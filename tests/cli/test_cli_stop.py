"""Ctrl-C during ``cosine-ray serve``'s start: the CLI stops, whatever the signal's inherited
disposition. A job started in the background by a non-interactive shell inherits SIGINT as
*ignored*; the CLI installs its own handlers before anything starts, so a SIGINT sent while
the application deploys (or just after /health first answers) is never lost. It kills the
deploying child, deletes what was deployed, shuts Serve down (its proxy no longer holds the
port) and exits 130, without a traceback."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

ray = pytest.importorskip("ray")

from support.cli_server import free_port, log_tail  # noqa: E402
from support.engine_app import force_cleanup  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model]

STARTING_LINE = "cosine_ray: starting"
"""What the CLI prints once Serve runs and the deploy begins (cli/serve.py)."""


def test_sigint_during_the_deploy_stops_the_cli_even_when_inherited_as_ignored(ray_cluster, tmp_path):
    log_path = tmp_path / "cli.log"
    exe = shutil.which("cosine-ray")
    port = free_port()
    cmd = ([exe] if exe else [sys.executable, "-m", "cosine_ray.cli"]) + [
        "serve", "--port", str(port), "--address", ray_cluster, "--drafters", "ngram", "--stages", "1"]

    def ignore_sigint() -> None:  # what `cosine-ray serve &` in a script gets
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=ignore_sigint)
    try:
        deadline = time.monotonic() + 120
        while STARTING_LINE not in log_path.read_text(errors="replace"):
            assert proc.poll() is None, f"exited with {proc.returncode} before deploying:\n{log_tail(log_path)}"
            assert time.monotonic() < deadline, f"never began deploying:\n{log_tail(log_path)}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"SIGINT during the start was lost: the CLI still runs 90 s later:\n{log_tail(log_path)}")
        text = log_path.read_text(errors="replace")
        assert code == 130, f"exit {code}:\n{log_tail(log_path)}"
        assert "stopped during the start" in text, log_tail(log_path)
        assert "Traceback" not in text, log_tail(log_path)
        assert "serving OpenAI API" not in text, log_tail(log_path)
        with pytest.raises(OSError):  # Serve's proxy went with the application: the next server gets the port
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
            force_cleanup()
