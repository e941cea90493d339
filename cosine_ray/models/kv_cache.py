"""The KV cache of one pipeline stage: one paged pool for every request, with a committed and
a speculative level per request.

    pool  # [num_layers, 2 (k|v), num_slots, num_kv_heads, head_dim],  num_slots = num_blocks × block_size

A request owns a *block table*: the pool blocks of its logical positions (vLLM's paged
layout), decided here or, with ``external``, by the engine for every stage at once
(``assign``). Its logical slots: ``0 .. committed_length`` committed, then the speculative
level (this step's tree nodes, node order). A forward writes the new keys/values into the
speculative level with one scatter per layer for the whole batch and reads each request's
keys with one gather per layer. ``commit_many`` moves the kept speculative slots (the
accepted path) onto the committed level with one gather/scatter and drops the rest
(PipeDec's two-level cache); PipeDec grows the level a tree layer at a time (``extend``,
``keep``). Keys are stored after RoPE, so moving a slot never changes it. The pool starts at
``initial_capacity`` tokens and doubles up to ``max_blocks`` (``for_budget`` preallocates
all of it, as CUDA graphs need); ``max_tokens`` separately caps the tokens held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from cosine_ray.models.device import indices_to

DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True)
class _Entry:
    blocks: list[int] = field(default_factory=list)
    committed_length: int = 0
    num_speculative: int = 0


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 initial_capacity: int = 256, max_tokens: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, max_blocks: int | None = None,
                 external: bool = False) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_tokens = max_tokens
        """Cap on tokens held over all requests (committed + speculative); None = no cap."""
        self.max_blocks = max_blocks
        """Cap on the pool's blocks (its memory budget); None = it grows as needed."""
        self.external = external
        """Block tables come from outside (``assign``: the engine's ``KVBlocks`` decides them
        for every stage at once); block 0 is the scratch block, never handed out."""
        blocks = max(1, -(-initial_capacity // block_size))
        if max_blocks is not None:
            blocks = min(blocks, max_blocks)
        self.pool = self._new_pool(blocks)
        self._free: list[int] = list(range(blocks - 1, -1, -1))  # a stack: block 0 first
        self._entries: dict[str, _Entry] = {}
        self._scratch_block: int | None = 0 if external else None

    @classmethod
    def for_budget(cls, num_layers: int, num_kv_heads: int, head_dim: int, budget_bytes: int, *,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                   block_size: int = DEFAULT_BLOCK_SIZE, **kwargs) -> "KVCache":
        """A pool of ``budget_bytes`` (whole blocks), allocated now and never grown."""
        per_block = num_layers * 2 * num_kv_heads * head_dim * dtype.itemsize * block_size
        blocks = int(budget_bytes // per_block)
        if blocks < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes is less than one block ({per_block} bytes)")
        return cls(num_layers, num_kv_heads, head_dim, dtype=dtype, device=device, block_size=block_size,
                   initial_capacity=blocks * block_size, max_blocks=blocks, **kwargs)

    # ---- bookkeeping --------------------------------------------------------------------
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @property
    def request_ids(self) -> list[str]:
        return list(self._entries)

    @property
    def num_blocks(self) -> int:
        return int(self.pool.shape[2]) // self.block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def committed_length(self, request_id: str) -> int:
        return self._entries[request_id].committed_length

    def num_speculative(self, request_id: str) -> int:
        return self._entries[request_id].num_speculative

    def num_tokens(self) -> int:
        return sum(e.committed_length + e.num_speculative for e in self._entries.values())

    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def allocate(self, request_id: str) -> None:
        if request_id in self._entries:
            raise KeyError(f"request {request_id!r} already has a KV cache")
        self._entries[request_id] = _Entry()

    def free(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None and not self.external:  # external blocks are the engine's to reuse
            self._free.extend(reversed(entry.blocks))

    def assign(self, request_id: str, blocks: Sequence[int], committed_length: int | None = None) -> None:
        """The request's block table, decided outside (``external``). A request new here starts
        with ``committed_length`` committed tokens already in its blocks (a prefix-cache hit);
        one it holds keeps its levels, its table extended or trimmed to ``blocks``."""
        if not self.external:
            raise RuntimeError("assign() needs a KV cache with external block tables")
        entry = self._entries.get(request_id)
        if entry is None:
            if committed_length is None:
                raise KeyError(f"request {request_id!r} has no KV cache here; give its committed length")
            entry = self._entries[request_id] = _Entry(committed_length=committed_length)
        if blocks and max(blocks) >= self.num_blocks:
            self._grow_pool(max(blocks) + 1)
        entry.blocks = list(blocks)

    # ---- the pool -------------------------------------------------------------------------
    @torch.inference_mode()  # the pool is only ever touched under inference mode
    def _new_pool(self, num_blocks: int) -> torch.Tensor:
        # zeros, not empty: padded and masked columns of a batched attention read slots nobody
        # wrote, and a masked weight of 0 times a NaN left in fresh memory is still NaN
        return torch.zeros(self.num_layers, 2, num_blocks * self.block_size, self.num_kv_heads, self.head_dim,
                           dtype=self.dtype, device=self.device)

    @torch.inference_mode()
    def _grow_pool(self, min_blocks: int) -> None:
        old = self.num_blocks
        new = max(min_blocks, 2 * old)
        if self.max_blocks is not None:
            new = min(new, self.max_blocks)
        if new < min_blocks:
            raise MemoryError(f"KV cache full: {min_blocks} blocks of {self.block_size} tokens needed, "
                              f"the budget holds {self.max_blocks}")
        pool = self._new_pool(new)
        pool[:, :, :old * self.block_size] = self.pool
        self.pool = pool
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _ensure(self, entry: _Entry, num_slots: int) -> None:
        """Blocks for logical slots [0, num_slots)."""
        needed = -(-num_slots // self.block_size) - len(entry.blocks)
        if needed <= 0:
            return
        if self.external:
            raise MemoryError(f"KV blocks for {num_slots} slots were not assigned "
                              f"({len(entry.blocks)} blocks of {self.block_size})")
        if needed > len(self._free):
            self._grow_pool(self.num_blocks + needed - len(self._free))
        entry.blocks.extend(self._free.pop() for _ in range(needed))

    def _release_tail(self, entry: _Entry) -> None:
        """Give back blocks past the request's used slots."""
        keep = -(-(entry.committed_length + entry.num_speculative) // self.block_size)
        while len(entry.blocks) > keep:
            block = entry.blocks.pop()
            if not self.external:
                self._free.append(block)

    def block_table(self, request_id: str) -> list[int]:
        """The request's pool blocks, logical block i first."""
        return self._entries[request_id].blocks

    def scratch_block(self) -> int:
        """A block no request ever owns (taken from the pool once): padded rows of a
        fixed-shape step (``models.runner``) write their keys there and read it."""
        if self._scratch_block is None:
            if not self._free:
                self._grow_pool(self.num_blocks + 1)
            self._scratch_block = self._free.pop()
        return self._scratch_block

    def slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Pool slots of the request's logical slots [start, end)."""
        return self._pool_slots(self._entries[request_id], range(start, end))

    def _pool_slots(self, entry: _Entry, logical: Iterable[int]) -> list[int]:
        bs, blocks = self.block_size, entry.blocks
        return [blocks[p // bs] * bs + p % bs for p in logical]

    # ---- forward-time writes and reads --------------------------------------------------
    def _check_cap(self, new_total: int) -> None:
        if self.max_tokens is not None and new_total > self.max_tokens:
            raise MemoryError(f"KV cache full: {new_total} tokens > max_tokens={self.max_tokens}")

    def reserve(self, request_id: str, num_new_tokens: int) -> int:
        """Open a speculative level of ``num_new_tokens`` slots (replacing any open one);
        returns its first logical slot."""
        entry = self._entries[request_id]
        start = entry.committed_length
        self._check_cap(self.num_tokens() - entry.num_speculative + num_new_tokens)
        self._ensure(entry, start + num_new_tokens)
        entry.num_speculative = num_new_tokens
        return start

    def extend(self, request_id: str, num_new_tokens: int) -> int:
        """Append ``num_new_tokens`` slots to the speculative level (PipeDec's next tree layer);
        returns the first new logical slot."""
        entry = self._entries[request_id]
        start = entry.committed_length + entry.num_speculative
        self._check_cap(self.num_tokens() + num_new_tokens)
        self._ensure(entry, start + num_new_tokens)
        entry.num_speculative += num_new_tokens
        return start

    @torch.inference_mode()
    def write(self, request_id: str, layer: int, start: int,
              keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values  # [num_kv_heads, num_new, head_dim] at logical slots from ``start``
        (one request; a forward writes the whole batch with ``write_slots``)."""
        index = torch.tensor(self.slots(request_id, start, start + keys.shape[1]), device=self.device)
        self.write_slots(layer, index, keys.transpose(0, 1), values.transpose(0, 1))

    @torch.inference_mode()
    def write_slots(self, layer: int, slot_mapping: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values  # [num_tokens, num_kv_heads, head_dim] into pool slots ``slot_mapping``."""
        self.pool[layer, 0].index_copy_(0, slot_mapping, keys.to(self.dtype))
        self.pool[layer, 1].index_copy_(0, slot_mapping, values.to(self.dtype))

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pool slots ``index`` (any shape S)  # each [*S, num_kv_heads, head_dim]"""
        flat = index.reshape(-1)
        shape = (*index.shape, self.num_kv_heads, self.head_dim)
        return (self.pool[layer, 0].index_select(0, flat).view(shape),
                self.pool[layer, 1].index_select(0, flat).view(shape))

    def span(self, layer: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pool slots [start, start + length) without a copy  # each [length, kv, hd]"""
        return self.pool[layer, 0, start:start + length], self.pool[layer, 1, start:start + length]

    def view(self, request_id: str, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of logical slots [0, end) (a copy)  # each [num_kv_heads, end, head_dim]"""
        keys, values = self.gather(layer, torch.tensor(self.slots(request_id, 0, end), dtype=torch.long,
                                                       device=self.device))
        return keys.transpose(0, 1), values.transpose(0, 1)

    # ---- after verification -------------------------------------------------------------
    def commit(self, request_id: str, keep: Sequence[int] | None = None) -> None:
        """Keep speculative slots ``keep`` (indices into the level, in path order); drop the rest.

        ``keep=None`` keeps the whole level (prefill, or a chain accepted in full).
        """
        self.commit_many([(request_id, keep)])

    def commit_many(self, commits: Iterable[tuple[str, Sequence[int] | None]]) -> None:
        """``commit`` for many requests: one gather/scatter over all layers for every slot
        that moves."""
        self.keep_many((rid, None if keep is None else list(keep), None) for rid, keep in commits)

    def keep(self, request_id: str, slots: Sequence[int], num_committed: int) -> None:
        """Keep speculative slots ``slots`` (in this order) and drop the rest of the level; the
        first ``num_committed`` of them join the committed level, the others stay speculative."""
        self.keep_many([(request_id, list(slots), num_committed)])

    @torch.inference_mode()
    def keep_many(self, keeps: Iterable[tuple[str, list[int] | None, int | None]]) -> None:
        """(request, kept slots or None for the whole level, how many of them commit or None
        for all). Checks every request first, so a bad one changes nothing."""
        plan = []
        for rid, slots, num_committed in keeps:
            entry = self._entries[rid]
            if slots is None:
                slots = list(range(entry.num_speculative))
            if any(not 0 <= k < entry.num_speculative for k in slots):
                raise IndexError(f"keep {slots} outside the speculative level of {entry.num_speculative}")
            num_committed = len(slots) if num_committed is None else num_committed
            if not 0 <= num_committed <= len(slots):
                raise ValueError(f"cannot commit {num_committed} of {len(slots)} kept slots")
            plan.append((entry, slots, num_committed))
        src: list[int] = []
        dst: list[int] = []
        for entry, slots, num_committed in plan:
            start = entry.committed_length
            moved = [(k, i) for i, k in enumerate(slots) if k != i]  # already in place when the kept slots lead
            if moved:
                src += self._pool_slots(entry, (start + k for k, _ in moved))
                dst += self._pool_slots(entry, (start + i for _, i in moved))
            entry.committed_length += num_committed
            entry.num_speculative = len(slots) - num_committed
        if src:
            src_t, dst_t = indices_to([src, dst], self.device)  # no wait for queued kernels
            self.pool.index_copy_(2, dst_t, self.pool.index_select(2, src_t))  # gather, then scatter
        for entry, _, _ in plan:
            self._release_tail(entry)

    def rollback(self, request_id: str, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` committed tokens (and any speculative level)."""
        entry = self._entries[request_id]
        if not 0 <= num_tokens <= entry.committed_length:
            raise ValueError(f"cannot roll back {num_tokens} of {entry.committed_length} tokens")
        entry.committed_length -= num_tokens
        entry.num_speculative = 0
        self._release_tail(entry)

    def truncate(self, request_id: str, length: int) -> None:
        """Keep only the first ``length`` committed tokens."""
        self.rollback(request_id, self.committed_length(request_id) - length)
