"""cosine_ray: collaborative speculative inference (CoSine) on a Ray cluster."""

import os as _os

# OpenMP threads that wait for work by sleeping, not spinning (unless the user chose). With
# torch's default busy-wait, a 2-thread forward collapses as soon as another process uses a
# core (measured with `cosine-ray generate`: 18 → 7 tok/s with one CPU hog; with passive
# waiting 20 → 17, same speed when idle; README "Threads"). libgomp reads this when it loads,
# i.e. at the first `import torch`: importing cosine_ray first (the CLI, every Ray actor of
# ours) is enough; a program that imported torch before cosine_ray keeps its own setting.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
