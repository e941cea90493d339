"""runtime/memory.py: the C-heap figures the soak test reads, and malloc_trim giving pages back."""

import json
import subprocess
import sys
import time

import pytest

from cosine_ray.runtime.memory import start_heap_trimmer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


HOLES_SCRIPT = r"""
import ctypes, json
from cosine_ray.runtime.memory import held_mib, malloc_in_use_bytes, resident_mib

def rss_anon_kib():
    return resident_mib()["RssAnon"] * 1024

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = malloc_in_use_bytes()
holes, pins = [], []
for _ in range(2000):
    ptr = libc.malloc(16384)
    ctypes.memset(ptr, 1, 16384)  # touch the pages
    holes.append(ptr)
    pins.append(libc.malloc(64))
allocated = malloc_in_use_bytes() - before
touched = rss_anon_kib()
for ptr in holes:
    libc.free(ptr)
in_use_after_free = malloc_in_use_bytes() - before
returned_by_free = touched - rss_anon_kib()
untrimmed = resident_mib()
held = held_mib()  # trims, then reads
returned_by_trim = touched - rss_anon_kib()
print(json.dumps(dict(allocated=allocated, in_use_after_free=in_use_after_free,
                      returned_by_free=returned_by_free, returned_by_trim=returned_by_trim,
                      untrimmed=untrimmed, held=held, vm_rss_kib=int(open("/proc/self/statm").read().split()[1]) * 4)))
"""


def test_in_use_follows_allocations_and_trim_returns_freed_pages():
    """Free 16 KiB holes between live 64-byte chunks: free() alone cannot give those pages back
    (the holes never reach the top of the heap); malloc_trim does. Run in a fresh interpreter:
    in a heap other tests have used, the 64-byte chunks come from old free lists instead of
    sitting between the holes."""
    out = subprocess.run([sys.executable, "-c", HOLES_SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    m = json.loads(out.stdout)
    assert m["allocated"] >= 2000 * 16384
    assert m["in_use_after_free"] < 2 * 2**20
    assert m["returned_by_free"] < 4096, "premise: free() kept the holes' pages"
    assert m["returned_by_trim"] > 16_000, "malloc_trim gave back most of the 31 MiB of holes"
    # the soak test's two readings: from outside, the kept holes count; held_mib reads after a trim
    untrimmed, held = m["untrimmed"], m["held"]
    assert set(untrimmed) == set(held) == {"VmRSS", "RssAnon", "RssShmem"}
    assert 0 < held["RssAnon"] <= held["VmRSS"]
    assert untrimmed["RssAnon"] - held["RssAnon"] > 15, "held_mib read before the trim"
    assert abs(held["VmRSS"] - m["vm_rss_kib"] / 1024) < 2


def test_trimmer_thread_runs_in_the_background():
    thread = start_heap_trimmer(0.05)
    assert thread is not None and thread.daemon
    time.sleep(0.2)
    assert thread.is_alive()


DROP_SCRIPT = r"""
import json, mmap, os, sys
import numpy as np
from cosine_ray.runtime.memory import _file_mappings, drop_file_pages

path = sys.argv[1]
data = np.arange(4 << 20, dtype=np.float32)  # 16 MiB
data.tofile(path)
clean = np.memmap(path, dtype=np.float32, mode="c")  # MAP_PRIVATE, read only from here on
total = float(clean.sum())  # touch every page
def rss_kib():
    return sum(stats.get("Rss", 0) for _, _, stats in _file_mappings(".bin"))
before = rss_kib()
dropped = drop_file_pages(".bin")
after_drop = rss_kib()
same = float(clean.sum()) == total  # the pages come back from the file, unchanged
dirty = np.memmap(path, dtype=np.float32, mode="c")
dirty[0] = -1.0  # a copy-on-write page: dropping it would revert it to the file's 0.0
drop_file_pages(".bin")
print(json.dumps({"before": before, "after_drop": after_drop, "dropped_mib": dropped, "same": same,
                  "dirty_kept": float(dirty[0]) == -1.0}))
"""


def test_dropping_file_pages_unmaps_what_was_read_and_skips_written_pages(tmp_path):
    """What a stage does after building its fused weights (runtime/actors.py): the pages of a
    checkpoint mapping leave this process's RSS, reading them again gives the file's bytes,
    and a mapping with a page written copy-on-write is left alone (its write is not lost)."""
    out = subprocess.run([sys.executable, "-c", DROP_SCRIPT, str(tmp_path / "weights.bin")], capture_output=True,
                         text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    assert r["before"] >= 15 * 1024 and r["after_drop"] == 0 and r["dropped_mib"] >= 15, r
    assert r["same"] and r["dirty_kept"], r
