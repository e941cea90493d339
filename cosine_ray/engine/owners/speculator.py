"""Draft and select: one token tree per decoding request (CoSine eq. 4 + TreeSelection).

``Speculator.draft(batch, routes)`` asks the routed drafters — one call per drafter per
round, all its requests at once, each call with a deadline — and returns a ``DraftTree``
per decoding request whose nodes carry their owner and confidence. Two choices are made
once, at construction (the ablations are strategies, not branches in the hot path):

- **drafting**: ``FusedDrafting`` (confidence fusion, eq. 4, round by round with chained
  answers, ``engine.owners.drafting.fuse_drafts``) or ``PathDrafting`` (each routed drafter's whole
  paths, merged: the union mode, and "fusion off" where routing gives one drafter);
- **selection**: ``PricedSelection`` (the LP's price: a node is verified when its expected
  gain pays for its marginal verify time at this batch, ``algo.tree_selection.TreePrice``),
  ``ConfidenceCutSelection`` (LP off: fixed γ with a fixed cumulative-confidence cut) or
  ``FixedSelection`` (adaptive off: fixed γ, no cut).

Algorithm 2 then trims the batch to Γ_max (decrement the largest γ_j). Confidences are
calibrated per drafter, domain, role and depth before fusion and selection
(``algo.calibration``).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Protocol, Sequence

from cosine_ray.algo.adaptive import expected_gains
from cosine_ray.algo.calibration import ConfidenceCalibrator, TreeBias, node_levels
from cosine_ray.algo.fusion import Calibrate, FusedPath, FusionState
from cosine_ray.algo.scheduling.lp_schedule import trim_gammas
from cosine_ray.algo.tree_selection import SelectedTree, build_tree
from cosine_ray.engine.drafters.base import DraftInput
from cosine_ray.engine.owners.drafting import fuse_drafts, gather_proposals, proposals_to_paths
from cosine_ray.engine.worker.clients import DrafterClient
from cosine_ray.engine.types import Answers, DraftTree, Drafted, DraftingStats, Drafts, Route, StepBatch
from cosine_ray.engine.request import Request
from cosine_ray.engine.owners.scheduler import PROBE_EVERY
from cosine_ray.engine.modes.twins import TWIN

FUSION_MIN_CUMULATIVE = 0.02
"""With the LP's price, fusion stops growing a trunk (and drops branches) below this
cumulative confidence, and selection keeps no node below it: such nodes never pay for their
verify slot on any hardware we have. Above it, the price decides (``PricedSelection``)."""


class DraftingStrategy(Protocol):
    async def draft(self, requests: Sequence[Request], routes: Mapping[str, Route], budgets: Mapping[str, int],
                    cut: float, calibration: Callable[[str], Calibrate], stats: DraftingStats,
                    contexts: Mapping[str, Sequence[int]] | None = None) -> dict[str, Drafted]:
        """Paths per request continuing ``contexts[request_id]`` (default: its committed context,
        the last token being the root)."""
        ...


def _context(request: Request, contexts: Mapping[str, Sequence[int]] | None) -> Sequence[int]:
    if contexts is not None and request.request_id in contexts:
        return contexts[request.request_id]
    return request.context_token_ids


class FusedDrafting:
    """CoSine's confidence fusion (eq. 4): round by round, the most confident token extends
    the trunk and the others stay as branches (``algo.fusion``)."""

    def __init__(self, clients: Mapping[str, DrafterClient], *, vocab_size: int, deadline_s: float,
                 is_live: Callable[[str], bool]) -> None:
        self.clients, self.vocab_size, self.deadline_s, self.is_live = clients, vocab_size, deadline_s, is_live

    async def draft(self, requests, routes, budgets, cut, calibration, stats, contexts=None) -> dict[str, Drafted]:
        states = {r.request_id: FusionState(routes[r.request_id].drafters, budgets[r.request_id], cut,
                                            calibration(r.domain)) for r in requests}
        await fuse_drafts(self.clients, states, {r.request_id: _context(r, contexts) for r in requests},
                          deadline_s=self.deadline_s, vocab_size=self.vocab_size, stats=stats, live=self.is_live)
        return {rid: Drafted(s.paths(), s.answers, tuple(s.trunk)) for rid, s in states.items()}


class PathDrafting:
    """Each routed drafter proposes whole paths on its own; their union is the tree."""

    def __init__(self, clients: Mapping[str, DrafterClient], *, vocab_size: int, deadline_s: float) -> None:
        self.clients, self.vocab_size, self.deadline_s = clients, vocab_size, deadline_s

    async def draft(self, requests, routes, budgets, cut, calibration, stats, contexts=None) -> dict[str, Drafted]:
        batches: dict[str, list[DraftInput]] = {}
        for r in requests:
            for name in routes[r.request_id].drafters:
                batches.setdefault(name, []).append(
                    DraftInput(r.request_id, tuple(_context(r, contexts)), budgets[r.request_id]))
        proposals = await gather_proposals(self.clients, batches, deadline_s=self.deadline_s,
                                           vocab_size=self.vocab_size, stats=stats)
        out = {}
        for r in requests:
            props = proposals.get(r.request_id, [])
            own: Answers = {}
            for p in props:  # a drafter's first path is its own best guess per depth
                if p.paths and p.drafter not in own:
                    own[p.drafter] = list(zip(p.paths[0], p.confidences[0]))
            out[r.request_id] = Drafted(proposals_to_paths(props, calibration(r.domain)), own)
        return out


class TreePolicy(Protocol):
    cut: float
    """Cumulative-confidence floor for fusion and TreeSelection."""

    def gammas(self, batch: StepBatch, trees: Sequence[tuple[Request, SelectedTree, tuple[float, ...]]]) -> list[int]:
        """γ_i per (request, its drafted tree, that tree's expected-gain curve), in order."""
        ...


class PricedSelection:
    """The LP's γ_i: each node pays its marginal verify time at this step or is left out (eq. 8),
    among the nodes at or above the floor ``cut`` (nodes are priced at the token slope their
    batch size's tree steps measure, ``CostModel.token_slope``)."""

    def __init__(self, cut: float = FUSION_MIN_CUMULATIVE) -> None:
        self.cut = cut

    def gammas(self, batch: StepBatch, trees: Sequence[tuple[Request, SelectedTree, tuple[float, ...]]]) -> list[int]:
        weights = [batch.weights.get(request.request_id, 1.0) for request, _, _ in trees] if batch.weights else None
        gammas = batch.price.gammas_for([(request.num_tokens, gains) for request, _, gains in trees], weights)
        for k, (request, full, _) in enumerate(trees):
            if gammas[k] == 0 and batch.num_steps.get(request.request_id, 0) % PROBE_EVERY == 0:
                gammas[k] = min(1, full.tree.num_draft_tokens)  # probe: keep measuring the drafters
        return gammas


class ConfidenceCutSelection:
    """LP off: fixed γ, nodes below a fixed cumulative confidence are not verified."""

    def __init__(self, cut: float) -> None:
        self.cut = cut

    def gammas(self, batch: StepBatch, trees: Sequence[tuple[Request, SelectedTree, tuple[float, ...]]]) -> list[int]:
        return [batch.budgets[request.request_id] for request, _, _ in trees]


class FixedSelection:
    """Adaptive off: verify whatever was drafted, up to the fixed γ."""

    cut = 0.0

    def gammas(self, batch: StepBatch, trees: Sequence[tuple[Request, SelectedTree, tuple[float, ...]]]) -> list[int]:
        return [batch.budgets[request.request_id] for request, _, _ in trees]


class Speculator:
    def __init__(self, drafting: DraftingStrategy, selection: TreePolicy, calibrator: ConfidenceCalibrator, *,
                 total_gamma_max: int, bias: TreeBias | None = None,
                 prune: Callable[[Request, Sequence[FusedPath], Sequence[int]], list[FusedPath]] | None = None
                 ) -> None:
        self.drafting = drafting
        self.prune = prune or _as_drafted
        """The forced chain, then the draft paths behind it, each cut at the first token the
        request's grammar forbids (``Constraints.prune``)."""
        self.selection = selection
        self.calibrator = calibrator
        self.total_gamma_max = total_gamma_max
        self.bias = bias if bias is not None else TreeBias()
        """Per-domain correction of a tree's expected accepted tokens (``algo.calibration.TreeBias``)."""
        self.drafted_nodes = 0
        """Draft nodes drafted (after fusion's floor) over every step so far."""
        self.verified_nodes = 0
        """Of those, the nodes selection sent to verification (Σ γ_i)."""

    def node_acceptance(self, domain: str, selected: SelectedTree) -> list[float]:
        """Each draft node's chance of acceptance, as the gains and the metrics count it."""
        return self.bias.scale(domain, selected.node_acceptance())

    def calibration(self, domain: str) -> Calibrate:
        """Confidence calibration per drafter, domain, role and depth (``algo.calibration``): a
        retrieval drafter is reliable on its own domain and not elsewhere, whatever its raw
        confidence says; a branch is accepted less often than a trunk node."""
        return lambda drafter, confidence, depth=1, is_trunk=True: self.calibrator.calibrate(
            node_levels(drafter, domain, depth, is_trunk), confidence)

    def _twin(self, request: Request, tokens: Sequence[int]) -> Drafted:
        """A follower's draft: its leader's text as one trunk chain (``engine.modes.twins``)."""
        calibrate = self.calibration(request.domain)
        confidences = tuple(calibrate(TWIN, 1.0, depth) for depth in range(1, len(tokens) + 1))
        return Drafted([FusedPath(tuple(tokens), confidences, (TWIN,) * len(tokens), (1.0,) * len(tokens))])

    async def draft(self, batch: StepBatch, routes: Mapping[str, Route]) -> Drafts:
        """A tree per decoding request (root only where nothing was drafted), and how drafting went."""
        stats = DraftingStats()
        forced = batch.forced
        contexts = budgets = None
        if forced:  # the drafters continue after the tokens the grammar forces, with what is left of the budget
            contexts = {rid: (*r.context_token_ids, *forced[rid]) for r in batch.decodes
                        if (rid := r.request_id) in forced}
            budgets = {rid: g - len(forced.get(rid, ())) for rid, g in batch.budgets.items()}
        drafted = await self.draft_paths(batch.decodes, routes, budgets or batch.budgets, stats, contexts)
        return self.select(batch, drafted, stats)

    async def draft_paths(self, requests: Sequence[Request], routes: Mapping[str, Route],
                          budgets: Mapping[str, int], stats: DraftingStats,
                          contexts: Mapping[str, Sequence[int]] | None = None) -> dict[str, Drafted]:
        """The routed drafters' paths per request (those with a route), continuing its committed
        context or ``contexts[request_id]`` (PEARL drafts ahead of what is being verified)."""
        drafting = [r for r in requests if r.request_id in routes]
        if not drafting:
            return {}
        drafted = await self.drafting.draft(drafting, routes, budgets, self.selection.cut, self.calibration, stats,
                                            contexts)
        for rid, d in drafted.items():
            d.route = routes[rid]
        return drafted

    def select(self, batch: StepBatch, drafted: Mapping[str, Drafted], stats: DraftingStats) -> Drafts:
        """TreeSelection and γ_i over ``drafted`` (paths after each request's root): the step's trees."""
        decodes = batch.decodes
        cut = self.selection.cut
        start = time.perf_counter()
        if batch.twins:
            drafted = {**drafted, **{rid: self._twin(r, batch.twins[r.request_id])
                                     for r in decodes if (rid := r.request_id) in batch.twins}}
        fulls: dict[str, tuple[SelectedTree, tuple[float, ...]]] = {}
        forced = batch.forced
        for r in decodes:
            rid = r.request_id
            chain = forced.get(rid, ())
            paths = self.prune(r, drafted[rid].paths if rid in drafted else [], chain) if rid in drafted or chain else []
            # a twin's chain is the target's own text: no floor (its calibration may lag)
            full = build_tree(r.output_token_ids[-1], paths, batch.budgets[rid],
                              min_confidence=0.0 if rid in batch.twins else cut)
            fulls[rid] = (full, expected_gains(self.node_acceptance(r.domain, full), batch.budgets[rid]))
            if rid in drafted:  # how far its drafters reached: the scheduler's next budget follows
                r.draft_depth = max(max(full.tree.depths()) - len(chain), 0) if full.tree.num_draft_tokens else 0
        chosen = self.selection.gammas(batch, [(r, *fulls[r.request_id]) for r in decodes]) if decodes else []
        if batch.twins:  # a twin's text is the target's own: verified whole, whatever the price
            chosen = [batch.budgets[r.request_id] if r.request_id in batch.twins else g for r, g in zip(decodes, chosen)]
        # the forced chain is verified whole, whatever the price (its budget and KV include it)
        chosen = [max(g, len(forced.get(r.request_id, ()))) for r, g in zip(decodes, chosen)]
        # no more than was drafted (a request with no paths has a root-only tree: γ = 0)
        gammas = {r.request_id: min(g, fulls[r.request_id][0].tree.num_draft_tokens) for r, g in zip(decodes, chosen)}
        gammas = trim_gammas(gammas, self.total_gamma_max)  # Algorithm 2
        for rid, chain in forced.items():
            if rid in gammas:
                gammas[rid] = max(gammas[rid], len(chain))
        trees = {}
        for r in decodes:
            rid = r.request_id
            full, gains = fulls[rid]
            selected = full.top(gammas[rid])  # = build_tree(root, paths, γ_i, min_confidence=cut)
            d = drafted.get(rid, Drafted())
            answers, trunk = d.answers, d.trunk
            if rid in forced:  # the drafters answered after the chain: their answers and trunk start with it
                head = [(token, 1.0) for token in forced[rid]]
                answers = {name: head + list(a) for name, a in answers.items()}
                trunk = forced[rid] + tuple(trunk) if trunk else trunk
            trees[rid] = DraftTree(selected, d.route, answers, trunk, gains)
        stats.selection_s = time.perf_counter() - start
        stats.num_drafted_nodes = sum(full.tree.num_draft_tokens for full, _ in fulls.values())
        self.drafted_nodes += stats.num_drafted_nodes
        self.verified_nodes += sum(gammas.values())
        return Drafts(trees, stats)


def _as_drafted(request: Request, paths: Sequence[FusedPath], forced: Sequence[int]) -> list[FusedPath]:
    """Without grammars: the paths as drafted (nothing is forced)."""
    return list(paths)
