"""The speculation cluster as the router sees it: drafter clients with deadlines.

Every drafter is called once per step with the whole batch. A drafter that errors, hangs
past its deadline or returns garbage is dropped from that step (the request goes on with
the remaining drafters, or none: plain decoding), and counted as a failure; text never
changes because verification decides every token.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from cosine_ray.algo.tree import TokenTree
from cosine_ray.engine.drafters.base import DraftFeedback, DraftInput, DraftProposal, Drafter

log = logging.getLogger(__name__)


class DrafterClient(Protocol):
    name: str

    async def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]: ...

    async def observe(self, feedback: Sequence[DraftFeedback]) -> None: ...

    async def release(self, request_ids: Sequence[str]) -> None: ...


class LocalDrafterClient:
    """DrafterClient over an in-process drafter."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.name = drafter.name

    async def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return self.drafter.propose(inputs)

    async def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        self.drafter.observe(feedback)

    async def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.drafter.release(rid)


@dataclass(slots=True)
class SpeculationStats:
    failures: dict[str, int] = field(default_factory=dict)

    def failed(self, name: str) -> None:
        self.failures[name] = self.failures.get(name, 0) + 1


def is_valid_proposal(p: object, item: DraftInput, vocab_size: int) -> bool:
    """A proposal the tree may use: right request, within budget, tokens in the vocabulary."""
    if not isinstance(p, DraftProposal) or p.request_id != item.request_id:
        return False
    if len(p.paths) != len(p.confidences) or p.num_draft_tokens > item.max_draft_tokens:
        return False
    for path, confs in zip(p.paths, p.confidences):
        if len(path) != len(confs):
            return False
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in path):
            return False
        if any(not 0.0 <= c <= 1.0 for c in confs):
            return False
    return True


async def gather_proposals(clients: Sequence[DrafterClient], inputs: Sequence[DraftInput], *,
                           deadline_s: float, vocab_size: int,
                           stats: SpeculationStats | None = None) -> list[list[DraftProposal]]:
    """Ask every drafter for the whole batch at once; returns proposals per input.

    Each call has its own deadline; a late, failing or malformed drafter contributes nothing.
    """
    per_input: list[list[DraftProposal]] = [[] for _ in inputs]
    if not inputs or not clients:
        return per_input

    async def call(client: DrafterClient):
        return await asyncio.wait_for(client.propose(inputs), timeout=deadline_s)

    results = await asyncio.gather(*(call(c) for c in clients), return_exceptions=True)
    for client, result in zip(clients, results):
        if isinstance(result, BaseException) or not isinstance(result, list) or len(result) != len(inputs):
            log.warning("drafter %s dropped from this step: %r", client.name, result)
            if stats is not None:
                stats.failed(client.name)
            continue
        for i, (item, proposal) in enumerate(zip(inputs, result)):
            if is_valid_proposal(proposal, item, vocab_size):
                if proposal.paths:
                    per_input[i].append(
                        proposal if proposal.drafter else
                        DraftProposal(proposal.request_id, proposal.paths, proposal.confidences, client.name))
            elif stats is not None:
                stats.failed(client.name)
    return per_input


def merge_proposals(root_token_id: int, proposals: Sequence[DraftProposal], budget: int, *,
                    min_confidence: float = 0.0) -> tuple[TokenTree, list[str]]:
    """Union of all drafters' paths as one tree of at most ``budget`` draft nodes.

    Nodes are kept by cumulative confidence (TreeSelection): all paths are merged, then the
    ``budget`` draft nodes with the highest product of confidences along their path survive
    (a node's cumulative confidence never exceeds its parent's, so ancestors survive first).
    Returns the tree and, per node, the first drafter that proposed it ("" for the root).
    """
    paths, confs, owners = [], [], []
    for p in proposals:
        for path, c in zip(p.paths, p.confidences):
            paths.append(path)
            confs.append(c)
            owners.append(p.drafter)
    full = TokenTree.from_paths(root_token_id, paths, confs)
    node_owner = [""] * full.num_nodes
    lookup = {}
    for i in range(1, full.num_nodes):
        lookup[(full.parent_ids[i], full.token_ids[i])] = i
    for path, owner in zip(paths, owners):
        node = 0
        for tok in path:
            node = lookup[(node, int(tok))]
            if not node_owner[node]:
                node_owner[node] = owner
    cum = full.cumulative_confidences()
    eligible = [i for i in range(1, full.num_nodes) if cum[i] >= min_confidence]
    if len(eligible) == full.num_draft_tokens <= budget:
        return full, node_owner
    # cum[child] <= cum[parent] and parents have smaller indices, so the top-`budget` set by
    # (-cum, index) — and the set above a threshold — always holds every kept node's ancestors.
    kept = sorted(sorted(eligible, key=lambda i: (-cum[i], i))[:budget])
    return full.select(kept), [""] + [node_owner[k] for k in kept]
