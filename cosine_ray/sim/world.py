"""The simulated deployment behind the engine's two client interfaces.

The engine core talks only to a ``TargetClient`` and ``DrafterClient``s, so the simulator gives
it simulated ones and runs the real engine on the virtual clock (``sim.clock``):

- **The target's text** is an oracle: request r's greedy token at position p is a hash of
  (r, p) (``Oracle``). ``SimTarget.score`` returns one-hot logits: each tree node whose path from
    the root matches the oracle gets the oracle's next token, any other node another token, so
  every simulated output equals the oracle's text: the simulator's own lossless check.
- **A forward's time**: the engine's host time on its device (the scenario's ``engine_host``: a
  constant per step plus a term per request), token ids to the first stage, each stage's share
  of T_llm on its device (a FIFO ``Resource``, so lanes pipeline as on real actors), hidden
  states between stages, and the last stage's answer back (logits or token ids).
- **A drafter** (``SimDrafter``) proposes the oracle's token at draft depth d with conditional
  probability α_d of its acceptance model for the request's domain (given its tokens before d
  were right), another token otherwise, and nothing with probability 1 − coverage. Draws are
  hashes of (drafter, request, position, depth); a share ``correlation`` is shared by all
  drafters. Its confidence is ``(1 − sharpness)·α_d + sharpness·[right]``. A call costs the
  drafter's T_ssm on its device plus the link both ways (docs/simulator.md).
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             FinishedText)
from cosine_ray.engine.worker.scoring import KVCommit, LayerItem, ScoreItem
from cosine_ray.sim.clock import Link, Resource
from cosine_ray.sim.latency import DrafterCost, TargetCost

_MASK = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 steps): the simulator's reproducible randomness."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h ^= h >> 31
        h = h * 0x94D049BB133111EB & _MASK
        h ^= h >> 29
    return h


def uniform(*values: int) -> float:
    """A uniform draw in [0, 1) keyed by ``values``."""
    return _mix(*values) / 2.0 ** 64


def key_of(name: str) -> int:
    return zlib.crc32(name.encode())


class Oracle:
    """The target's greedy text: token of request ``r`` at position ``p`` (output positions)."""

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self._keys: dict[str, int] = {}
        self.domains: dict[str, str] = {}
        """Request id → its domain (the runner sets it; drafters read their model for it)."""

    def key(self, request_id: str) -> int:
        k = self._keys.get(request_id)
        if k is None:
            k = self._keys[request_id] = key_of(request_id) ^ self.seed
        return k

    def token(self, request_id: str, position: int) -> int:
        return _mix(self.key(request_id), position) % self.vocab_size

    def other(self, request_id: str, position: int, salt: int) -> int:
        """A token that is not the oracle's at ``position``."""
        right = self.token(request_id, position)
        return (right + 1 + _mix(self.key(request_id), position, salt) % (self.vocab_size - 1)) % self.vocab_size

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self.domains.pop(request_id, None)


# ---- the target --------------------------------------------------------------------------------
@dataclass(slots=True)
class SimStage:
    device: Resource
    cost: TargetCost
    layers: float
    """Share of the target's layers (and of its forward time) this stage runs."""
    link_out: Link | None = None
    """To the next stage (None on the last one)."""


@dataclass(slots=True)
class TargetShape:
    hidden_size: int
    vocab_size: int
    """The *real* target's vocabulary: the size of a logits row the last stage ships."""
    activation_bytes: int = 4
    returns: str = "logits"
    """logits (fp32 rows of every scored node: our engine today) | ids (one token id a node)."""

    @property
    def row_bytes(self) -> int:
        """Bytes the last stage ships back per scored node."""
        return 4 * self.vocab_size if self.returns == "logits" else 8


class SimTarget:
    """``TargetClient`` over simulated stages (see the module docstring)."""

    def __init__(self, oracle: Oracle, stages: Sequence[SimStage], *, shape: TargetShape, host: Resource,
                 step_overhead_s: float, link_in: Link, link_back: Link,
                 overhead_per_request_s: float = 0.0) -> None:
        self.oracle = oracle
        self.stages = list(stages)
        self.shape = shape
        self.host = host
        self.step_overhead_s = step_overhead_s
        self.overhead_per_request_s = overhead_per_request_s
        self.link_in = link_in
        self.link_back = link_back
        self.forwards = 0
        self.decode_forwards = 0
        self.decode_tokens = 0
        self.decode_seconds = 0.0
        """Forwards without a prefill in them: how many, their scored tokens and their stage time
        (``benchmarks/sim/sim_validation.py`` compares them with a real run's)."""

    async def score(self, items: Sequence[ScoreItem]) -> list[torch.Tensor]:
        if not items:
            return []
        new_tokens = [len(it.token_ids) for it in items]
        context = [it.start_position for it in items]
        rows = sum(it.num_logit_rows for it in items)
        await self.host.use(self.step_overhead_s + self.overhead_per_request_s * len(items))
        await self.link_in.send(8 * sum(new_tokens) + 64 * len(items))  # ids + parents, item headers
        decode = all(it.parent_ids is not None for it in items)
        for stage in self.stages:
            cost = stage.layers * stage.cost.seconds(context, new_tokens)
            if decode:
                self.decode_seconds += cost
            await stage.device.use(cost)
            if stage.link_out is not None:
                await stage.link_out.send(sum(new_tokens) * self.shape.hidden_size * self.shape.activation_bytes)
        await self.link_back.send(rows * self.shape.row_bytes)
        self.forwards += 1
        if decode:
            self.decode_forwards += 1
            self.decode_tokens += sum(new_tokens)
        return [self._logits(it) for it in items]

    def _logits(self, item: ScoreItem) -> torch.Tensor:
        oracle, rid = self.oracle, item.request_id
        if item.parent_ids is None:  # prefill: the first output token follows the prompt
            out = torch.zeros(item.num_logit_rows, oracle.vocab_size)
            if not item.num_logit_rows:  # a prompt chunk before the last
                return out
            out[0, oracle.token(rid, item.start_position + len(item.token_ids))] = 1.0
            return out
        root = item.start_position
        on_path = [True] * len(item.token_ids)
        depth = [0] * len(item.token_ids)
        out = torch.zeros(len(item.token_ids), oracle.vocab_size)
        for i, (tok, parent) in enumerate(zip(item.token_ids, item.parent_ids)):
            if parent >= 0:
                depth[i] = depth[parent] + 1
                on_path[i] = on_path[parent] and tok == oracle.token(rid, root + depth[i])
            position = root + depth[i] + 1
            out[i, oracle.token(rid, position) if on_path[i] else oracle.other(rid, position, i)] = 1.0
        return out

    # ---- PipeDec (engine.worker.target.PipelineTarget) -----------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.stages)

    async def timestep(self, items: Sequence[LayerItem | None]) -> torch.Tensor | None:
        """Every stage with a layer works at once on its device: stage 0 gets the layer's ids
        from the engine, stage s the hidden states stage s-1 produced last timestep over the
        stage link; the last stage's rows go back. Its logits are the oracle's next token at
        each row (PipeDec's last stage only ever scores the tree's root, which is on the path)."""
        await self.host.use(self.step_overhead_s + self.overhead_per_request_s)
        last = len(self.stages) - 1

        async def run(s: int, item: LayerItem) -> None:
            stage, n = self.stages[s], len(item.token_ids)
            if s == 0:
                await self.link_in.send(8 * n + 64)
            else:
                await self.stages[s - 1].link_out.send(n * self.shape.hidden_size * self.shape.activation_bytes)
            await stage.device.use(stage.layers * stage.cost.seconds([item.positions[0]], [n]))
            if s == last:
                await self.link_back.send(n * self.shape.row_bytes)

        await asyncio.gather(*(run(s, it) for s, it in enumerate(items) if it is not None))
        self.forwards += 1
        item = items[last]
        if item is None:
            return None
        out = torch.zeros(len(item.token_ids), self.oracle.vocab_size)
        for i, position in enumerate(item.positions):
            out[i, self.oracle.token(item.request_id, position + 1)] = 1.0
        return out

    async def prune(self, request_id: str, per_stage) -> None:
        pass  # no KV here (the oracle is the text)

    async def settle(self, request_id: str) -> None:
        pass

    def commit(self, commits: Sequence[KVCommit]) -> None:
        pass  # the oracle has no KV to keep; the stages' memory is the engine's KV accounting

    async def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.oracle.forget(rid)

    async def recover(self, timeout_s: float) -> bool:
        return True


# ---- the drafters ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Acceptance:
    """One drafter's skill on one domain."""

    by_depth: tuple[float, ...]
    """α_d: P(its token at draft depth d is the target's | its tokens before d were)."""
    coverage: float = 1.0
    """P(it proposes anything at a step)."""


@dataclass(slots=True)
class DrafterModel:
    name: str
    acceptance: Mapping[str, Acceptance]
    """Domain → skill; ``default`` for domains not listed."""
    cost: DrafterCost
    correlation: float = 0.5
    sharpness: float = 0.3
    learns: bool = False

    def skill(self, domain: str) -> Acceptance:
        return self.acceptance.get(domain) or self.acceptance["default"]


class SimDrafter:
    """The ``Drafter`` protocol over an acceptance model (module docstring)."""

    def __init__(self, model: DrafterModel, oracle: Oracle) -> None:
        self.model = model
        self.name = model.name
        self.oracle = oracle
        self._key = key_of(model.name)

    def _answer(self, rid: str, root: int, prefix: Sequence[int], on_path: bool) -> tuple[int, float] | None:
        """The drafter's token after ``context ⊕ prefix`` (root at ``root``), or None."""
        skill = self.model.skill(self.oracle.domains.get(rid, "default"))
        depth = len(prefix) + 1
        r = self.oracle.key(rid)
        if depth > len(skill.by_depth) or uniform(self._key, r, root, 1) >= skill.coverage:
            return None
        alpha = skill.by_depth[depth - 1]
        position = root + depth
        base = (1.0 - self.model.sharpness) * alpha
        if not on_path:  # continuing its own wrong token: nothing here can be accepted
            return self.oracle.other(rid, position, _mix(self._key, *prefix[-2:])), base
        shared = uniform(r, position, depth, 2) < self.model.correlation
        u = uniform(r, position, depth, 3) if shared else uniform(self._key, r, position, depth)
        if u < alpha:
            return self.oracle.token(rid, position), base + self.model.sharpness
        return self.oracle.other(rid, position, self._key), base

    def _on_path(self, rid: str, root: int, prefix: Sequence[int]) -> bool:
        return all(t == self.oracle.token(rid, root + 1 + i) for i, t in enumerate(prefix))

    def _chain(self, rid: str, root: int, prefix: Sequence[int], depth: int) -> list[Candidates]:
        out: list[Candidates] = []
        prefix = list(prefix)
        on_path = self._on_path(rid, root, prefix)
        for _ in range(depth):
            ans = self._answer(rid, root, prefix, on_path)
            if ans is None:
                out.append([])
                break
            out.append([ans])
            on_path = on_path and ans[0] == self.oracle.token(rid, root + len(prefix) + 1)
            prefix.append(ans[0])
        return out

    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        out = []
        for it in inputs:
            chain = self._chain(it.request_id, len(it.context_token_ids) - 1, (), it.max_draft_tokens)
            path = [c[0] for c in chain if c]
            out.append(DraftProposal(it.request_id, [[t for t, _ in path]] if path else [],
                                     [[p for _, p in path]] if path else [], self.name))
        return out

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        return [[(self._chain(q.request_id, len(q.context_token_ids) - 1, p, 1) or [[]])[0] for p in q.prefixes]
                for q in queries]

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        return [[self._chain(q.request_id, len(q.context_token_ids) - 1, p, q.depth) for p in q.prefixes]
                for q in queries]

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        pass

    def release(self, request_id: str) -> None:
        pass


DRAFTER_CALLS = ("propose", "continue_drafts", "continue_chains")


def call_size(method: str, queries: Sequence[DraftInput] | Sequence[ContinueQuery]) -> tuple[int, int, int]:
    """(requests, tokens asked, context tokens sent) of one drafter call: what its T_ssm and
    its link are charged for (``benchmarks/sim/sim_validation.py`` fits T_ssm to real calls sized
    the same way)."""
    if method == "propose":
        tokens = sum(q.max_draft_tokens for q in queries)
    elif method == "continue_drafts":
        tokens = sum(len(q.prefixes) for q in queries)
    elif method == "continue_chains":
        tokens = sum(len(q.prefixes) * q.depth for q in queries)
    else:
        raise ValueError(f"not a drafter call: {method!r}")
    return len(queries), tokens, sum(len(q.context_token_ids) for q in queries)


@dataclass(slots=True)
class SimDrafterClient:
    """``DrafterClient`` for one simulated drafter: each call crosses the link, waits for the
    drafter's device and costs its T_ssm there, and comes back."""

    drafter: SimDrafter
    device: Resource
    link: Link
    calls: int = 0
    learns: bool = False
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.drafter.name

    async def _charge(self, method: str, queries: Sequence[DraftInput] | Sequence[ContinueQuery]) -> None:
        num_requests, num_tokens, context_tokens = call_size(method, queries)
        self.calls += 1
        await self.link.send(8 * context_tokens + 32 * num_requests)
        await self.device.use(self.drafter.model.cost.seconds(num_requests, num_tokens))
        await self.link.send(16 * num_tokens + 16 * num_requests)

    async def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        await self._charge("propose", inputs)
        return self.drafter.propose(inputs)

    async def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        await self._charge("continue_drafts", queries)
        return self.drafter.continue_drafts(queries)

    async def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        await self._charge("continue_chains", queries)
        return self.drafter.continue_chains(queries)

    async def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        pass

    async def release(self, request_ids: Sequence[str]) -> None:
        pass

    async def learn(self, texts: Sequence[FinishedText]) -> None:
        pass


class DomainOfPrompt:
    """The engine's domain classifier in the simulator: the runner knows each request's domain
    and writes it into the prompt's first token (``DOMAIN_TOKEN + index``)."""

    DOMAIN_TOKEN = 1

    def __init__(self, domains: Sequence[str]) -> None:
        self.domains = list(domains)

    def encode(self, domain: str) -> int:
        return self.DOMAIN_TOKEN + self.domains.index(domain)

    def classify(self, token_ids: Sequence[int]) -> tuple[str, float]:
        i = token_ids[0] - self.DOMAIN_TOKEN if token_ids else -1
        return (self.domains[i], 1.0) if 0 <= i < len(self.domains) else ("other", 0.0)

