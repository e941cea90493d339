"""Ray resource requests per role (DESIGN §1: heterogeneous placement).

Stages belong on datacenter GPUs, drafters on consumer GPUs. On a real cluster the nodes
advertise that with custom resources (``ray start --resources='{"datacenter_gpu": 4}'``);
``ClusterConfig.use_resources`` makes our actors ask for them. ``num_gpus`` is added when
the engine runs on CUDA. The embedded default runs every actor on CPU.
"""

from __future__ import annotations

from typing import Any

from cosine_ray.engine.config import EngineConfig
from cosine_ray.runtime.cluster import NAMESPACE, actor_name

STAGE_RESOURCE = "datacenter_gpu"
DRAFTER_RESOURCE = "consumer_gpu"
ROLE_RESOURCES = {"stage": STAGE_RESOURCE, "drafter": DRAFTER_RESOURCE}


def actor_options(role: str, index: int, config: EngineConfig) -> dict[str, Any]:
    """``.options(...)`` for actor ``cosine_ray:<role>:<index>``."""
    cluster = config.cluster
    options: dict[str, Any] = {
        "name": actor_name(role, index),
        "namespace": NAMESPACE,
        "num_cpus": cluster.num_cpus_per_actor,
        "max_task_retries": 0,  # a restarted stage has lost its KV: never replay a call blindly
    }
    if role == "stage":
        options["max_restarts"] = cluster.stage_max_restarts
    elif role == "drafter":
        options["max_restarts"] = cluster.drafter_max_restarts
    else:
        raise ValueError(f"unknown role {role!r}")
    if cluster.use_resources:
        options["resources"] = {ROLE_RESOURCES[role]: 1}
    if config.device.startswith("cuda"):
        options["num_gpus"] = 1
    return options
