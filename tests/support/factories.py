"""Small factories for unit tests of one step owner at a time (``cosine_ray.engine.owners``).

Each ``make_*`` builds one owner with defaults a test can override by keyword, the way vLLM's
``create_scheduler()`` does: settings go by name through ``engine_config`` (``**config``), collaborators
are fakes (``support.fakes``) or the real small objects. They stay thin on purpose: an
owner's constructor is the contract, a factory only fills in what a test does not care about.

Terms: ``Clock`` is a settable clock; ``VOCAB`` the fakes' vocabulary size.
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping, Sequence

from cosine_ray.algo.adaptive import ParticipationController
from cosine_ray.algo.calibration import ConfidenceCalibrator
from cosine_ray.algo.scheduling.latency_model import LatencyModel
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.modes.twins import Twins
from cosine_ray.engine.worker.clients import DrafterClient
from cosine_ray.engine.owners.economics import CostModel
from cosine_ray.engine.owners.kv import KVBlocks
from cosine_ray.engine.owners.learner import Learner
from cosine_ray.engine.owners.pool import RequestPool
from cosine_ray.engine.owners.routing import DraftRouting
from cosine_ray.engine.owners.scheduler import BatchPolicy, BatchScheduler, FirstComeBatchPolicy, LpBatchPolicy
from cosine_ray.engine.owners.speculator import (ConfidenceCutSelection, FixedSelection, FusedDrafting,
                                                 PathDrafting, PricedSelection, Speculator)
from cosine_ray.engine.owners.verifier import Verifier
from cosine_ray.engine.request import Request, RequestStatus, SamplingParams
from cosine_ray.engine.worker.recovery import RecoveringTarget
from cosine_ray.metrics.exporter import EngineMetrics
from cosine_ray.metrics.registry import MetricsRegistry
from cosine_ray.models.kv_cache import DEFAULT_BLOCK_SIZE

from support.fakes import VOCAB, TableTarget


class Clock:
    """A clock the test moves by hand (``clock.now += 1.0``)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _live(_request_id: str) -> bool:
    return True


def engine_config(**settings) -> EngineConfig:
    """A resolved ``EngineConfig`` for the core and its owners: the defaults (on CPU, stages in
    process) with ``settings`` changed by name (``EngineConfig.replace``)."""
    return EngineConfig().replace(**settings).resolved()


def make_request(request_id: str = "r0", prompt: Sequence[int] = (1, 2, 3), *, output: Sequence[int] = (),
                 max_tokens: int = 16, temperature: float = 0.0, seed: int | None = 0, domain: str = "other",
                 lane: int = 0, running: bool = True, eos: Sequence[int] = (), arrival_time: float = 0.0,
                 **params) -> Request:
    """A request as the pool holds it: running (admitted) unless ``running=False``, with
    ``output`` already generated and its KV computed up to the last token (a decoding request;
    no output: its next step prefills the prompt). It holds no KV blocks (``KVBlocks.ensure``
    gives them)."""
    request = Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                               seed=seed, **params),
                      tuple(eos), arrival_time=arrival_time, output_token_ids=list(output), lane=lane, domain=domain)
    if output:
        request.num_computed_tokens = request.num_tokens - 1
    if running:
        request.status = RequestStatus.RUNNING
        request.admitted_time = 0.0
    return request


def make_pool(*, max_num_seqs: int = 8, max_model_len: int = 256, num_lanes: int = 1, vocab_size: int = VOCAB,
              eos_token_ids: Sequence[int] = (), max_restores: int = 3,
              clock: Callable[[], float] | None = None) -> RequestPool:
    return RequestPool(max_num_seqs=max_num_seqs, max_model_len=max_model_len, num_lanes=num_lanes,
                       vocab_size=vocab_size, eos_token_ids=eos_token_ids, max_restores=max_restores,
                       clock=clock or Clock())


def add_running(pool: RequestPool, requests: Iterable[Request]) -> None:
    """Put ready-made requests (``make_request``) into the pool's running set, as admitted."""
    for r in requests:
        pool.running[r.request_id] = r


def make_kv(num_blocks: int | None = None, *, block_size: int = DEFAULT_BLOCK_SIZE, caching: bool = True) -> KVBlocks:
    """The engine's KV block tables; ``num_blocks`` None: the pools grow as needed."""
    return KVBlocks(num_blocks, block_size, caching=caching)


def make_scheduler(pool: RequestPool | None = None, *, policy: BatchPolicy | str = "lp", priced: bool = True,
                   guard=None, twins: bool = False, skip_unpaying: bool = True, kv: KVBlocks | None = None,
                   latency_model: LatencyModel | None = None, kv_bytes_per_token: int = 0,
                   clock: Callable[[], float] | None = None, **config) -> BatchScheduler:
    """A ``BatchScheduler`` over ``pool`` (``make_pool()`` by default) and ``kv`` (``make_kv()``:
    no block limit). ``policy``: "lp", "fcfs" or a ``BatchPolicy``; ``priced``: the LP's price
    reaches TreeSelection; ``twins``: identical greedy requests draft from each other."""
    clock = clock or (pool.clock if pool is not None else Clock())
    pool = pool if pool is not None else make_pool(clock=clock)
    if isinstance(policy, str):
        policy = LpBatchPolicy() if policy == "lp" else FirstComeBatchPolicy()
    return BatchScheduler(engine_config(**config), pool, policy, CostModel(latency_model), kv or make_kv(),
                          kv_bytes_per_token=kv_bytes_per_token, priced=priced, guard=guard, clock=clock,
                          skip_unpaying=skip_unpaying, twins=Twins(clock=clock) if twins else None)


def make_routing(drafters: Sequence[str] = ("ngram", "a", "b", "c"), *, domain_classifier=None,
                 participation: ParticipationController | None = None, seed: int | None = 0,
                 **config) -> DraftRouting:
    """``DraftRouting`` over drafter names; ``ngram`` is shared by default (``shared_drafters``)."""
    return DraftRouting(engine_config(**config), list(drafters), domain_classifier=domain_classifier,
                        participation=participation, seed=seed)


def make_speculator(drafters: Mapping[str, DrafterClient] | Sequence[DrafterClient] = (), *,
                    fusion: str = "confidence", selection: str = "fixed", cut: float = 0.25,
                    total_gamma_max: int = 64, vocab_size: int = VOCAB, deadline_s: float = 2.0,
                    is_live: Callable[[str], bool] = _live, drafting=None) -> Speculator:
    """A ``Speculator``: ``fusion`` "confidence" (``FusedDrafting``) or "union"
    (``PathDrafting``), or any ``drafting`` strategy; ``selection`` "fixed", "cut" (at
    ``cut``) or "priced"."""
    clients = dict(drafters) if isinstance(drafters, Mapping) else {d.name: d for d in drafters}
    if drafting is None:
        drafting = (FusedDrafting(clients, vocab_size=vocab_size, deadline_s=deadline_s, is_live=is_live)
                    if fusion == "confidence" else
                    PathDrafting(clients, vocab_size=vocab_size, deadline_s=deadline_s))
    policy = {"fixed": FixedSelection, "cut": lambda: ConfidenceCutSelection(cut), "priced": PricedSelection}[selection]()
    return Speculator(drafting, policy, ConfidenceCalibrator(), total_gamma_max=total_gamma_max)


def make_verifier(target=None, *, is_live: Callable[[str], bool] = _live, clock: Callable[[], float] | None = None,
                  on_lost: Callable[[bool, str], None] | None = None, recovery_s: float = 1.0) -> Verifier:
    """A ``Verifier`` over ``target`` (a ``TableTarget`` by default; read it back as
    ``verifier.target.inner``), wrapped in the engine's ``RecoveringTarget``."""
    recovering = RecoveringTarget(target if target is not None else TableTarget(), recovery_s=recovery_s,
                                  on_lost=on_lost or (lambda recovered, reason: None))
    return Verifier(recovering, is_live=is_live, clock=clock or Clock())


def make_learner(*, speculator: Speculator | None = None, routing: DraftRouting | None = None,
                 costs: CostModel | None = None, drafters: Sequence[DrafterClient] = (),
                 is_live: Callable[[str], bool] = _live, clock: Callable[[], float] | None = None,
                 participation: ParticipationController | None = None, guard=None,
                 metrics: EngineMetrics | None = None) -> Learner:
    """A ``Learner`` with a fresh speculator, routing over ``drafters``' names, the default cost
    model and its own metrics registry (``learner.metrics.registry``)."""
    names = [d.name for d in drafters]
    return Learner(speculator=speculator or make_speculator(drafters),
                   routing=routing or make_routing(names or ("a", "b"), participation=participation),
                   costs=costs or CostModel(), drafters=drafters,
                   metrics=metrics or EngineMetrics(MetricsRegistry()), is_live=is_live, clock=clock or Clock(),
                   participation=participation, guard=guard)
