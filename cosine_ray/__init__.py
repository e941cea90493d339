"""cosine_ray: collaborative speculative inference (CoSine) on a Ray cluster."""

import os as _os

# OpenMP threads that wait for work by sleeping, not spinning (unless the user chose). With
# torch's default busy-wait, a 2-thread forward collapses as soon as another process uses a
# core (measured with `cosine-ray generate`: 18 → 7 tok/s with one CPU hog; with passive
# waiting 20 → 17, same speed when idle; README "Threads"). libgomp reads this when it loads,
# i.e. at the first `import torch`: importing cosine_ray first (the CLI, every Ray actor of
# ours) is enough; a program that imported torch before cosine_ray keeps its own setting.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# oneDNN (the CPU projections, ``models.llama.projection_kernel``) keeps two caches keyed by
# input shape: ideep's (``LRU_CACHE_CAPACITY``) and oneDNN's primitive cache
# (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1024 entries each by default. A server sees a new
# shape with every prompt length and batch, so with the defaults its C heap grew ~0.8 MiB per
# request for the first thousand-odd shapes (measured: 114 requests at c=8 in 60 s, heap in use
# +88 MiB after warm-up; very likely the slow RSS creep the serving soak test saw). 64 entries
# each hold the shapes a decode step repeats: +6 MiB over the same run, and flat over a 3-minute
# soak (benchmarks/learning_soak.py), at the same speed (106-114 requests).
# Both are read when oneDNN first builds a kernel, so setting them here, before any forward,
# is enough; a value the user set is kept.
_os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
_os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
