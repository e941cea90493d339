"""Suffix drafter: model-free drafts from what this server has already generated.

SuffixDecoding (Oliaro et al., arXiv 2411.04975) in our own form. Two ``SuffixIndex``es
(``suffix_index``) answer "what followed the end of this context before?":

- *local*: one per request, over its own context (prompt + verified output), grown with
  each call's new tokens;
- *global*: shared, over finished requests' outputs (``ingest``), FIFO-evicted by whole
  request beyond ``max_cached_requests`` / ``max_indexed_tokens``; seeded from shipped
  datastores (``from_datastore``) and kept across restarts as Parquet (``save``/``load``).

Every match length L in each index is tried (longest first); a draft from L is at most
``min(max_spec_tokens, ⌊L · max_spec_factor + max_spec_offset⌋)`` tokens and stops where the
cumulative probability falls below ``min_token_prob``; the best-scoring node (expected
accepted tokens) of the two indexes is the step's *anchor*, and drafts walk the implicit
suffix tree below it (``suffix_tree``). *Peers*: a request also looks for long matches in the
local indexes of up to ``max_peers`` requests in flight with the same prompt, so identical
questions sent seconds apart share the first one's output while it is being written.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from cosine_ray.engine.drafters.base import (Candidates, ContinueQuery, DraftFeedback, DraftInput, DraftProposal,
                                             FinishedText)
from cosine_ray.engine.drafters.lookup.datastore import Datastore
from cosine_ray.engine.drafters.lookup.ngram import grow_paths
from cosine_ray.engine.drafters.lookup.suffix_index import SuffixIndex, read_snapshot, write_snapshot
from cosine_ray.engine.drafters.lookup.suffix_tree import Anchor


@dataclass(frozen=True, slots=True)
class SuffixConfig:
    max_depth: int = 32
    """Longest match considered: the pattern is the context's last ``max_depth`` tokens
    (the paper's tree depth, 24-64). Costs one comparison column per lookup, no memory."""
    key_lengths: tuple[int, ...] = (1, 3, 8)
    """k-gram lengths with a hash chain; matches shorter than the first are never found.
    Each costs ~12 B per indexed token. Long keys find old long matches, short keys see
    the recent occurrences of common text."""
    max_occurrences: int = 32
    """Occurrences examined per key length, most recent first: counts are over at most
    this many (times the number of key lengths) earlier positions."""
    min_match_len: int = 1
    """Shortest match length that may draft."""
    max_spec_tokens: int = 16
    """Longest draft path, whatever the match length."""
    max_spec_factor: float = 1.0
    """A match of length L drafts at most ``⌊L · factor + offset⌋`` tokens per path."""
    max_spec_offset: float = 0.0
    """See ``max_spec_factor``; negative values demand longer matches per drafted token."""
    min_token_prob: float = 0.1
    """A path stops before a token whose cumulative probability (product of the count
    ratios from the anchor) falls below this."""
    max_branches: int = 2
    """Distinct first tokens ``propose`` returns (1 = a single path, as in the paper
    without tree speculation); the budget then goes best-first by cumulative probability."""
    count_smoothing: float = 0.0
    """Pseudo-count added to each denominator; 1 makes a continuation seen once 1/2."""
    max_cached_requests: int = 10_000
    """Finished requests kept in the global index (FIFO); 0 turns the global index off."""
    max_indexed_tokens: int = 1_000_000
    """Tokens kept in the global index (FIFO by whole request); ~40 B each in memory."""
    num_prompt_context_tokens: int = 32
    """Prompt tokens stored in front of each ingested output: matched against, never
    proposed (so a repeated prompt drafts its output from the first token on)."""
    max_tracked_requests: int = 4096
    """Per-request indexes kept at most (least recently used dropped; rebuilt on demand)."""
    use_local: bool = True
    """Keep a per-request index of the request's own context. A domain expert drafting beside
    the context n-gram drafter leaves it off: that drafter already covers the context."""
    max_peers: int = 8
    """In-flight requests with the same prompt whose contexts (prompt + output so far) a
    request may also draft from, the latest to arrive first (0 = none): the global index
    learns a request only when it finishes, so without them an identical request that arrives
    while the first is still generating drafts nothing from it. Peers are found by one
    dictionary lookup of the prompt's hash, so a request whose prompt no other request in
    flight shares costs nothing more; a peer is matched on ``key_lengths[-1]`` tokens or more."""

    def __post_init__(self) -> None:
        keys = tuple(self.key_lengths)
        object.__setattr__(self, "key_lengths", keys)
        if not 1 <= self.max_depth <= 256:
            raise ValueError(f"max_depth must be in [1, 256], got {self.max_depth}; the paper uses 24-64")
        if not keys or any(not isinstance(k, int) or k < 1 for k in keys) or list(keys) != sorted(set(keys)):
            raise ValueError(f"key_lengths must be increasing positive ints such as (1, 3, 8), got {keys!r}")
        if keys[-1] > self.max_depth:
            raise ValueError(f"key_lengths {keys} has a key longer than max_depth={self.max_depth}; "
                             "shorten the key or raise max_depth")
        if not keys[0] <= self.min_match_len <= self.max_depth:
            raise ValueError(f"min_match_len={self.min_match_len} must be in [key_lengths[0]={keys[0]}, "
                             f"max_depth={self.max_depth}]")
        if self.max_occurrences < 1:
            raise ValueError(f"max_occurrences must be >= 1, got {self.max_occurrences}")
        if self.max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be >= 1, got {self.max_spec_tokens}")
        if self.max_spec_factor < 0.0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_branches < 1:
            raise ValueError(f"max_branches must be >= 1, got {self.max_branches}")
        if self.count_smoothing < 0.0:
            raise ValueError(f"count_smoothing must be >= 0, got {self.count_smoothing}")
        if self.max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0 (0 = no global index), got {self.max_cached_requests}")
        if self.max_indexed_tokens < 1:
            raise ValueError(f"max_indexed_tokens must be >= 1, got {self.max_indexed_tokens}")
        if self.num_prompt_context_tokens < 0:
            raise ValueError(f"num_prompt_context_tokens must be >= 0, got {self.num_prompt_context_tokens}")
        if self.max_tracked_requests < 1:
            raise ValueError(f"max_tracked_requests must be >= 1, got {self.max_tracked_requests}")
        if self.max_peers < 0:
            raise ValueError(f"max_peers must be >= 0 (0 = no peer matches), got {self.max_peers}")

    def max_draft_len(self, match_len: int) -> int:
        """The paper's adaptive length: ``min(max_spec_tokens, ⌊L · factor + offset⌋)``."""
        return max(0, min(self.max_spec_tokens, int(match_len * self.max_spec_factor + self.max_spec_offset)))


def _make_index(config: SuffixConfig, *, is_global: bool) -> SuffixIndex:
    if not is_global:
        return SuffixIndex(config.key_lengths, max_depth=config.max_depth, max_occurrences=config.max_occurrences)
    return SuffixIndex(config.key_lengths, max_depth=config.max_depth, max_occurrences=config.max_occurrences,
                       max_tokens=config.max_indexed_tokens, max_sequences=config.max_cached_requests,
                       initial_capacity=4096)


class _RequestState:
    __slots__ = ("index", "indexed", "context", "anchor", "anchor_version", "origin")

    def __init__(self, config: SuffixConfig, origin: int) -> None:
        self.origin = origin
        """Hash of the context this drafter first saw, less its last token (the tree root):
        the prompt, when the drafter is asked from the request's first step on."""
        self.index = _make_index(config, is_global=False)
        self.indexed = config.use_local
        """Whether ``index`` follows the context: always with ``use_local``, else from the
        first time another request with the same origin needs it as a peer."""
        self.context: tuple[int, ...] = ()
        self.anchor: Anchor | None = None
        self.anchor_version = -1

    def update(self, context: tuple[int, ...], config: SuffixConfig) -> None:
        """Index the tokens appended since the last call; rebuild on a non-extension."""
        old, n = self.context, len(self.context)
        if context is old or context == old:
            self.context = context
            return
        if self.indexed:
            if len(context) > n and context[:n] == old:
                self.index.extend(context[n:])
            else:
                self.index = _make_index(config, is_global=False)
                self.index.add_sequence(context)
        self.context, self.anchor, self.anchor_version = context, None, -1

    def start_indexing(self) -> None:
        if not self.indexed:
            self.index.add_sequence(self.context)
            self.indexed = True


class SuffixDrafter:
    """SuffixDecoding over per-request and global suffix indexes (the ``Drafter`` protocol)."""

    def __init__(self, config: SuffixConfig | None = None, *, name: str = "suffix", domain: str | None = None) -> None:
        self.config = config or SuffixConfig()
        self.name = name
        self.domain = domain
        """Learn only from finished requests of this domain (``learn``): a live domain expert.
        None learns from every request."""
        self._states: OrderedDict[str, _RequestState] = OrderedDict()
        self._by_origin: dict[int, dict[str, _RequestState]] = {}
        """Tracked requests by ``origin`` (their prompt), in the order they were first seen."""
        self._global = _make_index(self.config, is_global=True) if self.config.max_cached_requests > 0 else None

    # ---- learning ----------------------------------------------------------------------------
    def ingest(self, token_ids: Sequence[int], *, prompt_len: int = 0) -> None:
        """Add one finished request (``token_ids`` = prompt + output) to the global index.

        Only the output is proposed from; the prompt's last ``num_prompt_context_tokens``
        tokens are stored in front of it as match context. ``prompt_len=0`` indexes the
        whole sequence (datastore rows). The oldest requests are evicted beyond the caps."""
        if self._global is None:
            return
        tokens = [int(t) for t in token_ids]
        if tokens and min(tokens) < 0:
            raise ValueError(f"token id {min(tokens)} is negative; token ids come from the target's tokenizer")
        if not 0 <= prompt_len <= len(tokens):
            raise ValueError(f"prompt_len={prompt_len} must be in [0, {len(tokens)}] (the sequence's length)")
        if prompt_len == len(tokens):
            return  # no output: nothing to propose from
        kept = min(prompt_len, self.config.num_prompt_context_tokens)
        self._global.add_sequence(tokens[prompt_len - kept:], num_context_tokens=kept)

    def learn(self, texts: Sequence[FinishedText]) -> None:
        """Ingest the finished requests of this drafter's domain (all of them without one)."""
        for t in texts:
            if self.domain is None or t.domain == self.domain:
                self.ingest(t.token_ids, prompt_len=t.prompt_len)

    def ingest_many(self, sequences: Iterable[Sequence[int]], *, prompt_lens: Sequence[int] | None = None) -> None:
        for i, seq in enumerate(sequences):
            self.ingest(seq, prompt_len=0 if prompt_lens is None else prompt_lens[i])

    @classmethod
    def from_datastore(cls, datastores: Datastore | Sequence[Datastore], config: SuffixConfig | None = None, *,
                       name: str = "suffix", domain: str | None = None) -> "SuffixDrafter":
        """A drafter whose global index starts with the datastores' sequences (whole rows)."""
        drafter = cls(config, name=name, domain=domain)
        for ds in [datastores] if isinstance(datastores, Datastore) else datastores:
            drafter.ingest_many(ds.sequences)
        return drafter

    def save(self, path: str | os.PathLike) -> Path:
        """Write the global index's sequences (oldest first) to Parquet, atomically."""
        rows = self._global.sequences() if self._global is not None else []
        return write_snapshot(path, rows, {"drafter": self.name})

    @classmethod
    def load(cls, path: str | os.PathLike, config: SuffixConfig | None = None, *,
             name: str = "suffix") -> "SuffixDrafter":
        """A drafter whose global index is the snapshot ``save`` wrote (re-indexed with
        ``config``; its caps apply, evicting the snapshot's oldest rows first)."""
        rows = read_snapshot(path)
        drafter = cls(config, name=name)
        if drafter._global is not None:
            for tokens, num_context_tokens in rows:
                drafter._global.add_sequence(tokens, num_context_tokens=num_context_tokens)
        return drafter

    # ---- the Drafter protocol ----------------------------------------------------------------
    def propose(self, inputs: Sequence[DraftInput]) -> list[DraftProposal]:
        return [self._propose_one(item) for item in inputs]

    def continue_drafts(self, queries: Sequence[ContinueQuery]) -> list[list[Candidates]]:
        """Per prefix: the anchor's children at ``prefix`` (the committed context is indexed,
        the prefix is walked, never indexed)."""
        min_prob = self.config.min_token_prob
        out = []
        for q in queries:
            anchor = self._anchor_for(q.request_id, q.context_token_ids)
            out.append([anchor.candidates(tuple(prefix), q.k, min_prob) if anchor is not None else []
                        for prefix in q.prefixes])
        return out

    def continue_chains(self, queries: Sequence[ContinueQuery]) -> list[list[list[Candidates]]]:
        """``base.continue_chains`` in one pass: each level is one more step of the walk."""
        min_prob = self.config.min_token_prob
        out = []
        for q in queries:
            anchor = self._anchor_for(q.request_id, q.context_token_ids) if q.depth > 0 else None
            chains = []
            for prefix in q.prefixes:
                chain: list[Candidates] = []
                prefix = tuple(prefix)
                for _ in range(q.depth):
                    cands = anchor.candidates(prefix, q.k, min_prob) if anchor is not None else []
                    chain.append(cands)
                    if not cands:
                        break
                    prefix += (int(cands[0][0]),)
                chains.append(chain)
            out.append(chains)
        return out

    def observe(self, feedback: Sequence[DraftFeedback]) -> None:
        """Nothing to learn per step: the local index follows the verified context and the
        global index learns from finished requests (``ingest``)."""

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            self._forget(request_id, state)

    def _forget(self, request_id: str, state: _RequestState) -> None:
        group = self._by_origin[state.origin]
        del group[request_id]
        if not group:
            del self._by_origin[state.origin]

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def num_tracked_requests(self) -> int:
        return len(self._states)

    def state_size(self) -> dict[str, int]:
        """Memory held: per-request (local) indexes and the global index."""
        g = self._global
        return {"requests": len(self._states),
                "local_tokens": sum(s.index.num_tokens for s in self._states.values()),
                "local_bytes": sum(s.index.num_bytes for s in self._states.values()),
                "global_sequences": g.num_sequences if g is not None else 0,
                "global_tokens": g.num_tokens if g is not None else 0,
                "global_bytes": g.num_bytes if g is not None else 0}

    # ---- internals ---------------------------------------------------------------------------
    def _propose_one(self, item: DraftInput) -> DraftProposal:
        anchor = self._anchor_for(item.request_id, item.context_token_ids)
        if anchor is None or item.max_draft_tokens <= 0:
            return DraftProposal.empty(item.request_id, self.name)
        min_prob = self.config.min_token_prob

        def lookup(prefix_token_ids: list[int], k: int) -> list[tuple[int, float]]:
            return anchor.candidates(tuple(prefix_token_ids), k, min_prob)

        paths, confidences = grow_paths(lookup, [], item.max_draft_tokens,
                                        max_branches=self.config.max_branches, min_confidence=0.0)
        return DraftProposal(item.request_id, paths, confidences, self.name)

    def _anchor_for(self, request_id: str, context: Sequence[int]) -> Anchor | None:
        state = self._states.get(request_id)
        if state is None:
            state = _RequestState(self.config, hash(tuple(context[:-1])))
            self._states[request_id] = state
            self._by_origin.setdefault(state.origin, {})[request_id] = state
            while len(self._states) > self.config.max_tracked_requests:
                self._forget(*self._states.popitem(last=False))
        else:
            self._states.move_to_end(request_id)
        state.update(context if isinstance(context, tuple) else tuple(context), self.config)
        version = self._global.version if self._global is not None else 0
        if state.anchor_version != version:
            state.anchor, state.anchor_version = self._best_anchor(state), version
        return state.anchor

    def _best_anchor(self, state: _RequestState) -> Anchor | None:
        """The best-scoring node over every match length of the local and global indexes, and
        over the long matches in the peers' contexts (``_peers``)."""
        context = state.context
        if not context:
            return None
        cfg = self.config
        tail = [int(t) for t in context[-cfg.max_depth:]]
        best = self._best_in(state.index, tail, "local") if cfg.use_local else None
        found = [self._best_in(self._global, tail, "global")] if self._global is not None else []
        peer_len = max(cfg.min_match_len, cfg.key_lengths[-1])
        found += [self._best_in(peer.index, tail, "peer", min_len=peer_len) for peer in self._peers(state)]
        for other in found:
            if other is not None and (best is None or other.score > best.score):
                best = other
        return best

    def _peers(self, state: _RequestState) -> list[_RequestState]:
        """Up to ``max_peers`` other tracked requests with the same origin (prompt), the latest
        first: requests in flight (a finished one is released, and learnt by the global index)."""
        if not self.config.max_peers:
            return []
        group = self._by_origin[state.origin]
        if len(group) == 1:
            return []
        peers = [other for other in reversed(group.values()) if other is not state][:self.config.max_peers]
        for peer in peers:
            peer.start_indexing()
        return peers

    def _best_in(self, index: SuffixIndex, tail: Sequence[int], source: str, *,
                 min_len: int | None = None) -> Anchor | None:
        """Every match length, longest first, lazily by key length.

        Key length k_j answers the match lengths L in ``[k_j, k_(j+1))`` (the longest key:
        up to ``max_depth``): their occurrences are the positions of its chain and of the
        longer keys' chains with match length >= L. A length is worth trying only while its
        cap exceeds the best score so far (a score never exceeds its cap), so the shorter
        keys' chains are usually never walked. ``min_len`` (default ``min_match_len``) is the
        shortest match length tried: a level whose lengths are all shorter is not looked up."""
        cfg = self.config
        keys = cfg.key_lengths
        min_len = cfg.min_match_len if min_len is None else min_len
        pool: dict[int, tuple[int, list[int]]] = {}  # position → (match length, window)
        best: Anchor | None = None
        for level in range(len(keys) - 1, -1, -1):
            top = cfg.max_depth if level == len(keys) - 1 else keys[level + 1] - 1
            low = max(keys[level], min_len)
            if low > top or (best is not None and cfg.max_draft_len(top) <= best.score):
                break  # the shorter keys' levels are shorter still
            positions, lengths = index.find_level(tail, level)
            fresh = [(p, n) for p, n in zip(positions, lengths) if p not in pool]
            if fresh:
                windows = index.windows([p for p, _ in fresh], cfg.max_spec_tokens)
                pool.update((p, (n, w)) for (p, n), w in zip(fresh, windows))
            if not pool:
                continue
            entries = sorted(pool.items(), reverse=True)  # most recent first
            for match_len in sorted({min(n, top) for _, (n, _) in entries if n >= low}, reverse=True):
                max_len = cfg.max_draft_len(match_len)
                if max_len <= 0 or (best is not None and max_len <= best.score):
                    break
                rows = [w for _, (n, w) in entries if n >= match_len]
                anchor = Anchor(source, match_len, max_len, rows, cfg.count_smoothing)
                if anchor.greedy_score(cfg.min_token_prob) > (best.score if best is not None else 0.0):
                    best = anchor
        return best
