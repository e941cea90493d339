"""The processes of a Ray Serve deployment on this machine, read from ``/proc``.

Terms: a **role** names what a process is for (``stage``, ``engine``, ``raylet``, ...), from its
command line: Ray names a worker process after the actor it hosts (``ray::StageHost``, while a
call runs ``ray::StageHost.forward``), so no Ray API is needed to find an actor's PID, and
nothing here depends on the GCS or the dashboard being up (they are among the things killed).
A process is identified by (pid, start time): a PID the kernel reuses is another process.

The deployment is found one of two ways: ``tree`` (every descendant of this process: with
``set_child_subreaper`` the daemons ``ray start`` and ``ray.init`` leave behind stay ours), or
``session`` (the Ray session of whoever listens on the server's port: the Serve proxy, its
raylet, every process whose command line names that session directory, and the raylets'
children). Memory: RSS, PSS and private anonymous memory from ``/proc/PID/smaps_rollup``
(RSS only, from ``/proc/PID/status``, where smaps cannot be read).
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from typing import Iterable

ROLE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"^ray::StageHost", "stage"),
    (r"^ray::DrafterHost", "drafter"),
    (r"^ray::ServeReplica:[^:\s]+:cosine_ray_engine\b", "engine"),
    (r"^ray::ServeReplica:", "ingress"),
    (r"^ray::ProxyActor", "proxy"),
    (r"^ray::ServeController", "serve_controller"),
    (r"^ray::DashboardAgent|dashboard/agent\.py", "dashboard_agent"),
    (r"^ray::RuntimeEnvAgent|runtime_env/agent/main\.py", "runtime_env_agent"),
    (r"^ray::IDLE", "idle_worker"),
    (r"^ray::", "worker"),
    (r"/raylet/raylet\b", "raylet"),
    (r"/gcs/gcs_server\b", "gcs"),
    (r"dashboard/dashboard\.py", "dashboard"),
    (r"autoscaler/_private/monitor\.py", "autoscaler_monitor"),
    (r"_private/log_monitor\.py", "log_monitor"),
    (r"ray\.util\.client\.server", "ray_client_server"),
    (r"ray_process_reaper\.py", "reaper"),
    (r"cosine_ray\.cli\.serve_start\b", "server_deploy"),
    (r"cosine_ray\.cli\b.*\bserve\b|cosine-ray\s+serve\b", "server_cli"),
)
"""Matched against the first four words of the command line (the raylet's later arguments name
the agents' scripts); first match wins; anything else is ``other``."""
_ROLE_RES = tuple((re.compile(p), role) for p, role in ROLE_PATTERNS)
AGENT_ROLES = frozenset({"dashboard_agent", "runtime_env_agent"})
"""Per-node agents: killing one takes its raylet down (Ray fate-shares them), so the worker
kind never picks one; the node kind kills them with their node."""


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    start: int
    """Start time in clock ticks since boot (``/proc/PID/stat`` field 22)."""
    cmdline: str
    role: str

    @property
    def key(self) -> str:
        """Stable identity: ``pid@start``."""
        return f"{self.pid}@{self.start}"


def classify(cmdline: str) -> str:
    head = " ".join(cmdline.split()[:4])
    for pattern, role in _ROLE_RES:
        if pattern.search(head):
            return role
    return "other"


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after "pid (comm)" (so field N of proc(5) is item N - 3); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace").rsplit(")", 1)[1].split()
    except OSError:
        return None


def read_proc(pid: int) -> Proc | None:
    """One process, or None if it is gone (or is a kernel thread with no command line)."""
    fields = _stat_fields(pid)  # state ppid ... starttime is field 22
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if fields is None or not cmdline or fields[0] == "Z":
        return None
    return Proc(pid, int(fields[1]), int(fields[19]), cmdline, classify(cmdline))


def process_table() -> dict[int, Proc]:
    """Every live, non-zombie user process."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (p := read_proc(int(name))) is not None:
            table[p.pid] = p
    return table


def descendants(table: dict[int, Proc], roots: Iterable[int]) -> list[Proc]:
    """Every process below ``roots`` (not the roots themselves)."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(table[child])
            todo.append(child)
    return out


def is_alive(proc: Proc) -> bool:
    """Still the same process (same PID and start time)."""
    now = read_proc(proc.pid)
    return now is not None and now.start == proc.start


def set_child_subreaper() -> bool:
    """Make orphaned descendants (daemonised Ray processes) children of this process (Linux
    ``PR_SET_CHILD_SUBREAPER``), so the ``tree`` discovery and the final cleanup find them."""
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ---- the session of a port -------------------------------------------------------------------

def _socket_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                        inodes.add(parts[9])
        except (OSError, StopIteration):
            continue
    return inodes


def listening_pids(port: int) -> list[int]:
    """PIDs with a socket listening on ``port`` (any local address)."""
    wanted = {f"socket:[{i}]" for i in _socket_inodes(port)}
    found = []
    for name in os.listdir("/proc") if wanted else ():
        if not name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") in wanted:
                    found.append(int(name))
                    break
            except OSError:
                continue
    return sorted(found)


_SESSION = re.compile(r"(/\S*?/session_\d{4}-\d\d-\d\d_[\d_-]+)")


def session_dir_of(table: dict[int, Proc], pid: int) -> str | None:
    """The Ray session directory of ``pid``: from its own command line or its raylet's."""
    p = table.get(pid)
    while p is not None:
        if m := _SESSION.search(p.cmdline):
            return m.group(1)
        p = table.get(p.ppid)
    return None


def session_processes(table: dict[int, Proc], session_dir: str) -> list[Proc]:
    """Every process of one Ray session on this machine: those naming the session directory,
    the children of its raylets (workers, agents) and the driver that started its GCS."""
    named = {p.pid: p for p in table.values() if session_dir in p.cmdline}
    raylets = [pid for pid, p in named.items() if p.role == "raylet"]
    out = dict(named)
    out.update({p.pid: p for p in descendants(table, raylets)})
    for p in list(named.values()):
        parent = table.get(p.ppid)
        if p.role == "gcs" and parent is not None and parent.role == "server_cli":
            out[parent.pid] = parent
    return sorted(out.values(), key=lambda p: p.pid)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU-seconds a process has used so far (``/proc/PID/stat`` fields 14 and 15);
    None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- memory ----------------------------------------------------------------------------------

_ROLLUP_KEYS = {"Rss:": "rss", "Pss:": "pss", "Anonymous:": "anon", "Swap:": "swap"}


def memory_mib(pid: int) -> dict[str, float] | None:
    """``rss``, ``pss``, ``anon`` (private anonymous) and ``swap`` of a process in MiB; only
    ``rss`` when smaps cannot be read; None when the process is gone."""
    out: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in _ROLLUP_KEYS:
                    out[_ROLLUP_KEYS[parts[0]]] = int(parts[1]) / 1024
        if "rss" in out:
            return out
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return {"rss": int(line.split()[1]) / 1024}
    except OSError:
        return None
    return None
