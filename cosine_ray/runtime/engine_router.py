"""How the engine deployment scales and how Serve routes a call among its replicas.

``engine_replica_options(config)`` are the Serve settings of the engine deployment for
``cluster.engine_replicas``: N fixed replicas, or Serve's ``autoscaling_config`` between MIN and
MAX on the requests each replica holds. With more than one replica the deployment routes with
``PrefixAffinityRouter``, a Serve ``RequestRouter`` (Serve's request-router API: Serve keeps the
replica set, the queue lengths and the retries; this class only ranks the candidates):

* ``generate``: the prompt's first ``PREFIX_TOKENS`` tokens pick a home replica by rendezvous
  hashing (each replica's score is a hash of the prefix and the replica id; the highest wins),
  so requests that share a system prompt or the turns of one conversation meet the KV that
  replica's prefix cache holds, and a replica that comes or goes moves only its own prefixes.
  A home that holds ``imbalance`` more requests than the least loaded candidate is passed
  over: the request goes to the less loaded of two random replicas (power of two choices).
* a call that names its replica (``engine_replica=``: the abort or finish of a request a stream
  runs on) goes to that replica while it lives, else anywhere (the request died with it).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cosine_ray.engine.config import EngineConfig
from cosine_ray.runtime.engine_client import REPLICA_KWARG

PREFIX_TOKENS = 32
"""Prompt tokens that key a request's home replica: two KV blocks of 16, a system prompt's start."""
DEFAULT_IMBALANCE = 2
"""Requests a home replica may hold beyond the least loaded one before it is passed over. Small:
a few system prompts hash to few homes, and the other replicas warm their caches for a prefix
after its first requests, so spreading costs little of the hit rate (docs/scaling.md)."""
ROUTER_CLASS = "cosine_ray.runtime.engine_router.PrefixAffinityRouter"


def engine_replica_options(config: EngineConfig) -> dict[str, Any]:
    """The engine deployment's Serve settings for ``cluster.engine_replicas``. One replica is
    the deployment as it always was (Serve's own router); more, or autoscaling, add
    ``PrefixAffinityRouter``. Autoscaling targets ``max_num_seqs`` ongoing requests a replica:
    every generation the ingress admitted is ongoing at its engine replica, so past its batch
    they wait in its request pool, and that queue is what adds a replica."""
    low, high = config.cluster.engine_replica_range
    router = {"request_router_config": {"request_router_class": ROUTER_CLASS,
                                        "request_router_kwargs": {"imbalance": DEFAULT_IMBALANCE}}}
    if low == high == 1:
        return {"num_replicas": 1}
    if low == high:
        return {"num_replicas": low, **router}
    batch = config.resolved().scheduler.max_num_seqs
    return {"autoscaling_config": {"min_replicas": low, "max_replicas": high, "initial_replicas": low,
                                   "target_ongoing_requests": batch, "upscale_delay_s": 10.0,
                                   "downscale_delay_s": 120.0}, **router}


def prefix_key(prompt_token_ids: Sequence[int]) -> bytes:
    """The bytes that key a prompt's home replica: its first ``PREFIX_TOKENS`` tokens."""
    head = [int(t) for t in list(prompt_token_ids)[:PREFIX_TOKENS]]
    return b",".join(str(t).encode() for t in head)


def home_order(key: bytes, replica_ids: Sequence[str]) -> list[str]:
    """``replica_ids`` by rendezvous score of ``key``, the home first."""
    def score(replica_id: str) -> bytes:
        return hashlib.blake2b(key + b"|" + replica_id.encode(), digest_size=8).digest()

    return sorted(replica_ids, key=score, reverse=True)


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Serve's router of the engine deployment (the module docstring)."""

    imbalance = DEFAULT_IMBALANCE

    def initialize_state(self, imbalance: int = DEFAULT_IMBALANCE, **kwargs: Any) -> None:
        self.imbalance = int(imbalance)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        named = _named_replica(pending_request)
        if named is not None and named in by_id:
            return [[by_id[named]]]
        prompt = _prompt(pending_request)
        if prompt is None or len(candidate_replicas) == 1:
            return [_two_choices(candidate_replicas)]
        home = by_id[home_order(prefix_key(prompt), list(by_id))[0]]
        loads = {rid: self.replica_queue_len_cache.get(r.replica_id) for rid, r in by_id.items()}
        known = [n for n in loads.values() if n is not None]
        home_load = loads[home.replica_id.unique_id]
        if home_load is not None and known and home_load - min(known) > self.imbalance:
            return [_two_choices(candidate_replicas)]
        return [[home], _two_choices([r for r in candidate_replicas if r is not home])]


def _two_choices(replicas: list[RunningReplica]) -> list[RunningReplica]:
    """Two random replicas (Serve picks the shorter queue of a rank), or all of one or none."""
    return random.sample(replicas, 2) if len(replicas) > 2 else list(replicas)


def _named_replica(request: PendingRequest | None) -> str | None:
    if request is None:
        return None
    named = request.kwargs.get(REPLICA_KWARG)
    return named if isinstance(named, str) and named else None


def _prompt(request: PendingRequest | None) -> Sequence[int] | None:
    """A ``generate`` call's prompt token ids (its first argument), else None."""
    if request is None or request.metadata.call_method != "generate" or not request.args:
        return None
    prompt = request.args[0]
    return prompt if isinstance(prompt, (list, tuple)) and prompt else None
