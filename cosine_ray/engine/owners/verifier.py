"""Verification of one step: the whole batch through the target in one call, then acceptance.

Prefills (a new request's prompt, or a restore after a lost stage) and token trees go through
the stage chain as one varlen batch (``engine.worker.target``). Acceptance is lossless
(``algo.verify``): greedy requests take the longest tree path that matches the target's argmax
plus the bonus token. Sampled requests draw each position's token by the Gumbel-max race with
noise keyed by (request seed, position) (``algo.sampling.sample_keyed``), so verifying a tree is
an exact comparison with the target's sampled token (``algo.verify.verify_keyed``): the text
is the one plain sampling with that seed produces, whatever the drafters proposed and whatever
else was in the batch. A request with rules (penalties, bias, min_tokens, a grammar:
``engine.owners.constraints``) or log-probabilities ships logits rows; acceptance then uses each
row's processed scores. Every verified request yields a ``Verified``: its new tokens, the KV
slots to keep (the commit) and, when asked, the target's log-probabilities of those tokens.

A request whose rules mask every token of a row its next token comes from (a grammar whose
only tokens are stop tokens that ``min_tokens`` holds back; ``logit_bias`` of -inf on every
token) has no next token in plain decoding either: its ``Verified`` keeps the tokens before
that row and carries a ``refusal`` (``NoTokenLeft``), and the request ends there alone (unless
one of those tokens ends it first), while the rest of the batch goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from cosine_ray.algo.logits_rules import TokenLogprob, token_logprobs
from cosine_ray.algo.sampling import logits_to_probs, sample_keyed
from cosine_ray.algo.tree import TokenTree
from cosine_ray.algo.verify import VerifyResult, verify_greedy, verify_greedy_at, verify_keyed
from cosine_ray.engine.owners.constraints import GreedyTokens, scores
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
            # the target's argmax tokens are all a greedy request without rules needs
            greedy = r.params.is_greedy and not r.needs_rows
            if rid in batch.chunks:
                start = r.num_computed_tokens
                end = start + batch.chunks[rid]
                work.append((r, ScoreItem.prefill(rid, r.context_token_ids[start:end], start_position=start,
                                                  final=end == r.num_tokens, ids_only=greedy,
                                                  block_table=r.block_table, every_row=_wants_prompt_rows(r)),
                             None))
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
                try:
                    outcomes.append(_prefilled(request, item, item_logits))
                except NoTokenLeft as exc:
                    outcomes.append(Verified(request.request_id, (), tuple(range(len(item.token_ids))),
                                             refusal=str(exc)))
                continue
            result, none_left = self._accept(request, tree, item_logits, root_position=item.start_position)
            rows = (0,) + result.accepted_node_ids  # row of each new token's parent node
            tokens, refusal = result.new_token_ids, None
            if none_left is not None:  # the tokens before it stand; the request ends unless they end it
                tokens, rows = tokens[:none_left], rows[:max(none_left, 1)]
                refusal = str(NoTokenLeft(len(request.output_token_ids) + none_left))
            outcomes.append(Verified(request.request_id, tokens, rows, result, refusal=refusal,
                                     logprobs=_logprobs(request, item_logits, rows[:len(tokens)], tokens)))
        return VerifiedBatch(outcomes, tuple(i.start_position for i in items), tuple(len(i.token_ids) for i in items),
                             seconds, idle)

    def _accept(self, request: Request, tree: TokenTree, logits: torch.Tensor, *,
                root_position: int) -> tuple[VerifyResult, int | None]:
        """The tree's verification, and the index of the first new token whose row its rules
        masked whole (None: none was): plain decoding has no such token, so the request ends
        there, unless a token before it ends the request first (``Request.append``)."""
        if request.params.is_greedy and request.grammar is not None:  # masks only where the walk goes
            tokens = GreedyTokens(request, logits, tree)
            try:
                return verify_greedy_at(tree, tokens), tokens.dead
            finally:
                tokens.close()
        processed, dead = _live_scores(request, scores(request, logits, tree))
        if request.params.is_greedy:
            result = verify_greedy(tree, processed)
        else:
            result = verify_keyed(tree, _probs(request, processed), seed=request.seed, root_position=root_position)
        if dead is not None:
            for index, node in enumerate((0,) + result.accepted_node_ids):
                if dead[node]:
                    return result, index
        return result, None


class NoTokenLeft(Exception):
    """A request's rules mask every token of the row its next token would come from."""

    def __init__(self, num_output_tokens: int) -> None:
        super().__init__(f"no token is allowed after {num_output_tokens} output tokens: the request's grammar, "
                         "min_tokens, stop_token_ids and logit_bias together mask every token")


def _live_scores(request: Request, processed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``processed  # [n, vocab]`` with every row that its rules masked whole set to zeros (so
    argmax and sampling stay defined: such a row's token is never used), and which rows those
    are (``[n]`` bool; None when there are none, always for a request without rules)."""
    if request.rules is None and request.grammar is None:
        return processed, None
    dead = ~(processed > -float("inf")).any(dim=-1)  # [n]
    if not bool(dead.any()):
        return processed, None
    return processed.masked_fill(dead[:, None], 0.0), dead


def _wants_prompt_rows(request: Request) -> bool:
    """Every prompt row's logits: prompt log-probabilities, not computed yet."""
    return request.params.prompt_logprobs is not None and not request.output_token_ids


def _logprobs(request: Request, logits: torch.Tensor, rows: tuple[int, ...],
              token_ids: tuple[int, ...]) -> tuple[TokenLogprob, ...] | None:
    k = request.params.logprobs
    if k is None or not token_ids:
        return None
    return tuple(token_logprobs(logits[list(rows)], token_ids, k))


def _prefilled(request: Request, item: ScoreItem, logits: torch.Tensor) -> Verified:
    """A prompt chunk's outcome: after the last chunk, the context's next token at the context
    length's position; with prompt log-probabilities, those of the chunk's next tokens."""
    start, n = item.start_position, len(item.token_ids)
    end = start + n
    prompt = None
    if item.all_logits:  # row j predicts the token at start + j + 1
        context = request.context_token_ids
        known = min(end, len(context) - 1) - start  # rows whose next token is in the prompt
        k = request.params.prompt_logprobs or 0
        prompt = (None,) * (start == 0) + tuple(token_logprobs(logits[:known], context[start + 1:start + 1 + known], k))
    if end < request.num_tokens:
        return Verified(request.request_id, (), tuple(range(n)), prompt_logprobs=prompt)
    last = logits[-1:]
    token = target_token(request, last, position=end)
    return Verified(request.request_id, (token,), tuple(range(n)), prompt_logprobs=prompt,
                    logprobs=_logprobs(request, last, (0,), (token,)))


def _probs(request: Request, logits: torch.Tensor) -> torch.Tensor:
    params = request.params
    return logits_to_probs(logits, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def target_token(request: Request, logits: torch.Tensor, *, position: int) -> int:
    """The target's own token at absolute ``position`` from the logits [1, vocab] of the token
    before it (or, for a greedy request, its argmax [1]): argmax, or the keyed sample (what
    plain sampling with the request's seed draws), of the request's processed scores.
    ``NoTokenLeft`` when they allow none."""
    if logits.ndim == 1:
        return int(logits[0])
    if request.params.is_greedy and request.grammar is not None:
        tokens = GreedyTokens(request, logits)
        token = tokens(0)
        if tokens.dead is not None:
            raise NoTokenLeft(len(request.output_token_ids))
        return token
    processed, dead = _live_scores(request, scores(request, logits))
    if dead is not None:
        raise NoTokenLeft(len(request.output_token_ids))
    if request.params.is_greedy:
        return int(processed[0].argmax())
    return int(sample_keyed(_probs(request, processed), seed=request.seed, positions=[position])[0])
