"""The engine process's C heap: what is in use, and giving freed memory back to the OS.

The engine allocates and frees small buffers from several threads (Ray's core worker, the
step loop, serialization of stage outputs). glibc serves each thread from its own arena and
keeps the pages a thread freed for later, so the process's resident memory climbs in steps
for the first minutes of load (in 64 MiB-aligned thread arenas, as ``/proc/PID/smaps``
shows) although the bytes in use stay flat. ``malloc_trim`` hands those free pages back; the
engine calls it every ``TRIM_INTERVAL_S`` from a daemon thread, so its RSS tracks what it
really holds; the stage and drafter actors do the same (``runtime.actors``).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

TRIM_INTERVAL_S = 5.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _glibc(name: str) -> Any:
    """A glibc function (``restype`` set where it is not ``int``), or None elsewhere."""
    try:
        fn = getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    if name == "mallinfo2":
        fn.restype = _MallInfo2
    return fn


def malloc_in_use_bytes() -> int | None:
    """Bytes glibc's malloc has handed out and not had back (``mallinfo2``, every arena and
    mmapped chunk), or None on another C library."""
    mallinfo2 = _glibc("mallinfo2")
    if mallinfo2 is None:
        return None
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


def malloc_in_use_mib() -> float | None:
    """``malloc_in_use_bytes`` in MiB (None on another C library)."""
    in_use = malloc_in_use_bytes()
    return None if in_use is None else in_use / 2**20


def release_free_heap() -> bool:
    """Return the free pages of every malloc arena to the OS (glibc ``malloc_trim(0)``)."""
    trim = _glibc("malloc_trim")
    return trim is not None and bool(trim(0))


def resident_mib(pid: int | str = "self") -> dict[str, float]:
    """Resident memory of a process in MiB, from ``/proc/PID/status``: ``VmRSS`` in all,
    ``RssAnon`` its private memory, ``RssShmem`` the shared pages it touched (Linux only)."""
    out = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssShmem"):
                out[key] = int(line.split()[1]) / 1024
    if len(out) != 3:
        raise ValueError(f"no RSS figures for process {pid}")
    return out


def held_mib() -> dict[str, float]:
    """``resident_mib`` of this process right after ``release_free_heap``: what it holds, without
    the free pages glibc keeps until the next trim. Called between two of an actor's calls
    (its step buffers freed), it reads what a leak would raise and not the phase of a step."""
    release_free_heap()
    return resident_mib()


MADV_DONTNEED = 4


def drop_file_pages(suffix: str = ".safetensors") -> float:
    """Drop from this process's page tables the resident pages of file mappings whose path ends
    with ``suffix``; returns the MiB dropped. A stage reads its slice of the checkpoint through
    a mapping of the whole file: the fused weights it builds (q/k/v, gate/up) are copies, yet
    the pages they were copied from stay resident in the mapping for as long as any weight still
    points into it. After the drop, only the pages a forward reads again come back (shared, from
    the page cache). A mapping with a private (copy-on-write) page is skipped: dropping would
    revert it to the file's content."""
    madvise = _glibc("madvise")
    if madvise is None:
        return 0.0
    dropped = 0.0
    for start, end, stats in _file_mappings(suffix):
        if stats.get("Anonymous", 0) or not stats.get("Rss", 0):  # copy-on-write pages are anonymous
            continue
        if madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_DONTNEED) == 0:
            dropped += stats["Rss"] / 1024
    return dropped


def _file_mappings(suffix: str) -> list[tuple[int, int, dict[str, int]]]:
    """(start, end, smaps fields in KiB) of each mapping of a file ending with ``suffix``."""
    out: list[tuple[int, int, dict[str, int]]] = []
    current: dict[str, int] | None = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" not in parts[0]:  # a mapping's header line
                current = None
                if len(parts) >= 6 and parts[5].endswith(suffix):
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    current = {}
                    out.append((lo, hi, current))
            elif current is not None and parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
                current[parts[0][:-1]] = int(parts[1])
    return out


def start_heap_trimmer(interval_s: float = TRIM_INTERVAL_S) -> threading.Thread | None:
    """A daemon thread that calls ``release_free_heap`` every ``interval_s`` seconds."""
    if _glibc("malloc_trim") is None:
        return None

    def run() -> None:
        while True:
            time.sleep(interval_s)
            try:
                release_free_heap()
            except Exception:  # never take the engine down for housekeeping
                log.exception("malloc_trim failed")

    thread = threading.Thread(target=run, name="cosine_ray-heap-trim", daemon=True)
    thread.start()
    return thread
