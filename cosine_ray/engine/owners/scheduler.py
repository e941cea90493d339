"""The batch scheduler: which requests run this step, which waiting ones are admitted, and
the price TreeSelection applies to each drafted tree (CoSine eq. 5-8, Algorithm 2).

One owner for the request pool's scheduling. Per step (one lane's micro-batch):

1. **Admission** into the running batch is first come while it has room, each request into
   the least loaded lane (``RequestPool.admit``), so S stages get S equal micro-batches.
2. **Candidates** (``algo.lp_schedule.Candidate``): the lane's requests — decoding ones with
   their context, KV bytes and *predicted* expected-gain curve (``GainModel``: the calibrated
   curve of their last tree), and ones that must prefill: an admitted request that holds no KV
   yet is a *waiting* candidate of eq. 7 (its prefill tokens, and the KV bytes it will hold:
   prompt + max_tokens, reserved so an admitted request can always finish); a restore after a
   lost stage is a running one.
3. **Decision** by the policy chosen at construction: the LP (``LpBatchPolicy``: eq. 5-8
   solved exactly, ``algo.lp_schedule.schedule_batch``) or first come (``FirstComeBatchPolicy``,
   the "LP off" ablation). The KV budget M_max (``StepConfig.kv_budget_bytes``) and T_max
   decide how many prefills one step takes; a deferred prefill waits in its lane.
4. **Draft budgets** γ_i ≤ min(γ_max, tokens left − 1) for the decoding requests, and for the
   LP the **price** (λ of eq. 8 and the marginal verify cost): once the batch is fixed,
   TreeSelection picks the γ_i on the drafted trees themselves
   (``algo.tree_selection.TreePrice``) — the same optimum the LP would find with the trees'
   gains, without waiting for the trees to decide the batch. The price carries the latency
   model's convex token cost (its knee) and the step's tokens before drafting, so a node pays
   the slope at the step's real size: cheap while the forward is below the knee, dear above.
   The LP's λ = T0/b² values an accepted token at the time per token of *plain* decoding (its
   first-order expansion around γ = 0); where speculation already pays, a token is worth only the time per token at the
   operating point, T/(b + A) = (T0/b)/G, G being the measured goodput of the guard's level
   (tokens per plain-step unit of time, ``SpeculationGuard.operating_goodput``, never below 1).
   So the price is λ/G: a node is drafted when it lowers time per token where the step really
   runs (Dinkelbach's condition for a ratio), not where it would run without speculation.
   With λ alone, the trees were too big under load: at c=8 on 2 threads CoSine drafted γ_i 2.1
   per request against first come's 1.4 and spent 4.5 % more verify time in all, in 3 % fewer steps.
   The guard (``algo.guard``) then scales the price per step by a learned speculation level
   (0 = this step drafts nothing), so speculation never costs more than it measurably gains.
   A node's token cost is the slope this batch size's recent tree steps measure
   (``CostModel.token_slope``) once there is one, else the fit's: the fit, pulled by prefills
   and single-request steps, priced a token at c=8 on our CPU 20-30 % below what the steps
   measured, and the price verified long shots that did not pay.
5. **The drain price** (``StepConfig.drain_pricing``, on by default). A token is worth the time
   per token only while finishing a request early lets another one in. When nothing waits and
   fewer requests run than at the last admission, the pool is draining (the end of a batch
   job, or of a burst): the requests left finish when the slowest of them does, and a step
   costs the same fixed time however few run. So an early finish buys nothing, and a node that
   gets a request ahead of the last one still costs verify time for everyone. Each decoding
   request's expected accepted tokens are then weighted by (S_i / S_max)^16, S_i its tokens
   left (up to ``max_tokens``) over its measured tokens per step: the last to finish drafts at
   the full price, a request 10 % ahead of it at a fifth, one 20 % ahead hardly at all. The
   drain ends at the next admission. Measured on our CPU (16 held-back prompts, 64 tokens,
   interleaved; docs/measurements.md): with it full CoSine was ahead of itself without it at
   c=8 and c=16 on 1 and 2 threads, by 1–5 %.
6. **No drafting that cannot pay.** Once the price and the drain weights are known, a
   request whose first draft node could not pay even if it were accepted for certain
   (``TreePrice.node_can_pay``) gets γ_i = 0 *before* the drafters are asked: TreeSelection
   would choose 0 nodes anyway, so routing, drafting, fusion and its share of learning were
   host time spent for nothing. Its probe steps (``PROBE_EVERY``) still draft, so calibration
   keeps measuring its drafters (skipping them where the drain weight alone rules the node
   out measured within noise: 1.04× against 1.03× at c=16 on 1 thread, 0.96× against 0.98× on
   2). PEARL, which drafts while the target verifies, keeps drafting (``skip_unpaying``). At
   c=16 on 2 threads, where the drain weights leave most requests worth next to nothing, full
   CoSine went from 0.92× to 0.99× of speculation off with this (interleaved A/B,
   docs/measurements.md).

NOTE(scheduler): the paper's order — batch assignment before drafting (Algorithm 2) — needs
gains before the trees exist; the last tree's curve predicts them. Only the batch decision
uses the prediction; γ_i uses the real tree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from cosine_ray.algo.guard import SpeculationGuard
from cosine_ray.algo.lp_schedule import Candidate, Schedule, ScheduleConfig, first_come_batch, schedule_batch
from cosine_ray.algo.tree_selection import TreePrice
from cosine_ray.engine.config import StepConfig
from cosine_ray.engine.owners.economics import CostModel, GainModel
from cosine_ray.engine.owners.pool import RequestPool
from cosine_ray.engine.request import Request, needs_prefill
from cosine_ray.engine.modes.twins import Twins
from cosine_ray.engine.types import StepBatch


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


PROBE_EVERY = 8
"""A request priced at γ = 0 still drafts and verifies one node every this many steps
(``engine.owners.speculator.PricedSelection``), so calibration keeps measuring its drafters and
speculation can come back."""

DRAIN_SHARPNESS = 16.0
"""p of the drain price (S_i / S_max)^p: 1 for the request that finishes last, 0.85 one
step in a hundred ahead of it, 0.44 at 5 % ahead, 0.19 at 10 %, 0.03 at 20 %."""


class BatchPolicy(Protocol):
    def decide(self, candidates: Sequence[Candidate], costs: CostModel, config: ScheduleConfig) -> Schedule: ...


class LpBatchPolicy:
    """CoSine's batch scheduler (eq. 5-8): the exact MILP of ``algo.lp_schedule``."""

    def decide(self, candidates: Sequence[Candidate], costs: CostModel, config: ScheduleConfig) -> Schedule:
        return schedule_batch(candidates, costs.latency, config)


class FirstComeBatchPolicy:
    """The "LP off" ablation: first come (running, then arrival), up to the batch size."""

    def decide(self, candidates: Sequence[Candidate], costs: CostModel, config: ScheduleConfig) -> Schedule:
        return first_come_batch(candidates, config, config.gamma_max)


class BatchScheduler:
    def __init__(self, config: StepConfig, pool: RequestPool, policy: BatchPolicy, costs: CostModel,
                 gains: GainModel, *, kv_bytes_per_token: int = 0, priced: bool = True,
                 guard: SpeculationGuard | None = None, clock: Callable[[], float] = time.monotonic,
                 skip_unpaying: bool = True, twins: Twins | None = None) -> None:
        self.config = config
        self.pool = pool
        self.policy = policy
        self.costs = costs
        self.gains = gains
        self.kv_bytes_per_token = kv_bytes_per_token
        """KV bytes one token takes on all stages together (m_i of eq. 7)."""
        self.priced = priced
        """Hand the LP's price to TreeSelection (False: the budgets are final)."""
        self.guard = guard
        """Speculation level per step (a multiplier on the price; 0 = no drafting)."""
        self.clock = clock
        self.skip_unpaying = skip_unpaying
        """Give γ_i = 0 before drafting where no node could pay (point 6 above)."""
        self.twins = twins
        """Identical greedy requests: followers wait for, then draft from, their leader."""
        self._last_step: dict[str, float] = {}
        self._num_steps: dict[str, int] = {}
        self._holds_kv: set[str] = set()
        """Requests scheduled at least once: their KV counts against M_max whether they run or not."""
        self._configs: dict[int, ScheduleConfig] = {}
        """ScheduleConfig per lane size (the step config does not change)."""
        self._peak = 0
        """Running requests at the last admission, or more since: fewer now, and nothing
        waiting, means the pool drains."""
        self.tally = PriceTally()

    def schedule(self, lane: int | None) -> StepBatch:
        start = time.perf_counter()
        pool, cfg = self.pool, self.config
        before = len(pool.running)
        pool.admit()
        self._peak = len(pool.running) if len(pool.running) > before else max(self._peak, len(pool.running))
        now = self.clock()
        requests = pool.lane(lane)
        twins = self.twins.plan(pool.running.values(), requests, self._budget) if self.twins is not None else None
        if twins is not None and twins.held:
            requests = [r for r in requests if r.request_id not in twins.held]
        if not requests:
            return StepBatch.make_empty()
        budgets = {r.request_id: self._budget(r) for r in requests if not needs_prefill(r)}
        candidates = [self._candidate(r, now, budgets.get(r.request_id)) for r in requests]
        sched_config = self._configs.get(len(requests))
        if sched_config is None:
            sched_config = self._configs[len(requests)] = ScheduleConfig(
                max_batch_size=len(requests), gamma_max=cfg.num_speculative_tokens, total_gamma_max=cfg.total_gamma_max,
                t_max_s=cfg.step_time_max_s, kv_budget_bytes=cfg.kv_budget_bytes)
        schedule = self.policy.decide(candidates, self.costs, sched_config)
        chosen = set(schedule.batch)
        requests = [r for r in requests if r.request_id in chosen]
        budgets = {rid: g for rid, g in budgets.items() if rid in chosen}
        twin_drafts = {rid: d for rid, d in twins.drafts.items() if rid in budgets} if twins is not None else {}
        twin_budgets = {rid: budgets[rid] for rid in twin_drafts}
        for rid in budgets:
            self._num_steps[rid] = self._num_steps.get(rid, 0) + 1
        for r in requests:
            self._last_step[r.request_id] = now
            self._holds_kv.add(r.request_id)
        price, level = None, None
        if self.priced and budgets:
            offered = [rid for rid, g in budgets.items() if g]  # before the level and the pay test (tally)
            latency = self.costs.latency
            lam, kappa = schedule.lam, 1.0
            if self.guard is not None:
                lam /= self.guard.operating_goodput(len(requests))
                level = self.guard.choose(len(requests))
                kappa = self.guard.levels[level]
                if kappa == 0.0:  # speculation off for this step: nobody drafts
                    budgets = dict.fromkeys(budgets, 0)
            base_tokens = sum(1 if r.request_id in budgets else r.num_tokens for r in requests)
            slope = self.costs.token_slope(len(requests)) if len(budgets) == len(requests) else None
            # the slope this batch size's tree steps measure (point 4 above), else the fit's convex token cost
            c_tok, c_knee, knee = (latency.c_tok, latency.c_knee, latency.knee_tokens) if slope is None \
                else (slope, 0.0, 0)
            price = TreePrice(lam * kappa, len(requests), c_tok, latency.c_attn, c_knee, knee, base_tokens)
        weights = self._drain_weights() if price is not None and cfg.drain_pricing else {}
        if price is not None and self.skip_unpaying:  # no drafting where no node could pay: host time saved
            for r in requests:
                rid = r.request_id
                if budgets.get(rid) and self._num_steps[rid] % PROBE_EVERY \
                        and not price.node_can_pay(r.num_tokens, weights.get(rid, 1.0)):
                    budgets[rid] = 0
        if price is not None:
            tally = self.tally
            tally.request_steps += len(budgets)
            tally.drained += sum(1 for rid in budgets if rid in weights)
            tally.held_back += sum(1 for rid in offered if not budgets[rid])
        budgets.update(twin_budgets)  # a twin's text is verified whole, at any level or price
        return StepBatch(requests, budgets, price, {rid: self._num_steps[rid] for rid in budgets},
                         time.perf_counter() - start, level, now, weights, twin_drafts)

    def _drain_weights(self) -> dict[str, float]:
        """While the pool drains, what an accepted token of each decoding request is worth
        (module docstring): (S_i / S_max)^p, S_i = the request's tokens left over its measured
        tokens per step. Empty (all worth 1) while requests wait or the batch is as full as
        at the last admission."""
        pool = self.pool
        if pool.waiting or len(pool.running) >= self._peak:
            return {}
        left = {}
        for rid, r in pool.running.items():
            if needs_prefill(r):
                continue
            steps = self._num_steps.get(rid, 0)
            rate = max((len(r.output_token_ids) - 1) / steps, 1.0) if steps else 1.0
            left[rid] = max(r.params.max_tokens - len(r.output_token_ids), 0) / rate
        last = max(left.values(), default=0.0)
        if last <= 0:
            return {}
        return {rid: (s / last) ** DRAIN_SHARPNESS for rid, s in left.items()}

    @property
    def num_tracked_requests(self) -> int:
        return len(self._last_step.keys() | self._num_steps.keys() | self._holds_kv) \
            + (self.twins.num_tracked if self.twins is not None else 0)

    def forget(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._last_step.pop(rid, None)
            self._num_steps.pop(rid, None)
            self._holds_kv.discard(rid)
        if self.twins is not None:
            self.twins.forget(request_ids)

    def _budget(self, request: Request) -> int:
        left = request.params.max_tokens - len(request.output_token_ids) - 1
        return max(min(self.config.num_speculative_tokens, left), 0)

    def _candidate(self, request: Request, now: float, budget: int | None) -> Candidate:
        rid = request.request_id
        reserved = (len(request.prompt_token_ids) + request.params.max_tokens) * self.kv_bytes_per_token
        if budget is None:  # a prefill: an admitted request that holds no KV yet, or a restore
            since = self._last_step.get(rid, request.arrival_time)
            return Candidate(rid, 0, reserved, (0.0,), running=rid in self._holds_kv,
                             waited_s=max(now - since, 0.0), prefill_tokens=request.num_tokens)
        return Candidate(rid, request.num_tokens, reserved, self.gains.predict(rid, budget), running=True,
                         waited_s=max(now - self._last_step.get(rid, now), 0.0))
