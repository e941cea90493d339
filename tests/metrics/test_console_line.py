"""The engine's periodic console line (``metrics.console``): the figures of the interval between
two snapshots of the real registry, as the engine records them, and no line for an idle one."""

from __future__ import annotations

from cosine_ray.metrics.console import StatsLine
from cosine_ray.metrics.registry import MetricsRegistry


def served(m: MetricsRegistry, *, prompt: int, generated: int, drafts: int, drafted: int, accepted: int) -> None:
    m.inc("cosine_ray:prompt_tokens", prompt)
    m.inc("cosine_ray:generation_tokens", generated)
    m.inc("cosine_ray:spec_decode_num_drafts", drafts, domain="code")
    m.inc("cosine_ray:spec_decode_num_draft_tokens", drafted * 3 // 4, drafter="ngram", domain="code")
    m.inc("cosine_ray:spec_decode_num_draft_tokens", drafted - drafted * 3 // 4, drafter="suffix", domain="chat")
    m.inc("cosine_ray:spec_decode_num_accepted_tokens", accepted, drafter="ngram", domain="code")


def test_the_line_gives_the_intervals_rates_and_what_is_in_flight():
    m = MetricsRegistry()
    served(m, prompt=1000, generated=500, drafts=50, drafted=400, accepted=100)  # before: not in the line
    line = StatsLine.start(m.snapshot(), now=100.0)
    served(m, prompt=200, generated=80, drafts=20, drafted=100, accepted=40)
    m.add_cumulative("cosine_ray:prefix_cache_queries", 200, "engine")
    m.add_cumulative("cosine_ray:prefix_cache_hits", 50, "engine")
    m.set("cosine_ray:num_requests_running", 3)
    m.set("cosine_ray:num_requests_waiting", 1)
    m.set("cosine_ray:kv_cache_usage_perc", 0.125)
    m.set("cosine_ray:kv_cache_used_blocks", 40)
    text = line.update(m.snapshot(), now=104.0)
    assert text == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 20.0 tokens/s, Running: 3 reqs, "
                    "Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 25.0%, "
                    "Draft acceptance rate: 40.0%, Mean acceptance length: 3.00")


def test_a_pool_without_a_fixed_size_shows_its_blocks_and_idle_intervals_print_nothing():
    m = MetricsRegistry()
    line = StatsLine.start(m.snapshot(), now=0.0)
    assert line.update(m.snapshot(), now=5.0) is None  # nothing served, nothing in flight
    m.inc("cosine_ray:generation_tokens", 10)
    m.set("cosine_ray:kv_cache_used_blocks", 7)  # a CPU pool that grows: no share to give
    text = line.update(m.snapshot(), now=10.0)
    assert "Avg generation throughput: 2.0 tokens/s" in text and "KV cache: 7 blocks" in text
    assert "acceptance" not in text  # no drafts in the interval
    assert line.update(m.snapshot(), now=15.0) is None  # idle again: no line
    m.set("cosine_ray:num_requests_waiting", 2)  # waiting, nothing served yet: a line
    assert "Waiting: 2 reqs" in line.update(m.snapshot(), now=20.0)
