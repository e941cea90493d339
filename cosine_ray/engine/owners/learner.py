"""Learning from a verified step: one ``StepStats``, read by everything that learns.

Per verified tree:

- **calibration** (``algo.calibration``): each node whose parent was accepted is a verified
  observation of its owner's raw confidence, per (drafter, domain);
- **routing** (eq. 1-2, ``algo.routing``): each routed drafter's per-depth answers are scored
  against what the target committed (bonus included), and folded into the request's M_r and
  its domain's prior; eq. 3's L_acc is the accepted draft count;
- **gains** (``engine.owners.economics.GainModel``): the full tree's calibrated curve predicts the
  request's next step for the batch decision;
- **drafter feedback**: per drafter, its drafted and accepted counts (``DraftFeedback``);
- **request stats** (the ``cosine_ray`` block of a response) and the **metrics exporter**.

Per step: the verify forward's shape and time refit the latency model (``CostModel``), and
the verifier's idle share moves the adaptive drafter participation (``algo.adaptive``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from cosine_ray.algo.adaptive import ParticipationController
from cosine_ray.algo.calibration import ConfidenceCalibrator, node_levels
from cosine_ray.algo.guard import SpeculationGuard
from cosine_ray.algo.routing import routing_score, verification_accuracy
from cosine_ray.algo.verify import VerifyResult
from cosine_ray.engine.drafters.base import DraftFeedback, FinishedText
from cosine_ray.engine.worker.clients import DrafterClient
from cosine_ray.engine.owners.economics import CostModel
from cosine_ray.engine.request import Request
from cosine_ray.engine.owners.routing import DraftRouting
from cosine_ray.engine.types import DraftTree, Drafts, StepBatch, VerifiedBatch
from cosine_ray.engine.owners.speculator import Speculator
from cosine_ray.engine.modes.twins import TWIN
from cosine_ray.metrics.exporter import EngineMetrics
from cosine_ray.metrics.stats import RequestStepStats, StepStats


class Learner:
    def __init__(self, *, speculator: Speculator, routing: DraftRouting, costs: CostModel,
                 drafters: Sequence[DrafterClient], metrics: EngineMetrics, is_live: Callable[[str], bool],
                 clock: Callable[[], float], participation: ParticipationController | None = None,
                 guard: SpeculationGuard | None = None, unit_embeddings: torch.Tensor | None = None) -> None:
        self.speculator = speculator
        self.calibrator: ConfidenceCalibrator = speculator.calibrator
        self.routing = routing
        self.costs = costs
        self.drafters = list(drafters)
        self.metrics = metrics
        self.participation = participation
        self.unit_embeddings = unit_embeddings
        self.is_live = is_live
        """False for a request that finished or was aborted while this step was in flight: its
        state is (being) released, so it teaches nothing."""
        self.clock = clock
        # the optional learners, chosen once: the guard's levels and the drafter participation
        self.levels: GuardLearning | NoGuardLearning = NoGuardLearning()
        self.guard = guard
        self._learn_participation = self._observe_participation if participation is not None else _ignore

    def record(self, batch: StepBatch, drafts: Drafts, verified: VerifiedBatch) -> "PendingLearning":
        """What cannot wait for the next step: each request's own counts (its response's stats
        block is built when its tokens are appended) and the step's wall time for the guard."""
        stats = StepStats(batch_size=len(drafts.trees), verify_s=verified.verify_s,
                          decision_s=batch.decision_s + drafts.stats.selection_s,
                          gammas=[t.tree.num_draft_tokens for t in drafts.trees.values()],
                          drafter_failures=list(drafts.stats.failures),
                          drafter_round_trips=drafts.stats.calling_rounds)
        pending = PendingLearning(batch, drafts, verified, stats)
        by_id = {r.request_id: r for r in batch.requests}
        for rid, tree in drafts.trees.items():
            if tree.route is not None:
                stats.routed.append(RequestStepStats(
                    rid, by_id[rid].domain, routed=tuple((d, tree.route.mode_of(d)) for d in tree.route.drafters)))
        if verified.lost or not verified.outcomes:
            return pending
        pending.step_s = self.clock() - batch.started_at
        for outcome in verified.outcomes:
            if outcome.result is not None and self.is_live(outcome.request_id):
                request = by_id[outcome.request_id]
                draft = drafts.trees[request.request_id]
                stats.expected_accepted += sum(self.speculator.node_acceptance(request.domain, draft.selected))
                stats.num_accepted += len(outcome.result.accepted_node_ids)
                step = self._count_tree(request, draft, outcome.result)
                stats.requests.append(step)
                pending.trees.append((request, draft, outcome.result, step))
        return pending

    @property
    def guard(self) -> SpeculationGuard | None:
        return getattr(self.levels, "guard", None)

    @guard.setter
    def guard(self, guard: SpeculationGuard | None) -> None:
        self.levels = GuardLearning(guard) if guard is not None else NoGuardLearning()

    async def absorb(self, pending: "PendingLearning") -> StepStats:
        """The rest of what a recorded step teaches: calibration, routing, gains, drafter
        feedback, the latency fit, the guard, participation and the metrics. Run at once, or
        (``overlap_learning``) while the next step's forward is on the GPU; a request that
        finished meanwhile then teaches calibration only (its routing, gain and drafter
        state is already freed)."""
        batch, drafts, verified, stats = pending.batch, pending.drafts, pending.verified, pending.stats
        if not verified.lost and verified.outcomes:
            latency = self.costs.latency
            stats.verify_predicted_s = latency.predict_llm(verified.context_lens, verified.num_new_tokens)
            trees = not any(o.is_prefill for o in verified.outcomes)  # no prompt's cost in the step
            if trees:
                self.levels.observe(batch, verified, latency, pending.step_s)
            self.costs.observe_verify(verified.context_lens, verified.num_new_tokens, verified.verify_s, trees=trees)
            if self.costs.latency is not latency:
                self.levels.refitted(latency, self.costs.latency, verified.context_lens)
            live = []
            for request, draft, result, step in pending.trees:
                is_live = self.is_live(request.request_id)
                self._learn_tree(request, draft, result, calibration_only=not is_live)
                if is_live:
                    live.append(step)
            await self._feedback(live, stats)
        self.levels.report(len(batch.requests), stats)
        if verified.outcomes:
            self._learn_participation(drafts, verified, stats)
        self.metrics.observe_step(stats)
        return stats

    def _observe_participation(self, drafts: Drafts, verified: VerifiedBatch, stats: StepStats) -> None:
        """Adaptive drafter participation from the verifier's idle share (Algorithm 2)."""
        trimmed = 1.0 - stats.total_gamma / drafts.stats.num_drafted_nodes if drafts.stats.num_drafted_nodes else 0.0
        stats.participation = self.participation.observe(verified.verifier_idle_fraction, trimmed)

    def _count_tree(self, request: Request, draft: DraftTree, result: VerifyResult) -> RequestStepStats:
        """The step's counts for one request, added to its own stats at once."""
        tree, owners = draft.tree, draft.selected.owners
        accepted = set(result.accepted_node_ids)
        step = RequestStepStats(request.request_id, request.domain, tree.num_draft_tokens, len(accepted))
        for node in range(1, tree.num_nodes):
            owner = owners[node]
            step.drafted_by[owner] = step.drafted_by.get(owner, 0) + 1
            if node in accepted:
                step.accepted_by[owner] = step.accepted_by.get(owner, 0) + 1
        self._count_fusion(draft, accepted, step)
        s = request.stats
        s.num_verify_steps += 1
        s.num_draft_tokens += step.num_draft_tokens
        s.num_accepted_tokens += step.num_accepted_tokens
        for name, n in step.drafted_by.items():
            s.drafted_by[name] = s.drafted_by.get(name, 0) + n
        for name, n in step.accepted_by.items():
            s.accepted_by[name] = s.accepted_by.get(name, 0) + n
        return step

    def _learn_tree(self, request: Request, draft: DraftTree, result: VerifyResult, *,
                    calibration_only: bool = False) -> None:
        tree, owners, raws = draft.tree, draft.selected.owners, draft.selected.raw_confidences
        accepted = set(result.accepted_node_ids)
        reachable = {0} | accepted
        depths = tree.depths()
        for node in range(1, tree.num_nodes):
            if tree.parent_ids[node] in reachable:  # its confidence is conditional on an accepted parent
                levels = node_levels(owners[node], request.domain, depths[node], draft.selected.is_trunk(node))
                self.calibrator.observe(levels, raws[node], node in accepted)
        if tree.num_draft_tokens and owners[1] != TWIN:  # the bias is the drafters' (a twin's text is certain)
            self.speculator.bias.observe(request.domain, sum(draft.selected.node_acceptance()), len(accepted))
        if calibration_only:
            return
        request.gain_curve = draft.full_gains
        if draft.route is not None:
            self._score_routes(request, draft, result)

    def _score_routes(self, request: Request, draft: DraftTree, result: VerifyResult) -> None:
        """Eq. 1-2 for each routed drafter, folded into M_r; eq. 3's L_acc."""
        committed = list(result.new_token_ids)  # eq. 1 compares with what the target committed, bonus included
        # Only positions verification could confirm are scored: the kept tree's depth, plus the
        # bonus position (with γ = 0 that is the bonus token alone).
        tree_depths = draft.tree.depths()
        verified = max(tree_depths) + 1 if tree_depths else 1
        # c of eq. 2 is the drafter's *calibrated* confidence for this domain: raw retrieval
        # frequencies are often 1.0 (one matching continuation), and with c = 1 eq. 2 gives 1 for
        # any d > 0, so a confidently wrong drafter would score like a right one.
        calibrate = self.speculator.calibration(request.domain)
        scores = {}
        for name in draft.route.drafters:
            answer = draft.answers.get(name, [])[:verified]
            drafted = [tok for tok, _ in answer]
            confidences = [calibrate(name, conf, depth) for depth, (_, conf) in enumerate(answer, start=1)]
            scores[name] = routing_score(confidences, self._accuracy(committed, drafted))
        # eq. 3's L_acc: drafts accepted; None when none was verified (the mode stays as it was)
        self.routing.update(request, scores,
                            len(result.accepted_token_ids) if draft.tree.num_draft_tokens else None)

    def _accuracy(self, accepted: list[int], drafted: list[int | None]) -> list[float]:
        if self.unit_embeddings is not None:
            return verification_accuracy(self.unit_embeddings, accepted, drafted)
        return [1.0 if tok is not None and i < len(accepted) and tok == accepted[i] else 0.0
                for i, tok in enumerate(drafted)]

    @staticmethod
    def _count_fusion(draft: DraftTree, accepted: set[int], step: RequestStepStats) -> None:
        if not draft.trunk:
            return
        tree, owners = draft.tree, draft.selected.owners
        children = {(tree.parent_ids[i], tree.token_ids[i]): i for i in range(1, tree.num_nodes)}
        node = 0
        for tok in draft.trunk:
            node = children.get((node, tok), -1)
            if node < 0:
                break
            step.fusion_picks[owners[node]] = step.fusion_picks.get(owners[node], 0) + 1
            if node in accepted:
                step.fusion_picks_accepted[owners[node]] = step.fusion_picks_accepted.get(owners[node], 0) + 1

    async def learn_from_completed(self, requests: Sequence[Request]) -> None:
        """Hand the text of requests that finished normally to the drafters that learn from it
        (live suffix experts): prompt + output, and the domain the request was classified into."""
        learning = [d for d in self.drafters if getattr(d, "learns", False)]
        if not requests or not learning:
            return
        texts = [FinishedText(r.request_id, r.domain, tuple(r.context_token_ids), len(r.prompt_token_ids))
                 for r in requests]
        for d in learning:
            try:
                await d.learn(texts)
            except Exception:
                self.metrics.drafter_failed(d.name)

    async def _feedback(self, steps: Sequence[RequestStepStats], stats: StepStats) -> None:
        """Each drafter's drafted/accepted counts for the requests it served this step."""
        per_drafter: Mapping[str, list[DraftFeedback]] = {d.name: [] for d in self.drafters}
        for r in steps:
            for name in per_drafter:
                per_drafter[name].append(DraftFeedback(r.request_id, r.drafted_by.get(name, 0),
                                                       r.accepted_by.get(name, 0)))
        for d in self.drafters:
            if per_drafter[d.name]:
                try:
                    await d.observe(per_drafter[d.name])
                except Exception:
                    stats.drafter_failures.append(d.name)


@dataclass(slots=True)
class PendingLearning:
    """A verified step between ``Learner.record`` and ``Learner.absorb``."""

    batch: StepBatch
    drafts: Drafts
    verified: VerifiedBatch
    stats: StepStats
    step_s: float = 0.0
    """Wall time from the step's schedule to its verification's end (the guard's yield)."""
    trees: list[tuple[Request, DraftTree, VerifyResult, RequestStepStats]] = field(default_factory=list)
    """Each live request's tree, its verification and the step's counts for it."""


class GuardLearning:
    """What the speculation guard (``algo.guard``) learns from each verified step."""

    def __init__(self, guard: SpeculationGuard) -> None:
        self.guard = guard

    def observe(self, batch: StepBatch, verified: VerifiedBatch, latency, step_s: float) -> None:
        """What a step at its level yielded: committed tokens per request over the step's wall
        time in predicted plain-decode steps of the same shape. Steps with a prefill are not
        passed here (a prompt's cost is not the level's doing)."""
        if batch.level is None:
            return
        plain_s = latency.predict_llm(verified.context_lens, [1] * len(verified.context_lens))
        if plain_s > 0 and step_s > 0:
            tokens = sum(len(o.new_token_ids) for o in verified.outcomes) / len(verified.outcomes)
            self.guard.observe(batch.level, tokens, step_s / plain_s, len(verified.outcomes))

    def refitted(self, old, new, context_lens: Sequence[int]) -> None:
        """The cost model was refitted: the guard's stored step times, in plain-decode steps of
        the old model, become plain-decode steps of the new one (at this step's mean context),
        so a start-up default far from this machine's speed does not skew the levels for long."""
        ctx = max(int(round(sum(context_lens) / len(context_lens))), 1)

        def factor(rows: int) -> float:
            before = old.predict_llm([ctx] * rows, [1] * rows)
            after = new.predict_llm([ctx] * rows, [1] * rows)
            return before / after if before > 0 and after > 0 else 1.0

        self.guard.rescale_times(factor)

    def report(self, rows: int, stats: StepStats) -> None:
        """The current level for steps of this size (metrics)."""
        stats.speculation_level = self.guard.levels[self.guard.current_level(rows)]


class NoGuardLearning:
    """No guard: nothing to learn or report."""

    def observe(self, batch, verified, latency, step_s) -> None:
        return None

    def refitted(self, old, new, context_lens) -> None:
        return None

    def report(self, rows: int, stats: StepStats) -> None:
        return None


def _ignore(*args) -> None:
    """An optional learner that is off."""
