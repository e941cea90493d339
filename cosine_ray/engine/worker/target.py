"""The verification server's side: score token trees with the target model.

``TargetWorker`` owns one or more consecutive ``LlamaStage`` slices and their KV caches
(the single-process engine runs every slice here; the Ray runtime gives each slice its
own actor and chains the hidden states). The engine talks to it through ``TargetClient``
(``engine.worker.clients``).

What a step sends and gets back (``ScoreItem``, ``ScoreOutput``, ``KVCommit``) is in
``engine.worker.scoring``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from cosine_ray.engine.worker.scoring import (KVCommit, LayerItem, ScoreItem, ScoreOutput, apply_commits,
                                       build_stage_batch, score_output, split_output)
from cosine_ray.engine.worker.threads import ThreadGovernor
from cosine_ray.models.llama import LlamaStage
from cosine_ray.models.runner import StepRunner, startup_keys

if TYPE_CHECKING:
    from cosine_ray.engine.config import EngineConfig
    from cosine_ray.models.config import ModelConfig

log = logging.getLogger(__name__)


CUDA_KV_MEMORY_SHARE = 0.9
"""Share of a GPU's free memory (after the weights) its stages' KV pools take by default."""
CPU_KV_MEMORY_SHARE = 0.2
"""On CPU without a byte budget: share of the memory available at start that the whole
model's KV (all stages together) may grow to. The pools grow as requests need them, so
memory is taken only as the prefix cache fills; vLLM's CPU backend reserves a fixed KV
space the same way (``VLLM_CPU_KVCACHE_SPACE``), allocated up front."""


def available_memory_bytes() -> int:
    """Memory this process could still take: the kernel's ``MemAvailable``, and no more than a
    cgroup (v2 or v1) memory limit leaves, as in a container."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f, open(usage_path) as g:
                limit, usage = f.read().strip(), int(g.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max", or v1's huge "no limit"
            found.append(max(int(limit) - usage, 0))
        break
    if not found:
        found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(found)


def default_kv_tokens(config: "EngineConfig", model: "ModelConfig", dtype: torch.dtype) -> int:
    """Tokens a CPU stage's pool may grow to when no byte budget is given (``config`` resolved):
    what ``CPU_KV_MEMORY_SHARE`` of the available memory holds of the whole model's KV (so
    every stage holds as many tokens), and at least one request of ``max_model_len`` with its
    tree."""
    per_token = model.num_layers * 2 * model.num_kv_heads * model.head_dim * dtype.itemsize
    share = int(CPU_KV_MEMORY_SHARE * available_memory_bytes()) // per_token
    return max(config.scheduler.max_model_len + config.speculation.num_speculative_tokens + 1, share)


def kv_budgets(stages: Sequence[LlamaStage], kv_cache_memory: int | None) -> list[int | None]:
    """Each stage's KV pool in bytes: ``kv_cache_memory`` when set; else on CUDA
    ``CUDA_KV_MEMORY_SHARE`` of the device's free memory, split evenly between the given
    stages on that device; else None (CPU: the pool grows as needed)."""
    if kv_cache_memory is not None:
        return [kv_cache_memory] * len(stages)
    out: list[int | None] = []
    for stage in stages:
        if stage.device.type != "cuda":
            out.append(None)
            continue
        sharing = sum(s.device == stage.device for s in stages)
        free, _ = torch.cuda.mem_get_info(stage.device)  # measured before any of these pools exists
        # memory this process's allocator holds but no tensor uses (an engine built before, now
        # gone) is free for the pool too
        free += torch.cuda.memory_reserved(stage.device) - torch.cuda.memory_allocated(stage.device)
        out.append(int(CUDA_KV_MEMORY_SHARE * free / sharing))
    return out


class StageWorker:
    """One layer slice of the target with its KV cache: a pipeline stage (plain class; the
    Ray runtime makes it an actor). ``forward`` returns hidden states, or on the last stage
    a ``ScoreOutput`` (``split_output`` cuts it per item)."""

    def __init__(self, stage: LlamaStage, *, max_kv_tokens: int | None = None, kv_budget_bytes: int | None = None,
                 clock: Callable[[], float] = time.monotonic, runner: str = "auto",
                 external_blocks: bool = False, kv_token_budget: int | None = None) -> None:
        self.stage = stage
        grow_to = None if kv_budget_bytes is not None or kv_token_budget is None else -(-kv_token_budget // 16) + 1
        self.cache = stage.new_kv_cache(kv_budget_bytes, max_tokens=max_kv_tokens, external=external_blocks,
                                        max_blocks=grow_to)
        """The stage's paged KV pool; with ``external_blocks`` the engine decides every request's
        block table (``ScoreItem.block_table``), else the cache allocates its own."""
        self.runner = StepRunner(stage, runner)
        """Eager varlen forward, or fixed-shape steps replayed as CUDA graphs (``models.runner``)."""
        self.clock = clock
        self.started_at = clock()
        self.busy_s = 0.0
        """Seconds spent in finished ``forward`` calls (metrics: stage busy vs idle)."""
        self._busy_since: float | None = None

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """Count the time inside as busy (``utilisation``)."""
        self._busy_since = self.clock()
        try:
            yield
        finally:
            self.busy_s += self.clock() - self._busy_since
            self._busy_since = None

    def forward(self, items: Sequence[ScoreItem], hidden: torch.Tensor | None = None,
                commits: Sequence[KVCommit] = ()) -> torch.Tensor:
        """The stage's step (earlier steps' pending ``commits`` applied first); on the last stage
        a finished ``ScoreOutput`` (a stage actor returns it across processes, where a CUDA event
        cannot go)."""
        out = self.forward_pending(items, hidden, commits)
        if isinstance(out, ScoreOutput):
            return dataclasses.replace(out.wait(), ready=None)
        return out

    def forward_pending(self, items: Sequence[ScoreItem], hidden: torch.Tensor | None = None,
                        commits: Sequence[KVCommit] = ()):
        """``forward``, but on CUDA the last stage's ids may still be on their way
        (``ScoreOutput.ready``): the in-process engine polls instead of blocking."""
        with self._busy():
            apply_commits(self.cache, items, commits)
            try:
                out = self.runner.forward(build_stage_batch(items), self.cache, hidden)
                return score_output(items, out) if self.stage.is_last else out
            except Exception:  # a failed forward leaves no half-written speculative level behind
                self.cache.commit_many((it.request_id, ()) for it in items if it.request_id in self.cache)
                raise

    def forward_layer(self, item: LayerItem, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """PipeDec: prune this request's tree level, then append one layer of it (hidden
        states out, or on the last stage the layer's logits)."""
        with self._busy():
            self.prune(item.request_id, item.keep, item.num_committed)
            if item.block_table is not None:
                self.cache.assign(item.request_id, item.block_table)
            if hidden is not None and item.rows is not None:
                hidden = hidden[list(item.rows)]
            batch = item.stage_batch(self.cache.num_speculative(item.request_id))
            return self.stage.forward(batch, self.cache, hidden)

    def prune(self, request_id: str, keep: Sequence[int] | None, num_committed: int) -> None:
        if keep is not None:
            self.cache.keep(request_id, keep, num_committed)

    def utilisation(self) -> tuple[float, float]:
        """(busy, idle) seconds since this stage was built; a forward in progress counts as
        busy so far, so both only grow (they are exported as counters)."""
        now = self.clock()
        busy = self.busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        return busy, max(0.0, now - self.started_at - busy)

    def commit(self, commits: Sequence[KVCommit]) -> None:
        """Every request's kept slots in one gather/scatter (``KVCache.commit_many``)."""
        self.cache.commit_many((c.request_id, c.keep) for c in commits if c.request_id in self.cache)

    def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.cache.free(rid)

    def release_all(self) -> None:
        """Drop every request's KV (after a recovery nothing held before is valid)."""
        self.release(self.cache.request_ids)

    def capture_graphs(self, config: "EngineConfig") -> int:
        """CUDA graphs for the buckets the steps of ``config`` (resolved) can reach
        (``runner.startup_keys``; a verify tree is the draft budget plus its root), captured now
        so no step pays for one; a failure is logged and leaves capture to first use. Returns the
        graphs captured (0 unless the runner replays graphs)."""
        tree = config.speculation.num_speculative_tokens + 1
        self.runner.tree_size(tree)
        keys = startup_keys(config.scheduler.max_num_seqs, tree, config.scheduler.max_model_len,
                            self.cache.block_size, prefills=True, new_tokens=self.runner.new_tokens)
        try:
            return self.runner.capture(self.cache, keys)
        except Exception as exc:  # noqa: BLE001 - capture on first use still works
            log.warning("capturing CUDA graphs at start failed (%s); they are captured on first use", exc)
            return 0

    def kv_usage(self) -> dict[str, int]:
        """Requests and tokens held (tests check nothing leaks)."""
        return {"requests": len(self.cache.request_ids), "tokens": self.cache.num_tokens()}

    def kv_capacity(self) -> int | None:
        """Blocks the engine may hand out here (the budget less the scratch block); None: the
        pool grows as needed."""
        blocks = self.cache.max_blocks
        return None if blocks is None else blocks - 1


class TargetWorker:
    """All stages of the target in one process (the single-process engine)."""

    def __init__(self, stages: Sequence[LlamaStage], *, max_kv_tokens: int | None = None,
                 kv_cache_memory: int | None = None, runner: str = "auto", external_blocks: bool = False,
                 kv_token_budget: int | None = None, governor: ThreadGovernor | None = None) -> None:
        if not stages or not stages[0].is_first or not stages[-1].is_last:
            raise ValueError("stages must cover the model from the embedding to the lm_head")
        self.governor = governor
        """CPU: picks the torch thread count step by step (``engine.worker.threads``)."""
        self.stages = [StageWorker(s, max_kv_tokens=max_kv_tokens, kv_budget_bytes=b, runner=runner,
                                   external_blocks=external_blocks, kv_token_budget=kv_token_budget)
                       for s, b in zip(stages, kv_budgets(stages, kv_cache_memory))]

    def score(self, items: Sequence[ScoreItem], commits: Sequence[KVCommit] = ()) -> list[torch.Tensor]:
        return self.score_pending(items, commits).wait_and_split()

    def score_pending(self, items: Sequence[ScoreItem], commits: Sequence[KVCommit] = ()) -> "PendingScore":
        """Run every stage (``commits`` of earlier steps applied first); on CUDA return as soon
        as the work is queued (``PendingScore``)."""
        if not items:
            return PendingScore(items, None)
        hidden = None
        with nullcontext() if self.governor is None else self.governor.step(sum(len(i.token_ids) for i in items)):
            for stage in self.stages:
                hidden = stage.forward_pending(items, hidden, commits)
        return PendingScore(items, hidden)

    def commit(self, commits: Sequence[KVCommit]) -> None:
        for stage in self.stages:
            stage.commit(commits)

    def capture_graphs(self, config: "EngineConfig") -> int:
        """``StageWorker.capture_graphs`` on every stage for ``config``'s batch, tree and context."""
        return sum(s.capture_graphs(config) for s in self.stages)

    def release(self, request_ids: Sequence[str]) -> None:
        for stage in self.stages:
            stage.release(request_ids)

    def num_cached_requests(self) -> int:
        return max(s.kv_usage()["requests"] for s in self.stages)

    def kv_capacity(self) -> int | None:
        """Blocks every stage can hold (the smallest budget); None: the pools grow."""
        capacities = [s.kv_capacity() for s in self.stages]
        return None if None in capacities else min(capacities)


@dataclass(slots=True)
class PendingScore:
    """A step's scores on their way back from the GPU: ``ready()`` polls, ``wait_and_split``
    blocks (``TargetWorker.score``); the engine's client polls so the event loop can step another
    lane while the GPU verifies this one."""

    items: Sequence[ScoreItem]
    output: ScoreOutput | None

    def ready(self) -> bool:
        return self.output is None or self.output.ready is None or self.output.ready.query()

    def wait_and_split(self) -> list[torch.Tensor]:
        if self.output is None:
            return []
        return split_output(self.items, self.output.wait())
