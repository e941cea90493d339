"""The engine's periodic console line, in vLLM's words: what the last interval served and what
is in flight now, read from two snapshots of the metrics registry (``MetricsRegistry.snapshot``).

    Avg prompt throughput: 210.4 tokens/s, Avg generation throughput: 38.2 tokens/s, Running: 2 reqs,
    Waiting: 0 reqs, KV cache usage: 1.2%, Prefix cache hit rate: 40.0%, Draft acceptance rate: 61.5%,
    Mean acceptance length: 3.10

The KV figure is the share of the pool's blocks in use where the pool has a fixed size (CUDA),
else the blocks in use (a CPU pool grows as it is used). The speculation figures are those of
the interval: accepted over drafted tokens, and 1 + accepted tokens per drafted tree (vLLM's
mean acceptance length, the bonus token counted). An interval with no work is no line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

COUNTERS = {"prompt": "cosine_ray:prompt_tokens", "generation": "cosine_ray:generation_tokens",
            "drafts": "cosine_ray:spec_decode_num_drafts", "drafted": "cosine_ray:spec_decode_num_draft_tokens",
            "accepted": "cosine_ray:spec_decode_num_accepted_tokens", "queries": "cosine_ray:prefix_cache_queries",
            "hits": "cosine_ray:prefix_cache_hits"}
GAUGES = {"running": "cosine_ray:num_requests_running", "waiting": "cosine_ray:num_requests_waiting",
          "kv_share": "cosine_ray:kv_cache_usage_perc", "kv_blocks": "cosine_ray:kv_cache_used_blocks"}


def totals(snapshot: Mapping[str, Mapping[Any, Any]]) -> dict[str, float]:
    """Each counter and gauge of the line, summed over its labels."""
    def total(name: str) -> float:
        return float(sum(v for v in snapshot.get(name, {}).values() if isinstance(v, (int, float))))
    return {key: total(name) for key, name in {**COUNTERS, **GAUGES}.items()}


@dataclass
class StatsLine:
    """The line of each interval: ``update`` with the registry's snapshot now."""

    last: dict[str, float]
    at: float

    @classmethod
    def start(cls, snapshot: Mapping[str, Mapping[Any, Any]], now: float) -> "StatsLine":
        return cls(totals(snapshot), now)

    def update(self, snapshot: Mapping[str, Mapping[Any, Any]], now: float) -> str | None:
        """The line of the interval since the last update; None when nothing was served in it
        and nothing is in flight."""
        cur = totals(snapshot)
        delta = {k: max(cur[k] - self.last[k], 0.0) for k in COUNTERS}
        seconds = max(now - self.at, 1e-9)
        self.last, self.at = cur, now
        if not any(delta.values()) and not (cur["running"] or cur["waiting"]):
            return None
        parts = [f"Avg prompt throughput: {delta['prompt'] / seconds:.1f} tokens/s",
                 f"Avg generation throughput: {delta['generation'] / seconds:.1f} tokens/s",
                 f"Running: {cur['running']:.0f} reqs", f"Waiting: {cur['waiting']:.0f} reqs"]
        if cur["kv_share"] > 0 or not cur["kv_blocks"]:
            parts.append(f"KV cache usage: {100 * cur['kv_share']:.1f}%")
        else:
            parts.append(f"KV cache: {cur['kv_blocks']:.0f} blocks")
        if delta["queries"]:
            parts.append(f"Prefix cache hit rate: {100 * delta['hits'] / delta['queries']:.1f}%")
        if delta["drafted"]:
            parts.append(f"Draft acceptance rate: {100 * delta['accepted'] / delta['drafted']:.1f}%")
        if delta["drafts"]:
            parts.append(f"Mean acceptance length: {1 + delta['accepted'] / delta['drafts']:.2f}")
        return ", ".join(parts)
