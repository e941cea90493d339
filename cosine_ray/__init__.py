"""cosine_ray: collaborative speculative inference (CoSine) on a Ray cluster."""

import os as _os

# OpenMP threads that wait for work by sleeping, not spinning (unless the user chose). With
# torch's default busy-wait, a 2-thread forward collapses as soon as another process uses a
# core (docs/choices.md, "CPU threads and memory"). libgomp reads this when it loads,
# i.e. at the first `import torch`: importing cosine_ray first (the CLI, every Ray actor of
# ours) is enough; a program that imported torch before cosine_ray keeps its own setting.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# oneDNN (the CPU projections, ``models.llama.projection_kernel``) keeps two caches keyed by
# input shape: ideep's (``LRU_CACHE_CAPACITY``) and oneDNN's primitive cache
# (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1024 entries each by default. A server sees a new
# shape with every prompt length and batch, so with the defaults its C heap grows with every
# request for the first thousand-odd shapes; 64 entries each hold the shapes a decode step
# repeats, at the same speed (docs/choices.md).
# Both are read when oneDNN first builds a kernel, so setting them here, before any forward,
# is enough; a value the user set is kept.
_os.environ.setdefault("LRU_CACHE_CAPACITY", "64")
_os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
