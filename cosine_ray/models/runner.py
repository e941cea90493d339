"""The step runner of one stage: the eager varlen forward, or a fixed-shape step replayed as a
CUDA graph (vLLM's and nano-vllm's model runner, for our trees).

Launched one kernel at a time from Python, a small model's verify step is host-bound on a GPU;
a CUDA graph replays the whole step with one launch. A graph has fixed shapes and addresses,
so the runner lays every eligible step out as B request rows × n query rows over L logical KV
slots, each rounded up to a bucket (``GRAPH_BATCH_SIZES``, ``GRAPH_NEW_TOKENS``, powers of two
from ``MIN_GRAPH_SLOTS``), writes the step's inputs into that bucket's device buffers with one
copy from a pinned, double-buffered host buffer, and replays its graph (slot mapping, gather
index and tree mask are computed inside it, ``attention.padded_plan``). Prompt chains (more
than ``max(GRAPH_NEW_TOKENS)`` new tokens) go through a *prefill bucket* and the rest through a
verify bucket. Steps that fit no bucket, PipeDec's tree layers and contexts past
``MAX_GRAPH_SLOTS`` run eagerly; graphs are dropped if the pool is reallocated.

Modes: ``auto`` (``graph`` on CUDA, ``eager`` elsewhere), ``eager`` (``--enforce-eager``),
``graph``, and ``static``: the fixed-shape path run eagerly on any device, how the CPU tests
check the graph path against the eager forward token for token (on CPU it is not the
default: padding rows costs real projection work there).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cosine_ray.models.attention import PaddedInputs
from cosine_ray.models.device import RUNNER_MODES, indices_to
from cosine_ray.models.kv_cache import KVCache
from cosine_ray.models.llama import LlamaStage, StageBatch

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
"""Batch buckets; a runner captures at start those up to the engine's ``max_num_seqs``."""
GRAPH_NEW_TOKENS = (1, 2, 4, 8, 16, 32)
"""Query rows of a verify bucket; a runner adds its engine's whole tree (``tree_size``: γ_max
+ 1, 9 by default), so full trees are not padded to the next power of two (8 × 16 rows for
8 × 9 real ones)."""
PREFILL_NEW_TOKENS = (64, 128, 256, 512)
"""Query rows of a prefill bucket: causal chains only (no dense ancestor bits), logits of each
request row's last token only. A step with prompts past ``GRAPH_NEW_TOKENS`` runs them
through one of these and its other requests through a verify bucket: two replays instead of
one eager forward."""
MAX_PREFILL_ROWS = 2048
"""B × n above this runs eagerly (padding a few long prompts to many rows costs real compute)."""
MIN_GRAPH_SLOTS = 256
MAX_GRAPH_SLOTS = 16384
STARTUP_MAX_SLOTS = 1024
"""Contexts up to this many slots get their graphs at start (``startup_keys``); longer ones on
first use."""


def _is_prefill(num_rows: int) -> bool:
    """Whether a bucket of this many query rows is a prefill bucket (causal chains, no ancestor bits)."""
    return num_rows > GRAPH_NEW_TOKENS[-1]


def _bucket(value: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sizes if s >= value), None)


def _slots_bucket(value: int, block_size: int) -> int | None:
    size = MIN_GRAPH_SLOTS
    while size < value:
        size *= 2
    size = -(-size // block_size) * block_size
    return size if size <= MAX_GRAPH_SLOTS else None


def startup_keys(max_batch_size: int, max_new_tokens: int, max_slots: int, block_size: int, *,
                 prefills: bool = False, new_tokens: tuple[int, ...] = GRAPH_NEW_TOKENS) -> list[tuple[int, int, int]]:
    """Buckets worth capturing at start: batch sizes up to ``max_batch_size``'s bucket, query
    rows up to ``max_new_tokens``'s (a verify tree: the draft budget + its root), contexts up to
    ``min(max_slots, STARTUP_MAX_SLOTS)``; with ``prefills`` also the prefill buckets of those
    batch sizes and contexts that a prompt of at most ``max_slots`` tokens can reach; most rows
    first, so smaller graphs reuse the memory of the largest. Anything else is captured the
    first time a step needs it."""
    b_max = _bucket(min(max_batch_size, GRAPH_BATCH_SIZES[-1]), GRAPH_BATCH_SIZES)
    n_max = _bucket(min(max_new_tokens, new_tokens[-1]), new_tokens)
    slots_max = _slots_bucket(min(max_slots, STARTUP_MAX_SLOTS), block_size)
    batches = [b for b in GRAPH_BATCH_SIZES if b <= b_max]
    news = [n for n in new_tokens if n <= n_max]
    slots = []
    size = _slots_bucket(1, block_size)
    while size <= slots_max:
        slots.append(size)
        size = _slots_bucket(size + 1, block_size)
    keys = [(b, n, s) for b in batches for n in news for s in slots]
    if prefills:  # prompts: every prefill bucket a prompt of at most max_slots tokens can reach
        smallest = dict(zip(PREFILL_NEW_TOKENS, (GRAPH_NEW_TOKENS[-1] + 1,) + tuple(n + 1 for n in PREFILL_NEW_TOKENS)))
        keys += [(b, n, s) for b in batches for n in PREFILL_NEW_TOKENS for s in slots
                 if smallest[n] <= max_slots and n <= s and b * n <= MAX_PREFILL_ROWS]
    return sorted(keys, key=lambda k: (k[0] * k[1], k[2], k[0]), reverse=True)  # most rows first


@dataclass(slots=True)
class _Bucket:
    """One fixed shape: its device input buffer (every input a view of it), its hidden-state
    input (stages after the first), its output and, once captured, its graph."""

    key: tuple[int, int, int]
    packed: torch.Tensor
    """Device int64 buffer: tokens | positions | start | count | tables | ancestors | rows."""
    inputs: PaddedInputs
    rows: torch.Tensor
    """[B * n] padded row of each flat token (first T entries used), then of each logit row."""
    hidden: torch.Tensor | None
    out: torch.Tensor | None = None
    graph: "torch.cuda.CUDAGraph | None" = None


class StepRunner:
    """Runs ``stage.forward`` for a ``StageBatch``: eagerly, or through a bucket's fixed-shape
    step (graph-replayed on CUDA). Same outputs either way (up to float summation order)."""

    def __init__(self, stage: LlamaStage, mode: str = "auto") -> None:
        if mode not in RUNNER_MODES:
            raise ValueError(f"runner mode {mode!r}: use {', '.join(RUNNER_MODES)}")
        if mode == "auto":
            mode = "graph" if stage.device.type == "cuda" else "eager"
        if mode == "graph" and stage.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; use the eager or static runner")
        self.stage, self.mode = stage, mode
        self._buckets: dict[tuple[int, int, int], _Bucket] = {}
        self._pool_ptr: int | None = None
        self._graph_pool = None
        self._host = [torch.empty(0, dtype=torch.long) for _ in range(2)]
        self._host_ready: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._gpu_busy_ms = 0.0
        self.stats = {"eager": 0, "static": 0, "graph": 0, "captures": 0}
        """Steps run each way and graphs captured (benchmarks and tests read them)."""
        self.new_tokens = GRAPH_NEW_TOKENS
        """Query-row sizes of the verify buckets (``tree_size`` adds one)."""

    # ---- the decision -------------------------------------------------------------------------
    def tree_size(self, num_tokens: int) -> None:
        """Add a verify bucket of ``num_tokens`` query rows (the engine's whole tree, γ_max + 1)."""
        if 1 <= num_tokens <= GRAPH_NEW_TOKENS[-1]:
            self.new_tokens = tuple(sorted(set(self.new_tokens) | {num_tokens}))

    def _key(self, batch: StageBatch, cache: KVCache,
             news: tuple[int, ...] | None = None) -> tuple[int, int, int] | None:
        if self.mode == "eager" or batch.extend:
            return None
        news = self.new_tokens if news is None else news
        b = _bucket(len(batch.request_ids), GRAPH_BATCH_SIZES)
        n = _bucket(max(batch.num_new_tokens), news)
        if b is None or n is None or (_is_prefill(n) and b * n > MAX_PREFILL_ROWS):
            return None
        longest = max(cache.committed_length(rid) for rid in batch.request_ids) + n
        slots = _slots_bucket(longest, cache.block_size)
        return None if slots is None else (b, n, slots)

    def _prefill_split(self, batch: StageBatch, cache: KVCache) -> list[tuple] | None:
        """A step whose only obstacle to a bucket is prompts past ``GRAPH_NEW_TOKENS``: its
        other requests as one sub-batch for a verify bucket, the prompts (causal chains whose
        last stage needs at most one logit row each) as one for a prefill bucket. Each part is
        (sub-batch, key, its rows of the step's flat tokens, its positions among the step's
        logit rows); None when the step must run eagerly."""
        if self.mode == "eager" or batch.extend:
            return None
        counts = batch.num_new_tokens
        prompts = [i for i, k in enumerate(counts) if _is_prefill(k)]
        if not prompts or any(batch.tree_masks[i] is not None for i in prompts):
            return None
        others = [i for i, k in enumerate(counts) if not _is_prefill(k)]
        offsets = np.concatenate([[0], np.cumsum(counts)])
        total = int(offsets[-1])
        logits = np.arange(total) if batch.logit_indices is None else batch.logit_indices.numpy()
        parts = []
        for members, news in ((others, self.new_tokens), (prompts, PREFILL_NEW_TOKENS)):
            if not members:
                continue
            token_rows = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in members])
            local = np.full(total, -1)
            local[token_rows] = np.arange(len(token_rows))
            mine = local[logits] >= 0
            rows = torch.from_numpy(token_rows)
            sub = StageBatch([batch.request_ids[i] for i in members], [counts[i] for i in members],
                             batch.positions.index_select(0, rows), [batch.tree_masks[i] for i in members],
                             None if batch.logit_indices is None else torch.from_numpy(local[logits[mine]]),
                             None if batch.token_ids is None else batch.token_ids.index_select(0, rows))
            key = self._key(sub, cache, news)
            if key is None or (news is PREFILL_NEW_TOKENS and self.stage.is_last and int(mine.sum()) > key[0]):
                return None
            parts.append((sub, key, token_rows, np.flatnonzero(mine)))
        return parts

    def forward(self, batch: StageBatch, cache: KVCache, hidden: torch.Tensor | None = None) -> torch.Tensor:
        key = self._key(batch, cache)
        split = self._prefill_split(batch, cache) if key is None else None
        if split is not None:
            out, begin = self._forward_split(split, hidden, cache)  # times its parts itself
        elif key is None:
            self.stats["eager"] += 1
            begin = self._mark()
            out = self.stage.forward(batch, cache, hidden)
        else:
            out, begin = self._forward_bucket(key, batch, cache, hidden)
        if begin is not None:
            self._timed.append((begin, self._mark()))
        self._fold(wait=False)
        return out

    def _mark(self) -> "torch.cuda.Event | None":
        """A timing event queued now on CUDA (None elsewhere)."""
        if self.stage.device.type != "cuda":
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _fold(self, *, wait: bool) -> None:
        while self._timed and (wait or self._timed[0][1].query()):
            begin, end = self._timed.pop(0)
            end.synchronize()
            self._gpu_busy_ms += begin.elapsed_time(end)

    def gpu_busy_seconds(self) -> float:
        """GPU time inside this runner's forwards so far, from CUDA events queued around each
        (for a graph step after the host has packed its inputs; 0 on CPU). Over a wall-clock
        window, 1 − busy / wall is the GPU's idle share: host planning, drafting and bookkeeping
        that no other lane's forward has hidden."""
        self._fold(wait=True)
        return self._gpu_busy_ms / 1e3

    # ---- the fixed-shape step -------------------------------------------------------------------
    def _bucket_for(self, key: tuple[int, int, int], cache: KVCache) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        b, n, slots = key
        device = self.stage.device
        sizes = self._sizes(key, cache.block_size)
        packed = torch.zeros(sum(sizes), dtype=torch.long, device=device)
        parts = packed.split(sizes)
        tokens, positions, start, count, tables, ancestors, rows, scratch = parts
        chains = _is_prefill(n)
        inputs = PaddedInputs(tokens, positions, start, count, tables.view(b, -1),
                              None if chains else ancestors.view(b, n, n), scratch.view(()),
                              rows[b * n:b * n + b] if chains and self.stage.is_last else None)
        hidden = None
        if not self.stage.is_first:
            hidden = torch.zeros(b * n, self.stage.config.hidden_size, dtype=self.stage.dtype, device=device)
        bucket = self._buckets[key] = _Bucket(key, packed, inputs, rows, hidden)
        return bucket

    @staticmethod
    def _sizes(key: tuple[int, int, int], block_size: int) -> list[int]:
        b, n, slots = key
        ancestors = 0 if _is_prefill(n) else b * n * n  # a prefill bucket: causal chains
        return [b * n, b * n, b, b, b * slots // block_size, ancestors, 2 * b * n, 1]

    def _host_buffer(self, size: int) -> torch.Tensor:
        """One of two host buffers, taken in turn; pinned on CUDA so the copy is asynchronous.
        Before refilling one, wait until the copy that last read it has run."""
        self._turn ^= 1
        turn = self._turn
        pinned = self.stage.device.type == "cuda"
        if self._host[turn].numel() < size:
            self._host[turn] = torch.empty(max(size, 2 * self._host[turn].numel()), dtype=torch.long,
                                           pin_memory=pinned)
        event = self._host_ready[turn]
        if event is not None:
            event.synchronize()
        return self._host[turn][:size]

    def _fill(self, bucket: _Bucket, batch: StageBatch | None, cache: KVCache) -> tuple[int, int]:
        """Open each request's speculative level and write the step's inputs into the bucket's
        device buffer with one copy. Returns (flat tokens T, logit rows). ``batch`` None: an idle
        step, every row padding (it writes and reads the scratch block only)."""
        b, n, slots = bucket.key
        if batch is None:
            batch = StageBatch([], [], torch.zeros(0, dtype=torch.long), [], None, torch.zeros(0, dtype=torch.long))
        starts = [cache.reserve(rid, k) for rid, k in zip(batch.request_ids, batch.num_new_tokens)]
        scratch = cache.scratch_block()
        sizes = self._sizes(bucket.key, cache.block_size)
        host_t = self._host_buffer(sum(sizes))
        host = host_t.numpy()
        tokens, positions, start, count, tables, ancestors, rows, scratch_slot = np.split(host, np.cumsum(sizes)[:-1])
        tables = tables.reshape(b, -1)
        chains = _is_prefill(n)
        tokens[:] = 0
        positions[:] = 0
        start[:] = 0
        count[:] = 0
        tables[:] = scratch
        if not chains:
            ancestors = ancestors.reshape(b, n, n)
            ancestors[:] = 0
            ancestors[:, np.arange(n), np.arange(n)] = 1  # padded query rows see themselves only
        else:
            rows[b * n:b * n + b] = 0  # logit rows past the real ones: any valid row
        scratch_slot[0] = scratch * cache.block_size
        counts = batch.num_new_tokens
        total = sum(counts)
        flat_pos = batch.positions.numpy()
        flat_ids = batch.token_ids.numpy() if batch.token_ids is not None else None
        offset = 0
        for i, (rid, k, first) in enumerate(zip(batch.request_ids, counts, starts)):
            lo = i * n
            if flat_ids is not None:
                tokens[lo:lo + k] = flat_ids[offset:offset + k]
            positions[lo:lo + k] = flat_pos[offset:offset + k]
            start[i], count[i] = first, k
            table = cache.block_table(rid)
            tables[i, :len(table)] = table
            tree = batch.tree_masks[i]
            if not chains:
                ancestors[i, :k, :k] = np.tril(np.ones((k, k), dtype=np.int64)) if tree is None else tree.numpy()
            rows[offset:offset + k] = np.arange(lo, lo + k)
            offset += k
        logit_index = (np.arange(total) if batch.logit_indices is None else batch.logit_indices.numpy())
        num_logits = len(logit_index)
        rows[b * n:b * n + num_logits] = rows[:total][logit_index]
        if self.stage.device.type == "cuda":
            bucket.packed.copy_(host_t, non_blocking=True)
            event = self._host_ready[self._turn] or torch.cuda.Event()
            event.record()
            self._host_ready[self._turn] = event
        else:
            bucket.packed.copy_(host_t)
        return total, num_logits

    def capture(self, cache: KVCache, keys) -> int:
        """Capture the graphs of bucket ``keys`` now, on idle inputs, so no step pays for a
        capture later (vLLM captures its sizes at start the same way). Returns graphs captured;
        0 unless the mode is ``graph``."""
        if self.mode != "graph":
            return 0
        before = self.stats["captures"]
        with torch.inference_mode():
            for key in keys:
                bucket = self._bucket_for(key, cache)
                self._fill(bucket, None, cache)
                self._replay(bucket, cache)
        return self.stats["captures"] - before

    def _run(self, bucket: _Bucket, cache: KVCache) -> torch.Tensor:
        return self.stage.forward_padded(bucket.inputs, cache, bucket.hidden)

    @torch.inference_mode()
    def _forward_bucket(self, key, batch: StageBatch, cache: KVCache,
                        hidden: torch.Tensor | None) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        bucket = self._bucket_for(key, cache)
        total, num_logits = self._fill(bucket, batch, cache)  # reserves: may grow a CPU pool
        b, n, _ = key
        rows = bucket.rows
        if bucket.hidden is not None:
            assert hidden is not None and hidden.shape[0] == total
            bucket.hidden.index_copy_(0, rows[:total], hidden.to(device=bucket.hidden.device, dtype=bucket.hidden.dtype))
        begin = self._mark()  # after the host's packing: from here the GPU works
        if self.mode == "graph":
            self._replay(bucket, cache)
            self.stats["graph"] += 1
            out = bucket.out
        else:
            out = self._run(bucket, cache)
            self.stats["static"] += 1
        if self.stage.is_last:
            if bucket.inputs.logit_rows is not None:  # the graph computed only these rows
                return out[:num_logits].clone(), begin
            return out.index_select(0, rows[b * n:b * n + num_logits]), begin
        return out.index_select(0, rows[:total]), begin

    def _forward_split(self, parts: list[tuple], hidden: torch.Tensor | None,
                       cache: KVCache) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
        """The parts of ``_prefill_split`` through their buckets, outputs back in the step's order."""
        outs, order = [], []
        for sub, key, token_rows, logit_positions in parts:
            part_hidden = None
            if hidden is not None:
                part_hidden = hidden.index_select(0, indices_to(token_rows.tolist(), hidden.device))
            out, begin = self._forward_bucket(key, sub, cache, part_hidden)
            if begin is not None:  # each part's own GPU span (the other's packing is host time)
                self._timed.append((begin, self._mark()))
            outs.append(out)
            order.append(logit_positions if self.stage.is_last else token_rows)
        order = np.concatenate(order)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        if np.array_equal(order, np.arange(len(order))):  # the prompts came last: already in order
            return out, None
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(order))
        return out.index_select(0, indices_to(inverse.tolist(), out.device)), None  # pinned: no wait for the GPU

    def _replay(self, bucket: _Bucket, cache: KVCache) -> None:
        pool_ptr = cache.pool.data_ptr()
        if self._pool_ptr != pool_ptr:  # the pool moved: every graph reads the old one
            for other in self._buckets.values():
                other.graph, other.out = None, None
            self._pool_ptr = pool_ptr
        if bucket.graph is None:
            self._capture(bucket, cache)
        bucket.graph.replay()

    def _capture(self, bucket: _Bucket, cache: KVCache) -> None:
        """Two eager runs on a side stream (the warm-up graph capture needs), then the capture.
        The warm-up runs compute this very step, so their KV writes are the ones the replay makes."""
        device = self.stage.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(bucket, cache)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            bucket.out = self._run(bucket, cache)
        bucket.graph = graph
        self.stats["captures"] += 1
