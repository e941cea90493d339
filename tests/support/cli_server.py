"""Helpers for tests that run the real ``cosine-ray serve`` CLI as a subprocess."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

READY_LINE = "serving OpenAI API"
"""What ``cosine-ray serve`` prints once the app answers (cli/serve.py)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log_path: Path, lines: int = 40) -> str:
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])


def wait_until_serving(proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    """Until the CLI prints its ready line; fails the test (with the log's tail) if it exits
    or is not ready within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while READY_LINE not in log_path.read_text(errors="replace"):
        if proc.poll() is not None:
            pytest.fail(f"cosine-ray serve exited with {proc.returncode} before serving:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            pytest.fail(f"cosine-ray serve not ready after {timeout_s} s:\n{log_tail(log_path)}")
        time.sleep(0.5)


def stop_cli(proc: subprocess.Popen, *, grace_s: float = 90.0) -> int:
    """SIGINT (the CLI deletes the app, whose engine takes its actors along, and shuts Serve down), then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode


def launch_serve(args: list[str], log_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, IO[bytes]]:
    """``cosine-ray serve ARGS`` (the installed script, else ``python -m cosine_ray.cli``) with
    ``env`` added to this environment, its output into ``log_path``: the process and the open log."""
    exe = shutil.which("cosine-ray")
    cmd = ([exe] if exe else [sys.executable, "-m", "cosine_ray.cli"]) + ["serve", *args]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
    return proc, log
