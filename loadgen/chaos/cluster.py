"""A multi-node Ray cluster on this machine, made with ``ray start``, for the ``node`` fault.

``LocalCluster`` starts a head node and worker nodes as separate raylets on this machine
(``ray start --head`` / ``ray start --address``), each with its own CPUs and custom resources
(``NodeSpec``), in a temporary directory of its own (so the ``ray_current_cluster`` file other
Ray users on the machine read is untouched) and on free ports. A node's processes are the new
descendants of this process after its ``ray start`` (with ``procs.set_child_subreaper`` the
daemons stay ours), plus whatever its raylet starts later (its workers and actors). Killing a
node is SIGKILL to all of them at once, like a machine losing power. ``stop`` ends every
process of every node by PID (never ``ray stop``, which ends every Ray process of the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from loadgen.chaos import procs

RAY_ENV = {"RAY_AUTH_MODE": "token"}
"""``ray start --head`` turns on token authentication; joining nodes and drivers must send the
token (``~/.ray/auth_token``), which they do only in this mode."""


class ClusterError(RuntimeError):
    """A node did not start (one line, with the end of ``ray start``'s output)."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node's logical resources."""

    cpus: float
    """Ray's ``CPU`` resource of the node."""
    resources: dict[str, float] = field(default_factory=dict)
    """Custom resources (``datacenter_gpu``, ``consumer_gpu``, ...)."""

    @classmethod
    def parse(cls, text: str) -> "NodeSpec":
        """``CPU=2,datacenter_gpu=2`` (CPU is required; other names are custom resources)."""
        values: dict[str, float] = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            name, sep, value = part.partition("=")
            try:
                number = float(value)
            except ValueError:
                number = -1.0
            if not sep or not name.strip() or number < 0:
                raise ValueError(f"node spec {text!r}: expected NAME=NUMBER items (CPU=2,consumer_gpu=8), got {part!r}")
            values[name.strip()] = number
        if "CPU" not in values:
            raise ValueError(f"node spec {text!r}: give the node's CPU=N")
        cpus = values.pop("CPU")
        return cls(cpus, values)

    def describe(self) -> str:
        return ",".join([f"CPU={self.cpus:g}"] + [f"{k}={v:g}" for k, v in self.resources.items()])


@dataclass
class Node:
    name: str
    spec: NodeSpec
    procs: list[procs.Proc]
    """What its ``ray start`` left running (raylet, agents, log monitor; GCS etc. on the head)."""

    @property
    def raylet(self) -> procs.Proc | None:
        return next((p for p in self.procs if p.role == "raylet"), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, head: NodeSpec, workers: list[NodeSpec], *, log: Callable[[str], None] = print,
                 start_timeout_s: float = 120.0) -> None:
        self.head_spec, self.worker_specs, self.log = head, list(workers), log
        self.start_timeout_s = start_timeout_s
        self.temp_dir = tempfile.mkdtemp(prefix="rc", dir="/tmp")  # short: Unix socket paths are limited
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.head: Node | None = None
        self.workers: list[Node] = []
        self.dead: list[Node] = []
        self._num_started = 0

    def env(self) -> dict[str, str]:
        return {**os.environ, **RAY_ENV}

    def start(self) -> "LocalCluster":
        head_args = ["--head", "--port", str(self.port), "--temp-dir", self.temp_dir, "--include-dashboard", "false",
                     "--ray-client-server-port", str(free_port()), "--dashboard-port", str(free_port())]
        self.head = self._start_node("head", self.head_spec, head_args)
        for spec in self.worker_specs:
            self.add_worker(spec)
        return self

    def add_worker(self, spec: NodeSpec) -> Node:
        node = self._start_node(f"worker-{self._num_started}", spec, ["--address", self.address])
        self.workers.append(node)
        return node

    def _start_node(self, name: str, spec: NodeSpec, args: list[str]) -> Node:
        before = {p.key for p in procs.descendants(procs.process_table(), [os.getpid()])}
        cmd = [shutil.which("ray") or "ray", "start", *args, "--num-cpus", f"{spec.cpus:g}", "--disable-usage-stats",
               "--dashboard-agent-listen-port", str(free_port())]
        if spec.resources:
            cmd += ["--resources", json.dumps(spec.resources)]
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, env=self.env(), timeout=self.start_timeout_s,
                                  stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ClusterError(f"ray start of node {name} failed: {exc}") from None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise ClusterError(f"ray start of node {name} exited {done.returncode}: {tail[0][:300]}")
        self._num_started += 1
        new = [p for p in procs.descendants(procs.process_table(), [os.getpid()]) if p.key not in before]
        node = Node(name, spec, new)
        self.log(f"[cluster] node {name} ({spec.describe()}) up in {time.monotonic() - start:.1f} s: "
                 f"raylet pid {node.raylet.pid if node.raylet else '?'}")
        return node

    def node_processes(self, node: Node) -> list[procs.Proc]:
        """The node's own processes and everything its raylet started (workers, actors)."""
        table = procs.process_table()
        live = [p for p in node.procs if procs.is_alive(p)]
        raylet = node.raylet
        below = procs.descendants(table, [raylet.pid]) if raylet is not None and procs.is_alive(raylet) else []
        return live + below

    def kill_node(self, node: Node) -> list[procs.Proc]:
        """SIGKILL every process of ``node`` at once; it leaves ``workers``."""
        victims = self.node_processes(node)
        for p in victims:
            _signal(p, signal.SIGKILL)
        self.workers.remove(node)
        self.dead.append(node)
        return victims

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL, every process of every node (workers first, head last)."""
        nodes = [*self.workers, *([self.head] if self.head else [])]
        victims = [p for node in nodes for p in self.node_processes(node)]
        for p in victims:
            _signal(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(procs.is_alive(p) for p in victims) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in victims:
            _signal(p, signal.SIGKILL)
        self.log(f"[cluster] stopped; Ray's logs are in {self.temp_dir}")


def _signal(p: procs.Proc, sig: signal.Signals) -> None:
    if procs.is_alive(p):
        try:
            os.kill(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
