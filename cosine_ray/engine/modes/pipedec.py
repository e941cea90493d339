"""PipeDec's timestep loop for a request that runs alone (arXiv 2504.04104; ``--pipeline-mode pipedec``).

With S stages and one request, plain pipelining keeps one stage busy at a time. PipeDec keeps
all of them busy on one *dynamic prediction tree*: every timestep stage 0 embeds the tree's
newest layer and stage s works on the layer stage s-1 finished (``PipelineTarget.timestep``),
while the drafters add the next layer (``width`` children of the frontier by cumulative
confidence). The last stage's output is the root's logits: the target's own next token y is
committed; if the root has a child y (**hit**) the tree is pruned to its subtree, else
(**miss**) it restarts from y. Each stage's speculative KV level holds the nodes it processed
(``KVCache.extend``); a prune keeps the survivors and commits old roots (``LayerItem.keep``);
the engine's block table covers every stage's level for the session.

Lossless by construction: a token is committed only as the target's own choice at the root.
The engine runs a request here while it is alone in the pool; when another arrives the
session *leaves* (every stage keeps what was committed) and the request goes on in lanes.
See docs/algorithms.md, "PipeDec".
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from cosine_ray.engine.drafters.base import ContinueQuery
from cosine_ray.engine.owners.drafting import call_drafters, is_valid_candidates
from cosine_ray.engine.worker.clients import DrafterClient
from cosine_ray.engine.owners.kv import KVBlocks
from cosine_ray.engine.worker.recovery import RecoveringTarget
from cosine_ray.engine.request import Request
from cosine_ray.engine.worker.scoring import LayerItem
from cosine_ray.engine.owners.verifier import target_token


@dataclass(slots=True)
class _Node:
    token: int
    parent: int | None
    position: int
    cumulative: float
    children: dict[int, int] = field(default_factory=dict)
    """token → node id."""
    expanded: bool = False
    sent: bool = False
    """Given to stage 0."""


class PipeDecSession:
    """One request's prediction tree and what each stage holds of it."""

    def __init__(self, request: Request, num_stages: int, drafters: Sequence[str]) -> None:
        self.request = request
        self.request_id = request.request_id
        self.lane = request.lane
        """The engine lane whose steps run this session's timesteps (only it may end it)."""
        self.drafters = tuple(drafters)
        self.nodes: dict[int, _Node] = {}
        """The live tree (committed and pruned nodes are removed)."""
        self._ids = itertools.count()
        self.root = self._add(request.output_token_ids[-1], None, request.num_tokens - 1, 1.0)
        self.spec: list[list[int]] = [[] for _ in range(num_stages)]
        """Per stage: node ids in its speculative KV level, slot order."""
        self.committed: list[int] = []
        """Old roots committed since a stage holding them last synced (depth order)."""
        self.last_out: list[list[int]] = [[] for _ in range(num_stages)]
        """Per stage: node ids of its output rows in the last timestep."""
        self.base = request.num_tokens - 1
        """Committed KV length when the session started."""
        self.num_accepted = 0
        """Tokens committed since (each one a root that entered some stage's committed level)."""

    def slots_needed(self) -> int:
        """KV slots every stage's level fits in: the session's committed tokens and the longest
        speculative level (after this timestep's layers)."""
        return self.base + self.num_accepted + max(len(spec) for spec in self.spec)

    def _add(self, token: int, parent: int | None, position: int, cumulative: float) -> int:
        nid = next(self._ids)
        self.nodes[nid] = _Node(token, parent, position, cumulative)
        if parent is not None and parent in self.nodes:
            self.nodes[parent].children[token] = nid
        return nid

    # ---- what each stage does this timestep ------------------------------------------------
    def layer_items(self) -> list[LayerItem | None]:
        items: list[LayerItem | None] = []
        out: list[list[int]] = []
        for s in range(len(self.spec)):
            if s == 0:
                fresh = [n for n, node in self.nodes.items() if not node.sent]
                depth = min((self.nodes[n].position for n in fresh), default=None)
                layer = [n for n in fresh if self.nodes[n].position == depth]
                rows = None
                for n in layer:
                    self.nodes[n].sent = True
            else:
                prev = self.last_out[s - 1]
                layer = [n for n in prev if n in self.nodes]
                rows = None if len(layer) == len(prev) else tuple(i for i, n in enumerate(prev) if n in self.nodes)
            out.append(layer)
            if not layer:
                items.append(None)
                continue
            keep, num_committed = self.sync(s) or (None, 0)
            slot = {n: i for i, n in enumerate(self.spec[s])}
            items.append(LayerItem(
                self.request_id, tuple(self.nodes[n].token for n in layer),
                tuple(self.nodes[n].position for n in layer),
                tuple(tuple(sorted(slot[a] for a in self.ancestors(n))) for n in layer),
                rows, keep, num_committed))
            self.spec[s].extend(layer)
        self.last_out = out
        return items

    def sync(self, s: int) -> tuple[tuple[int, ...], int] | None:
        """Stage s's prune: its committed old roots first, then its live nodes; None if no change."""
        spec = self.spec[s]
        committed = [i for i, n in enumerate(spec) if n in self.committed]
        live = [i for i, n in enumerate(spec) if n in self.nodes]
        if not committed and len(live) == len(spec):
            return None
        self.spec[s] = [spec[i] for i in live]
        held = {n for sp in self.spec for n in sp}
        self.committed = [n for n in self.committed if n in held]
        return tuple(committed + live), len(committed)

    def leave(self) -> list[tuple[tuple[int, ...], int] | None]:
        """Every stage keeps only what was committed (the lanes path's state)."""
        self.nodes.clear()
        return [self.sync(s) for s in range(len(self.spec))]

    def ancestors(self, nid: int) -> list[int]:
        """Live (uncommitted) ancestors of a node, nearest first."""
        out, parent = [], self.nodes[nid].parent
        while parent is not None and parent in self.nodes:
            out.append(parent)
            parent = self.nodes[parent].parent
        return out

    def path(self, nid: int) -> tuple[int, ...]:
        """Tokens after the root down to ``nid`` (the root itself: empty)."""
        tokens = []
        while nid != self.root:
            tokens.append(self.nodes[nid].token)
            nid = self.nodes[nid].parent
        return tuple(reversed(tokens))

    # ---- the target's answer ------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """The root's next token is ``token``: commit the root, move to its child (hit) or
        restart from ``token`` (miss). Returns whether it was a hit."""
        old = self.nodes[self.root]
        self.committed.append(self.root)
        self.num_accepted += 1
        child = old.children.get(token)
        if child is not None and child in self.nodes:
            keep = {child}
            for nid in sorted(self.nodes):  # ids grow with depth: parents come first
                if self.nodes[nid].parent in keep:
                    keep.add(nid)
            self.nodes = {n: node for n, node in self.nodes.items() if n in keep}
            scale = self.nodes[child].cumulative  # confidences count from the root
            for node in self.nodes.values():
                node.cumulative /= scale
            self.root = child
            return True
        self.nodes.clear()
        self.root = self._add(token, None, old.position + 1, 1.0)
        return False

    def frontier(self, max_depth: int) -> list[int]:
        """The deepest layer, if not expanded yet and within ``max_depth`` of the root."""
        deepest = max(node.position for node in self.nodes.values())
        if deepest - self.nodes[self.root].position >= max_depth:
            return []
        return [n for n, node in self.nodes.items() if node.position == deepest and not node.expanded]


class ModeGuard:
    """For a request alone in the pool: PipeDec or lanes, whichever commits tokens faster on
    this deployment. PipeDec pays with many stages and a drafter whose layers catch the
    target's token; with two stages on a CPU it does not (docs/history/2026-11-25-pipedec.md),
    and no formula knows which case a deployment is in. So the guard measures: it
    runs each mode for ``window_tokens`` tokens (PipeDec first), keeps the faster one, and
    every ``reprobe_tokens`` tokens runs the other for one window again (a request's text,
    the drafters' accuracy and the machine's load change). Rates are tokens per second of wall
    time of the solo request's steps, a switch's refill included; each window's rate is
    averaged with the mode's earlier ones (weight 1/2)."""

    MODES = ("pipedec", "lanes")

    def __init__(self, *, window_tokens: int = 32, reprobe_tokens: int = 512) -> None:
        self.window_tokens = window_tokens
        self.reprobe_tokens = reprobe_tokens
        self.rates: dict[str, float | None] = {m: None for m in self.MODES}
        self.current = "pipedec"
        self._tokens = 0
        self._seconds = 0.0
        self._since_probe = 0

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        """A solo step in ``mode`` committed ``tokens`` in ``seconds``."""
        if mode != self.current:
            return
        self._tokens += tokens
        self._seconds += seconds
        self._since_probe += tokens
        if self._tokens < self.window_tokens or self._seconds <= 0:
            return
        rate = self._tokens / self._seconds
        old = self.rates[mode]
        self.rates[mode] = rate if old is None else 0.5 * (old + rate)
        self._tokens, self._seconds = 0, 0.0
        other = self.MODES[1 - self.MODES.index(mode)]
        if self.rates[other] is None or self._since_probe >= self.reprobe_tokens:
            self.current, self._since_probe = other, 0  # explore, or probe the other again
        else:
            self.current = max(self.MODES, key=lambda m: self.rates[m] or 0.0)


class PipeDec:
    """The engine's PipeDec mode: one session at a time (``EngineCore.step`` decides when)."""

    def __init__(self, target: RecoveringTarget, drafters: Mapping[str, DrafterClient], kv: KVBlocks, *, width: int,
                 max_depth: int | None, vocab_size: int, deadline_s: float,
                 on_drafter_failure: Callable[[str], None] = lambda name: None) -> None:
        self.target = target
        self.kv = kv
        self.clients = dict(drafters)
        self.width = width
        self.max_depth = max_depth or target.inner.num_stages
        self.vocab_size = vocab_size
        self.deadline_s = deadline_s
        self.session: PipeDecSession | None = None
        self.on_drafter_failure = on_drafter_failure
        """Called with a drafter's name for each dropped call or malformed answer (the metric)."""

    async def step(self, request: Request, route: Callable[[], Sequence[str]]) -> tuple[int, ...] | None:
        """One timestep for ``request``: the tokens it commits (none or one), or None when a
        stage was lost (the target recovered; the request re-prefills). A new session asks
        ``route`` for the request's drafters."""
        session = self.session
        if session is None or session.request_id != request.request_id:
            await self.leave()
            await self.target.settle(request.request_id)
            session = self.session = PipeDecSession(request, self.target.inner.num_stages, route())
        items = session.layer_items()
        if not self.kv.ensure(request, session.slots_needed()):
            raise MemoryError(f"KV cache full: PipeDec's tree for {request.request_id} does not fit")
        table = tuple(request.block_table)
        items = [None if item is None else dataclasses.replace(item, block_table=table) for item in items]
        forward = asyncio.ensure_future(self.target.timestep(items))
        try:
            await self._expand(session, request)
        finally:
            ok, logits = await forward
        if not ok:
            self.session = None
            return None
        request.stats.pipedec_timesteps += 1
        if logits is None:
            return ()
        root = session.nodes[session.root]
        row = session.last_out[-1].index(session.root)
        token = target_token(request, logits[row:row + 1], position=root.position + 1)
        request.stats.pipedec_tokens += 1
        request.stats.pipedec_hits += session.accept(token)
        # the root is committed (on each stage when it next syncs); its blocks stay in the table
        # for the session's tree levels, and are trimmed and cached when the session ends
        request.num_computed_tokens = session.base + session.num_accepted
        return (token,)

    async def leave(self, *, keep_kv: bool = True) -> None:
        """End the session: every stage drops the tree and keeps what was committed
        (``keep_kv=False``: the request is gone, its KV is being freed anyway)."""
        session, self.session = self.session, None
        if session is not None and keep_kv:
            await self.target.prune(session.request_id, session.leave())
            self.kv.commit(session.request, session.request.num_tokens - 1)

    def fits(self, request: Request) -> bool:
        """Whether the KV pool can hold a session's tree for ``request`` (else it runs in lanes);
        a request with score rules or log-probabilities runs in lanes too (verification
        applies them at every node)."""
        if request.needs_rows:
            return False
        tree = self.width * (self.max_depth + 1) + 2 * self.target.inner.num_stages
        return self.kv.can_fit(self.kv.blocks_for(request.num_tokens + tree) - len(request.block_table))

    async def _expand(self, session: PipeDecSession, request: Request) -> None:
        """The drafters' part of a timestep: the next tree layer, ``width`` nodes at most."""
        frontier = session.frontier(self.max_depth)
        if not frontier or not session.drafters:
            return
        for n in frontier:
            session.nodes[n].expanded = True
        context = tuple(request.context_token_ids)
        query = ContinueQuery(request.request_id, context, tuple(session.path(n) for n in frontier), self.width)
        results = await call_drafters(self.clients, {name: [query] for name in session.drafters}, "continue_drafts",
                                      self.deadline_s)
        best: dict[tuple[int, int], float] = {}  # (frontier node, token) → highest confidence of any drafter
        for name, result in results.items():
            if isinstance(result, BaseException) or not isinstance(result, list) or len(result) != 1 \
                    or len(result[0]) != len(frontier) \
                    or not all(is_valid_candidates(c, self.width, self.vocab_size) for c in result[0]):
                self.on_drafter_failure(name)
                continue
            for n, cands in zip(frontier, result[0]):
                for token, confidence in cands:
                    key = (n, int(token))
                    best[key] = max(best.get(key, 0.0), float(confidence))
        scored = sorted(((session.nodes[n].cumulative * c, n, t) for (n, t), c in best.items()),
                        key=lambda x: -x[0])
        # No confidence floor: a layer costs a stage about the same with 1 or ``width`` nodes,
        # and a child that is not in the tree when its parent is the root is a whole refill.
        for cumulative, n, token in scored[:self.width]:
            if cumulative > 0.0 and n in session.nodes:
                session._add(token, n, session.nodes[n].position + 1, cumulative)
