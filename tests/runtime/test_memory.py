"""runtime/memory.py: the C-heap figures the soak test reads, and malloc_trim giving pages back."""

import ctypes
import sys
import time

import pytest

from cosine_ray.runtime.memory import malloc_in_use_bytes, release_free_heap, start_heap_trimmer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")


def rss_anon_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise AssertionError("no RssAnon")


def test_in_use_follows_allocations_and_trim_returns_freed_pages():
    """Free 16 KiB holes between live 64-byte chunks: free() alone cannot give those pages back
    (the holes never reach the top of the heap); malloc_trim does."""
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
    assert malloc_in_use_bytes() - before >= 2000 * 16384
    touched = rss_anon_kib()
    for ptr in holes:
        libc.free(ptr)
    assert malloc_in_use_bytes() - before < 2 * 2**20
    assert touched - rss_anon_kib() < 4096, "premise: free() kept the holes' pages"
    release_free_heap()
    assert touched - rss_anon_kib() > 16_000, "malloc_trim gave back most of the 31 MiB of holes"
    for ptr in pins:
        libc.free(ptr)


def test_trimmer_thread_runs_in_the_background():
    thread = start_heap_trimmer(0.05)
    assert thread is not None and thread.daemon
    time.sleep(0.2)
    assert thread.is_alive()
