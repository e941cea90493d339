"""The batch scheduler: which requests run this step, which waiting ones are admitted, and
the price TreeSelection applies to each drafted tree (CoSine eq. 5-8, Algorithm 2).

``schedule(lane)`` runs its jobs in order: admit (fairly between tenants, ``RequestPool.next_waiting``,
into the least loaded lane, while the KV pool has room; a new request takes its cached prefix;
a tenant below its share preempts a request of one above it), plan twins, fit the step's token
budget (decodes and trees first, then prompt chunks), decide the batch (the LP or first come,
``BatchPolicy``), reserve each chosen request's KV (preempting the request that arrived last
when it does not fit), record, price the trees (λ of eq. 8 over the guard's level, the drain
weights, no drafting that cannot pay), add the tokens each grammar forces next and reserve
the trees' slots. Whether trees are priced is a
rule chosen at start (``TreePricing`` or ``FixedBudgets``); docs/scheduling.md explains each job.

The paper's order — batch assignment before drafting (Algorithm 2) — needs
gains before the trees exist; the last tree's curve predicts them. Only the batch decision
uses the prediction; γ_i uses the real tree.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from cosine_ray.algo.guard import SpeculationGuard
from cosine_ray.algo.scheduling.lp_schedule import Candidate, Schedule, ScheduleConfig, first_come_batch, schedule_batch, trim_gammas
from cosine_ray.algo.tree_selection import TreePrice
from cosine_ray.engine.config import EngineConfig
from cosine_ray.engine.owners.constraints import MAX_FORCED_TOKENS, forced_tokens
from cosine_ray.engine.owners.economics import CostModel, predicted_gains
from cosine_ray.engine.owners.kv import KVBlocks
from cosine_ray.engine.owners.pool import RequestPool
from cosine_ray.engine.request import Request, RequestStatus, needs_prefill
from cosine_ray.engine.modes.twins import NoTwins, Twins
from cosine_ray.engine.types import PROBE_EVERY, StepBatch


@dataclass(slots=True)
class PriceTally:
    """What the price did to the decoding requests' budgets, summed over the priced steps
    (``cosine-ray bench`` reports it per measured run, to tell which part of the price cut the
    trees on a given machine)."""

    request_steps: int = 0
    """Decoding requests scheduled in priced steps, summed over the steps."""
    drained: int = 0
    """Of those, the ones scheduled while the pool drained (their tokens weighted below 1)."""
    held_back: int = 0
    """Of those, the ones given γ_i = 0 before drafting: the guard's level 0 or no node could pay."""


DRAIN_SHARPNESS = 16.0
"""p of the drain price (S_i / S_max)^p: 1 for the request that finishes last, 0.85 one
step in a hundred ahead of it, 0.44 at 5 % ahead, 0.19 at 10 %, 0.03 at 20 %."""


class BatchPolicy(Protocol):
    def decide(self, candidates: Sequence[Candidate], costs: CostModel, config: ScheduleConfig) -> Schedule: ...


class LpBatchPolicy:
    """CoSine's batch scheduler (eq. 5-8): the exact MILP of ``algo.scheduling.lp_schedule``."""

    def decide(self, candidates: Sequence[Candidate], costs: CostModel, config: ScheduleConfig) -> Schedule:
        return schedule_batch(candidates, costs.latency, config)


class FirstComeBatchPolicy:
    """The "LP off" ablation: first come (running, then arrival), up to the batch size."""

    def decide(self, candidates: Sequence[Candidate], costs: CostModel, config: ScheduleConfig) -> Schedule:
        return first_come_batch(candidates, config, config.gamma_max)


class BatchScheduler:
    def __init__(self, config: EngineConfig, pool: RequestPool, policy: BatchPolicy, costs: CostModel, kv: KVBlocks, *,
                 kv_bytes_per_token: int = 0, priced: bool = True, guard: SpeculationGuard | None = None,
                 clock: Callable[[], float] = time.monotonic, skip_unpaying: bool = True,
                 twins: Twins | None = None) -> None:
        self.config = config.scheduler
        """The batch and token budgets, the LP's bounds (``SchedulerConfig``)."""
        spec = config.speculation
        self.gamma_max = spec.num_speculative_tokens
        """γ_max: a request's draft budget per step, unless its drafters match long."""
        self.max_budget = max(spec.long_draft_tokens, self.gamma_max) if self.gamma_max and priced else self.gamma_max
        """The largest budget a request's long matches earn it (``_budget``); γ_max where the
        trees are not priced (the fixed-γ ablations verify their budget whole)."""
        self.pool = pool
        self.kv = kv
        self.policy = policy
        self.costs = costs
        self.kv_bytes_per_token = kv_bytes_per_token
        """KV bytes one token takes on all stages together (m_i of eq. 7)."""
        self.priced = priced
        """Hand the LP's price to TreeSelection (False: the budgets are final)."""
        self.clock = clock
        self.twins = twins if twins is not None else NoTwins()
        """Identical greedy requests: followers wait for, then draft from, their leader."""
        self.tally = PriceTally()
        self.jump_forward = spec.pearl == "off"
        """Grammar-forced tokens join each step's budget (``_force``); PEARL drafts the next tree
        ahead from this one's trunk, which leaves no place for a chain before it."""
        self.pricing = (TreePricing(self, guard, skip_unpaying=skip_unpaying, drain=self.config.drain_pricing)
                        if priced else FixedBudgets())
        """The rule that prices this step's trees, chosen once."""
        self._configs: dict[int, ScheduleConfig] = {}
        """ScheduleConfig per lane size (the step config does not change)."""
        self._peak = 0
        """Running requests at the last admission, or more since: fewer now, and nothing
        waiting, means the pool drains."""
        self.num_preemptions = 0
        """Requests preempted for KV memory."""
        self.num_fair_preemptions = 0
        """Requests preempted so that a tenant below its fair share got in (``_admit``)."""

    @property
    def guard(self) -> SpeculationGuard | None:
        """Speculation level per step (a multiplier on the price; 0 = no drafting); None: none."""
        return getattr(self.pricing, "guard", None)

    @guard.setter
    def guard(self, guard: SpeculationGuard | None) -> None:
        self.pricing.guard = guard

    def schedule(self, lane: int | None) -> StepBatch:
        start = time.perf_counter()
        self._admit()
        now = self.clock()
        requests = self.pool.lane(lane)
        twins = self.twins.plan(self.pool.running.values(), requests, self._budget)
        requests = [r for r in requests if r.request_id not in twins.held]
        if not requests:
            return StepBatch.make_empty()
        budgets = {r.request_id: self._budget(r) for r in requests if not needs_prefill(r)}
        chunks = self._fit_tokens(requests, budgets)
        requests = [r for r in requests if r.request_id in budgets or r.request_id in chunks]
        if not requests:
            return StepBatch.make_empty()
        schedule = self._decide(requests, budgets, chunks, now)
        chosen = set(schedule.batch)
        requests = self._reserve([r for r in requests if r.request_id in chosen], chunks)
        kept = {r.request_id for r in requests}
        budgets = {rid: g for rid, g in budgets.items() if rid in kept}
        chunks = {rid: n for rid, n in chunks.items() if rid in kept}
        twin_drafts = {rid: d for rid, d in twins.drafts.items() if rid in budgets}
        twin_budgets = {rid: budgets[rid] for rid in twin_drafts}
        self._record(requests, budgets, now)
        batch = StepBatch(requests, budgets, started_at=now, twins=twin_drafts, chunks=chunks,
                          epochs={r.request_id: r.kv_epoch for r in requests})
        self.pricing.price(batch, schedule)
        budgets.update(twin_budgets)  # a twin's text is verified whole, at any level or price
        if self.jump_forward:
            self._force(batch)
        self._reserve_trees(batch)
        batch.num_steps = {r.request_id: r.num_decode_steps for r in requests if r.request_id in budgets}
        batch.decision_s = time.perf_counter() - start
        return batch

    # ---- the jobs of a step, in order -------------------------------------------------------
    def _admit(self) -> None:
        """Admit waiting requests in the pool's fair order (``RequestPool.next_waiting``) while
        the running batch has room and the KV pool can hold the next one's whole context (less
        its cached prefix, which it takes) and a token more: its blocks are reserved now. A
        request that does not fit takes nothing and nobody overtakes it: preempted requests
        waiting with their cached prefixes pinned would fill the pool and stall every one. But
        when its tenant runs fewer requests than another (``RequestPool.over_share``), one of
        the other's is preempted for it: resumed later by recomputing its context (mostly
        prefix-cache hits), with the same text. Remember the largest batch since an admission."""
        pool, kv = self.pool, self.kv
        before = len(pool.running)
        while (request := pool.next_waiting()) is not None:
            if len(pool.running) >= self.config.max_num_seqs or not kv.can_fit(kv.blocks_to_admit(request)):
                victims = pool.over_share(request)
                if not victims:
                    break  # it waits for a slot or blocks, holding none, and nobody overtakes it
                self.preempt(victims[0], fair=True)
                continue
            if not request.prefix_looked_up and self._prefix_in_flight(request):
                break  # it takes the blocks from the cache once they are computed
            kv.take_cached_prefix(request)
            kv.ensure(request, request.num_tokens)
            pool.admit(request)
        self._peak = len(pool.running) if len(pool.running) > before else max(self._peak, len(pool.running))

    def _prefix_in_flight(self, request: Request) -> bool:
        """A running request is prefilling at least one full block of ``request``'s prompt that
        is not computed yet (identical prompts: the choices of one API request, a shared
        system prompt): ``request`` waits for it, then takes those blocks from the prefix cache
        instead of computing them too. Nobody overtakes it meanwhile (a step at most per chunk)."""
        kv = self.kv
        if not kv.caching or request.params.prompt_logprobs is not None:
            return False
        prompt = request.prompt_token_ids
        for other in self.pool.running.values():
            if not needs_prefill(other):
                continue
            theirs, shared = other.prompt_token_ids, 0
            limit = min(len(prompt) - 1, len(theirs))
            while shared < limit and prompt[shared] == theirs[shared]:
                shared += 1
            if shared // kv.block_size > other.num_computed_tokens // kv.block_size:
                return True
        return False

    def _fit_tokens(self, requests: Sequence[Request], budgets: dict[str, int]) -> dict[str, int]:
        """The step's token budget: every decode's root and its draft tree first (Algorithm 2
        trims the trees when they do not fit), then prompt chunks in admission order. Returns
        the chunk of each prefilling request that gets one; the others wait."""
        room = self.config.max_num_batched_tokens - len(budgets)
        if sum(budgets.values()) > room:
            budgets.update(trim_gammas(budgets, max(room, 0)))
        room -= sum(budgets.values())
        chunks = {}
        for r in requests:
            if r.request_id in budgets or room <= 0:
                continue
            chunks[r.request_id] = min(r.num_tokens - r.num_computed_tokens, room)
            room -= chunks[r.request_id]
        return chunks

    def _decide(self, requests: Sequence[Request], budgets: dict[str, int], chunks: dict[str, int],
                now: float) -> Schedule:
        """Which of the lane's requests run (the policy: the LP of eq. 5-8, or first come)."""
        candidates = [self._candidate(r, now, budgets.get(r.request_id), chunks.get(r.request_id))
                      for r in requests]
        return self.policy.decide(candidates, self.costs, self._schedule_config(len(requests)))

    def _reserve(self, requests: list[Request], chunks: dict[str, int]) -> list[Request]:
        """KV for each request's committed growth this step (a decode's root, a prompt chunk),
        first come first; when the pool is full, the running request that arrived last (and no
        step is working on) is preempted, possibly the one asking. Returns the requests that run."""
        kept = []
        for r in sorted(requests, key=lambda r: r.arrival_time):
            if r.status is not RequestStatus.RUNNING:  # preempted for an earlier one
                continue
            need = r.num_computed_tokens + chunks.get(r.request_id, 1)
            while not self.kv.ensure(r, need):
                victim = self._last_arrived()
                if victim is None:  # every other request is in another lane's step: this one waits
                    break
                self.preempt(victim)
                if victim is r:
                    break
            else:
                kept.append(r)
        kept = {r.request_id for r in kept if r.status is RequestStatus.RUNNING}
        return [r for r in requests if r.request_id in kept]

    def _last_arrived(self) -> Request | None:
        """The running request that arrived last among those no step is working on, of the
        tenant that runs the most requests (the memory goes to the others' first)."""
        running = self.pool.running.values()
        tenants = Counter(r.tenant.name for r in running)
        candidates = [r for r in running if not r.num_in_flight]
        return max(candidates, key=lambda r: (tenants[r.tenant.name], r.arrival_time), default=None)

    def preempt(self, request: Request, *, fair: bool = False) -> None:
        """Free the request's KV and send it back to the queue; it resumes with the same text.
        ``fair``: for another tenant's share, not for memory."""
        self.kv.free(request)
        self.pool.preempt(request)
        if fair:
            self.num_fair_preemptions += 1
        else:
            self.num_preemptions += 1

    @staticmethod
    def _force(batch: StepBatch) -> None:
        """The tokens each decoding request's grammar forces next join its budget, ahead of
        what the price gave the drafters: they are accepted for certain, at the cost of a
        verified row each (within the tokens it has left)."""
        for r in batch.decodes:
            rid = r.request_id
            if r.grammar is None or rid in batch.twins:
                continue
            left = r.params.max_tokens - len(r.output_token_ids) - 1
            forced = forced_tokens(r, min(left, MAX_FORCED_TOKENS))
            if forced:
                batch.forced[rid] = forced
                batch.budgets[rid] = min(batch.budgets[rid] + len(forced), left)

    def _reserve_trees(self, batch: StepBatch) -> None:
        """KV slots for the draft trees (root + γ_i); a tree the pool cannot hold is not drafted."""
        for r in batch.decodes:
            gamma = batch.budgets[r.request_id]
            if gamma and not self.kv.ensure(r, r.num_computed_tokens + 1 + gamma):
                batch.budgets[r.request_id] = 0
                batch.twins.pop(r.request_id, None)
                batch.forced.pop(r.request_id, None)

    def _schedule_config(self, size: int) -> ScheduleConfig:
        config = self._configs.get(size)
        if config is None:
            cfg = self.config
            config = self._configs[size] = ScheduleConfig(
                max_batch_size=size, gamma_max=self.gamma_max, total_gamma_max=cfg.total_gamma_max,
                t_max_s=cfg.step_time_max_s, kv_budget_bytes=cfg.kv_budget_bytes)
        return config

    @staticmethod
    def _record(requests: Sequence[Request], budgets: dict[str, int], now: float) -> None:
        """What the chosen requests remember of being scheduled (their state on the request)."""
        for r in requests:
            if r.request_id in budgets:
                r.num_decode_steps += 1
            r.last_scheduled_at = now
            r.holds_kv = True

    def drain_weights(self) -> dict[str, float]:
        """While the pool drains, what an accepted token of each decoding request is worth:
        (S_i / S_max)^p, S_i = the request's tokens left over its measured tokens per step.
        Empty (all worth 1) while requests wait or the batch is as full as at the last
        admission (docs/scheduling.md)."""
        pool = self.pool
        if pool.waiting or len(pool.running) >= self._peak:
            return {}
        left = {}
        for rid, r in pool.running.items():
            if needs_prefill(r):
                continue
            steps = r.num_decode_steps
            rate = max((len(r.output_token_ids) - 1) / steps, 1.0) if steps else 1.0
            left[rid] = max(r.params.max_tokens - len(r.output_token_ids), 0) / rate
        last = max(left.values(), default=0.0)
        if last <= 0:
            return {}
        return {rid: (s / last) ** DRAIN_SHARPNESS for rid, s in left.items()}

    def _budget(self, request: Request) -> int:
        """Draft tokens the request's tree may have: twice its last tree's depth, within
        [γ_max, ``max_budget``], and never more than it has tokens left. A tree filled to its
        budget doubles the next one (the drafters had more to say), so a long match reaches
        the cap in a few steps; a short one brings the budget back to γ_max."""
        left = request.params.max_tokens - len(request.output_token_ids) - 1
        budget = min(max(self.gamma_max, 2 * request.draft_depth), self.max_budget)
        return max(min(budget, left), 0)

    def _candidate(self, request: Request, now: float, budget: int | None, chunk: int | None) -> Candidate:
        rid = request.request_id
        reserved = (len(request.prompt_token_ids) + request.params.max_tokens) * self.kv_bytes_per_token
        if budget is None:  # a prompt chunk: a new or resumed request, or a long prompt's next part
            since = request.last_scheduled_at if request.last_scheduled_at is not None else request.arrival_time
            return Candidate(rid, request.num_computed_tokens, reserved, (0.0,), running=request.holds_kv,
                             waited_s=max(now - since, 0.0), prefill_tokens=chunk)
        since = request.last_scheduled_at if request.last_scheduled_at is not None else now
        return Candidate(rid, request.num_tokens, reserved, predicted_gains(request, budget), running=True,
                         waited_s=max(now - since, 0.0))


class FixedBudgets:
    """Unpriced trees (the fixed-cut and fixed-γ policies): the budgets are final."""

    def price(self, batch: StepBatch, schedule: Schedule) -> None:
        return None


class TreePricing:
    """The LP's price for TreeSelection (eq. 8's λ over the guard's measured goodput, the
    token slope this batch size's steps measure), the drain weights, and no drafting where
    no node could pay; ``tally`` counts what it did."""

    def __init__(self, scheduler: BatchScheduler, guard: SpeculationGuard | None, *, skip_unpaying: bool,
                 drain: bool) -> None:
        self.scheduler = scheduler
        self.guard = guard
        self.skip_unpaying = skip_unpaying
        """Give γ_i = 0 before drafting where no node could pay (PEARL drafts anyway)."""
        self.drain = drain

    def price(self, batch: StepBatch, schedule: Schedule) -> None:
        budgets, requests = batch.budgets, batch.requests
        if not budgets:
            return
        offered = [rid for rid, g in budgets.items() if g]  # before the level and the pay test (tally)
        lam, kappa = schedule.lam, 1.0
        if self.guard is not None:
            lam /= self.guard.operating_goodput(len(requests))
            batch.level = self.guard.choose(len(requests))
            kappa = self.guard.levels[batch.level]
            if kappa == 0.0:  # speculation off for this step: nobody drafts
                budgets.update(dict.fromkeys(budgets, 0))
        batch.price = self._tree_price(requests, budgets, lam * kappa)
        batch.weights = self.scheduler.drain_weights() if self.drain else {}
        if self.skip_unpaying:
            self._hold_back_unpaying(batch)
        tally = self.scheduler.tally
        tally.request_steps += len(budgets)
        tally.drained += sum(1 for rid in budgets if rid in batch.weights)
        tally.held_back += sum(1 for rid in offered if not budgets[rid])

    def _tree_price(self, requests: Sequence[Request], budgets: dict[str, int], lam: float) -> TreePrice:
        costs = self.scheduler.costs
        latency = costs.latency
        base_tokens = sum(1 if r.request_id in budgets else r.num_tokens for r in requests)
        slope = costs.token_slope(len(requests)) if len(budgets) == len(requests) else None
        # the slope this batch size's tree steps measure, else the fit's convex token cost
        c_tok, c_knee, knee = (latency.c_tok, latency.c_knee, latency.knee_tokens) if slope is None \
            else (slope, 0.0, 0)
        return TreePrice(lam, len(requests), c_tok, latency.c_attn, c_knee, knee, base_tokens)

    @staticmethod
    def _hold_back_unpaying(batch: StepBatch) -> None:
        """γ_i = 0 before drafting for a request whose first node could not pay even if it were
        accepted for certain, except on its probe steps (calibration keeps measuring)."""
        for r in batch.requests:
            rid = r.request_id
            if batch.budgets.get(rid) and r.num_decode_steps % PROBE_EVERY \
                    and not batch.price.node_can_pay(r.num_tokens, batch.weights.get(rid, 1.0)):
                batch.budgets[rid] = 0
