"""The speculation cluster as the engine sees it: drafter clients with deadlines.

Two ways to draft a batch, both one call per drafter for all the requests routed to it:

- ``fuse_drafts``: CoSine's token fusion (eq. 4, ``algo.fusion``), round by round — each
  round asks every drafter to continue the fused prefix (and its own losing token) of each
  of its requests, then fuses the answers by calibrated confidence. A lookup drafter answers
  a whole chain ahead (``continue_chains``) and is called again only for prefixes its chain
  does not cover, i.e. after fusion's trunk left it: the rounds are the same, the drafter
  round trips far fewer. A model drafter answers one level a call, since each level is a
  forward that a chain fusion leaves would waste;
- ``gather_proposals``: each drafter proposes whole paths on its own (single-drafter
  speculation, and the union-of-paths mode).

Either way TreeSelection (``algo.tree_selection``) then builds the tree. A drafter that errors, hangs past its
deadline or returns garbage is dropped (for the step, or for the rest of the fusion rounds)
and counted as a failure; the request goes on with the remaining drafters, or none (plain
decoding). Text never changes because verification decides every token.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Mapping, Sequence

from cosine_ray.algo.fusion import Calibrate, FusedPath, FusionState
from cosine_ray.engine.drafters.base import Candidates, ContinueQuery, DraftInput, DraftProposal
from cosine_ray.engine.types import DraftingStats
from cosine_ray.engine.worker.clients import DrafterClient

log = logging.getLogger(__name__)


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


def is_valid_candidates(cands: object, k: int, vocab_size: int) -> bool:
    """An answer for one prefix: at most ``k`` ``(token, confidence)`` pairs, tokens in the vocabulary."""
    if not isinstance(cands, (list, tuple)) or len(cands) > k:
        return False
    for c in cands:
        if not isinstance(c, (list, tuple)) or len(c) != 2:
            return False
        tok, conf = c
        if not isinstance(tok, int) or not 0 <= tok < vocab_size:
            return False
        if not isinstance(conf, (int, float)) or not 0.0 <= conf <= 1.0:
            return False
    return True


async def continue_via_propose(client: DrafterClient, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
    """``continue_drafts`` for a drafter that only implements ``propose``: one propose call
    per prefix slot with the prefix appended to the context and a budget of ``k`` (first
    tokens of its paths). Stateless drafters answer the same; stateful ones may rebuild."""
    out: list[list[Candidates]] = [[[] for _ in q.prefixes] for q in queries]
    for slot in range(max((len(q.prefixes) for q in queries), default=0)):
        live = [(i, q) for i, q in enumerate(queries) if slot < len(q.prefixes)]
        inputs = [DraftInput(q.request_id, tuple(q.context_token_ids) + tuple(q.prefixes[slot]), q.k) for _, q in live]
        proposals = await client.propose(inputs)
        if not isinstance(proposals, list) or len(proposals) != len(inputs):
            raise ValueError(f"propose returned {type(proposals).__name__} for {len(inputs)} inputs")
        for (i, q), p in zip(live, proposals):
            firsts = [(path[0], confs[0]) for path, confs in zip(p.paths, p.confidences) if path]
            out[i][slot] = firsts[:q.k]
    return out


def _is_synchronous(client: object) -> bool:
    """An in-process client whose calls never yield (``engine.worker.clients.LocalDrafterClient``)."""
    return bool(getattr(client, "synchronous", False))


async def call_drafters(clients: Mapping[str, DrafterClient], batches: Mapping[str, list], method: str,
                        deadline_s: float) -> dict[str, object]:
    """One call per drafter (its batch), concurrently, each with its own deadline. In-process
    drafters (``synchronous``) are awaited one after another in place: a task and a deadline
    per call would only let the event loop run other lanes' host work in the middle of this
    step's drafting, delaying its forward (on a GPU, two lanes then draft together and
    verify together instead of taking turns)."""
    names = [n for n, batch in batches.items() if batch and n in clients]

    def work(name: str):
        client = clients[name]
        if method == "continue_drafts" and not hasattr(client, "continue_drafts"):
            return continue_via_propose(client, batches[name])
        return getattr(client, method)(batches[name])

    async def call(name: str):
        return await asyncio.wait_for(work(name), timeout=deadline_s)

    results: dict[str, object] = {}
    remote = [n for n in names if not _is_synchronous(clients[n])]
    for name in names:
        if name not in remote:
            try:
                results[name] = await work(name)
            except Exception as exc:  # noqa: BLE001 - dropped and counted like a remote failure
                results[name] = exc
    if remote:
        results.update(zip(remote, await asyncio.gather(*(call(n) for n in remote), return_exceptions=True)))
    return {n: results[n] for n in names}


async def gather_proposals(clients: Mapping[str, DrafterClient], batches: Mapping[str, Sequence[DraftInput]], *,
                           deadline_s: float, vocab_size: int,
                           stats: DraftingStats | None = None) -> dict[str, list[DraftProposal]]:
    """Ask each drafter for whole draft paths for the requests routed to it.

    Returns request id → valid, non-empty proposals; a late, failing or malformed drafter
    contributes nothing."""
    per_request: dict[str, list[DraftProposal]] = {}
    results = await call_drafters(clients, {n: list(b) for n, b in batches.items()}, "propose", deadline_s)
    for name, result in results.items():
        inputs = batches[name]
        if isinstance(result, BaseException) or not isinstance(result, list) or len(result) != len(inputs):
            log.warning("drafter %s dropped from this step: %r", name, result)
            if stats is not None:
                stats.failed(name)
            continue
        for item, proposal in zip(inputs, result):
            if is_valid_proposal(proposal, item, vocab_size):
                if proposal.paths:
                    per_request.setdefault(item.request_id, []).append(
                        DraftProposal(proposal.request_id, proposal.paths, proposal.confidences, name))
            elif stats is not None:
                stats.failed(name)
    return per_request


async def fuse_drafts(clients: Mapping[str, DrafterClient], states: Mapping[str, FusionState],
                      contexts: Mapping[str, Sequence[int]], *, deadline_s: float, vocab_size: int,
                      stats: DraftingStats | None = None, live: Callable[[str], bool] | None = None) -> DraftingStats:
    """Run fusion rounds until every state is done.

    Each round needs, per drafter and request, its answers for a few prefixes. Answers come
    from the chains the drafter returned earlier in this step; the prefixes no chain covers
    go to the drafter in one call for all its requests (``continue_chains`` to the end of
    the request's depth; ``continue_drafts``, one position, for a client without it). A
    drafter that fails a call is dropped for the remaining rounds of this step. A request for
    which ``live`` turns false (aborted while drafting) gets no further rounds: a later call
    would recreate the per-request state its release has just freed on the drafters."""
    dropped: set[str] = set()
    known: dict[tuple[str, str], dict[tuple[int, ...], Candidates]] = {}
    calls = stats if stats is not None else DraftingStats()
    while True:
        wanted: dict[str, dict[str, tuple[tuple[int, ...], ...]]] = {}  # request → drafter → prefixes
        for rid, state in states.items():
            if not state.done and live is not None and not live(rid):
                state.done = True
            if not state.done:
                wanted[rid] = {n: prefixes for n, prefixes in state.queries().items() if n not in dropped}
        if not any(wanted.values()):
            return calls
        calls.rounds += 1
        batches: dict[str, list[ContinueQuery]] = {}
        for rid, per_drafter in wanted.items():
            for name, prefixes in per_drafter.items():
                cache = known.get((name, rid), {})
                missing = tuple(p for p in prefixes if p not in cache)
                if missing:  # the prefixes of one round all have the trunk's length
                    batches.setdefault(name, []).append(ContinueQuery(
                        rid, tuple(contexts[rid]), missing, 1, depth=states[rid].max_depth - len(missing[0])))
        if batches:
            calls.calling_rounds += 1
            calls.calls += sum(1 for name in batches if name in clients)
            for name, ok in (await _fetch_chains(clients, batches, deadline_s, vocab_size, known)).items():
                if not ok:
                    log.warning("drafter %s dropped from this step's fusion", name)
                    dropped.add(name)
                    calls.failed(name)
        for rid, per_drafter in wanted.items():
            answers: dict[str, list[Candidates]] = {}
            for name, prefixes in per_drafter.items():
                cache = known.get((name, rid), {})
                if name not in dropped and all(p in cache for p in prefixes):
                    answers[name] = [cache[p] for p in prefixes]
            states[rid].absorb(answers)


async def _fetch_chains(clients: Mapping[str, DrafterClient], batches: Mapping[str, list[ContinueQuery]],
                        deadline_s: float, vocab_size: int,
                        known: dict[tuple[str, str], dict[tuple[int, ...], Candidates]]) -> dict[str, bool]:
    """One call per drafter; stores every answered position under its prefix in ``known``.
    Returns drafter → whether its answer was well formed (else nothing of it is stored)."""
    chained = {n: b for n, b in batches.items() if hasattr(clients.get(n), "continue_chains")}
    calls = (call_drafters(clients, chained, "continue_chains", deadline_s),
             call_drafters(clients, {n: b for n, b in batches.items() if n not in chained}, "continue_drafts", deadline_s))
    if all(_is_synchronous(clients.get(n)) for n in batches):  # nothing to wait on concurrently
        results, plain = [await c for c in calls]
    else:
        results, plain = await asyncio.gather(*calls)
    for name, result in plain.items():  # one position per prefix: a chain of one
        if isinstance(result, list):
            plain[name] = [[[c] for c in r] if isinstance(r, list) else r for r in result]
    results.update(plain)
    ok: dict[str, bool] = {}
    for name, result in results.items():
        queries = batches[name]
        ok[name] = (not isinstance(result, BaseException) and isinstance(result, list) and len(result) == len(queries)
                    and all(is_valid_chains(r, q, vocab_size) for q, r in zip(queries, result)))
        if not ok[name]:
            continue
        for q, chains in zip(queries, result):
            cache = known.setdefault((name, q.request_id), {})
            for prefix, chain in zip(q.prefixes, chains):
                for cands in chain:
                    cache[prefix] = cands
                    if not cands:
                        break
                    prefix = prefix + (int(cands[0][0]),)
    return ok


def is_valid_chains(chains: object, q: ContinueQuery, vocab_size: int) -> bool:
    """A ``continue_chains`` answer for one query: per prefix, 1..depth well-formed candidate lists."""
    return (isinstance(chains, list) and len(chains) == len(q.prefixes)
            and all(isinstance(c, list) and 1 <= len(c) <= q.depth and all(is_valid_candidates(x, q.k, vocab_size) for x in c)
                    for c in chains))


def proposals_to_paths(proposals: Sequence[DraftProposal], calibrate: Calibrate | None = None) -> list[FusedPath]:
    paths = []
    for p in proposals:
        for index, (path, confs) in enumerate(zip(p.paths, p.confidences)):  # a drafter's first path: its trunk
            cal = tuple(calibrate(p.drafter, c, depth, index == 0) if calibrate else c
                        for depth, c in enumerate(confs, start=1))
            paths.append(FusedPath(tuple(path), cal, (p.drafter,) * len(path), tuple(confs), (index == 0,) * len(path)))
    return paths
