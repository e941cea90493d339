"""CoSine's speculation plan for one step: route → draft (fuse) → select → schedule, then learn.

The router's step loop asks ``SpeculationPlanner.plan`` for the draft tree of every decoding
request in the micro-batch and gets back which requests run this step and their trees:

1. **route** (eq. 1-3, ``algo.routing``): k drafters per request by its routing scores,
   exploring when the last step accepted little; k is the adaptive participation;
2. **draft**: one call per drafter per fusion round for all its requests; the answers are
   fused by calibrated confidence (eq. 4, ``algo.fusion``), or — ablations — the single
   best drafter proposes alone (``fusion="single"``) or all routed drafters' whole paths are
   merged (``fusion="union"``);
3. **select** (TreeSelection): each request's tree keeps its best nodes by cumulative
   calibrated confidence, which is each node's chance of being accepted;
4. **schedule** (eq. 5-8 + Algorithm 2, ``algo.lp_schedule``): the LP picks the requests of
   the step and each γ_i from the trees' expected-gain curves and the measured latency
   model; γ_i = 0 turns speculation off for a request whose drafts do not pay for their
   verify time. ``scheduler="fcfs"`` (LP off) takes requests first come with the fixed
   confidence cut; ``adaptive=False`` verifies a fixed γ whatever the confidences.

After verification ``learn`` updates confidence calibration, routing scores (eq. 1-2) and the
metrics; ``observe_verify`` feeds the latency model and the participation controller.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

import torch

from cosine_ray.algo.adaptive import ParticipationController, expected_gains
from cosine_ray.algo.calibration import ConfidenceCalibrator
from cosine_ray.algo.domains import DomainClassifier
from cosine_ray.algo.fusion import FusionState
from cosine_ray.algo.latency_model import LatencyModel, LlmSample
from cosine_ray.algo.lp_schedule import Candidate, ScheduleConfig, first_come_batch, schedule_batch, trim_gammas
from cosine_ray.algo.routing import ExpertiseRouter, RoutingConfig, routing_score, verification_accuracy
from cosine_ray.algo.verify import VerifyResult
from cosine_ray.engine.drafters.base import DraftInput
from cosine_ray.engine.request import Request
from cosine_ray.engine.speculation import (DrafterClient, SelectedTree, SpeculationStats, build_tree, fuse_drafts,
                                           gather_proposals, proposals_to_paths)
from cosine_ray.metrics.registry import MetricsRegistry

if TYPE_CHECKING:
    from cosine_ray.engine.router import RouterConfig

FUSION_MIN_CUMULATIVE = 0.02
"""Fusion stops growing a trunk (and drops branches) below this cumulative confidence when
the scheduler decides γ: such nodes never pay for their verify slot on any hardware we have."""


PROBE_EVERY = 8
"""A request the scheduler keeps at γ = 0 still verifies one draft node every this many
steps, so calibration keeps measuring its drafters and speculation can come back."""
REFIT_EVERY = 16
LIVE_SAMPLES = 256


@dataclass(slots=True)
class Plan:
    """One request's speculation for this step."""

    selected: SelectedTree
    drafters: tuple[str, ...]
    """Drafters routed to it, best-scoring first."""
    answers: dict[str, list[tuple[int | None, float]]]
    """Per drafter, per depth: its token after the fused prefix and raw confidence (eq. 1-2)."""
    trunk: tuple[int, ...] = ()
    """The fused trunk's tokens (fusion mode), to count fusion picks."""


@dataclass(slots=True)
class _VerifierClock:
    """Busy vs idle time of the verifier as the router sees it (score calls in flight)."""

    clock: Callable[[], float]
    inflight: int = 0
    busy_s: float = 0.0
    since: float = 0.0
    window_start: float = field(default=0.0)

    def begin(self) -> None:
        if self.inflight == 0:
            self.since = self.clock()
        self.inflight += 1

    def end(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self.busy_s += self.clock() - self.since

    def idle_fraction(self) -> float:
        """Idle share since the last call (then starts a new window)."""
        now = self.clock()
        busy = self.busy_s + (now - self.since if self.inflight else 0.0)
        elapsed = now - self.window_start
        self.busy_s, self.window_start = 0.0, now
        if self.inflight:
            self.since = now
        return 0.0 if elapsed <= 0 else min(max(1.0 - busy / elapsed, 0.0), 1.0)


class SpeculationPlanner:
    def __init__(self, config: "RouterConfig", drafters: Sequence[DrafterClient], *, vocab_size: int,
                 metrics: MetricsRegistry, stats: SpeculationStats, clock: Callable[[], float] = time.monotonic,
                 unit_embeddings: torch.Tensor | None = None, domain_classifier: DomainClassifier | None = None,
                 latency_model: LatencyModel | None = None, seed: int | None = 0) -> None:
        self.config = config
        self.clients: dict[str, DrafterClient] = {d.name: d for d in drafters}
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.stats = stats
        self.clock = clock
        self.unit_embeddings = unit_embeddings
        self.domain_classifier = domain_classifier
        self.latency_model = latency_model or LatencyModel.default()
        self._base_model = self.latency_model
        self._live: deque[LlmSample] = deque(maxlen=LIVE_SAMPLES)
        self._since_refit = 0
        # Shared (domain-agnostic) drafters join every request; routing chooses among the rest.
        # With fusion off ("the single best drafter") every drafter competes for the one slot.
        shared = set(config.shared_drafters) if config.fusion != "single" else set()
        self.shared = tuple(n for n in self.clients if n in shared)
        pool = [n for n in self.clients if n not in shared]
        self.routing = ExpertiseRouter(pool, RoutingConfig(
            drafters_per_request=config.drafters_per_request,
            mode="random" if config.routing == "random" else "expertise"), seed=seed)
        self.calibrator = ConfidenceCalibrator()
        self.participation = ParticipationController(
            min_drafters=1, max_drafters=max(config.max_drafters_per_request, config.drafters_per_request),
            initial=config.drafters_per_request)
        self.verifier = _VerifierClock(clock, window_start=clock())
        self._last_step: dict[str, float] = {}
        self._steps: dict[str, int] = {}
        self._trimmed_fraction = 0.0
        self.metrics.set("cosine_ray:drafter_participation", self.participation.current)

    # ---- request lifecycle --------------------------------------------------------------
    def start(self, request: Request) -> None:
        if self.domain_classifier is not None:
            request.domain = self.domain_classifier.classify(request.prompt_token_ids)[0]
        self.routing.start(request.request_id, request.domain)
        self._last_step[request.request_id] = self.clock()

    def finish(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            if rid in self._last_step:
                domain = self.routing.domain_of(rid)
                self.routing.finish(rid)
                del self._last_step[rid]
                self._steps.pop(rid, None)
                for name, score in self.routing.prior(domain).items():
                    self.metrics.set("cosine_ray:routing_score", score, drafter=name, domain=domain)

    @property
    def drafters_per_request(self) -> int:
        if self.config.fusion == "single":
            return 1
        return self.participation.current if self.config.adaptive else self.config.drafters_per_request

    # ---- plan ---------------------------------------------------------------------------
    async def plan(self, requests: Sequence[Request], live: Callable[[str], bool] | None = None) -> dict[str, Plan]:
        """Trees for the requests that run this step (a request absent from the result sits
        this step out: the scheduler left it for the next one). ``live(request_id)`` turns
        false for a request aborted while drafting: it gets no further drafter calls."""
        if not requests:
            return {}
        cfg = self.config
        budgets = {r.request_id: max(min(cfg.num_speculative_tokens, r.params.max_tokens - len(r.output_token_ids) - 1), 0)
                   for r in requests}
        drafting = [r for r in requests if budgets[r.request_id] > 0 and self.clients]
        choices = self.routing.choose([r.request_id for r in drafting], k=self.drafters_per_request)
        routed: dict[str, tuple[str, ...]] = {}
        for r in drafting:
            choice = choices[r.request_id]
            scores = self.routing.scores(r.request_id)
            routed[r.request_id] = tuple(sorted(choice.drafters, key=lambda n: -scores.get(n, 0.0))) + self.shared
            r.stats.num_routed_steps += 1
            for name in routed[r.request_id]:
                mode = "shared" if name in self.shared else choice.mode
                self.metrics.inc("cosine_ray:routing_decisions", drafter=name, mode=mode, domain=r.domain)
                r.stats.routed_to[name] = r.stats.routed_to.get(name, 0) + 1
        cut = self._confidence_cut()
        paths, answers, trunks = await self._draft(drafting, routed, budgets, cut, live)
        plans = {}
        for r in requests:
            rid = r.request_id
            selected = build_tree(r.output_token_ids[-1], paths.get(rid, []), budgets[rid], min_confidence=cut)
            plans[rid] = Plan(selected, routed.get(rid, ()), answers.get(rid, {}), trunks.get(rid, ()))
        return self._schedule(requests, plans, budgets, paths)

    def _confidence_cut(self) -> float:
        if not self.config.adaptive:
            return 0.0  # fixed γ: verify whatever was drafted, up to γ
        if self.config.scheduler == "fcfs":
            return self.config.min_tree_confidence  # LP off: the fixed cut decides the tree size
        return FUSION_MIN_CUMULATIVE

    async def _draft(self, drafting: Sequence[Request], routed: Mapping[str, tuple[str, ...]],
                     budgets: Mapping[str, int], cut: float, live: Callable[[str], bool] | None):
        paths: dict[str, list] = {}
        answers: dict[str, dict[str, list[tuple[int | None, float]]]] = {}
        trunks: dict[str, tuple[int, ...]] = {}
        if not drafting:
            return paths, answers, trunks
        deadline = self.config.drafter_deadline_s
        if self.config.fusion == "confidence":
            states = {r.request_id: FusionState(routed[r.request_id], budgets[r.request_id], cut,
                                                self._calibration_for(r.domain)) for r in drafting}
            await fuse_drafts(self.clients, states, {r.request_id: r.context_token_ids for r in drafting},
                              deadline_s=deadline, vocab_size=self.vocab_size, stats=self.stats, live=live)
            for rid, state in states.items():
                paths[rid] = state.paths()
                answers[rid] = state.answers
                trunks[rid] = tuple(state.trunk)
            return paths, answers, trunks
        batches: dict[str, list[DraftInput]] = {}
        for r in drafting:
            for name in routed[r.request_id]:
                batches.setdefault(name, []).append(
                    DraftInput(r.request_id, tuple(r.context_token_ids), budgets[r.request_id]))
        proposals = await gather_proposals(self.clients, batches, deadline_s=deadline,
                                           vocab_size=self.vocab_size, stats=self.stats)
        for r in drafting:
            props = proposals.get(r.request_id, [])
            paths[r.request_id] = proposals_to_paths(props, self._calibration_for(r.domain))
            own: dict[str, list[tuple[int | None, float]]] = {}
            for p in props:  # a drafter's first path is its own best guess per depth
                if p.paths and p.drafter not in own:
                    own[p.drafter] = list(zip(p.paths[0], p.confidences[0]))
            answers[r.request_id] = own
        return paths, answers, trunks

    def _calibration_for(self, domain: str) -> Callable[[str, float], float]:
        """Confidence calibration per (drafter, domain): a retrieval drafter is reliable on
        its own domain and not elsewhere, whatever its raw confidence says."""
        return lambda drafter, confidence: self.calibrator.calibrate(f"{drafter}@{domain}", confidence)

    def _schedule(self, requests: Sequence[Request], plans: dict[str, Plan], budgets: Mapping[str, int],
                  paths: Mapping[str, list]) -> dict[str, Plan]:
        cfg = self.config
        now = self.clock()
        start = time.perf_counter()
        candidates = [Candidate(
            request_id=r.request_id, context_len=r.num_tokens, kv_bytes=0,
            gains=expected_gains(plans[r.request_id].selected.node_acceptance(), budgets[r.request_id]),
            running=True, waited_s=max(now - self._last_step.get(r.request_id, now), 0.0)) for r in requests]
        sched_config = ScheduleConfig(max_batch_size=cfg.max_batch_size, gamma_max=cfg.num_speculative_tokens,
                                      total_gamma_max=cfg.total_gamma_max, t_max_s=cfg.step_time_max_s)
        if cfg.scheduler == "lp":
            schedule = schedule_batch(candidates, self.latency_model, sched_config)
        else:
            schedule = first_come_batch(candidates, sched_config, cfg.num_speculative_tokens)
        gammas = dict(schedule.gamma)
        if not cfg.adaptive:  # fixed γ (Algorithm 2 still trims the batch to Γ_max)
            gammas = trim_gammas({rid: budgets[rid] for rid in schedule.batch}, cfg.total_gamma_max)
        decision_s = time.perf_counter() - start
        drafted = sum(plans[rid].selected.tree.num_draft_tokens for rid in plans)
        out = {}
        for rid in schedule.batch:
            plan = plans[rid]
            gamma = gammas.get(rid, 0)
            self._steps[rid] = self._steps.get(rid, 0) + 1
            if gamma == 0 and cfg.adaptive and self._steps[rid] % PROBE_EVERY == 0:
                gamma = min(1, plan.selected.tree.num_draft_tokens)  # probe
            if gamma < plan.selected.tree.num_draft_tokens:
                root = plan.selected.tree.token_ids[0]
                plan.selected = build_tree(root, paths.get(rid, []), gamma, min_confidence=self._confidence_cut())
            out[rid] = plan
            self._last_step[rid] = now
        total_gamma = sum(p.selected.tree.num_draft_tokens for p in out.values())
        self._trimmed_fraction = 0.0 if drafted == 0 else 1.0 - total_gamma / drafted
        m = self.metrics
        m.observe("cosine_ray:scheduler_decision_seconds", decision_s)
        m.observe("cosine_ray:scheduler_batch_size", len(out))
        m.observe("cosine_ray:scheduler_total_gamma", total_gamma)
        for p in out.values():
            m.observe("cosine_ray:scheduler_gamma", p.selected.tree.num_draft_tokens)
        m.set("cosine_ray:speculation_enabled", 1.0 if total_gamma > 0 else 0.0)
        return out

    # ---- learn --------------------------------------------------------------------------
    def observe_verify(self, context_lens: Sequence[int], num_new_tokens: Sequence[int], seconds: float) -> None:
        """One verify forward's shape and time, and a participation tick.

        The latency model is refitted every ``REFIT_EVERY`` steps from its base samples (the
        profile) plus the last ``LIVE_SAMPLES`` live ones, so the LP follows the machine's
        real speed (other load, thermal limits) rather than the start-up profile alone."""
        self._live.append(LlmSample(tuple(context_lens), tuple(num_new_tokens), seconds))
        self._since_refit += 1
        if self._since_refit >= REFIT_EVERY:
            self._since_refit = 0
            base = self._base_model
            self.latency_model = LatencyModel.fit(
                list(base.llm_samples) + list(self._live), base.ssm_samples, model_name=base.model_name,
                device=base.device, dtype=base.dtype, num_stages=base.num_stages, num_threads=base.num_threads)
        if self.config.adaptive and self.config.fusion != "single":
            k = self.participation.observe(self.verifier.idle_fraction(), self._trimmed_fraction)
            self.metrics.set("cosine_ray:drafter_participation", k)

    def learn(self, request: Request, plan: Plan, result: VerifyResult) -> None:
        tree, owners, raws = plan.selected.tree, plan.selected.owners, plan.selected.raw_confidences
        accepted = set(result.accepted_node_ids)
        reachable = {0} | accepted
        m, domain = self.metrics, request.domain
        if tree.num_draft_tokens:
            m.inc("cosine_ray:spec_decode_num_drafts", domain=domain)
        for node in range(1, tree.num_nodes):
            m.inc("cosine_ray:spec_decode_num_draft_tokens", drafter=owners[node], domain=domain)
            if node in accepted:
                m.inc("cosine_ray:spec_decode_num_accepted_tokens", drafter=owners[node], domain=domain)
            if tree.parent_ids[node] in reachable:  # its confidence is conditional on an accepted parent
                self.calibrator.observe(f"{owners[node]}@{domain}", raws[node], node in accepted)
        for position in range(len(result.accepted_node_ids)):
            m.inc("cosine_ray:spec_decode_num_accepted_tokens_per_pos", position=position)
        self._count_fusion(plan, result)
        if not plan.drafters:
            return
        committed = list(result.new_token_ids)  # eq. 1 compares with what the target committed, bonus included
        # Only positions verification could confirm are scored: the kept tree's depth, plus the
        # bonus position (with γ = 0 that is the bonus token alone).
        depths = tree.depths()
        verified = max(depths) + 1 if depths else 1
        # c of eq. 2 is the drafter's *calibrated* confidence for this domain: raw retrieval
        # frequencies are often 1.0 (one matching continuation), and with c = 1 eq. 2 gives 1 for
        # any d > 0, so a confidently wrong drafter would score like a right one.
        calibrate = self._calibration_for(domain)
        scores = {}
        for name in plan.drafters:
            answer = plan.answers.get(name, [])[:verified]
            drafted = [tok for tok, _ in answer]
            confidences = [calibrate(name, conf) for _, conf in answer]
            scores[name] = routing_score(confidences, self._accuracy(committed, drafted))
        # eq. 3's L_acc: drafts accepted; None when none was verified (the mode stays as it was)
        self.routing.update(request.request_id, scores,
                            len(result.accepted_token_ids) if tree.num_draft_tokens else None)

    def _accuracy(self, accepted: list[int], drafted: list[int | None]) -> list[float]:
        if self.unit_embeddings is not None:
            return verification_accuracy(self.unit_embeddings, accepted, drafted)
        return [1.0 if tok is not None and i < len(accepted) and tok == accepted[i] else 0.0
                for i, tok in enumerate(drafted)]

    def _count_fusion(self, plan: Plan, result: VerifyResult) -> None:
        if not plan.trunk:
            return
        tree, owners = plan.selected.tree, plan.selected.owners
        children = {(tree.parent_ids[i], tree.token_ids[i]): i for i in range(1, tree.num_nodes)}
        accepted = set(result.accepted_node_ids)
        node = 0
        for tok in plan.trunk:
            node = children.get((node, tok), -1)
            if node < 0:
                break
            self.metrics.inc("cosine_ray:fusion_picks", drafter=owners[node])
            if node in accepted:
                self.metrics.inc("cosine_ray:fusion_picks_accepted", drafter=owners[node])


