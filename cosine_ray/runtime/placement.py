"""Ray resource requests per role (heterogeneous placement, docs/deployment.md), and whether they fit.

Stages belong on datacenter GPUs, drafters on consumer GPUs. On a real cluster the nodes
advertise that with custom resources (``ray start --resources='{"datacenter_gpu": 4}'``);
``ClusterConfig.use_resources`` makes our actors ask for them. ``num_gpus`` is added when
the engine runs on CUDA. The embedded default runs every actor on CPU.

Ray keeps an actor whose request no node can meet pending forever, without a word. So before
any actor is created, ``plan_placement`` packs every stage and drafter actor's request
(``ActorAsk``) onto the alive nodes' *total* resources, stages first, each actor on the node
with the most room for what it asks: an actor that finds no room can never start. A stage
that cannot is an error that names it, what it asks and what every node offers
(``PlacementError``); a drafter that cannot is left out (a drafter never blocks serving). The
packing is greedy: "fits" is proven, "cannot fit" is what this packing found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cosine_ray.engine.config import DrafterSpec, EngineConfig
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
        # no per-call task events: each would be kept by the GCS (for the state API / dashboard,
        # neither of which we use), whose memory then grew with every step (docs/chaos.md)
        "enable_task_events": False,
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


class PlacementError(RuntimeError):
    """A pipeline stage no node of the cluster can host (the message says which and why)."""


@dataclass(frozen=True, slots=True)
class ActorAsk:
    name: str
    """``cosine_ray:stage:0``, ``cosine_ray:drafter:3``."""
    what: str
    """``stage 0`` or ``drafter retrieval:chat``."""
    resources: dict[str, float]
    """Ray resources it asks (``CPU``, ``GPU``, custom ones)."""
    drafter_index: int | None = None
    """Its place in the engine's drafter list (drafters only)."""


def _asked(options: Mapping[str, Any]) -> dict[str, float]:
    """The Ray resources actor ``options`` ask, without the zero ones."""
    out = {"CPU": float(options.get("num_cpus", 0)), "GPU": float(options.get("num_gpus", 0)),
           **{k: float(v) for k, v in options.get("resources", {}).items()}}
    return {k: v for k, v in out.items() if v > 0}


ENGINE_ASK = "cosine_ray_engine"
"""``ActorAsk.name`` of the engine replica when the stages run in it (Serve places it)."""


def actor_asks(config: EngineConfig) -> list[ActorAsk]:
    """Every actor the engine creates, stages first (drafters run in the engine, and a feature
    head, which runs beside the last stage, ask nothing); with ``cluster.stages_in_engine`` the
    engine replica itself, which asks what a stage would, in the stages' place."""
    if config.cluster.stages_in_engine:
        asks = [ActorAsk(ENGINE_ASK, "the engine with its stages", _asked(engine_actor_options(config)))]
    else:
        asks = [ActorAsk(actor_name("stage", i), f"stage {i}", _asked(actor_options("stage", i, config)))
                for i in range(config.num_stages)]
    asks += [ActorAsk(actor_name("drafter", i), f"drafter {spec.name}", _asked(actor_options("drafter", i, config)), i)
             for i, spec in enumerate(config.drafters)
             if spec.kind not in config.cluster.drafters_in_engine and spec.kind != "head"]
    return asks


def engine_actor_options(config: EngineConfig) -> dict[str, Any]:
    """The engine replica's ``ray_actor_options``: it reserves no CPU (it schedules; the stages
    compute), unless the stages run in it (``cluster.stages_in_engine``), when it asks what
    stage 0 would have asked."""
    if not config.cluster.stages_in_engine:
        return {"num_cpus": 0}
    stage = actor_options("stage", 0, config)
    return {k: stage[k] for k in ("num_cpus", "num_gpus", "resources") if k in stage}


def describe(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())) or "nothing"


def public(resources: Mapping[str, float]) -> dict[str, float]:
    """Without Ray's bookkeeping resources (``node:<ip>``, memory, object store, ...)."""
    return {k: v for k, v in resources.items() if ":" not in k and k not in ("memory", "object_store_memory")}


def describe_nodes(nodes: Sequence[Mapping[str, float]]) -> str:
    return "; ".join(f"node {i + 1}: {describe(public(n))}" for i, n in enumerate(nodes)) or "no alive node"


@dataclass
class Placement:
    placed: dict[str, int]
    """Actor name → index of the node the packing put it on."""
    unplaceable: list[tuple[ActorAsk, str]]
    """Each actor no node had room for, with why (one line)."""


def plan_placement(asks: Sequence[ActorAsk], nodes: Sequence[Mapping[str, float]]) -> Placement:
    """Greedy packing of ``asks`` (in order) onto ``nodes`` (each node's total resources)."""
    free = [dict(n) for n in nodes]
    placed: dict[str, int] = {}
    unplaceable: list[tuple[ActorAsk, str]] = []
    for ask in asks:
        fits = [i for i, f in enumerate(free) if all(f.get(k, 0.0) + 1e-9 >= v for k, v in ask.resources.items())]
        if not fits:
            unplaceable.append((ask, _why(ask, nodes, free)))
            continue
        best = max(fits, key=lambda i: min(free[i].get(k, 0.0) - v for k, v in ask.resources.items()))
        for k, v in ask.resources.items():
            free[best][k] = free[best].get(k, 0.0) - v
        placed[ask.name] = best
    return Placement(placed, unplaceable)


def _why(ask: ActorAsk, nodes: Sequence[Mapping[str, float]], free: Sequence[Mapping[str, float]]) -> str:
    alone = [i for i, n in enumerate(nodes) if all(n.get(k, 0.0) + 1e-9 >= v for k, v in ask.resources.items())]
    if not alone:
        missing = sorted({k for k, v in ask.resources.items() if all(n.get(k, 0.0) < v for n in nodes)})
        detail = f"no node has enough {' or '.join(missing)}" if missing else "no node has all of it at once"
        return f"{ask.what} ({ask.name}) asks {describe(ask.resources)}: {detail}; the cluster offers {describe_nodes(nodes)}"
    left = "; ".join(f"node {i + 1}: {describe({k: max(0.0, free[i].get(k, 0.0)) for k in ask.resources})}"
                     for i in alone)
    return (f"{ask.what} ({ask.name}) asks {describe(ask.resources)}: the nodes that could host it are full "
            f"once the actors before it are placed (left: {left}); the cluster offers {describe_nodes(nodes)}")


def check_placement(config: EngineConfig, nodes: Sequence[Mapping[str, float]]) -> list[tuple[ActorAsk, str]]:
    """Raises PlacementError when a stage cannot be placed; returns the drafters that cannot
    (with why), which the engine then runs without."""
    plan = plan_placement(actor_asks(config), nodes)
    stages = [why for ask, why in plan.unplaceable if ask.drafter_index is None]
    if stages:
        raise PlacementError("cannot place the pipeline: " + " | ".join(stages))
    return [(ask, why) for ask, why in plan.unplaceable if ask.drafter_index is not None]


def without_drafters(config: EngineConfig, indices: Sequence[int]) -> EngineConfig:
    """``config`` minus the drafters at ``indices``."""
    import dataclasses
    keep: tuple[DrafterSpec, ...] = tuple(s for i, s in enumerate(config.drafters) if i not in set(indices))
    return dataclasses.replace(config, drafters=keep)


def cluster_nodes() -> list[dict[str, float]]:
    """Total resources of each alive node of the connected Ray cluster, the head first, then
    in the order of their description (so messages name nodes the same way every time)."""
    import ray
    nodes = [dict(n.get("Resources") or {}) for n in ray.nodes() if n.get("Alive")]
    return sorted(nodes, key=lambda n: ("node:__internal_head__" not in n, describe(public(n))))
