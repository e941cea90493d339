"""Faults: what a chaos run kills or pauses, chosen at random (seeded) from a set of kinds.

    stage    SIGKILL a pipeline stage actor (``ray::StageHost``): Ray restarts it, the engine
             re-prefills the requests it held
    drafter  SIGKILL a drafter actor (``ray::DrafterHost``; the server must run drafters as
             actors: ``--drafters-in-engine none`` or a list without that kind)
    engine   SIGKILL the engine replica (Serve starts a new one, with new stages and drafters)
    proxy    SIGKILL the Serve HTTP proxy (connections through it break; Serve restarts it)
    worker   SIGKILL any Ray worker process of the deployment (actors, Serve's controller and
             replicas, idle workers; never a node's agents, which take their raylet along)
    pause    SIGSTOP a stage, drafter, engine, ingress or proxy process, SIGCONT after
             ``pause_s``: a slow node
    node     SIGKILL every process of a worker node of a ``LocalCluster`` at once, then start
             a replacement node with the same resources

Only processes of the deployment (``find()``) on this machine are touched, each checked again
by PID *and* start time right before the signal. ``resume_all`` sends SIGCONT to anything still
paused (the run calls it on every exit path).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from loadgen.chaos import procs
from loadgen.chaos.cluster import LocalCluster

KINDS = ("stage", "drafter", "engine", "proxy", "worker", "pause", "node")
WORKER_ROLES = frozenset({"stage", "drafter", "engine", "ingress", "proxy", "serve_controller", "idle_worker",
                          "worker"})
PAUSE_ROLES = frozenset({"stage", "drafter", "engine", "ingress", "proxy"})
KIND_ROLES: dict[str, frozenset[str]] = {
    "stage": frozenset({"stage"}), "drafter": frozenset({"drafter"}), "engine": frozenset({"engine"}),
    "proxy": frozenset({"proxy"}), "worker": WORKER_ROLES, "pause": PAUSE_ROLES,
}


def parse_kinds(text: str) -> tuple[str, ...]:
    """``all`` or a comma list of KINDS."""
    kinds = KINDS if text.strip() == "all" else tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"--kinds: unknown kind(s) {', '.join(unknown) or '(none given)'}; "
                         f"use all or a comma list of {', '.join(KINDS)}")
    return tuple(dict.fromkeys(kinds))


@dataclass
class Fault:
    """One kill or pause, and what followed it (times on the run clock, seconds)."""

    index: int
    kind: str
    t: float
    action: str
    """SIGKILL, SIGSTOP or node."""
    targets: list[dict[str, Any]]
    """``{"pid", "role"}`` of each process signalled."""
    in_flight: list[str] = field(default_factory=list)
    """Request ids in flight at ``t``."""
    resumed_t: float | None = None
    """pause: when SIGCONT was sent; node: when the replacement node was up."""
    health_down: bool = False
    """/health answered something other than 200 (or nothing) after the fault."""
    health_ok_t: float | None = None
    recovered_t: float | None = None
    """First success of a probe request sent after /health answered 200 again."""
    note: str = ""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_t is None else self.recovered_t - self.t

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "kind": self.kind, "t": self.t, "action": self.action, "targets": self.targets,
                "in_flight": len(self.in_flight), "resumed_t": self.resumed_t, "health_down": self.health_down,
                "health_ok_t": self.health_ok_t, "recovered_t": self.recovered_t, "recovery_s": self.recovery_s,
                "note": self.note}


class Injector:
    def __init__(self, find: Callable[[], list[procs.Proc]], rng: np.random.Generator, *,
                 cluster: LocalCluster | None = None, pause_s: float = 10.0,
                 log: Callable[[str], None] = print) -> None:
        self.find, self.rng, self.cluster, self.pause_s, self.log = find, rng, cluster, pause_s, log
        self._paused: dict[str, procs.Proc] = {}
        self._lock = threading.Lock()

    def candidates(self, kind: str) -> list[procs.Proc]:
        if kind == "node":
            return [n.raylet for n in (self.cluster.workers if self.cluster else []) if n.raylet is not None]
        roles = KIND_ROLES[kind]
        with self._lock:
            paused = set(self._paused)
        return [p for p in self.find() if p.role in roles and p.key not in paused]

    def inject(self, kind: str, index: int, t: float) -> Fault | None:
        """Signal one target of ``kind`` chosen at random; None when there is none right now."""
        if kind == "node":
            return self._kill_node(index, t)
        options = self.candidates(kind)
        self.rng.shuffle(options)
        for target in options:
            if not procs.is_alive(target):
                continue
            sig = signal.SIGSTOP if kind == "pause" else signal.SIGKILL
            try:
                os.kill(target.pid, sig)
            except (ProcessLookupError, PermissionError):
                continue
            fault = Fault(index, kind, t, sig.name, [{"pid": target.pid, "role": target.role}])
            if kind == "pause":
                with self._lock:
                    self._paused[target.key] = target
            self.log(f"[chaos] #{index} {kind}: {sig.name} pid {target.pid} ({target.role}) at {t:.1f} s")
            return fault
        return None

    def _kill_node(self, index: int, t: float) -> Fault | None:
        nodes = list(self.cluster.workers) if self.cluster else []
        if not nodes:
            return None
        node = nodes[int(self.rng.integers(len(nodes)))]
        victims = self.cluster.kill_node(node)
        self.log(f"[chaos] #{index} node: SIGKILL node {node.name} ({len(victims)} processes) at {t:.1f} s")
        return Fault(index, "node", t, "node", [{"pid": p.pid, "role": p.role} for p in victims],
                     note=f"node {node.name} ({node.spec.describe()})")

    def follow_up(self, fault: Fault, clock: Callable[[], float]) -> None:
        """Blocking: a pause's SIGCONT after ``pause_s``; a killed node's replacement."""
        if fault.kind == "pause":
            time.sleep(self.pause_s)
            self.resume(fault)
            fault.resumed_t = clock()
        elif fault.kind == "node" and self.cluster is not None:
            spec = next(n.spec for n in self.cluster.dead if fault.note.startswith(f"node {n.name} "))
            try:
                node = self.cluster.add_worker(spec)
                fault.resumed_t = clock()
                fault.note += f"; replaced by {node.name}"
            except Exception as exc:  # the run reports it; recovery then times out or not
                fault.note += f"; replacement failed: {exc}"

    def resume(self, fault: Fault) -> None:
        with self._lock:
            for target in fault.targets:
                key = next((k for k, p in self._paused.items() if p.pid == target["pid"]), None)
                if key is not None:
                    self._send_cont(self._paused.pop(key))

    def resume_all(self) -> None:
        with self._lock:
            for proc in self._paused.values():
                self._send_cont(proc)
            self._paused.clear()

    @staticmethod
    def _send_cont(proc: procs.Proc) -> None:
        if procs.is_alive(proc):
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass
