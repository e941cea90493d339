"""cosine_ray: collaborative speculative inference (CoSine) on a Ray cluster."""

import os as _os

# OpenMP threads that spin for a short while (~0.3 ms) before they sleep, unless the user chose
# (OMP_WAIT_POLICY or GOMP_SPINCOUNT). A CPU decode step runs ~120 parallel regions, and a thread
# that sleeps between them is woken too late for each (docs/performance-cpu.md). Spinning
# threads lose to a process that keeps a core busy; the engine then falls back to one thread
# (engine/worker/threads.py, docs/choices.md, "CPU threads and memory"). libgomp reads both when it loads, at the first `import torch`:
# importing cosine_ray first (the CLI, every Ray actor of ours) is enough.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "30000"

# oneDNN (the CPU projections, ``models.linear.projection_kernel``) keeps two caches keyed by
# input shape: ideep's (``LRU_CACHE_CAPACITY``) and oneDNN's primitive cache
# (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1024 entries each by default. A server sees a new
# shape with every prompt length and batch, so with the defaults its C heap grows with every
# request for the first thousand-odd shapes; 64 entries each hold the shapes a decode step
# repeats, at the same speed (docs/choices.md).
# Both are read when oneDNN first builds a kernel, so setting them here, before any forward,
# is enough; a value the user set is kept.
_os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
_os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")

_OFFLINE_API = ("LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob")
"""``from cosine_ray import LLM, SamplingParams``: loaded on first use, so that importing the
package (every Ray actor and CLI command does) costs nothing more."""


def __getattr__(name: str):
    if name in _OFFLINE_API:
        from cosine_ray import offline
        return getattr(offline, name)
    raise AttributeError(f"module 'cosine_ray' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_OFFLINE_API))
