"""One local Ray cluster for the whole test session (same fixture as tests/runtime/conftest.py).

``ray_cluster`` is defined identically in ``tests/runtime/conftest.py``: whichever runs first
starts the cluster (``cosine_ray.runtime.cluster.connect``: 4 logical CPUs, namespace
``cosine_ray``, no dashboard, OMP_NUM_THREADS=1 in every worker) and shuts it down at the end
of the session; the other one finds Ray initialized and just reuses it. Actor start is slow on
small machines (each actor process imports torch), so test modules keep their routers for the
whole module.
"""

from __future__ import annotations

import time

import pytest

RAY_NUM_CPUS = 4


@pytest.fixture(scope="session")
def ray_cluster():
    """The GCS address of the session's local Ray cluster."""
    ray = pytest.importorskip("ray")
    from cosine_ray.runtime.cluster import connect

    owner = not ray.is_initialized()
    if owner:
        start = time.perf_counter()
        connect(None, num_cpus=RAY_NUM_CPUS)
        print(f"\n[ray] local cluster up in {time.perf_counter() - start:.1f} s "
              f"({ray.get_runtime_context().gcs_address})", flush=True)
    yield ray.get_runtime_context().gcs_address
    if owner:
        from cosine_ray.runtime.router_actor import kill_router
        try:
            kill_router()
        finally:
            ray.shutdown()
