"""Tests of the target worker (``cosine_ray.engine.worker``): what the last stage returns, the thread governor."""
