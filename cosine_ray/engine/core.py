"""The engine core: one ``step()`` is the whole algorithm (CoSine Algorithms 1-2).

Each line of ``_lanes_step`` is one call to the owner of that job::

    schedule  BatchScheduler   admission, prefills, which requests run, the LP's price (eq. 5-8)
    route     DraftRouting     k expert drafters + the shared ones per request (eq. 1-3)
    draft     Speculator       confidence fusion (eq. 4) + TreeSelection → one tree per request
    verify    Verifier         prefills and trees in one target call; lossless acceptance
    commit    target client    keep the accepted paths' KV (two-level cache)
    learn     Learner          one StepStats → calibration, routing, gains, latency, metrics
    advance   RequestPool      append tokens, stream them, finish

The optional modes are rules chosen once in ``__init__``: PEARL replaces draft-then-verify,
PipeDec takes a request that runs alone, and learning runs in the step or under the next
forward. The core never touches a model or an actor: the target and drafters are behind
``TargetClient`` and ``DrafterClient``, so the same loop drives in-process workers and Ray actors.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from cosine_ray.algo.adaptive import ParticipationController
from cosine_ray.algo.calibration import ConfidenceCalibrator
from cosine_ray.algo.guard import SpeculationGuard
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.drafters.prediction import PredictionDrafter
from cosine_ray.engine.drafters.worker import DrafterWorker
from cosine_ray.engine.modes.pearl import Pearl, trunk_tokens
from cosine_ray.engine.modes.pipedec import ModeGuard, PipeDec
from cosine_ray.engine.modes.twins import Twins
from cosine_ray.engine.owners.constraints import Constraints
from cosine_ray.engine.owners.grammars import GrammarCompiler, NoGrammars
from cosine_ray.engine.worker.clients import DrafterClient
from cosine_ray.engine.owners.economics import CostModel
from cosine_ray.engine.owners.kv import KVBlocks
from cosine_ray.engine.owners.learner import Learner, PendingLearning
from cosine_ray.engine.owners.pool import RequestPool
from cosine_ray.engine.owners.routing import DraftRouting
from cosine_ray.engine.owners.scheduler import BatchScheduler, FirstComeBatchPolicy, LpBatchPolicy
from cosine_ray.engine.owners.speculator import (ConfidenceCutSelection, FixedSelection, FusedDrafting,
                                                 PathDrafting, PricedSelection, Speculator)
from cosine_ray.engine.owners.verifier import NoTokenLeft, Verifier
from cosine_ray.engine.request import (NO_TENANT, Request, RequestOutput, RequestRefused, RequestStatus, SamplingParams,
                                       Tenant, needs_prefill)
from cosine_ray.engine.types import DraftingStats, Drafts, StepBatch, Verified, VerifiedBatch
from cosine_ray.engine.worker.recovery import RecoveringTarget
from cosine_ray.engine.worker.clients import LocalDrafterClient, TargetClient
from cosine_ray.metrics.exporter import EngineMetrics
from cosine_ray.metrics.registry import MetricsRegistry
from cosine_ray.models.kv_cache import DEFAULT_BLOCK_SIZE

if TYPE_CHECKING:
    from cosine_ray.algo.domains import DomainClassifier
    from cosine_ray.algo.scheduling.latency_model import LatencyModel


class PhaseTimer:
    """Wall time (``time.perf_counter``) from one mark to the next, per phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


class EngineCore:
    def __init__(self, config: EngineConfig, target: TargetClient, drafters: Sequence[DrafterClient], *,
                 vocab_size: int, eos_token_ids: Sequence[int] = (), clock: Callable[[], float] = time.monotonic,
                 metrics: MetricsRegistry | None = None, unit_embeddings: torch.Tensor | None = None,
                 domain_classifier: "DomainClassifier | None" = None,
                 latency_model: "LatencyModel | None" = None, kv_bytes_per_token: int = 0,
                 kv_num_blocks: int | None = None, seed: int | None = 0,
                 tokenizer: Any = None) -> None:
        """``config``: resolved (``EngineConfig.resolved``: the device's batch, the lanes, the
        model's context). ``kv_num_blocks``: KV blocks every stage can hold
        (``TargetClient.kv_capacity``); None: the stages' pools grow as needed. ``tokenizer``: the
        target's HF tokenizer, for grammars (None: requests with a grammar are refused)."""
        if not config.is_resolved:
            raise ValueError("EngineCore needs a resolved config (EngineConfig.resolved)")
        self.config = config
        sched, spec, run, exp = config.scheduler, config.speculation, config.runtime, config.experiments
        self.clock = clock
        self.metrics = metrics or MetricsRegistry()
        """Plain counters (cosine_ray.metrics.names); exported at the edge."""
        self.exporter = EngineMetrics(self.metrics)
        self.drafters = list(drafters)
        self.prediction = PredictionDrafter() if self.drafters and spec.num_speculative_tokens > 0 else None
        """The drafter of requests with a prediction: in this process whatever the backend, since it
        is told each request's prediction as the request starts (``DraftRouting.start``)."""
        if self.prediction is not None:
            self.drafters.append(LocalDrafterClient(DrafterWorker(self.prediction)))
        self.pool = RequestPool(max_num_seqs=sched.max_num_seqs, max_model_len=sched.max_model_len,
                                num_lanes=sched.num_lanes, vocab_size=vocab_size, eos_token_ids=eos_token_ids,
                                max_restores=run.max_restores, clock=clock, seed=config.seed)
        self.kv = KVBlocks(kv_num_blocks, DEFAULT_BLOCK_SIZE, caching=sched.enable_prefix_caching)
        """Every request's block table and the prefix cache (the stages' pools, seen from here)."""
        self.target = RecoveringTarget(target, recovery_s=run.stage_recovery_s, on_lost=self._target_lost)
        costs = CostModel(latency_model)
        # The ablations, chosen once: LP or first come, fusion or whole paths, and the tree policy.
        is_lp, adaptive = exp.scheduler == "lp", exp.adaptive
        guard = SpeculationGuard(seed=seed) if is_lp and adaptive and self.drafters else None
        uses_twins = spec.twins and self.drafters and spec.num_speculative_tokens > 0
        self.scheduler = BatchScheduler(config, self.pool, LpBatchPolicy() if is_lp else FirstComeBatchPolicy(),
                                        costs, self.kv, kv_bytes_per_token=kv_bytes_per_token,
                                        priced=is_lp and adaptive, guard=guard, clock=clock,
                                        # PEARL drafts ahead while the target verifies: not host time to save
                                        skip_unpaying=spec.pearl == "off",
                                        twins=Twins(clock=clock) if uses_twins else None)
        participation = None
        if adaptive and exp.fusion != "single":
            participation = ParticipationController(
                min_drafters=1, max_drafters=max(spec.max_drafters_per_request, spec.drafters_per_request),
                initial=spec.drafters_per_request)
        self.routing = DraftRouting(config, [d.name for d in self.drafters], domain_classifier=domain_classifier,
                                    participation=participation, seed=seed, prediction=self.prediction)
        clients = {d.name: d for d in self.drafters}
        drafting = (FusedDrafting(clients, vocab_size=vocab_size, deadline_s=run.drafter_deadline_s,
                                  is_live=self.pool.is_live) if exp.fusion == "confidence" else
                    PathDrafting(clients, vocab_size=vocab_size, deadline_s=run.drafter_deadline_s))
        selection = (FixedSelection() if not adaptive else
                     PricedSelection() if is_lp else ConfidenceCutSelection(exp.min_tree_confidence))
        self.constraints = Constraints(GrammarCompiler(tokenizer, vocab_size) if tokenizer is not None else NoGrammars(),
                                       vocab_size)
        """Score rules and grammars of requests (``engine.owners.constraints``)."""
        self.speculator = Speculator(drafting, selection, ConfidenceCalibrator(), total_gamma_max=sched.total_gamma_max,
                                     prune=self.constraints.prune)
        self.verifier = Verifier(self.target, is_live=self.pool.is_live, clock=clock)
        self.learner = Learner(speculator=self.speculator, routing=self.routing, costs=costs,
                               drafters=self.drafters, metrics=self.exporter, is_live=self.pool.is_live,
                               clock=clock, participation=participation, guard=guard,
                               unit_embeddings=unit_embeddings)
        self.exporter.participation(self.routing.drafters_per_request)
        # The optional modes, chosen once.
        self.pearl = Pearl(spec.pearl) if spec.pearl != "off" and self.drafters else None
        self._draft_and_verify = self._draft_then_verify if self.pearl is None else self._pearl_draft_verify
        self.pipedec: PipeDec | None = None
        self.mode_guard: ModeGuard | None = None
        self._step = self._lanes_step
        if spec.pipeline_mode == "pipedec":
            if not self.target.supports_pipedec:
                raise ValueError("pipeline_mode 'pipedec' needs a target client with PipeDec timesteps")
            self.pipedec = PipeDec(self.target, clients, self.kv, width=spec.pipedec_width,
                                   max_depth=spec.pipedec_depth or None, vocab_size=vocab_size,
                                   deadline_s=run.drafter_deadline_s,
                                   on_drafter_failure=self.exporter.drafter_failed)
            self.mode_guard = ModeGuard() if spec.pipedec_guard else None
            self._step = self._solo_or_lanes_step
        self.overlap_learning = (spec.overlap_learning == "on" or spec.overlap_learning == "auto"
                                 and bool(getattr(target, "runs_async", False)))
        """Learn from step n while step n+1's forward runs (``SpeculationConfig.overlap_learning``)."""
        self._learn = self._learn_later if self.overlap_learning else self._learn_now
        self._unlearned: list[PendingLearning] = []
        """Recorded steps whose learning waits for the next forward (``overlap_learning``)."""

    # ---- the step ---------------------------------------------------------------------------
    async def step(self, lane: int | None = None) -> list[RequestOutput]:
        """One iteration for the requests of ``lane`` (None: every running request)."""
        await self.release(self.pool.take_released())
        preempted = self.pool.take_preempted()
        if preempted:  # the stages drop their KV before they resume (their blocks are reused)
            await self.target.release(preempted)
        return await self._step(lane)

    async def _lanes_step(self, lane: int | None) -> list[RequestOutput]:
        timer = PhaseTimer()
        batch = self.scheduler.schedule(lane)
        timer.mark("schedule")
        self._hold(batch, +1)
        try:
            routes = self.routing.route(batch)
            timer.mark("route")
            # Learning from the steps before runs while this one's forward is on the GPU: the
            # task starts at verification's first wait (the poll for the GPU, a remote call).
            drafts, verified = await self._draft_and_verify(batch, routes, timer)
            timer.mark("verify")
            self.target.commit(verified.commits)
            timer.mark("commit")
            pending = self.learner.record(batch, drafts, verified)
            await (self._learn(pending) if batch.requests else self.learner.absorb(pending))
            timer.mark("learn")
            outputs = self.pool.advance(verified.outcomes)
            self._commit_kv(batch, verified)
            timer.mark("advance")
            if batch.requests:
                self.exporter.step_phases(timer.seconds)
            return outputs
        finally:
            self._hold(batch, -1)

    async def _draft_then_verify(self, batch: StepBatch, routes, timer: PhaseTimer) -> tuple[Drafts, VerifiedBatch]:
        drafts = await self.speculator.draft(batch, routes)
        timer.mark("draft")
        return drafts, await self._verify_absorbing(batch, drafts)

    async def _verify_absorbing(self, batch: StepBatch, drafts: Drafts) -> VerifiedBatch:
        """Verify, and absorb what earlier steps taught while the forward runs (a no-op unless
        learning was deferred)."""
        absorbing = asyncio.ensure_future(self.flush_learning()) if self._unlearned else None
        try:
            return await self.verifier.verify(batch, drafts)
        finally:
            if absorbing is not None:
                await absorbing

    async def _pearl_draft_verify(self, batch: StepBatch, routes, timer: PhaseTimer) -> tuple[Drafts, VerifiedBatch]:
        """PEARL (``engine.modes.pearl``): verify the trees the previous step drafted ahead (or
        just the roots: pre-verify) while the drafters draft ahead of them, from committed +
        trunk. Drafting ahead overlaps the verification: the two are one phase."""
        stats = DraftingStats()
        drafted = self.pearl.take(batch.decodes)
        post_verify = len(drafted)
        fresh = [r for r in batch.decodes if r.request_id not in drafted and batch.budgets[r.request_id] > 0]
        if fresh and not self.pearl.pre_verify():  # drafting is the quicker here: draft first
            drafted.update(await self.speculator.draft_paths(fresh, routes, batch.budgets, stats))
            pre_verify, drafted_first = 0, len(fresh)
        else:
            pre_verify, drafted_first = len(fresh), 0
        self.pearl.stats.pre_verify += pre_verify
        self.pearl.stats.drafted_first += drafted_first
        self.exporter.pearl_steps(post_verify=post_verify, pre_verify=pre_verify, drafted_first=drafted_first)
        drafts = self.speculator.select(batch, drafted, stats)
        trunks = {rid: trunk_tokens(tree.selected) for rid, tree in drafts.trees.items()}
        ahead_of = [r for r in batch.decodes if batch.budgets[r.request_id] > 0 and r.request_id in routes]
        contexts = {r.request_id: (*r.context_token_ids, *trunks[r.request_id]) for r in ahead_of}

        async def draft_ahead():
            # PEARL's window: γ tokens drafted per segment, the first one the guess of the
            # target's next token (checked by this verification's bonus token), the rest the next tree
            start = self.clock()
            out = await self.speculator.draft_paths(ahead_of, routes, batch.budgets, stats, contexts)
            return out, self.clock() - start

        verified, (ahead, draft_s) = await asyncio.gather(self._verify_absorbing(batch, drafts), draft_ahead())
        self.pearl.observe(draft_s if ahead_of else None, verified.verify_s)
        if not verified.lost:
            self.pearl.keep(batch.decodes, trunks, ahead, verified.outcomes)
        return drafts, verified

    def _commit_kv(self, batch: StepBatch, verified: VerifiedBatch) -> None:
        """The engine's tables follow the commit, once the new tokens are appended: each
        request's committed KV grew by its kept slots (a prompt chunk, or the root and the
        accepted path); its full blocks enter the prefix cache (a finished one's too)."""
        by_id = {r.request_id: r for r in batch.requests}
        for outcome in verified.outcomes:
            request = by_id[outcome.request_id]
            if request.status is not RequestStatus.FINISHED or request.finish_reason in ("stop", "length"):
                self.kv.commit(request, request.num_computed_tokens + len(outcome.keep))

    def _target_lost(self, recovered: bool, reason: str) -> None:
        """A stage lost its KV: nothing any request held is there any more, nothing is cached."""
        self.kv.reset(self.pool.requests())
        self.pool.target_lost(recovered, reason)

    async def _learn_now(self, pending: PendingLearning) -> None:
        await self.learner.absorb(pending)

    async def _learn_later(self, pending: PendingLearning) -> None:
        """Queue the step's learning for the next forward (``overlap_learning``)."""
        self._unlearned.append(pending)

    async def flush_learning(self) -> None:
        """Absorb every recorded step not learned from yet (``overlap_learning``): before the
        next forward's end, when the loop goes idle, and at shutdown."""
        while self._unlearned:
            pending = self._unlearned.pop(0)
            await self.learner.absorb(pending)

    @staticmethod
    def _hold(batch: StepBatch, delta: int) -> None:
        """Count the steps working on each request: another lane's step releases none of them
        until this one is done with its drafter and stage calls (``pool.take_released``)."""
        for r in batch.requests:
            r.num_in_flight += delta

    # ---- PipeDec: a request alone in the pool --------------------------------------------------
    async def _solo_or_lanes_step(self, lane: int | None) -> list[RequestOutput]:
        """A request alone in the pool runs PipeDec's timestep loop while the mode guard measures
        it faster than lanes; any other step leaves the PipeDec session and runs in lanes."""
        solo = self._solo(lane)
        if solo is not None and not self.pipedec.fits(solo):
            solo = None
        if solo is not None and (self.mode_guard is None or self.mode_guard.current == "pipedec"):
            return await self._pipedec_step(solo)
        session = self.pipedec.session
        if session is not None and (lane is None or lane == session.lane):
            # another request came (or the guard chose lanes): back to lanes. Only the session's
            # own lane leaves it, so a step of another lane never prunes the tree mid-timestep.
            await self.pipedec.leave(keep_kv=self._keeps_kv(session.request_id))
        if solo is None:
            return await self._lanes_step(lane)
        started, before = self.clock(), solo.num_tokens  # the guard measures a request alone in lanes too
        outputs = await self._lanes_step(lane)
        self.mode_guard.record("lanes", solo.num_tokens - before, self.clock() - started)
        return outputs

    def _solo(self, lane: int | None) -> Request | None:
        """The one running request, if nothing else runs or waits and it is decoding."""
        if self.pool.waiting or len(self.pool.running) != 1 or not self.drafters:
            return None
        request = next(iter(self.pool.running.values()))
        if (lane is not None and request.lane != lane) or needs_prefill(request) \
                or not self.pool.is_live(request.request_id):
            return None
        return request

    def _keeps_kv(self, request_id: str) -> bool:
        request = self.pool.running.get(request_id)
        return request is not None and not needs_prefill(request)

    async def _pipedec_step(self, request: Request) -> list[RequestOutput]:
        batch = StepBatch([request], {request.request_id: self.config.speculation.pipedec_width})
        self._hold(batch, +1)
        started = self.clock()
        try:
            tokens = await self.pipedec.step(request, lambda: self.routing.route(batch)[request.request_id].drafters)
        except NoTokenLeft as exc:  # its rules allow no root token: it ends alone
            self.pool.refuse(request.request_id, str(exc))
            await self.pipedec.leave(keep_kv=False)
            return self.pool.advance([])
        finally:
            self._hold(batch, -1)
        if self.mode_guard is not None and tokens is not None:
            self.mode_guard.record("pipedec", len(tokens), self.clock() - started)
        if not tokens:  # none yet (the pipeline fills), or a stage was lost (the request re-prefills)
            return self.pool.advance([])
        outputs = self.pool.advance([Verified(request.request_id, tokens, ())])
        if request.request_id not in self.pool.running:  # finished: its KV is freed with it
            await self.pipedec.leave(keep_kv=False)
        return outputs

    # ---- requests in and out --------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    tenant: Tenant = NO_TENANT, resume_token_ids: Sequence[int] = ()) -> Request:
        """Queue a request (``tenant``: whose it is, for the fair share between tenants). Its
        grammar is compiled here unless ``prepare_request`` compiled it: a server awaits that first.
        ``resume_token_ids``: tokens it already generated elsewhere (an engine replica that died):
        they are its output as if generated here (max_tokens, min_tokens, penalties, its grammar's
        state, the positions its seed keys), and it goes on as a preempted request would."""
        self._check_fits(prompt_token_ids, params)
        self.constraints.check(params)
        self.routing.check(params, self.pool.vocab_size)
        resumed = [int(t) for t in resume_token_ids]
        if len(resumed) >= params.max_tokens or any(not 0 <= t < self.pool.vocab_size for t in resumed):
            raise RequestRefused(f"{len(resumed)} tokens to resume from: fewer than max_tokens "
                                 f"({params.max_tokens}), each in [0, {self.pool.vocab_size})", "resume_token_ids")
        request = self.pool.add(request_id, prompt_token_ids, params, tenant)
        try:
            self.constraints.start(request)
            self.constraints.replay(request, resumed)
        except Exception:
            self.pool.abort(request_id)
            raise
        self.routing.start(request)
        return request

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestRefused if the request cannot be served (before anything is queued). A
        grammar is compiled here and now: ``prepare_request`` is the same off the event loop."""
        self._check_cheaply(prompt_token_ids, params)
        self.constraints.check_grammar(params)

    async def prepare_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """``check_request`` with the grammar compiled in a worker thread (or found compiled):
        what a server awaits before ``add_request``, so that neither compiles on the event loop
        that drives the steps (``engine.owners.grammars``)."""
        self._check_cheaply(prompt_token_ids, params)
        await self.constraints.prepare(params)

    def _check_cheaply(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.pool.check(prompt_token_ids, params)
        self._check_fits(prompt_token_ids, params)
        self.constraints.check(params)
        self.routing.check(params, self.pool.vocab_size)

    def _check_fits(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Only a request that could never fit the KV pool, even alone, is refused."""
        tokens = len(prompt_token_ids) + params.max_tokens + self.config.speculation.num_speculative_tokens + 1
        blocks = self.kv.blocks_for(tokens)
        if self.kv.capacity is not None and blocks > self.kv.capacity:
            raise RequestRefused(f"the prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                 f"need {blocks} KV blocks of {self.kv.block_size} tokens; the KV cache holds "
                                 f"{self.kv.capacity} (raise --kv-cache-memory or lower max_tokens)",
                                 "max_tokens", "kv_cache")

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its state on the target and drafters is freed at the next step."""
        return self.pool.abort(request_id)

    async def release(self, requests: Sequence[Request]) -> None:
        """Retire finished and aborted requests. What the engine knew of them lives on the
        ``Request`` and goes with it; the drafters that learn get the text of the ones that
        finished normally, the target and the drafters free their KV and indexes."""
        await self.learner.learn_from_completed(self.pool.take_completed())
        if not requests:
            return
        self.exporter.routing_priors(self.routing.priors(requests))
        self.scheduler.twins.forget(self.pool.running.values())
        for r in requests:
            self.kv.free(r)
        request_ids = [r.request_id for r in requests]
        await self.target.release(request_ids)
        for d in self.drafters:
            try:
                await d.release(request_ids)
            except Exception:  # a dead drafter's state is gone anyway
                self.exporter.drafter_failed(d.name)

    def read_gauges(self) -> None:
        """Put the pool's and the KV cache's current state into the metrics (read at /metrics)."""
        self.exporter.requests_in_pool(len(self.pool.running), len(self.pool.waiting))
        stats = self.kv.stats
        self.exporter.kv_cache(queries=stats.queries, hits=stats.hits, preemptions=self.scheduler.num_preemptions,
                               used_blocks=self.kv.num_used_blocks, capacity=self.kv.capacity)

    @property
    def num_tracked_requests(self) -> int:
        """Requests the engine still references anywhere (a leak check: 0 when idle)."""
        pool = self.pool
        return len(pool.running) + len(pool.waiting) + pool.num_to_release + self.scheduler.twins.num_tracked

    # ---- what the loop and the front ends read ----------------------------------------------------
    @property
    def running(self) -> dict[str, Request]:
        return self.pool.running

    @property
    def waiting(self):
        return self.pool.waiting

    @property
    def vocab_size(self) -> int:
        return self.pool.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.pool.eos_token_ids

    @property
    def has_work(self) -> bool:
        return self.pool.has_work

    def lane_has_work(self, lane: int) -> bool:
        return self.pool.lane_has_work(lane)
