"""Suffix matching over a token buffer: where did the end of a text occur before?

``SuffixIndex`` holds token sequences back to back in one int32 buffer, a sentinel (-1)
in front of each, and for every key length k in ``key_lengths`` a hash chain (zlib's
head/prev arrays) linking each *continuation position* p to the previous position whose k
tokens before it hash alike::

    buffer   [-1  a  b  c  x  -1  q  a  b  c  y]         -1 = sentinel before each sequence
    k = 3:   head[h(a b c)] → 10 ──prev──→ 4 ──prev──→ -1      (continuations y, x)

``find_level(tail, level)`` walks the chain of the tail's last k tokens (most recent first,
at most ``max_occurrences``), then measures each candidate's exact match length in one
vectorised comparison: the counts of the next tokens are a depth-capped suffix tree's node
(recency-capped for very frequent keys). The arrays hold no Python objects (~42 B a token
with three key lengths). On disk (``write_snapshot``/``read_snapshot``) the sequences are one
Parquet file (``token_ids``, ``num_context_tokens``; chains are rebuilt on load). Eviction
is FIFO by whole sequence (``live_start`` moves past the oldest; the dead prefix is cut off
with one shift once it outgrows a quarter of the live tokens).
"""

from __future__ import annotations

import json
import os
from collections import deque
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cosine_ray.engine.drafters.lookup.datastore import read_parquet

SENTINEL = -1
_HASH_BASE = 0x100000001B3  # FNV-1 64-bit prime
_HASH_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier (Fibonacci hashing)
_MASK64 = (1 << 64) - 1
_MIN_HEAD_BITS = 8
_SMALL_APPEND = 8
"""Appends of at most this many positions are linked in Python (no numpy call overhead)."""
_SMALL_LOOKUP = 4
"""Lookups over at most this many positions run in Python (no numpy call overhead)."""


def _key_hash(token_ids: Sequence[int]) -> int:
    """Polynomial hash of a k-gram (mod 2^64); ``SuffixIndex._buckets`` computes the same, vectorised."""
    h = 0
    for t in token_ids:
        h = (h * _HASH_BASE + t) & _MASK64
    return h


class SuffixIndex:
    """Sequences of token ids and their k-gram hash chains; see the module docstring.

    Sequences are added whole (``add_sequence``) or grown at the end (``extend``, for one
    request's context). A sequence may start with ``num_context_tokens`` tokens that are
    matched against but never proposed (a prompt's end kept in front of its output).
    """

    __slots__ = ("key_lengths", "max_depth", "max_occurrences", "max_tokens", "max_sequences",
                 "version", "_token_ids", "_num_used", "_live_start", "_num_live_tokens",
                 "_sequences", "_prev", "_heads", "_head_bits", "_depth_offsets")

    def __init__(self, key_lengths: Sequence[int], *, max_depth: int, max_occurrences: int,
                 max_tokens: int | None = None, max_sequences: int | None = None,
                 initial_capacity: int = 256) -> None:
        self.key_lengths = tuple(int(k) for k in key_lengths)
        if not self.key_lengths or any(k < 1 for k in self.key_lengths) \
                or list(self.key_lengths) != sorted(set(self.key_lengths)):
            raise ValueError(f"key_lengths must be increasing positive ints, got {key_lengths!r}")
        if max_depth < self.key_lengths[-1]:
            raise ValueError(f"max_depth={max_depth} is shorter than the longest key length {self.key_lengths[-1]}")
        self.max_depth = int(max_depth)
        self.max_occurrences = int(max_occurrences)
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.version = 0
        """Bumped on every change; callers cache lookups against it."""
        capacity = max(int(initial_capacity), 2 * self.max_depth)
        self._token_ids = np.full(capacity, SENTINEL, np.int32)  # unused capacity stays -1
        self._num_used = 0  # slots in use; slot _num_used is always a sentinel
        self._live_start = 0  # the sentinel before the oldest live sequence
        self._num_live_tokens = 0
        self._sequences: deque[list[int]] = deque()  # [start, first continuation, end) per sequence
        self._prev = [np.full(capacity, -1, np.int32) for _ in self.key_lengths]
        self._head_bits = _MIN_HEAD_BITS
        self._heads = [np.full(1 << self._head_bits, -1, np.int32) for _ in self.key_lengths]
        self._depth_offsets = np.arange(self.max_depth, dtype=np.int64)

    # ---- size -----------------------------------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def num_tokens(self) -> int:
        """Tokens stored in live sequences (context tokens included, sentinels not)."""
        return self._num_live_tokens

    @property
    def num_bytes(self) -> int:
        """Approximate memory: numpy arrays plus ~100 B per sequence record."""
        arrays = [self._token_ids, *self._prev, *self._heads]
        return sum(a.nbytes for a in arrays) + 100 * len(self._sequences)

    def sequences(self) -> list[tuple[list[int], int]]:
        """Live sequences, oldest first: ``(token_ids, num_context_tokens)``."""
        tok = self._token_ids
        return [(tok[s:e].tolist(), f - s) for s, f, e in self._sequences]

    # ---- adding ---------------------------------------------------------------------------
    def add_sequence(self, token_ids: Sequence[int], *, num_context_tokens: int = 0) -> None:
        """Store a new sequence (its first ``num_context_tokens`` are match context only),
        then evict the oldest sequences beyond ``max_tokens`` / ``max_sequences``. A
        sequence longer than ``max_tokens`` keeps its last ``max_tokens`` tokens."""
        tokens = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        num_context_tokens = min(max(int(num_context_tokens), 0), len(tokens))
        if self.max_tokens is not None and len(tokens) > self.max_tokens:
            cut = len(tokens) - self.max_tokens
            tokens, num_context_tokens = tokens[cut:], max(num_context_tokens - cut, 0)
        self._reserve(len(tokens) + 1)
        start = self._num_used + 1  # _num_used is a sentinel slot (unused capacity is -1)
        end = start + len(tokens)
        self._token_ids[start:end] = tokens
        self._num_used = end
        self._sequences.append([start, start + num_context_tokens, end])
        self._num_live_tokens += len(tokens)
        self._link_range(len(self._sequences) - 1, start)
        self._evict()
        self.version += 1

    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the last sequence (starts one if there is none)."""
        if not self._sequences:
            self.add_sequence(token_ids)
            return
        m = len(token_ids)
        if m == 0:
            return
        self._reserve(m)
        record = self._sequences[-1]
        a = record[2]
        self._token_ids[a:a + m] = token_ids
        record[2] = self._num_used = a + m
        self._num_live_tokens += m
        self._link_range(len(self._sequences) - 1, a)
        self._evict()
        self.version += 1

    def _reserve(self, num_new: int) -> None:
        """Room for ``num_new`` more slots plus one trailing sentinel slot."""
        needed = self._num_used + num_new + 1
        if needed <= len(self._token_ids):
            return
        if self._live_start > 0:
            self._compact()
            needed = self._num_used + num_new + 1
            if needed <= len(self._token_ids):
                return
        capacity = max(needed, 2 * len(self._token_ids))
        tok = np.full(capacity, SENTINEL, np.int32)
        tok[:self._num_used] = self._token_ids[:self._num_used]
        self._token_ids = tok
        for i, prev in enumerate(self._prev):
            grown = np.full(capacity, -1, np.int32)
            grown[:self._num_used] = prev[:self._num_used]
            self._prev[i] = grown

    def _link_range(self, seq_index: int, first: int) -> None:
        """Link the continuation positions of sequence ``seq_index`` from ``first`` on."""
        if self._num_live_tokens > (1 << self._head_bits) // 2:
            self._rehash()  # links every live position, this range included
            return
        start, first_continuation, end = self._sequences[seq_index]
        for level, k in enumerate(self.key_lengths):
            a = max(first, first_continuation, start + k)
            if a >= end:
                continue
            if end - a <= _SMALL_APPEND:
                self._link_small(level, a, end)
            else:
                self._link(level, np.arange(a, end, dtype=np.int64))

    def _link_small(self, level: int, a: int, b: int) -> None:
        k = self.key_lengths[level]
        tok = self._token_ids[a - k:b].tolist()
        prev, head, shift = self._prev[level], self._heads[level], 64 - self._head_bits
        for p in range(a, b):
            i = p - a
            bucket = ((_key_hash(tok[i:i + k]) * _HASH_MIX) & _MASK64) >> shift
            prev[p] = head[bucket]
            head[bucket] = p

    def _link(self, level: int, positions: np.ndarray) -> None:
        """Push ascending ``positions`` onto their chains (vectorised zlib insert)."""
        if len(positions) == 0:
            return
        buckets = self._buckets(level, positions)
        prev, head = self._prev[level], self._heads[level]
        order = np.argsort(buckets, kind="stable")  # stable: ascending positions per bucket
        sorted_buckets, sorted_pos = buckets[order], positions[order]
        same = sorted_buckets[1:] == sorted_buckets[:-1]
        links = np.empty(len(positions), np.int64)
        links[0] = head[sorted_buckets[0]]
        links[1:] = np.where(same, sorted_pos[:-1], head[sorted_buckets[1:]])
        prev[sorted_pos] = links
        is_last = np.ones(len(positions), bool)
        is_last[:-1] = ~same
        head[sorted_buckets[is_last]] = sorted_pos[is_last]

    def _buckets(self, level: int, positions: np.ndarray) -> np.ndarray:
        k = self.key_lengths[level]
        tok = self._token_ids
        h = np.zeros(len(positions), np.uint64)
        for j in range(k):
            h = h * np.uint64(_HASH_BASE) + tok[positions - k + j].astype(np.uint64)
        return ((h * np.uint64(_HASH_MIX)) >> np.uint64(64 - self._head_bits)).astype(np.int64)

    def _rehash(self) -> None:
        """Grow the head tables to >= 2 slots per live token and relink everything."""
        bits = max(_MIN_HEAD_BITS, int(2 * max(self._num_live_tokens, 1) - 1).bit_length())
        self._head_bits = bits
        self._heads = [np.full(1 << bits, -1, np.int32) for _ in self.key_lengths]
        for prev in self._prev:
            prev[:] = -1
        for level, k in enumerate(self.key_lengths):
            ranges = [np.arange(max(f, s + k), e, dtype=np.int64) for s, f, e in self._sequences if max(f, s + k) < e]
            if ranges:
                self._link(level, np.concatenate(ranges))

    # ---- eviction -------------------------------------------------------------------------
    def _evict(self) -> None:
        seqs = self._sequences
        while seqs and ((self.max_tokens is not None and self._num_live_tokens > self.max_tokens)
                        or (self.max_sequences is not None and len(seqs) > self.max_sequences)):
            start, _, end = seqs.popleft()
            self._num_live_tokens -= end - start
            self._live_start = seqs[0][0] - 1 if seqs else self._num_used
        dead = self._live_start
        if dead > 4096 and dead * 4 > self._num_live_tokens:
            self._compact()

    def _compact(self) -> None:
        """Drop the dead prefix: shift buffer, chains and records left by ``live_start``."""
        shift, n = self._live_start, self._num_used
        if shift == 0:
            return
        tok = self._token_ids
        tok[:n - shift] = tok[shift:n]
        tok[n - shift:n] = SENTINEL
        tok[0] = SENTINEL
        for prev in self._prev:
            moved = prev[shift:n] - shift
            moved[moved < 0] = -1  # pointed into the dropped prefix: end of chain
            prev[:n - shift] = moved
            prev[n - shift:n] = -1
        for head in self._heads:
            live = head >= shift
            head[live] -= shift
            head[~live] = -1
        for record in self._sequences:
            record[0] -= shift
            record[1] -= shift
            record[2] -= shift
        self._num_used -= shift
        self._live_start = 0

    # ---- matching -------------------------------------------------------------------------
    def find_level(self, tail_token_ids: Sequence[int], level: int) -> tuple[list[int], list[int]]:
        """Occurrences of the tail's last ``key_lengths[level]`` tokens: ``(positions,
        match_lengths)``, most recent first.

        ``tail_token_ids`` holds Python ints. A position p is a continuation position
        (``token_at(p)`` followed the match); its match length is the number of tokens before
        p equal to the tail's last tokens (at most ``max_depth``). The walk reads the first
        ``max_occurrences`` entries of the k-gram's chain and keeps those whose match length
        is >= k (hash collisions, rare at <= 1/2 load, share a chain and are dropped here)."""
        k = self.key_lengths[level]
        depth = min(self.max_depth, len(tail_token_ids))
        if k > depth or not self._sequences:
            return [], []
        tail = list(tail_token_ids[len(tail_token_ids) - depth:])
        bucket = ((_key_hash(tail[depth - k:]) * _HASH_MIX) & _MASK64) >> (64 - self._head_bits)
        prev_item, live_start = self._prev[level].item, self._live_start
        p = self._heads[level].item(bucket)
        chain = []
        for _ in range(self.max_occurrences):
            if p <= live_start:  # -1 (end of chain) or an evicted position
                break
            chain.append(p)
            p = prev_item(p)
        if not chain:
            return [], []
        lengths = self._match_lengths(chain, tail)
        kept = [(p, n) for p, n in zip(chain, lengths) if n >= k]
        return [p for p, _ in kept], [n for _, n in kept]

    def find(self, tail_token_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The union of ``find_level`` over every key length, most recent first."""
        found: dict[int, int] = {}
        for level in range(len(self.key_lengths)):
            found.update(zip(*self.find_level(tail_token_ids, level)))
        positions = sorted(found, reverse=True)
        return positions, [found[p] for p in positions]

    def _match_lengths(self, positions: list[int], tail: list[int]) -> list[int]:
        """Per position p: how many tokens before p equal the tail's last tokens."""
        depth = len(tail)
        tok = self._token_ids
        if len(positions) <= _SMALL_LOOKUP:  # a few positions: Python beats numpy's call overhead
            out = []
            for p in positions:
                segment = tok[max(p - depth, 0):p].tolist()
                m, n = len(segment), 0
                while n < m and segment[m - 1 - n] == tail[depth - 1 - n]:
                    n += 1
                out.append(n)
            return out
        pos = np.asarray(positions, dtype=np.int64)
        # Column j compares the token j+1 before p with the tail's (j+1)-th last token; an
        # index below 0 wraps around, but a sentinel (position 0 at the latest) stops the
        # match before it, and only the first mismatch matters.
        before = tok[pos[:, None] - 1 - self._depth_offsets[:depth]]  # [num_positions, depth]
        mismatch = before != np.asarray(tail[::-1], dtype=np.int32)[None, :]
        return np.where(mismatch.any(axis=1), mismatch.argmax(axis=1), depth).tolist()

    def windows(self, positions: Sequence[int], num_tokens: int) -> list[list[int]]:
        """Per position p: tokens p .. p + num_tokens - 1; -1 from the sequence's end on."""
        if not positions or num_tokens <= 0:
            return [[] for _ in positions]
        tok = self._token_ids
        if len(positions) <= _SMALL_LOOKUP:
            out = []
            for p in positions:
                window = tok[p:p + num_tokens].tolist()  # past the end: unused capacity, all -1
                out.append(window + [SENTINEL] * (num_tokens - len(window)))
            return out
        idx = np.asarray(positions, dtype=np.int64)[:, None] + np.arange(num_tokens)
        np.minimum(idx, self._num_used, out=idx)  # slot _num_used is always a sentinel
        return tok[idx].tolist()

    def token_at(self, position: int) -> int:
        return int(self._token_ids[position])


SNAPSHOT_METADATA_KEY = b"cosine_ray.suffix_index"
SNAPSHOT_FORMAT_VERSION = 1
_SNAPSHOT_SCHEMA = pa.schema([("token_ids", pa.list_(pa.int32())), ("num_context_tokens", pa.int32())])


def write_snapshot(path: str | os.PathLike, sequences: Sequence[tuple[Sequence[int], int]],
                   metadata: Mapping[str, Any] | None = None) -> Path:
    """Write ``(token_ids, num_context_tokens)`` rows to Parquet atomically (temp + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({"token_ids": pa.array([list(t) for t, _ in sequences], type=pa.list_(pa.int32())),
                      "num_context_tokens": pa.array([n for _, n in sequences], type=pa.int32())},
                     schema=_SNAPSHOT_SCHEMA)
    meta = {**dict(metadata or {}), "format_version": SNAPSHOT_FORMAT_VERSION, "num_sequences": len(sequences)}
    table = table.replace_schema_metadata({SNAPSHOT_METADATA_KEY: json.dumps(meta).encode()})
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)
    return path


def read_snapshot(path: str | os.PathLike) -> list[tuple[list[int], int]]:
    """The rows ``write_snapshot`` wrote; ValueError (saying what to do) for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"suffix snapshot {path} does not exist; write one with SuffixDrafter.save(path)")
    try:
        table = read_parquet(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path} is not a readable Parquet file ({exc}); delete it to start empty") from exc
    raw = (table.schema.metadata or {}).get(SNAPSHOT_METADATA_KEY)
    if raw is None or set(table.column_names) != {"token_ids", "num_context_tokens"}:
        raise ValueError(f"{path} is not a suffix drafter snapshot (no {SNAPSHOT_METADATA_KEY.decode()} "
                         "metadata); pass a file written by SuffixDrafter.save")
    version = json.loads(raw).get("format_version")
    if version != SNAPSHOT_FORMAT_VERSION:
        raise ValueError(f"{path}: snapshot format_version {version!r} is not supported (this build reads "
                         f"{SNAPSHOT_FORMAT_VERSION}); delete it to start empty")
    return list(zip(table.column("token_ids").to_pylist(), table.column("num_context_tokens").to_pylist()))
