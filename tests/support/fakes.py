"""Fakes for engine-core tests: a lookup-table target that checks the KV protocol, and drafters
that are perfect, wrong, malformed, failing or hanging (the engine-core tests and the owner
factories, ``support.factories``)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter, defaultdict

import torch

from cosine_ray.engine.drafters.base import DraftProposal

VOCAB = 48
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]]


# ---- fake target -----------------------------------------------------------------------------

class TableTarget:
    """TargetClient whose logits are a fixed function of the context (last two tokens and the
    length mod 5). It keeps its own "KV": the committed tokens per request, and the tokens each
    pool block holds (the engine's block tables). It asserts the protocol: a new request starts
    at 0, or at a prefix-cache hit whose blocks hold committed tokens (its context is read back
    from them, so a wrong or corrupted block changes the text); a commit is a root path of the
    last scored tree (a prefix of a prefill chain); every scored level is committed or dropped
    before the next; and ``start_position`` equals the committed length."""

    BLOCK_SIZE = 16

    def __init__(self, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.table = scale * torch.randn(vocab, vocab, 5, vocab, generator=g)
        self.committed: dict[str, list[int]] = {}
        self.last: dict[str, tuple[tuple[int, ...], tuple[int, ...] | None]] = {}
        self.tables: dict[str, tuple[int, ...]] = {}
        self.blocks: dict[int, list[int | None]] = {}
        """Pool block → the token at each of its slots (None: never committed)."""
        self.batch_sizes: list[int] = []
        self.scored: Counter[str] = Counter()
        self.released: list[str] = []
        self.fail_next = 0
        self.prefill_tokens = 0
        """Prompt tokens scored in chains (a prefix-cache hit is not scored again)."""

    def logits(self, context: list[int]) -> torch.Tensor:  # [vocab]
        prev = context[-2] if len(context) > 1 else 0
        return self.table[prev, context[-1], len(context) % 5]

    def next_token(self, context: list[int]) -> int:
        return int(self.logits(context).argmax())

    def greedy(self, prompt: list[int], max_tokens: int, stops: tuple[int, ...] = ()) -> list[int]:
        out: list[int] = []
        while len(out) < max_tokens:
            out.append(self.next_token(prompt + out))
            if out[-1] in stops:
                break
        return out

    async def score(self, items):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("target stage died")
        self.batch_sizes.append(len(items))
        out = []
        for it in items:
            rid = it.request_id
            self.scored[rid] += 1
            if rid not in self.committed:
                self.committed[rid] = self._read_blocks(it.block_table, it.start_position)
            else:
                assert rid not in self.last, f"{rid}: previous level neither committed nor dropped"
            if it.block_table is not None:
                self.tables[rid] = it.block_table
            base = self.committed[rid]
            assert it.start_position == len(base), (rid, it.start_position, len(base))
            rows = []
            for node in range(len(it.token_ids)):
                if it.parent_ids is None:
                    path = list(it.token_ids[:node + 1])
                else:
                    path, n = [], node
                    while n != -1:
                        path.append(it.token_ids[n])
                        n = it.parent_ids[n]
                    path.reverse()
                rows.append(self.logits(base + path))
            if it.parent_ids is None:
                self.prefill_tokens += len(it.token_ids)
            logits = torch.stack(rows)  # [n, vocab]
            out.append(logits[len(logits) - it.num_logit_rows:])
            self.last[rid] = (it.token_ids, it.parent_ids)
        return out

    def _read_blocks(self, table, length: int) -> list[int]:
        """The committed tokens a new request's table says it starts with (a prefix-cache hit)."""
        if not length:
            return []
        assert table is not None and len(table) * self.BLOCK_SIZE >= length, (table, length)
        tokens = [self.blocks.get(table[p // self.BLOCK_SIZE], [None] * self.BLOCK_SIZE)[p % self.BLOCK_SIZE]
                  for p in range(length)]
        assert None not in tokens, f"a cache hit on slots never committed: {tokens}"
        return tokens

    def commit(self, commits):
        for c in commits:
            self._keep(c.request_id, c.keep)

    def _keep(self, rid, keep):
        tokens, parents = self.last.pop(rid)
        keep = list(keep)
        if parents is None:
            assert keep == list(range(len(keep))), keep
        else:
            assert keep[0] == 0 and all(parents[b] == a for a, b in zip(keep, keep[1:])), keep
        start = len(self.committed[rid])
        self.committed[rid] += [tokens[k] for k in keep]
        table = self.tables.get(rid)
        if table is not None:  # the committed tokens land in the request's blocks
            for p in range(start, len(self.committed[rid])):
                block = self.blocks.setdefault(table[p // self.BLOCK_SIZE], [None] * self.BLOCK_SIZE)
                block[p % self.BLOCK_SIZE] = self.committed[rid][p]

    async def release(self, request_ids):
        for rid in request_ids:
            self.committed.pop(rid, None)
            self.last.pop(rid, None)
            self.tables.pop(rid, None)
            self.released.append(rid)


# ---- fake drafters ---------------------------------------------------------------------------

class FakeDrafter:
    """DrafterClient base: records calls; ``draft(item)`` returns one proposal."""

    def __init__(self, name: str, target: TableTarget | None = None) -> None:
        self.name = name
        self.target = target
        self.num_calls = 0
        self.num_inputs = 0
        self.observed = []
        self.released: list[str] = []

    async def propose(self, inputs):
        self.num_calls += 1
        self.num_inputs += len(inputs)
        return [self.draft(item) for item in inputs]

    def greedy_path(self, item, n: int) -> list[int]:
        context = list(item.context_token_ids)
        path = []
        for _ in range(n):
            path.append(self.target.next_token(context + path))
        return path

    def draft(self, item) -> DraftProposal:
        return DraftProposal.empty(item.request_id)

    async def observe(self, feedback):
        self.observed.extend(feedback)

    async def release(self, request_ids):
        self.released.extend(request_ids)


class OracleDrafter(FakeDrafter):
    """Knows the target: drafts its greedy continuation, the whole budget (or ``max_len``)."""

    def __init__(self, name: str, target: TableTarget, max_len: int | None = None) -> None:
        super().__init__(name, target)
        self.max_len = max_len

    def draft(self, item):
        n = item.max_draft_tokens if self.max_len is None else min(self.max_len, item.max_draft_tokens)
        path = self.greedy_path(item, n)
        return DraftProposal(item.request_id, [path], [[1.0] * len(path)])


class AdversarialDrafter(FakeDrafter):
    """Always wrong: the target's 2nd and 3rd choices (the most tempting wrong tokens) as two
    branches, each continued greedily, with confidence ``confidence``."""

    def __init__(self, name: str, target: TableTarget, confidence: float = 1.0) -> None:
        super().__init__(name, target)
        self.confidence = confidence

    def draft(self, item):
        context = list(item.context_token_ids)
        ranked = self.target.logits(context).argsort(descending=True).tolist()
        budget = item.max_draft_tokens
        paths = []
        for first in ranked[1:3]:
            n = budget - sum(len(p) for p in paths)
            if n <= 0:
                break
            rest = [self.target.next_token(context + [first])] * (n - 1)
            paths.append(([first] + rest)[:n])
        return DraftProposal(item.request_id, paths, [[self.confidence] * len(p) for p in paths])


class GarbageDrafter(FakeDrafter):
    """Malformed proposals of one kind, built around correct tokens (so accepting one by
    mistake would show in the stats)."""

    PER_ITEM = ("out_of_vocab", "negative_token", "wrong_request_id", "over_budget", "bad_confidence",
                "nan_confidence", "ragged", "float_token")
    WHOLE_CALL = ("short_list", "not_a_list")

    def __init__(self, kind: str, target: TableTarget) -> None:
        super().__init__(kind, target)
        self.kind = kind

    async def propose(self, inputs):
        out = await super().propose(inputs)
        if self.kind == "short_list":
            return out[:-1]
        if self.kind == "not_a_list":
            return None
        return out

    def draft(self, item):
        budget = item.max_draft_tokens
        path = self.greedy_path(item, budget)
        confs = [1.0] * len(path)
        rid = item.request_id
        if self.kind == "out_of_vocab":
            return DraftProposal(rid, [path[:-1] + [self.target.vocab]], [confs])
        if self.kind == "negative_token":
            return DraftProposal(rid, [[-1] + path[1:]], [confs])
        if self.kind == "wrong_request_id":
            return DraftProposal(rid + "-other", [path], [confs])
        if self.kind == "over_budget":
            return DraftProposal(rid, [self.greedy_path(item, budget + 1)], [[1.0] * (budget + 1)])
        if self.kind == "bad_confidence":
            return DraftProposal(rid, [path], [[1.5] * len(path)])
        if self.kind == "nan_confidence":
            return DraftProposal(rid, [path], [[math.nan] * len(path)])
        if self.kind == "ragged":
            return DraftProposal(rid, [path], [confs[:-1]])
        if self.kind == "float_token":
            return DraftProposal(rid, [[float(t) for t in path]], [confs])
        return DraftProposal(rid, [path], [confs])


class RaisingDrafter(FakeDrafter):
    def __init__(self, name: str = "raising", *, on=("propose", "observe", "release")) -> None:
        super().__init__(name)
        self.on = on

    async def propose(self, inputs):
        self.num_calls += 1
        if "propose" in self.on:
            raise RuntimeError("drafter crashed")
        return [DraftProposal.empty(i.request_id) for i in inputs]

    async def observe(self, feedback):
        if "observe" in self.on:
            raise RuntimeError("drafter crashed in observe")

    async def release(self, request_ids):
        if "release" in self.on:
            raise ConnectionError("drafter is gone")
        self.released.extend(request_ids)


class HangingDrafter(FakeDrafter):
    """Answers nothing, after ``seconds``; ``called`` is set when a call has started (a test
    awaits it to act while a step is waiting for this drafter)."""

    def __init__(self, name: str = "hanging", seconds: float = 30.0) -> None:
        super().__init__(name)
        self.seconds = seconds
        self.called = asyncio.Event()

    async def propose(self, inputs):
        self.num_calls += 1
        self.called.set()
        await asyncio.sleep(self.seconds)
        return [DraftProposal.empty(i.request_id) for i in inputs]


async def drain(core, *, max_steps: int = 20000):
    """Step until nothing is left (finished requests released too). Returns tokens and final
    outputs per request, and the largest running batch seen."""
    tokens: dict[str, list[int]] = defaultdict(list)
    finals = {}
    for _ in range(max_steps):
        if not core.has_work:
            return tokens, finals
        for out in await core.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in finals, "finished twice"
                finals[out.request_id] = out
    raise AssertionError("core did not finish")


# ---- fusion behind a drafter that always wins --------------------------------------------------

class LeadingDrafter:
    """A fusion client whose one token wins every round (confidence 0.999), so fusion's trunk
    leaves every other drafter's chain each round: the worst case of a drafter's fusion cost."""

    def __init__(self, token: int, name: str = "leader") -> None:
        self.token, self.name = token, name

    async def continue_drafts(self, queries):
        return [[[(self.token, 0.999)] for _ in q.prefixes] for q in queries]


def fuse_behind_leader(drafter, token: int, context: tuple[int, ...], depth: int, vocab_size: int = 256):
    """One request's fusion state after ``fuse_drafts`` with ``LeadingDrafter(token)`` first and
    ``drafter`` (in process, through ``DrafterWorker``) second."""
    from cosine_ray.algo.fusion import FusionState
    from cosine_ray.engine.drafters.worker import DrafterWorker
    from cosine_ray.engine.owners.drafting import fuse_drafts
    from cosine_ray.engine.worker.clients import LocalDrafterClient

    leader = LeadingDrafter(token)
    states = {"r": FusionState((leader.name, drafter.name), depth)}
    clients = {leader.name: leader, drafter.name: LocalDrafterClient(DrafterWorker(drafter))}
    asyncio.run(fuse_drafts(clients, states, {"r": context}, deadline_s=30.0, vocab_size=vocab_size))
    return states["r"]
