"""The rules on a request's scores, applied where the target's token is chosen.

``Constraints`` is what the verifier (and PipeDec's root) asks for the scores of a request's
rows: each row is the target's logits for the token after one node of the request's tree (or
after its prompt), processed by the request's rules (``algo.logits_rules``) with that node's
own path as history, and masked by what its grammar allows there. Greedy acceptance takes the
argmax of the processed row, keyed sampling samples it, so the committed text is constrained
plain decoding's whatever was drafted. Grammars are compiled by llguidance, once per spec and
off the event loop (``engine.owners.grammars``): a server awaits ``prepare`` before it adds
the request. The request's matcher, a copy of the compiled one, follows its committed output.

Speculation under a grammar: the tokens the grammar forces next (``forced_tokens``: a JSON
key of the schema, its quotes and colon) are a chain the scheduler gives every step, ahead of
the drafters, who draft after it; draft paths are cut at their first token the grammar
forbids (``prune``), so no verified row is spent on them. A greedy request's masks are
computed only for the rows the acceptance walk visits, and only where the row's argmax is
not allowed (``GreedyTokens``); a sampled request's tree forks the matcher along each path.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cosine_ray.algo.fusion import FusedPath
from cosine_ray.algo.logits_rules import RowRules, apply_rules, unpack_bitmask
from cosine_ray.algo.tree import TokenTree
from cosine_ray.engine.owners.grammars import GrammarCompiler, NoGrammars  # noqa: F401 (GrammarCompiler re-exported)
from cosine_ray.engine.request import Request, RequestRefused

GRAMMAR = "grammar"
"""Owner of the draft nodes a grammar forces (tokens no other token can replace there)."""
MAX_FORCED_TOKENS = 32
"""Most forced tokens one step's tree takes (the rest come in the next step's)."""


class Constraints:
    """The engine's owner of request rules (module docstring)."""

    def __init__(self, compiler: GrammarCompiler | NoGrammars, vocab_size: int) -> None:
        self.compiler = compiler
        self.vocab_size = vocab_size

    # ---- arrival ---------------------------------------------------------------------------
    def check(self, params: Any) -> None:
        """RequestRefused if the request's rules cannot be served (its grammar is not compiled
        here: ``prepare`` or ``check_grammar``)."""
        for token, _ in params.logit_bias:
            if not 0 <= token < self.vocab_size:
                raise RequestRefused(f"logit_bias token id {token} is outside the vocabulary [0, {self.vocab_size})",
                                     "logit_bias")
        for token in params.stop_token_ids:
            if not 0 <= token < self.vocab_size:
                raise RequestRefused(f"stop_token_ids: {token} is outside the vocabulary [0, {self.vocab_size})",
                                     "stop_token_ids")

    async def prepare(self, params: Any) -> None:
        """Compile the request's grammar off the event loop, or find it compiled (RequestRefused
        if it cannot be): after this, ``start`` only copies it."""
        if params.structured is not None:
            await self.compiler.prepare(params.structured)

    def check_grammar(self, params: Any) -> None:
        """``prepare`` for a caller without an event loop to keep going: compiles here and now."""
        if params.structured is not None:
            self.compiler.check(params.structured)

    def start(self, request: Request) -> None:
        """Give the request its own matcher (a copy of its grammar's compiled one)."""
        if request.params.structured is not None:
            request.grammar = self.compiler.matcher(request.params.structured)

    @staticmethod
    def replay(request: Request, token_ids: Sequence[int]) -> None:
        """Make ``token_ids`` the output of a request that has none yet, its grammar's state
        advanced over them (a request resumed from the tokens another engine generated)."""
        for tok in token_ids:
            if request.grammar is not None and not request.grammar.consume_token(tok):
                raise RequestRefused("the tokens to resume from do not follow the request's grammar",
                                     "resume_token_ids")
        request.output_token_ids.extend(token_ids)

    # ---- drafts ----------------------------------------------------------------------------
    @staticmethod
    def prune(request: Request, paths: Sequence[FusedPath], forced: Sequence[int] = ()) -> list[FusedPath]:
        """``forced`` (the grammar's next tokens, ``forced_tokens``) as a path of its own owned by
        ``GRAMMAR``, then each draft path (drafted after ``forced``) behind it, cut before its
        first token the request's grammar forbids there."""
        forced = tuple(forced)
        out = [FusedPath(forced, (1.0,) * len(forced), (GRAMMAR,) * len(forced), (1.0,) * len(forced))] if forced else []
        matcher = request.grammar
        if matcher is None:
            return out + [_behind(forced, p, len(p.token_ids)) for p in paths]
        consumed = matcher.try_consume_tokens(list(forced)) if forced else 0
        if consumed != len(forced):  # never: the grammar forced them
            matcher.rollback(consumed)
            return out
        try:
            for p in paths:
                n = matcher.validate_tokens(list(p.token_ids))
                if n > 0:
                    out.append(_behind(forced, p, n))
        finally:
            if forced:
                matcher.rollback(len(forced))
        return out


def forced_tokens(request: Request, limit: int) -> tuple[int, ...]:
    """The tokens the request's grammar forces after its committed output (jump-forward: no
    other token is allowed at each), at most ``limit``; () without a grammar."""
    matcher = request.grammar
    if matcher is None or limit <= 0 or matcher.is_stopped():
        return ()
    return tuple(matcher.compute_ff_tokens()[:limit])


def _behind(forced: tuple[int, ...], p: FusedPath, n: int) -> FusedPath:
    """The first ``n`` tokens of ``p``, after ``forced`` (certain: confidence 1)."""
    k = len(forced)
    flags = p.trunk_flags[:n]
    return FusedPath(forced + p.token_ids[:n], (1.0,) * k + p.confidences[:n], (GRAMMAR,) * k + p.owners[:n],
                     (1.0,) * k + (p.raw_confidences or p.confidences)[:n], (True,) * k + flags if flags else ())


class GreedyTokens:
    """The target's greedy token at the nodes of a request's tree, for ``verify_greedy_at``:
    the argmax of the node's row under the request's rules, checked against the grammar's
    mask after the node's path. The matcher follows the walk (each node asked is the child of
    the one before) and ``close`` rolls it back. A mask is filled per visited node, and applied
    to the row only where its argmax is not allowed: masking leaves the row's values alone where
    it allows, so an allowed argmax is the masked row's argmax too (ties: the first index).
    ``dead``: the first visit (0: the root) whose row the rules masked whole; its token is 0,
    as the masked row of zeros ``_live_scores`` gives."""

    def __init__(self, request: Request, logits: torch.Tensor, tree: TokenTree | None = None) -> None:
        self.request, self.logits, self.tree = request, logits, tree
        self.consumed = 0
        self.visits = 0
        self.dead: int | None = None
        self.path: tuple[int, ...] = ()
        self._bitmask = None

    def __call__(self, node: int) -> int:
        request, matcher = self.request, self.request.grammar
        if self.dead is not None:  # nothing after a dead row is committed
            return 0
        if node:
            token = self.tree.token_ids[node]
            self.path += (token,)
            if matcher is not None:
                matcher.consume_token(token)  # its parent's masked argmax: allowed there
                self.consumed += 1
        self.visits += 1
        row = self.logits[node:node + 1]
        if request.rules is not None:
            row = apply_rules(row, request.rules, prompt_ids=request.prompt_token_ids,
                              output_ids=request.output_token_ids, paths=[self.path])
        token = int(row[0].argmax())
        if matcher is None:
            return token
        import llguidance.torch as llg_torch
        if self._bitmask is None:
            self._bitmask = llg_torch.allocate_token_bitmask(1, self.logits.shape[1])
        llg_torch.fill_next_token_bitmask(matcher, self._bitmask, 0)
        if int(self._bitmask[0, token // 32]) >> (token % 32) & 1:
            return token
        masked = row[0].float().masked_fill(~unpack_bitmask(self._bitmask, self.logits.shape[1])[0], -float("inf"))
        if not bool((masked > -float("inf")).any()):
            if self.dead is None:
                self.dead = self.visits - 1
            return 0
        return int(masked.argmax())

    def close(self) -> None:
        """Roll the matcher back to the request's committed output."""
        if self.consumed:
            self.request.grammar.rollback(self.consumed)
            self.consumed = 0


def scores(request: Request, logits: torch.Tensor, tree: TokenTree | None = None) -> torch.Tensor:
    """The request's scores (``algo.logits_rules.apply_rules``) of ``logits  # [n, vocab]``: the
    rows of ``tree``'s nodes, or (no tree) the one row after its committed context. Raw logits
    when the request has no rule."""
    if request.rules is None and request.grammar is None:
        return logits
    paths = [()] if tree is None else _paths(tree)
    allowed = None if request.grammar is None else _allowed(request.grammar, tree, logits.shape[1])
    return apply_rules(logits, request.rules or RowRules(), prompt_ids=request.prompt_token_ids,
                       output_ids=request.output_token_ids, paths=paths, allowed=allowed)


def _allowed(matcher: Any, tree: TokenTree | None, vocab: int) -> torch.Tensor:  # [n, vocab] bool
    """The grammar's allowed set after each node's path (the matcher is forked along each path
    and rolled back, so it ends where it began)."""
    import llguidance.torch as llg_torch

    n = 1 if tree is None else tree.num_nodes
    bitmask = llg_torch.allocate_token_bitmask(n, vocab)  # [n, ceil(vocab / 32)] int32
    llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)
    if tree is not None:
        children: list[list[int]] = [[] for _ in range(n)]
        for node in range(1, n):
            children[tree.parent_ids[node]].append(node)
        _fill_subtree(matcher, tree, children, bitmask, 0, vocab)
    return unpack_bitmask(bitmask, vocab)


def _fill_subtree(matcher: Any, tree: TokenTree, children: list[list[int]], bitmask: torch.Tensor, node: int,
                  vocab: int) -> None:
    """Masks of ``node``'s descendants, ``node``'s own row already filled (depth first)."""
    import llguidance.torch as llg_torch

    allowed = unpack_bitmask(bitmask[node:node + 1], vocab)[0]
    for child in children[node]:
        token = tree.token_ids[child]
        if not bool(allowed[token]) or not matcher.consume_token(token):
            bitmask[child] = bitmask[node]  # never accepted: the parent's row forbids its token
            _copy_subtree(children, bitmask, child)
            continue
        llg_torch.fill_next_token_bitmask(matcher, bitmask, child)
        _fill_subtree(matcher, tree, children, bitmask, child, vocab)
        matcher.rollback(1)


def _copy_subtree(children: list[list[int]], bitmask: torch.Tensor, node: int) -> None:
    for child in children[node]:
        bitmask[child] = bitmask[node]
        _copy_subtree(children, bitmask, child)


def _paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Each node's tokens after the root (the root's: empty)."""
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, tree.num_nodes):
        paths.append(paths[tree.parent_ids[node]] + (tree.token_ids[node],))
    return paths
