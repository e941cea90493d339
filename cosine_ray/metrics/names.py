"""Every metric cosine_ray exports: one table, one place.

Names follow vLLM's (``vllm:`` becomes ``cosine_ray:``) where vLLM has one, so existing queries
and dashboards carry over. Counters are listed by their base name; the Prometheus exposition
adds ``_total``. Labels: ``drafter`` is a drafter name (``ngram``, ``retrieval:code``,
``model:…``), ``domain`` the request's domain as the engine classified it (``code``, ``math``,
``instruction``, ``chat`` or ``other``).

Who records what: the engine's exporter (``metrics/exporter.py``, fed one ``StepStats`` per step)
the speculation, routing, fusion and scheduler series; the engine loop the serving series; the
HTTP edge ``http_requests`` and the ``tenant_*`` series; the engine deployment, at scrape time, ``stage_*_seconds``,
``drafter_restarts`` and the running/waiting gauges. One registry in the engine process holds
them all; ``metrics/prometheus.py`` renders it. Derived figures (acceptance rate, mean accepted
length, ...) are PromQL in docs/metrics.md and in the dashboards.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MetricSpec:
    kind: str
    """counter | gauge | histogram"""
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
SIZE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_PHASES = ("schedule", "route", "draft", "verify", "commit", "learn", "advance")
"""The parts of an engine step, in order (``engine.core``), the ``phase`` label of
``cosine_ray:step_phase_seconds``."""

METRICS: dict[str, MetricSpec] = {
    # ---- serving (vLLM names) ------------------------------------------------------------
    "cosine_ray:num_requests_running": MetricSpec("gauge", "Requests in the running batch."),
    "cosine_ray:num_requests_waiting": MetricSpec("gauge", "Requests queued for admission."),
    "cosine_ray:time_to_first_token_seconds": MetricSpec(
        "histogram", "Arrival at the engine to the first streamed token.", (), LATENCY_BUCKETS),
    "cosine_ray:inter_token_latency_seconds": MetricSpec(
        "histogram", "Time between consecutive streamed increments, per token.", (), LATENCY_BUCKETS),
    "cosine_ray:time_per_output_token_seconds": MetricSpec(
        "histogram", "Per request: (e2e - ttft) / (output tokens - 1).", (), LATENCY_BUCKETS),
    "cosine_ray:e2e_request_latency_seconds": MetricSpec(
        "histogram", "Arrival to finish.", (), LATENCY_BUCKETS),
    "cosine_ray:request_queue_time_seconds": MetricSpec(
        "histogram", "Arrival to admission into the running batch.", (), LATENCY_BUCKETS),
    "cosine_ray:prompt_tokens": MetricSpec("counter", "Prompt tokens of admitted requests."),
    "cosine_ray:generation_tokens": MetricSpec("counter", "Tokens streamed to clients."),
    "cosine_ray:request_success": MetricSpec(
        "counter", "Finished requests by reason (stop, length, abort, error).", ("finished_reason",)),
    "cosine_ray:prefix_cache_queries": MetricSpec(
        "counter", "Prompt tokens looked up in the prefix cache (new and resumed requests)."),
    "cosine_ray:prefix_cache_hits": MetricSpec(
        "counter", "Of those, tokens whose KV was found cached (not computed again)."),
    "cosine_ray:num_preemptions": MetricSpec(
        "counter", "Requests preempted for KV memory (they resume by recomputing their context)."),
    "cosine_ray:kv_cache_usage_perc": MetricSpec(
        "gauge", "Share of the KV pool's blocks that requests hold (0 while the pool has no budget)."),
    "cosine_ray:kv_cache_used_blocks": MetricSpec("gauge", "KV blocks that requests hold."),
    "cosine_ray:http_requests": MetricSpec(
        "counter", "HTTP responses by route and status code.", ("route", "status")),
    # ---- tenants: per API key, labelled by the key's name (never the key) ---------------------
    "cosine_ray:tenant_requests": MetricSpec(
        "counter", "HTTP responses to requests that carried an API key, by key name and status code.",
        ("key", "status")),
    "cosine_ray:tenant_requests_in_flight": MetricSpec(
        "gauge", "Generation requests an API key has admitted and not finished (all ingress replicas).", ("key",)),
    "cosine_ray:tenant_tokens_in_flight": MetricSpec(
        "gauge", "Tokens those requests claim, n × (prompt + max_tokens) each (all ingress replicas).", ("key",)),
    "cosine_ray:tenant_rate_limited": MetricSpec(
        "counter", "Requests refused with 429, by key name and reason (concurrency, tokens, fair_share).",
        ("key", "reason")),
    # ---- speculation (vLLM names) ----------------------------------------------------------
    "cosine_ray:spec_decode_num_drafts": MetricSpec(
        "counter", "Verify steps that carried at least one draft token.", ("domain",)),
    "cosine_ray:spec_decode_num_draft_tokens": MetricSpec(
        "counter", "Draft tokens verified.", ("drafter", "domain")),
    "cosine_ray:spec_decode_num_accepted_tokens": MetricSpec(
        "counter", "Draft tokens accepted (bonus excluded).", ("drafter", "domain")),
    "cosine_ray:spec_decode_num_accepted_tokens_per_pos": MetricSpec(
        "counter", "Accepted draft tokens by depth in the tree (0 = first draft token).", ("position",)),
    # ---- CoSine: routing, fusion, scheduling ----------------------------------------------------
    "cosine_ray:routing_decisions": MetricSpec(
        "counter", "Drafter chosen for a request's step, by mode (explore/exploit).",
        ("drafter", "mode", "domain")),
    "cosine_ray:routing_score": MetricSpec(
        "gauge", "Per-domain prior routing score (eq. 2) of each drafter.", ("drafter", "domain")),
    "cosine_ray:fusion_picks": MetricSpec(
        "counter", "Fused (trunk) tokens taken from each drafter (eq. 4).", ("drafter",)),
    "cosine_ray:fusion_picks_accepted": MetricSpec(
        "counter", "Fused tokens of each drafter that verification accepted.", ("drafter",)),
    "cosine_ray:drafter_participation": MetricSpec(
        "gauge", "Drafters routed per request (adaptive speculation)."),
    "cosine_ray:speculation_enabled": MetricSpec(
        "gauge", "1 while the scheduler drafts at all, 0 when it turned speculation off."),
    "cosine_ray:scheduler_batch_size": MetricSpec(
        "histogram", "Requests in each scheduled micro-batch.", (), SIZE_BUCKETS),
    "cosine_ray:scheduler_total_gamma": MetricSpec(
        "histogram", "Γ: draft tokens per scheduled micro-batch.", (), SIZE_BUCKETS),
    "cosine_ray:scheduler_gamma": MetricSpec(
        "histogram", "γ_i: draft-token budget given to each scheduled request.", (), SIZE_BUCKETS),
    "cosine_ray:scheduler_decision_seconds": MetricSpec(
        "histogram", "Time of one batch-scheduling decision (LP solve included).", (), DECISION_BUCKETS),
    "cosine_ray:engine_steps": MetricSpec(
        "counter", "Engine steps that ran a batch (prefills, trees or both)."),
    "cosine_ray:step_phase_seconds": MetricSpec(
        "counter", "Wall time of each part of the engine's steps: schedule, route, draft (fusion "
        "and TreeSelection included), verify (the target call), commit, learn, advance. All but "
        "verify are the engine's host work.", ("phase",)),
    # ---- economics: the models the scheduler decides with, checked against what happened ----------
    "cosine_ray:verify_seconds": MetricSpec(
        "counter", "Wall time of the verify forwards (the target call of each step)."),
    "cosine_ray:verify_predicted_seconds": MetricSpec(
        "counter", "What the cost model (T_llm) predicted for those same forwards."),
    "cosine_ray:spec_decode_expected_accepted_tokens": MetricSpec(
        "counter", "Draft tokens the gain model expected verification to accept (Σ node acceptance)."),
    "cosine_ray:speculation_level": MetricSpec(
        "gauge", "κ, the guard's current multiplier on the value of an accepted token for the last step's batch size (0 = off)."),
    "cosine_ray:stage_busy_seconds": MetricSpec(
        "counter", "Seconds a pipeline stage spent computing.", ("stage",)),
    "cosine_ray:stage_idle_seconds": MetricSpec(
        "counter", "Seconds a pipeline stage waited for work (pipeline bubbles).", ("stage",)),
    "cosine_ray:pearl_steps": MetricSpec(
        "counter", "Requests' PEARL steps by kind: post_verify (tree drafted during the previous "
        "verification), pre_verify (root checked while drafting), drafted_first (auto).", ("kind",)),
    "cosine_ray:drafter_failures": MetricSpec(
        "counter", "Drafter calls dropped (error, deadline, malformed answer).", ("drafter",)),
    "cosine_ray:drafter_restarts": MetricSpec(
        "counter", "Drafter actors respawned after being lost.", ("drafter",)),
    # ---- the exporter itself --------------------------------------------------------------------
    "cosine_ray:metrics_collection_failures": MetricSpec(
        "counter", "Scrape-time reads that failed or missed their deadline (a stage that did not "
        "answer keeps its last values).", ("source",)),
}
