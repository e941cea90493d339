"""The deployment a chaos run works on: launched here (optionally on a ``LocalCluster``) or
joined by URL, and how to list its processes.

Launched: ``launch`` is a command template with ``{port}`` (and ``{address}``, the cluster's
GCS address, when nodes are started here; without the placeholder ``--address ADDRESS`` is
appended); this process becomes a child subreaper first, so every process the server and the
nodes start (Ray daemonises its own) stays our descendant: that is the deployment, and on exit
whatever is left of it is stopped by PID. Joined: the URL must name this machine, and the
deployment is the Ray session of the process listening on its port (``procs``).
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from loadgen.chaos import procs
from loadgen.chaos.cluster import RAY_ENV, LocalCluster, NodeSpec
from loadgen.launcher import ServerProcess, free_port


class DeploymentError(RuntimeError):
    """The deployment cannot be started, found or reached (one line)."""


@dataclass(frozen=True, slots=True)
class DeploymentOptions:
    url: str | None = None
    """Join the server at this URL (on this machine) instead of launching one."""
    launch: str | None = None
    """Server command template with ``{port}`` (and optionally ``{address}``)."""
    host: str = "127.0.0.1"
    launch_timeout_s: float = 900.0
    stop_timeout_s: float = 90.0
    head: NodeSpec | None = None
    """Start a head node with ``ray start`` (and the server joins it)."""
    workers: tuple[NodeSpec, ...] = ()
    log_dir: Path = Path(".")


def is_local_host(host: str) -> bool:
    """True when ``host`` resolves only to addresses of this machine."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    local = {"127.0.0.1", "::1"}
    try:
        local |= {i[4][0] for i in socket.getaddrinfo(socket.gethostname(), None)}
    except socket.gaierror:
        pass
    return all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback or i[4][0] in local for i in infos)


class Deployment:
    def __init__(self, opts: DeploymentOptions, log: Callable[[str], None] = print) -> None:
        self.opts, self.log = opts, log
        self.cluster: LocalCluster | None = None
        self.server: ServerProcess | None = None
        self.url = opts.url.rstrip("/") if opts.url else ""
        self.port = 0

    def __enter__(self) -> "Deployment":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        opts = self.opts
        if opts.url:
            parts = urlsplit(self.url)
            if not parts.hostname or not is_local_host(parts.hostname):
                raise DeploymentError(f"--url {opts.url}: chaos kills processes, so the server must run on this "
                                      f"machine (host {parts.hostname!r} is not a local address)")
            self.port = parts.port or (443 if parts.scheme == "https" else 80)
            if not procs.listening_pids(self.port):
                raise DeploymentError(f"--url {opts.url}: no process on this machine listens on port {self.port}")
            return
        procs.set_child_subreaper()
        template = opts.launch or ""
        env_extra: dict[str, str] = {}
        if opts.head is not None:
            self.cluster = LocalCluster(opts.head, list(opts.workers), log=self.log).start()
            env_extra = dict(RAY_ENV)
            if "{address}" not in template:
                template += " --address {address}"
        self.port = free_port(opts.host)
        try:
            command = shlex.split(template.format(port=self.port, host=opts.host,
                                                  address=self.cluster.address if self.cluster else ""))
        except (KeyError, IndexError, ValueError) as exc:
            raise DeploymentError(f"--launch {opts.launch!r}: {exc} (placeholders: {{port}}, {{host}}, "
                                  f"{{address}})") from None
        self.url = f"http://{opts.host}:{self.port}"
        os.environ.update(env_extra)  # the server's driver must send the cluster's token
        self.server = ServerProcess("server", command, self.url, opts.log_dir / "server.log",
                                    ready_timeout_s=opts.launch_timeout_s, stop_grace_s=opts.stop_timeout_s,
                                    log=self.log)
        self.server.start()
        self.server.wait_ready()
        deadline = time.monotonic() + 60.0  # /health can answer before `cosine-ray serve`'s deploying child exits
        while any(p.role == "server_deploy" for p in self.processes()) and time.monotonic() < deadline:
            time.sleep(0.5)

    def processes(self) -> list[procs.Proc]:
        """Every process of the deployment now."""
        table = procs.process_table()
        if self.opts.url:
            listeners = procs.listening_pids(self.port)
            session = next((s for pid in listeners if (s := procs.session_dir_of(table, pid))), None)
            return procs.session_processes(table, session) if session else []
        return [p for p in procs.descendants(table, [os.getpid()]) if not _transient(p)]

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.cluster is not None:
            self.cluster.stop()
        if not self.opts.url:
            _end_descendants(self.log)


def _transient(p: procs.Proc) -> bool:
    """``ray start`` itself and this run's own helpers (not part of what is served)."""
    return p.role == "other" and (" start " in f" {p.cmdline} " and "ray" in p.cmdline)


def _end_descendants(log: Callable[[str], None], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, whatever the server and the nodes left behind (ours by descent)."""
    left = procs.descendants(procs.process_table(), [os.getpid()])
    if not left:
        return
    log(f"[chaos] stopping {len(left)} leftover processes: {', '.join(f'{p.pid} ({p.role})' for p in left[:12])}")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in left:
            if procs.is_alive(p):
                try:
                    os.kill(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
        deadline = time.monotonic() + grace_s
        while any(procs.is_alive(p) for p in left) and time.monotonic() < deadline:
            time.sleep(0.2)
