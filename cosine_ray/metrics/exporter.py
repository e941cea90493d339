"""The engine's metric exporter: ``StepStats`` and a few engine events → named metrics.

The only place in the engine's path that knows metric names (``metrics/names.py``); the
engine hands it plain figures. The serving series (TTFT, TPOT, ...) are recorded by
``metrics/serving.py`` as outputs reach callers; the HTTP ones at the edge.
"""

from __future__ import annotations

from typing import Mapping

from cosine_ray.metrics.registry import MetricsRegistry
from cosine_ray.metrics.stats import StepStats


class EngineMetrics:
    def __init__(self, registry: MetricsRegistry) -> None:
        self.registry = registry

    def step_phases(self, seconds: Mapping[str, float]) -> None:
        """Wall time of one step's parts (``metrics.names.STEP_PHASES``), and one more step."""
        self.registry.inc("cosine_ray:engine_steps")
        for phase, s in seconds.items():
            self.registry.inc("cosine_ray:step_phase_seconds", s, phase=phase)

    def observe_step(self, stats: StepStats) -> None:
        m = self.registry
        for r in stats.routed:
            for drafter, mode in r.routed:
                m.inc("cosine_ray:routing_decisions", drafter=drafter, mode=mode, domain=r.domain)
        if stats.batch_size:
            m.observe("cosine_ray:scheduler_decision_seconds", stats.decision_s)
            m.observe("cosine_ray:scheduler_batch_size", stats.batch_size)
            m.observe("cosine_ray:scheduler_total_gamma", stats.total_gamma)
            for gamma in stats.gammas:
                m.observe("cosine_ray:scheduler_gamma", gamma)
            m.set("cosine_ray:speculation_enabled", 1.0 if stats.is_speculating else 0.0)
        for name in stats.drafter_failures:
            self.drafter_failed(name)
        for r in stats.requests:
            if r.num_draft_tokens:
                m.inc("cosine_ray:spec_decode_num_drafts", domain=r.domain)
            for drafter, n in r.drafted_by.items():
                m.inc("cosine_ray:spec_decode_num_draft_tokens", n, drafter=drafter, domain=r.domain)
            for drafter, n in r.accepted_by.items():
                m.inc("cosine_ray:spec_decode_num_accepted_tokens", n, drafter=drafter, domain=r.domain)
            for position in range(r.num_accepted_tokens):
                m.inc("cosine_ray:spec_decode_num_accepted_tokens_per_pos", position=position)
            for drafter, n in r.fusion_picks.items():
                m.inc("cosine_ray:fusion_picks", n, drafter=drafter)
            for drafter, n in r.fusion_picks_accepted.items():
                m.inc("cosine_ray:fusion_picks_accepted", n, drafter=drafter)
        if stats.verify_s > 0:
            m.inc("cosine_ray:verify_seconds", stats.verify_s)
            m.inc("cosine_ray:verify_predicted_seconds", stats.verify_predicted_s)
            m.inc("cosine_ray:spec_decode_expected_accepted_tokens", stats.expected_accepted)
        if stats.speculation_level is not None:
            m.set("cosine_ray:speculation_level", stats.speculation_level)
        if stats.participation is not None:
            self.participation(stats.participation)

    def requests_in_pool(self, running: int, waiting: int) -> None:
        self.registry.set("cosine_ray:num_requests_running", running)
        self.registry.set("cosine_ray:num_requests_waiting", waiting)

    def kv_cache(self, *, queries: int, hits: int, preemptions: int, used_blocks: int,
                 capacity: int | None) -> None:
        """The prefix cache's cumulative counts and the KV pool's use, read now."""
        m = self.registry
        m.add_cumulative("cosine_ray:prefix_cache_queries", queries, "engine")
        m.add_cumulative("cosine_ray:prefix_cache_hits", hits, "engine")
        m.add_cumulative("cosine_ray:num_preemptions", preemptions, "engine")
        m.set("cosine_ray:kv_cache_used_blocks", used_blocks)
        m.set("cosine_ray:kv_cache_usage_perc", used_blocks / capacity if capacity else 0.0)

    def stage_utilisation(self, stage: int, busy_s: float, idle_s: float, source: str) -> None:
        """Cumulative busy/idle seconds of one stage, read where they are counted (``source``:
        the stage's incarnation, so a restarted stage never makes the counters go down)."""
        self.registry.add_cumulative("cosine_ray:stage_busy_seconds", busy_s, source, stage=stage)
        self.registry.add_cumulative("cosine_ray:stage_idle_seconds", idle_s, source, stage=stage)

    def collection_failed(self, source: str) -> None:
        self.registry.inc("cosine_ray:metrics_collection_failures", source=source)

    def drafter_restarts(self, drafter: str, num_respawns: int, source: str) -> None:
        self.registry.add_cumulative("cosine_ray:drafter_restarts", num_respawns, source, drafter=drafter)

    def drafter_failures(self) -> dict[str, int]:
        """Dropped calls per drafter so far (drafters that never failed are absent)."""
        series = self.registry.snapshot()["cosine_ray:drafter_failures"]
        return {dict(labels)["drafter"]: int(n) for labels, n in series.items() if n}

    def drafter_failed(self, drafter: str) -> None:
        self.registry.inc("cosine_ray:drafter_failures", drafter=drafter)

    def pearl_steps(self, *, post_verify: int, pre_verify: int, drafted_first: int) -> None:
        for kind, n in (("post_verify", post_verify), ("pre_verify", pre_verify), ("drafted_first", drafted_first)):
            if n:
                self.registry.inc("cosine_ray:pearl_steps", n, kind=kind)

    def participation(self, k: int) -> None:
        self.registry.set("cosine_ray:drafter_participation", k)

    def routing_priors(self, priors: Mapping[str, Mapping[str, float]]) -> None:
        """Per-domain prior routing scores (eq. 2) of each drafter, after requests finished."""
        for domain, scores in priors.items():
            for drafter, score in scores.items():
                self.registry.set("cosine_ray:routing_score", score, drafter=drafter, domain=domain)
