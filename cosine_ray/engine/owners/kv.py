"""The engine's view of the stages' paged KV pools: block tables, free blocks, the prefix cache.

Every stage holds the same block ids for its own layers, so the engine decides once which pool
blocks each request's logical positions use (vLLM's block manager) and sends the table with each
forward (``ScoreItem.block_table``). A block is ``block_size`` tokens.

Prefix cache: a *full* block of committed tokens is content-addressed by (the hash of its
prefix, its own tokens): the prefix hash chains a 128-bit BLAKE2b over every block before it,
and the block's own tokens are compared exactly. Blocks are reference-counted; a block nobody
references stays cached on an LRU free list until the pool needs it. A new or resumed request
takes the longest cached prefix of its context (in whole blocks, at most all tokens but one:
the last one is computed so the step has its logits). Only committed tokens enter a full
block: draft-tree slots lie past a request's committed length, in its own last blocks, so a
rejected tree never touches a shared block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

from cosine_ray.engine.request import Request

BlockKey = tuple[int, tuple[int, ...]]
"""(hash of the tokens before the block, 0 for the first block; the block's tokens)."""


def chain_hash(prefix_hash: int, tokens: tuple[int, ...]) -> int:
    """The hash of a prefix one block longer: 128-bit BLAKE2b of the previous hash and the tokens."""
    digest = hashlib.blake2b(prefix_hash.to_bytes(16, "little") + array("q", tokens).tobytes(), digest_size=16)
    return int.from_bytes(digest.digest(), "little")


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    """Prompt tokens looked up (new and resumed requests)."""
    hits: int = 0
    """Of those, tokens found cached (their KV is reused, not computed)."""
    evictions: int = 0
    """Cached blocks reused for other content."""


class KVBlocks:
    def __init__(self, num_blocks: int | None, block_size: int, *, caching: bool = True) -> None:
        if num_blocks is not None and num_blocks < 1:
            raise ValueError("the KV pool needs at least one block besides the scratch block")
        self.capacity = num_blocks
        """Blocks requests may use (ids 1..capacity; 0 is the stages' scratch block); None: no
        budget, the pools grow as needed and a cached block is reused before they grow."""
        self.block_size = block_size
        self.caching = caching
        self._next_id = 1
        """Ids from here on were never handed out (the stages' pools grow into them)."""
        self._free: OrderedDict[int, None] = OrderedDict()
        """Blocks no request references: those that cache nothing first, then the cached ones
        least recently used first (a cached block keeps its key until it is evicted)."""
        self._refs: dict[int, int] = {}
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self.stats = PrefixCacheStats()

    # ---- what is left ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int | None:
        """Blocks a request could still get (free or never used); None: no limit."""
        if self.capacity is None:
            return None
        return len(self._free) + self.capacity - self._next_id + 1

    @property
    def num_used_blocks(self) -> int:
        return len(self._refs)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_fit(self, num_blocks: int) -> bool:
        free = self.num_free_blocks
        return free is None or num_blocks <= free

    # ---- a request's table ---------------------------------------------------------------------
    def _cached_blocks(self, request: Request) -> list[tuple[int, int]]:
        """(block, chain hash) of the longest cached prefix of the request's context, in whole
        blocks and all its tokens but the last at most; nothing is taken."""
        context = request.context_token_ids
        if not self.caching or (request.params.prompt_logprobs is not None and not request.output_token_ids):
            return []  # prompt log-probabilities need every prompt row: its prompt is computed
        bs, parent, found = self.block_size, 0, []
        while (len(found) + 1) * bs <= len(context) - 1:
            key = (parent, tuple(context[len(found) * bs:(len(found) + 1) * bs]))
            block = self._block_of.get(key)
            if block is None:
                break
            parent = chain_hash(*key)
            found.append((block, parent))
        return found

    def blocks_to_admit(self, request: Request) -> int:
        """Free blocks a request that holds none would use up if admitted now: the new blocks
        its context and one token more need, and the cached blocks of its prefix that nobody
        references (taking them removes them from the free ones)."""
        if request.prefix_looked_up:
            return max(self.blocks_for(request.num_tokens + 1) - len(request.block_table), 0)
        cached = self._cached_blocks(request)
        idle = sum(1 for block, _ in cached if block in self._free)
        return max(self.blocks_for(request.num_tokens + 1) - len(cached), 0) + idle

    def take_cached_prefix(self, request: Request) -> int:
        """For a request that holds no blocks: take the longest cached prefix of its context
        (whole blocks, all tokens but the last at most). Returns the tokens found."""
        if request.prefix_looked_up:
            return request.num_computed_tokens
        request.prefix_looked_up = True
        self.stats.queries += len(request.context_token_ids)
        cached = self._cached_blocks(request)
        for block, chained in cached:
            self._ref(block)
            request.block_table.append(block)
            request.block_contents.append(chained)
        found = len(cached) * self.block_size
        self.stats.hits += found
        request.num_computed_tokens = found
        if not request.output_token_ids:  # its prompt's hit (a resumed request's is not the prompt's)
            request.stats.num_cached_tokens = found
        return found

    def ensure(self, request: Request, num_slots: int) -> bool:
        """Extend the request's table to cover ``num_slots`` logical slots; False (and no change)
        when the pool has not that many blocks left."""
        needed = self.blocks_for(num_slots) - len(request.block_table)
        if needed <= 0:
            return True
        if not self.can_fit(needed):
            return False
        request.block_table.extend(self._allocate() for _ in range(needed))
        return True

    def commit(self, request: Request, num_computed_tokens: int) -> None:
        """The request's committed KV now covers its first ``num_computed_tokens`` tokens: give
        back the blocks past them and register the full blocks in the prefix cache."""
        request.num_computed_tokens = num_computed_tokens
        keep = self.blocks_for(num_computed_tokens)
        while len(request.block_table) > keep:
            self._unref(request.block_table.pop())
        if not self.caching:
            return
        context, bs = request.context_token_ids, self.block_size
        for i in range(len(request.block_contents), min(num_computed_tokens, len(context)) // bs):
            parent = request.block_contents[-1] if request.block_contents else 0
            key = (parent, tuple(context[i * bs:(i + 1) * bs]))
            block = request.block_table[i]
            if key not in self._block_of and block not in self._key_of:  # else another block holds it
                self._block_of[key], self._key_of[block] = block, key
            request.block_contents.append(chain_hash(*key))

    def free(self, request: Request) -> None:
        """Give back every block of the request (last first, so its prefix is evicted last);
        full committed blocks stay cached."""
        for block in reversed(request.block_table):
            self._unref(block)
        request.block_table.clear()
        request.block_contents.clear()
        request.num_computed_tokens = 0
        request.prefix_looked_up = False

    def reset(self, requests: Sequence[Request]) -> None:
        """The stages lost every block's content (a stage restarted): nothing is cached, every
        request holds nothing."""
        for r in requests:
            r.block_table.clear()
            r.block_contents.clear()
            r.num_computed_tokens = 0
            r.prefix_looked_up = False
        self._free.clear()
        self._refs.clear()
        self._key_of.clear()
        self._block_of.clear()
        self._next_id = 1

    # ---- blocks ---------------------------------------------------------------------------------
    def _allocate(self) -> int:
        """A block for new content, in this order: a free block that caches nothing; a
        never-used id while the budget has one (the stages' pools grow into it); the least
        recently used cached block, whose content is evicted. So the prefix cache keeps what
        the whole budget holds, and forgets the blocks used longest ago first. Without a
        budget the pools would grow forever: a cached block is reused before they grow."""
        first = next(iter(self._free), None)
        if first is not None and first not in self._key_of:
            del self._free[first]
            block = first
        elif first is None or (self.capacity is not None and self._next_id <= self.capacity):
            block, self._next_id = self._next_id, self._next_id + 1
        else:
            block, _ = self._free.popitem(last=False)
            self._evict(block)
        self._refs[block] = 1
        return block

    def _evict(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._block_of[key]
            self.stats.evictions += 1

    def _ref(self, block: int) -> None:
        self._free.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def _unref(self, block: int) -> None:
        n = self._refs[block] - 1
        if n:
            self._refs[block] = n
            return
        del self._refs[block]
        if block in self._key_of:
            self._free[block] = None  # cached: reusable on a hit until evicted
        else:
            self._free[block] = None
            self._free.move_to_end(block, last=False)  # no content worth keeping: reused first
