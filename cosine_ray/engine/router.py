"""The router: request pool, continuous batching and the speculative step loop.

NOTE(lead): one ``step()`` is the whole algorithm (DESIGN §2):

    admit → plan (route each request to its drafters, draft with confidence fusion, select
    one token tree per request, schedule the batch and each γ_i: ``engine.planner``) →
    score (target: prefill chains and trees in one varlen forward) → verify (greedy /
    lossless rejection sampling) → commit (accepted path's KV kept at the next score) →
    learn (calibration, routing scores, latency model, metrics) → stream.

The router never touches a model: the target and drafters are behind ``TargetClient`` and
``DrafterClient``; the same loop drives in-process workers and Ray actors.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from cosine_ray.algo.sampling import logits_to_probs, sample
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.verify import VerifyResult, verify_greedy, verify_stochastic
from cosine_ray.engine.drafters.base import DraftFeedback, DraftInput, DraftProposal
from cosine_ray.engine.request import Request, RequestOutput, RequestStatus, SamplingParams
from cosine_ray.engine.planner import Plan, SpeculationPlanner
from cosine_ray.engine.speculation import DrafterClient, SpeculationStats
from cosine_ray.engine.target import ScoreItem, TargetClient, TargetUnavailable
from cosine_ray.metrics.registry import MetricsRegistry

if TYPE_CHECKING:
    from cosine_ray.algo.domains import DomainClassifier
    from cosine_ray.algo.latency_model import LatencyModel

ROUTING_MODES = ("expertise", "random")
FUSION_MODES = ("confidence", "single", "union")
SCHEDULERS = ("lp", "fcfs")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    max_batch_size: int = 8
    """Requests running at once (continuous batching admits new ones as others finish)."""
    num_speculative_tokens: int = 8
    """γ_max: draft-token budget of one request's tree per step (0 = plain decoding)."""
    min_tree_confidence: float = 0.25
    """With ``scheduler="fcfs"`` (LP off): draft nodes whose cumulative confidence (product
    along their path) is below this are not verified. The LP decides γ_i itself."""
    routing: str = "expertise"
    """expertise (CoSine eq. 1-3) | random (ablation: routing off, k drafters at random)."""
    fusion: str = "confidence"
    """confidence (eq. 4, round by round) | single (ablation: the best routed drafter alone) |
    union (every routed drafter's whole paths merged)."""
    scheduler: str = "lp"
    """lp (eq. 5-8 with scipy HiGHS) | fcfs (ablation: first come, fixed size, fixed cut)."""
    adaptive: bool = True
    """False (ablation): fixed γ and fixed drafter participation."""
    drafters_per_request: int = 2
    """k: drafters routed to each request per step (adaptive: where participation starts)."""
    shared_drafters: tuple[str, ...] = ("ngram",)
    """Domain-agnostic drafters every request uses besides its k routed ones (the context
    n-gram drafter costs a dictionary lookup and knows the request's own text better than any
    domain expert). Names not in the pool are ignored; with ``fusion="single"`` they compete
    for the one slot like every other drafter."""
    max_drafters_per_request: int = 3
    total_gamma_max: int = 64
    """Γ_max: draft tokens per micro-batch (eq. 6; Algorithm 2 trims above it)."""
    step_time_max_s: float = 5.0
    """T_max: the scheduler keeps a step's predicted time under this (eq. 7)."""
    drafter_deadline_s: float = 2.0
    """A drafter's answer later than this is dropped for the step."""
    max_model_len: int = 8192
    """Prompt + output tokens a request may reach."""
    stage_recovery_s: float = 60.0
    """How long a lost stage may take to come back before its requests fail."""
    max_restores: int = 3
    """Re-prefills one request may go through before it fails (a bug must not loop)."""
    num_lanes: int = 1
    """Micro-batches in flight at once: running requests are split into this many lanes,
    each stepped by its own coroutine, so with S pipeline stages stage s can work on lane
    n while stage s+1 works on lane n-1. 1 for the in-process engine."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.drafter_deadline_s <= 0:
            raise ValueError("drafter_deadline_s must be > 0")
        if self.num_lanes < 1:
            raise ValueError("num_lanes must be >= 1")
        if isinstance(self.shared_drafters, str) or not all(isinstance(n, str) for n in self.shared_drafters):
            raise ValueError("shared_drafters must be a list of drafter names")
        object.__setattr__(self, "shared_drafters", tuple(self.shared_drafters))
        for name, value, allowed in (("routing", self.routing, ROUTING_MODES), ("fusion", self.fusion, FUSION_MODES),
                                     ("scheduler", self.scheduler, SCHEDULERS)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: use one of {', '.join(allowed)}")
        if not 1 <= self.drafters_per_request <= self.max_drafters_per_request:
            raise ValueError("need 1 <= drafters_per_request <= max_drafters_per_request")
        if self.total_gamma_max < 0 or self.step_time_max_s <= 0:
            raise ValueError("total_gamma_max must be >= 0 and step_time_max_s > 0")


@dataclass(slots=True)
class _Planned:
    request: Request
    item: ScoreItem
    plan: Plan | None = None  # None: prefill

    @property
    def tree(self) -> TokenTree | None:
        return None if self.plan is None else self.plan.selected.tree


class Router:
    def __init__(self, config: RouterConfig, target: TargetClient,
                 drafters: Sequence[DrafterClient], *, vocab_size: int,
                 eos_token_ids: Sequence[int] = (), clock: Callable[[], float] = time.monotonic,
                 metrics: MetricsRegistry | None = None, unit_embeddings: torch.Tensor | None = None,
                 domain_classifier: "DomainClassifier | None" = None,
                 latency_model: "LatencyModel | None" = None, seed: int | None = 0) -> None:
        self.config = config
        self.metrics = metrics or MetricsRegistry()
        """Plain counters (cosine_ray.metrics.names); exported at the edge."""
        self.target = target
        self.drafters = list(drafters)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self._to_release: list[str] = []
        self.speculation_stats = SpeculationStats(self.metrics)
        self.planner = SpeculationPlanner(config, self.drafters, vocab_size=vocab_size, metrics=self.metrics,
                                          stats=self.speculation_stats, clock=clock, unit_embeddings=unit_embeddings,
                                          domain_classifier=domain_classifier, latency_model=latency_model, seed=seed)
        self._epoch = 0
        """Completed target recoveries. A step scored under an older epoch is stale: a recovery
        (another lane's) dropped all KV while it was in flight."""
        self._recovery_lock: asyncio.Lock | None = None

    # ---- pool ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams) -> Request:
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(prompt_token_ids, params)
        request = Request(request_id, [int(t) for t in prompt_token_ids], params,
                          self.eos_token_ids, arrival_time=self.clock())
        self.planner.start(request)
        self.waiting.append(request)
        return request

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError if the request cannot be served (before anything is queued)."""
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if any(not 0 <= int(t) < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) + params.max_tokens > self.config.max_model_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens "
                             f"({params.max_tokens}) exceeds the model length {self.config.max_model_len}")

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its state on the target and drafters is freed at the next step."""
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                r.finish("abort")
                self.planner.finish([request_id])
                return True
        request = self.running.pop(request_id, None)
        if request is None:
            return False
        request.finish("abort")
        self._to_release.append(request_id)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_release)

    def lane_has_work(self, lane: int) -> bool:
        can_admit = bool(self.waiting) and len(self.running) < self.config.max_batch_size
        return can_admit or bool(self._to_release) or any(r.lane == lane for r in self.running.values())

    async def release_finished(self) -> None:
        if not self._to_release:
            return
        ids, self._to_release = self._to_release, []
        self.planner.finish(ids)
        await self.target.release(ids)
        for d in self.drafters:
            try:
                await d.release(ids)
            except Exception:  # a dead drafter's state is gone anyway
                self.speculation_stats.failed(d.name)

    # ---- the step loop ------------------------------------------------------------------
    async def step(self, lane: int | None = None) -> list[RequestOutput]:
        """One iteration for the requests of ``lane`` (None: every running request)."""
        await self.release_finished()
        self._admit()
        batch = [r for r in self.running.values() if lane is None or r.lane == lane]
        if not batch:
            return []
        epoch = self._epoch  # before drafting: a recovery may complete while drafters answer
        planned = await self._plan_and_draft(batch)
        planned = [p for p in planned if p.request.request_id in self.running]  # aborted while drafting
        if not planned:
            return []
        items = [p.item for p in planned]
        verify_start = self.clock()
        self.planner.verifier.begin()
        try:
            logits = await self.target.score(items)
        except TargetUnavailable as exc:
            return await self._recover(str(exc), epoch)
        finally:
            self.planner.verifier.end()
        self.planner.observe_verify([i.start_position for i in items], [len(i.token_ids) for i in items],
                                    self.clock() - verify_start)
        if epoch != self._epoch:  # a recovery dropped the KV these logits belong to: re-prefill
            for p in planned:
                p.request.kv_lost, p.request.pending_commit = True, None
            return []
        outputs = []
        feedback: dict[str, list[DraftFeedback]] = {d.name: [] for d in self.drafters}
        for p, item_logits in zip(planned, logits):
            request = p.request
            if request.request_id not in self.running:  # aborted while this step was in flight
                continue
            if p.tree is None:  # prefill (or restore after a lost stage) of the whole context
                new_tokens = [self._sample_one(request, item_logits[-1:])]
                request.pending_commit = tuple(range(len(p.item.token_ids)))
                request.kv_lost = False
            else:
                result = self._verify(request, p.tree, item_logits)
                new_tokens = list(result.new_token_ids)
                request.pending_commit = (0,) + result.accepted_node_ids
                self._account(request, p, result, feedback)
                self.planner.learn(request, p.plan, result)
            appended = request.append(new_tokens)
            outputs.append(RequestOutput(
                request.request_id, appended, request.is_finished, request.finish_reason,
                len(request.prompt_token_ids), len(request.output_token_ids), request.stats))
            if request.is_finished:
                del self.running[request.request_id]
                self._to_release.append(request.request_id)
        for d in self.drafters:
            if feedback[d.name]:
                try:
                    await d.observe(feedback[d.name])
                except Exception:
                    self.speculation_stats.failed(d.name)
        return outputs

    async def _recover(self, reason: str, epoch: int) -> list[RequestOutput]:
        """A stage is gone: wait for it, then re-prefill every running request from its prompt
        and committed tokens (nothing is streamed twice); fail them if it does not come back.
        One recovery at a time: a lane whose step failed under an older epoch was already
        covered by the recovery that ended that epoch (its requests are marked kv_lost)."""
        if self._recovery_lock is None:
            self._recovery_lock = asyncio.Lock()
        async with self._recovery_lock:
            if epoch != self._epoch:
                return []
            return self._after_recovery(reason, await self.target.recover(self.config.stage_recovery_s))

    def _after_recovery(self, reason: str, recovered: bool) -> list[RequestOutput]:
        self._epoch += 1
        outputs = []
        for request in list(self.running.values()):
            request.num_restores += 1
            request.kv_lost, request.pending_commit = True, None
            if recovered and request.num_restores <= self.config.max_restores:
                continue
            request.finish("error")
            del self.running[request.request_id]
            self._to_release.append(request.request_id)
            outputs.append(RequestOutput(request.request_id, [], True, "error",
                                         len(request.prompt_token_ids), len(request.output_token_ids),
                                         request.stats, error=f"target unavailable: {reason}"))
        return outputs

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.admitted_time = self.clock()
            loads = [0] * self.config.num_lanes
            for r in self.running.values():
                loads[r.lane] += 1
            request.lane = loads.index(min(loads))
            self.running[request.request_id] = request

    async def _plan_and_draft(self, requests: list[Request]) -> list[_Planned]:
        planned: list[_Planned] = []
        decoding: list[Request] = []
        for request in requests:
            if not request.output_token_ids or request.kv_lost:
                planned.append(_Planned(request, ScoreItem.prefill(request.request_id, request.context_token_ids)))
            else:
                decoding.append(request)
        plans = await self.planner.plan(decoding, live=self.running.__contains__)
        for request in decoding:
            plan = plans.get(request.request_id)
            if plan is None:  # the scheduler left it for a later step
                continue
            item = ScoreItem.for_tree(request.request_id, plan.selected.tree, request.num_tokens - 1,
                                      request.pending_commit)
            planned.append(_Planned(request, item, plan))
        return planned

    def _sample_one(self, request: Request, logits: torch.Tensor) -> int:
        """First token after prefill: the target's own choice (argmax or a sample)."""
        if request.params.is_greedy:
            return int(logits[0].argmax())
        return int(sample(self._probs(request, logits), generator=request.generator)[0])

    def _verify(self, request: Request, tree: TokenTree, logits: torch.Tensor) -> VerifyResult:
        if request.params.is_greedy:
            return verify_greedy(tree, logits)
        return verify_stochastic(tree, self._probs(request, logits), generator=request.generator)

    @staticmethod
    def _probs(request: Request, logits: torch.Tensor) -> torch.Tensor:
        params = request.params
        return logits_to_probs(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)

    def _account(self, request: Request, p: _Planned, result: VerifyResult,
                 feedback: dict[str, list[DraftFeedback]]) -> None:
        stats = request.stats
        stats.num_verify_steps += 1
        stats.num_draft_tokens += p.tree.num_draft_tokens
        stats.num_accepted_tokens += len(result.accepted_node_ids)
        owners = p.plan.selected.owners
        drafted: dict[str, int] = {}
        accepted: dict[str, int] = {}
        for node in range(1, p.tree.num_nodes):
            drafted[owners[node]] = drafted.get(owners[node], 0) + 1
        for node in result.accepted_node_ids:
            accepted[owners[node]] = accepted.get(owners[node], 0) + 1
        for name, n in drafted.items():
            stats.drafted_by[name] = stats.drafted_by.get(name, 0) + n
        for name, n in accepted.items():
            stats.accepted_by[name] = stats.accepted_by.get(name, 0) + n
        for name in feedback:
            feedback[name].append(DraftFeedback(request.request_id, drafted.get(name, 0), accepted.get(name, 0)))
