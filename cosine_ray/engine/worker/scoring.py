"""What crosses the target's boundary in a step: score items in, ids or logits out, KV commits.

One ``ScoreItem`` per request and step carries everything a stage needs, so no metadata
round trip precedes a forward (SiPipe's structure-aware transmission): the new tokens — a
prompt chain (or chunk) at prefill, or a token tree's nodes afterwards — and the request's
block table. ``KVCommit`` is what the engine keeps after verification (the Ray client sends
pending commits with the next forward), ``ScoreOutput`` what the last stage sends back and
``LayerItem`` one PipeDec tree layer: plain data (picklable for Ray) and the pure functions
on it. The workers that run the model are in ``engine.worker.target``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from cosine_ray.algo.tree import TokenTree
from cosine_ray.models.device import indices_to
from cosine_ray.models.kv_cache import KVCache
from cosine_ray.models.llama import StageBatch


@dataclass(frozen=True, slots=True)
class KVCommit:
    """Keep these slots of a request's last speculative level (indices into the level, in
    path order); the rest of the level is dropped (PipeDec's two-level cache)."""

    request_id: str
    keep: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ScoreItem:
    request_id: str
    token_ids: tuple[int, ...]
    """New tokens: the prompt chain (prefill) or a tree's nodes (root first)."""
    parent_ids: tuple[int, ...] | None
    """Tree parents (node 0 = -1); None = a causal chain."""
    start_position: int
    """Committed length before this step: the first new token's (the tree root's) position."""
    all_logits: bool = True
    """Logits for every new token (trees) or only the last one (prefill)."""
    ids_only: bool = False
    """Return the target's argmax token of each of those rows instead of their logits (a
    greedy request needs nothing else; a sampled one needs the distributions)."""
    block_table: tuple[int, ...] | None = None
    """The request's pool blocks after this step's reservation, decided by the engine
    (``engine.owners.kv``); None: the stage allocates its own (direct use of a stage)."""
    wants_logits: bool = True
    """False: no logit row at all (a prompt chunk that is not the prompt's last)."""

    @classmethod
    def prefill(cls, request_id: str, token_ids: Sequence[int], *, start_position: int = 0, final: bool = True,
                ids_only: bool = False, block_table: Sequence[int] | None = None,
                every_row: bool = False) -> "ScoreItem":
        """A chain of context tokens from ``start_position``: a whole prompt, or one chunk of it
        (``final``: the chunk ends the context, so its last token's row is wanted; ``every_row``:
        every token's row is, for prompt log-probabilities)."""
        return cls(request_id, tuple(token_ids), None, start_position, all_logits=every_row,
                   ids_only=ids_only and not every_row,
                   block_table=None if block_table is None else tuple(block_table), wants_logits=final or every_row)

    @classmethod
    def for_tree(cls, request_id: str, tree: TokenTree, start_position: int, *, ids_only: bool = False,
                 block_table: Sequence[int] | None = None) -> "ScoreItem":
        return cls(request_id, tree.token_ids, tree.parent_ids, start_position, ids_only=ids_only,
                   block_table=None if block_table is None else tuple(block_table))

    @property
    def num_logit_rows(self) -> int:
        """Logit rows it wants: every token's (a tree), the last one's (a prompt), or none."""
        n = len(self.token_ids)
        return 0 if not self.wants_logits else n if self.all_logits else 1

    def _tree(self) -> TokenTree:
        return TokenTree(self.token_ids, self.parent_ids, (1.0,) * len(self.token_ids))

    def tree_mask(self) -> torch.Tensor | None:
        return None if self.parent_ids is None else self._tree().attention_mask()

    def positions(self) -> torch.Tensor:
        if self.parent_ids is None:
            return torch.arange(self.start_position, self.start_position + len(self.token_ids))
        return torch.tensor(self._tree().depths(), dtype=torch.long) + self.start_position


def build_stage_batch(items: Sequence[ScoreItem]) -> StageBatch:
    """Flatten a step's items into one varlen batch (shared by every stage of the chain)."""
    counts = [len(it.token_ids) for it in items]
    logit_rows, offset = [], 0
    for it, n in zip(items, counts):
        logit_rows.extend(range(offset + n - it.num_logit_rows, offset + n))
        offset += n
    return StageBatch(
        request_ids=[it.request_id for it in items],
        num_new_tokens=counts,
        positions=torch.cat([it.positions() for it in items]),
        tree_masks=[it.tree_mask() for it in items],
        logit_indices=torch.tensor(logit_rows, dtype=torch.long),
        token_ids=torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long),
    )


@dataclass(frozen=True, slots=True)
class ScoreOutput:
    """What the last stage returns for a step: the argmax token of every logit row (one
    vectorised op and one small device→host copy) and the logits of the rows whose item
    wants them (sampled requests) — not every node's fp32 logits."""

    token_ids: torch.Tensor
    """[num_logit_rows] int64, on the host (pinned on CUDA: read it once ``ready`` has fired)."""
    logits: torch.Tensor
    """[rows of the items without ``ids_only``, vocab] fp32."""
    ready: "torch.cuda.Event | None" = None
    """CUDA: fires when ``token_ids`` has arrived (the step's one device→host copy, left
    asynchronous so the host can plan another lane meanwhile); None: ready now."""

    def wait(self) -> "ScoreOutput":
        if self.ready is not None:
            self.ready.synchronize()
        return self


def score_output(items: Sequence[ScoreItem], logits: torch.Tensor) -> ScoreOutput:
    """logits  # [num_logit_rows, vocab] (the last stage's forward) -> ``ScoreOutput``."""
    ids = logits.argmax(dim=-1)
    ready = None
    if ids.is_cuda:
        token_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        token_ids.copy_(ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        token_ids = ids
    if not any(it.ids_only for it in items):
        return ScoreOutput(token_ids, logits, ready)
    rows, offset = [], 0
    for it, n in zip(items, _row_counts(items)):
        if not it.ids_only:
            rows.extend(range(offset, offset + n))
        offset += n
    return ScoreOutput(token_ids, logits.index_select(0, indices_to(rows, logits.device)), ready)


def _row_counts(items: Sequence[ScoreItem]) -> list[int]:
    return [it.num_logit_rows for it in items]


def split_output(items: Sequence[ScoreItem], out: ScoreOutput) -> list[torch.Tensor]:
    """One tensor per item: [n_i or 1] int64 argmax tokens for an ``ids_only`` item, else its
    [n_i or 1, vocab] logits (``algo.verify.verify_greedy`` and ``verifier.target_token`` take
    either)."""
    counts = _row_counts(items)
    ids = list(out.token_ids.split(counts))
    logits = iter(out.logits.split([n for it, n in zip(items, counts) if not it.ids_only]))
    return [ids[i] if it.ids_only else next(logits) for i, it in enumerate(items)]


def apply_commits(cache: KVCache, items: Sequence[ScoreItem], commits: Sequence[KVCommit] = ()) -> None:
    """Keep earlier steps' accepted slots (``commits``: the Ray client sends them with the next
    forward), open caches for new requests (at a prefix-cache hit's length when the engine
    gives the table) and adopt the engine's tables (every stage)."""
    cache.commit_many((c.request_id, c.keep) for c in commits if c.request_id in cache)
    for it in items:
        if it.request_id in cache:
            continue
        if it.block_table is not None:
            cache.assign(it.request_id, it.block_table, committed_length=it.start_position)
        elif it.start_position != 0:
            raise ValueError(f"request {it.request_id!r} has no KV cache here but starts at "
                             f"position {it.start_position}; re-prefill it")
        else:
            cache.allocate(it.request_id)
    for it in items:
        if it.block_table is not None:  # after the commits: they move slots within the old table
            cache.assign(it.request_id, it.block_table)
    for it in items:
        length = cache.committed_length(it.request_id)
        if length != it.start_position:
            raise ValueError(f"request {it.request_id!r}: stage holds {length} committed tokens, "
                             f"the engine expects {it.start_position}")


@dataclass(frozen=True, slots=True)
class LayerItem:
    """One PipeDec tree layer for one stage (``engine.modes.pipedec``): the stage first prunes its
    speculative level (``keep``, of which the first ``num_committed`` become committed), then
    appends these nodes to it. Each node attends to the committed tokens, the speculative
    slots in its ``ancestors`` and itself."""

    request_id: str
    token_ids: tuple[int, ...]
    """The nodes' tokens (only the first stage embeds them)."""
    positions: tuple[int, ...]
    ancestors: tuple[tuple[int, ...], ...]
    """Per node: the speculative slots (after the prune) of its uncommitted ancestors."""
    rows: tuple[int, ...] | None = None
    """Rows of the previous stage's output these nodes are (None: all of them, in order)."""
    keep: tuple[int, ...] | None = None
    """Prune first: speculative slots to keep, in order; None: no change."""
    num_committed: int = 0
    block_table: tuple[int, ...] | None = None
    """The request's pool blocks, covering every stage's tree level (the engine's table)."""

    def stage_batch(self, num_speculative: int) -> StageBatch:
        n = len(self.token_ids)
        mask = torch.zeros(n, num_speculative + n, dtype=torch.bool)
        for i, slots in enumerate(self.ancestors):
            mask[i, list(slots)] = True
            mask[i, num_speculative + i] = True
        return StageBatch([self.request_id], [n], torch.tensor(self.positions, dtype=torch.long), [mask],
                          token_ids=torch.tensor(self.token_ids, dtype=torch.long), extend=True)
