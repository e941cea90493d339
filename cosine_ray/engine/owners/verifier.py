"""Verification of one step: the whole batch through the target in one call, then acceptance.

Prefills (a new request's prompt, or a restore after a lost stage) and token trees go through
the stage chain as one varlen batch (``engine.worker.target``). Acceptance is lossless
(``algo.verify``): greedy requests take the longest tree path that matches the target's argmax
plus the bonus token. Sampled requests draw each position's token by the Gumbel-max race with
noise keyed by (request seed, position) (``algo.sampling.sample_keyed``), so verifying a tree is
an exact comparison with the target's sampled token (``algo.verify.verify_keyed``): the text
is the one plain sampling with that seed produces, whatever the drafters proposed and whatever
else was in the batch. Every verified request yields a ``Verified``: its new tokens and the KV
slots to keep (the commit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cosine_ray.algo.sampling import logits_to_probs, sample_keyed
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.verify import VerifyResult, verify_greedy, verify_keyed
from cosine_ray.engine.types import Drafts, StepBatch, Verified, VerifiedBatch
from cosine_ray.engine.worker.recovery import RecoveringTarget
from cosine_ray.engine.request import Request
from cosine_ray.engine.worker.scoring import ScoreItem


@dataclass(slots=True)
class VerifierClock:
    """Busy vs idle time of the verifier as the engine sees it (score calls in flight)."""

    clock: Callable[[], float]
    inflight: int = 0
    busy_s: float = 0.0
    since: float = 0.0
    window_start: float = 0.0

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


class Verifier:
    def __init__(self, target: RecoveringTarget, *, is_live: Callable[[str], bool],
                 clock: Callable[[], float]) -> None:
        self.target = target
        self.is_live = is_live
        self.clock = clock
        self.busy = VerifierClock(clock, window_start=clock())

    async def verify(self, batch: StepBatch, drafts: Drafts) -> VerifiedBatch:
        """Score the batch's prompt chunks and trees in one target call and accept per request.
        Requests aborted while drafting, or whose KV was dropped meanwhile, sit out."""
        work: list[tuple[Request, ScoreItem, TokenTree | None]] = []
        for r in batch.requests:
            rid = r.request_id
            if not self.is_live(rid) or batch.epochs.get(rid, r.kv_epoch) != r.kv_epoch:
                continue
            greedy = r.params.is_greedy  # the target's argmax tokens are all a greedy request needs
            if rid in batch.chunks:
                start = r.num_computed_tokens
                end = start + batch.chunks[rid]
                work.append((r, ScoreItem.prefill(rid, r.context_token_ids[start:end], start_position=start,
                                                  final=end == r.num_tokens, ids_only=greedy,
                                                  block_table=r.block_table), None))
            else:
                tree = drafts.trees[rid].tree
                work.append((r, ScoreItem.for_tree(rid, tree, r.num_tokens - 1, ids_only=greedy,
                                                   block_table=r.block_table), tree))
        if not work:
            return VerifiedBatch()
        items = [item for _, item, _ in work]
        start = self.clock()
        self.busy.begin()
        try:
            logits = await self.target.score(items)
        finally:
            self.busy.end()
        seconds = self.clock() - start
        idle = self.busy.idle_fraction()
        if logits is None:
            return VerifiedBatch(lost=True, verify_s=seconds, verifier_idle_fraction=idle)
        outcomes = []
        for (request, item, tree), item_logits in zip(work, logits):
            if tree is None:
                # after the last chunk, the context's next token, at the context length's position
                end = item.start_position + len(item.token_ids)
                token = (target_token(request, item_logits[-1:], position=end),) if item.wants_logits else ()
                outcomes.append(Verified(request.request_id, token, tuple(range(len(item.token_ids)))))
            else:
                result = self._accept(request, tree, item_logits, root_position=item.start_position)
                outcomes.append(Verified(request.request_id, result.new_token_ids,
                                         (0,) + result.accepted_node_ids, result))
        return VerifiedBatch(outcomes, tuple(i.start_position for i in items), tuple(len(i.token_ids) for i in items),
                             seconds, idle)

    def _accept(self, request: Request, tree: TokenTree, logits: torch.Tensor, *, root_position: int) -> VerifyResult:
        if request.params.is_greedy:
            return verify_greedy(tree, logits)
        return verify_keyed(tree, _probs(request, logits), seed=request.seed, root_position=root_position)


def _probs(request: Request, logits: torch.Tensor) -> torch.Tensor:
    params = request.params
    return logits_to_probs(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def target_token(request: Request, logits: torch.Tensor, *, position: int) -> int:
    """The target's own token at absolute ``position`` from the logits [1, vocab] of the token
    before it (or, for a greedy request, its argmax [1]): argmax, or the keyed sample (what
    plain sampling with the request's seed draws)."""
    if request.params.is_greedy:
        return int(logits[0]) if logits.ndim == 1 else int(logits[0].argmax())
    return int(sample_keyed(_probs(request, logits), seed=request.seed, positions=[position])[0])
