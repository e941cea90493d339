"""Start a server process, wait until ``GET /health`` answers 200, stop it (``compare --launch``).

The command is a template with ``{port}`` and ``{host}`` placeholders, e.g.
``cosine-ray serve --port {port} --stages 1``, plus per-target extra arguments appended at the end
(``--drafters none``). Robustness rules:

- the server runs in its own session (process group) with stdout+stderr to a log file;
- readiness: /health = 200 within ``ready_timeout_s``; if the process exits first, or the time
  runs out, ``LaunchError`` says which, with the last log line and the log's path;
- stop: SIGINT (``cosine-ray serve`` then deletes its Serve app and engine and shuts Ray down),
  then SIGTERM and finally SIGKILL to the whole process group if it has not exited within
  ``stop_grace_s``; ``ServerProcess`` is a context manager so a server is stopped on every path
  (errors, Ctrl-C) and never outlives the loadgen.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import httpx


class LaunchError(RuntimeError):
    """A launched server did not come up (one line, names the target and the log file)."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_command(template: str, extra_args: str, *, host: str, port: int) -> list[str]:
    try:
        base = shlex.split(template.format(host=host, port=port))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--launch template {template!r}: {exc} (placeholders: {{host}}, {{port}})") from None
    if not base:
        raise ValueError("--launch template is empty")
    return base + shlex.split(extra_args)


@dataclass
class ServerProcess:
    name: str
    command: Sequence[str]
    url: str
    log_path: Path
    ready_timeout_s: float = 600.0
    stop_grace_s: float = 90.0
    poll_s: float = 0.5
    cwd: Path | None = None
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True)

    def __post_init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.ready_after_s: float | None = None

    def __enter__(self) -> "ServerProcess":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log(f"[{self.name}] starting: {shlex.join(self.command)} (log: {self.log_path})")
        with open(self.log_path, "wb") as log_file:
            try:
                self.proc = subprocess.Popen(list(self.command), stdout=log_file, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.cwd,
                                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
            except OSError as exc:
                raise LaunchError(f"{self.name}: cannot start {self.command[0]!r}: {exc.strerror or exc}") from None

    def last_log_line(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return lines[-1][:300] if lines else "(empty log)"

    def wait_ready(self) -> float:
        """Seconds until /health answered 200; LaunchError if the server dies or times out."""
        assert self.proc is not None, "start() first"
        start = time.monotonic()
        last = "no answer yet"
        with httpx.Client(timeout=5.0) as client:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise LaunchError(f"{self.name}: the server exited with code {rc} before /health answered "
                                      f"200; last log line: {self.last_log_line()} (log: {self.log_path})")
                try:
                    resp = client.get(f"{self.url}/health")
                    if resp.status_code == 200:
                        self.ready_after_s = time.monotonic() - start
                        self.log(f"[{self.name}] ready after {self.ready_after_s:.1f} s at {self.url}")
                        return self.ready_after_s
                    last = f"HTTP {resp.status_code}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}"
                if time.monotonic() - start > self.ready_timeout_s:
                    raise LaunchError(f"{self.name}: /health not 200 after {self.ready_timeout_s:g} s ({last}); "
                                      f"last log line: {self.last_log_line()} (log: {self.log_path})")
                time.sleep(self.poll_s)

    def stop(self) -> int | None:
        """SIGINT, then SIGTERM/SIGKILL to the process group; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        try:
            if proc.poll() is None:
                self.log(f"[{self.name}] stopping (SIGINT)")
                self._signal_until_exit(proc)
        except KeyboardInterrupt:  # Ctrl-C while waiting: no more grace, but never leave it running
            kill_process_group(proc.pid)
            proc.wait(timeout=10)
            raise
        finally:
            kill_process_group(proc.pid)
        self.log(f"[{self.name}] stopped (exit {proc.returncode})")
        return proc.returncode

    def _signal_until_exit(self, proc: subprocess.Popen) -> None:
        for sig, grace in ((signal.SIGINT, self.stop_grace_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                if sig == signal.SIGINT:
                    proc.send_signal(sig)
                else:
                    os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                self.log(f"[{self.name}] still running {grace:g} s after {sig.name}")


def kill_process_group(pgid: int) -> None:
    """Kill whatever is left in the server's process group (children it did not reap)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
