"""Write the Grafana dashboards in ``dashboards/`` from one list of panels per dashboard.

    python scripts/build_dashboards.py          # rewrite dashboards/*.json
    python scripts/build_dashboards.py --check  # exit 1 if a file differs (tests/metrics uses it)

Every query uses only names from ``cosine_ray.metrics.names.METRICS`` (counters with
``_total``, histograms through ``_bucket``/``_sum``/``_count``), ``$__rate_interval`` for rate
windows and the ``${datasource}`` Prometheus variable, so a dashboard imports into any Grafana.
The JSON files are the product; this script keeps their boilerplate consistent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "dashboards"
P = "cosine_ray:"
W = "[$__rate_interval]"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
ERRORS = '{status=~"[45].."}'
SERVER_ERRORS = '{status=~"5.."}'


def rate(metric: str, selector: str = "") -> str:
    return f"rate({P}{metric}{selector}{W})"


def quantiles(histogram: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, sum by (le) ({rate(histogram + '_bucket')}))", f"p{round(q * 100)}")
            for q in qs]


def mean(histogram: str) -> str:
    return f"sum({rate(histogram + '_sum')}) / sum({rate(histogram + '_count')})"


def ratio_by(label: str, numerator: str, denominator: str) -> str:
    return f"sum by ({label}) ({rate(numerator)}) / sum by ({label}) ({rate(denominator)})"


def share_by(label: str, metric: str) -> str:
    return f"sum by ({label}) ({rate(metric)}) / scalar(sum({rate(metric)}))"


def panel(title: str, targets: list[tuple[str, str]], *, unit: str = "short", description: str = "",
          kind: str = "timeseries", width: int = 12, stack: bool = False, max_value: float | None = None) -> dict:
    defaults: dict = {"unit": unit, "custom": {"fillOpacity": 10, "stacking": {"mode": "normal" if stack else "none"}}}
    if kind != "timeseries":
        defaults = {"unit": unit}
    if max_value is not None:
        defaults["max"] = max_value
        defaults["min"] = 0
    return {
        "type": kind, "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"w": width, "h": 8},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
                    for i, (expr, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}}
        if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}},
    }


def dashboard(uid: str, title: str, description: str, panels: list[dict]) -> dict:
    x = y = 0
    for i, p in enumerate(panels, start=1):  # lay panels out left to right, top to bottom
        if x + p["gridPos"]["w"] > 24:
            x, y = 0, y + 8
        p["id"] = i
        p["gridPos"].update(x=x, y=y)
        x += p["gridPos"]["w"]
    return {
        "uid": uid, "title": title, "description": description, "tags": ["cosine_ray"],
        "schemaVersion": 39, "version": 1, "editable": True, "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"}, "timezone": "browser",
        "templating": {"list": [{"name": "datasource", "label": "Prometheus", "type": "datasource",
                                 "query": "prometheus", "current": {}, "hide": 0, "refresh": 1}]},
        "annotations": {"list": []},
        "links": [{"title": "cosine_ray", "type": "dashboards", "tags": ["cosine_ray"], "asDropdown": True}],
        "panels": panels,
    }


def overview() -> dict:
    return dashboard("cosine-ray-overview", "cosine_ray: overview",
                     "Throughput, latency percentiles, queue and errors (vLLM-style serving metrics).", [
        panel("Finished requests / s by reason",
              [(f"sum by (finished_reason) ({rate('request_success_total')})", "{{finished_reason}}")],
              unit="reqps", stack=True),
        panel("Tokens / s", [(f"sum({rate('prompt_tokens_total')})", "prompt"),
                             (f"sum({rate('generation_tokens_total')})", "generation")], unit="short"),
        panel("Time to first token", quantiles("time_to_first_token_seconds"), unit="s", width=8),
        panel("Time per output token", quantiles("time_per_output_token_seconds"), unit="s", width=8),
        panel("End-to-end latency", quantiles("e2e_request_latency_seconds"), unit="s", width=8),
        panel("Inter-token latency", quantiles("inter_token_latency_seconds", (0.5, 0.99))
              + [(mean("inter_token_latency_seconds"), "mean")], unit="s", width=8),
        panel("Queue time", quantiles("request_queue_time_seconds", (0.5, 0.99)), unit="s", width=8),
        panel("Requests running / waiting", [(f"sum({P}num_requests_running)", "running"),
                                             (f"sum({P}num_requests_waiting)", "waiting")], width=8),
        panel("Prefix cache hit rate", [(f"sum({rate('prefix_cache_hits_total')}) / "
                                         f"sum({rate('prefix_cache_queries_total')})", "cached / prompt tokens")],
              unit="percentunit", max_value=1, width=8,
              description="Share of the prompt tokens of new and resumed requests whose KV was reused."),
        panel("KV cache usage and preemptions", [(f"max({P}kv_cache_usage_perc)", "share of the KV pool in use"),
                                                 (f"sum(increase({P}num_preemptions_total{W}))", "preemptions")],
              width=8, description="Share of the KV pool's blocks in use (0 without a budget) and requests "
                                   "preempted for memory over the window."),
        panel("KV blocks in use", [(f"sum({P}kv_cache_used_blocks)", "blocks")], width=8,
              description="Blocks of 16 tokens that running and cached-but-referenced requests hold."),
        panel("HTTP responses / s by route and status",
              [(f"sum by (route, status) ({rate('http_requests_total')})", "{{route}} {{status}}")],
              unit="reqps"),
        panel("Errors", [
            (f"sum by (route, status) ({rate('http_requests_total', ERRORS)})", "{{route}} {{status}}"),
            (f"(sum({rate('http_requests_total', SERVER_ERRORS)}) or vector(0))"
             f" / sum({rate('http_requests_total')})", "5xx share"),
        ], unit="short", description="4xx/5xx responses per second, and the share of 5xx among all responses."),
        panel("Requests / s by API key and status",
              [(f"sum by (key, status) ({rate('tenant_requests_total')})", "{{key}} {{status}}")], unit="reqps",
              width=8, description="Responses to requests that carried an API key, by the key's name."),
        panel("In flight by API key", [(f"sum by (key) ({P}tenant_requests_in_flight)", "{{key}} requests"),
                                       (f"sum by (key) ({P}tenant_tokens_in_flight)", "{{key}} tokens")],
              width=8, description="Generation requests each key has admitted, and the tokens they claim "
                                   "(n × (prompt + max_tokens) each)."),
        panel("429s / s by API key and reason",
              [(f"sum by (key, reason) ({rate('tenant_rate_limited_total')})", "{{key}} {{reason}}")],
              unit="reqps", width=8, description="Requests refused for a key's own limits (concurrency, tokens) "
                                                 "or beyond its fair share of a full server."),
    ])


def speculation() -> dict:
    acc, draft = "spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"
    drafts = "spec_decode_num_drafts_total"
    return dashboard("cosine-ray-speculation", "cosine_ray: speculation",
                     "Is speculation paying off: acceptance per drafter, domain and depth; routing and "
                     "fusion shares; draft budgets.", [
        panel("Acceptance rate", [(f"sum({rate(acc)}) / sum({rate(draft)})", "accepted / drafted")],
              unit="percentunit", max_value=1, width=8),
        panel("Mean accepted length (bonus included)",
              [(f"1 + sum({rate(acc)}) / sum({rate(drafts)})", "tokens per verify step")], width=8),
        panel("Draft tokens / s by drafter", [(f"sum by (drafter) ({rate(draft)})", "{{drafter}}")],
              stack=True, width=8),
        panel("Acceptance rate by drafter", [(ratio_by("drafter", acc, draft), "{{drafter}}")],
              unit="percentunit", max_value=1),
        panel("Acceptance rate by domain", [(ratio_by("domain", acc, draft), "{{domain}}")],
              unit="percentunit", max_value=1),
        panel("Acceptance by tree depth (per verify step)",
              [(f"sum by (position) ({rate('spec_decode_num_accepted_tokens_per_pos_total')})"
                f" / scalar(sum({rate(drafts)}))", "depth {{position}}")], unit="percentunit", max_value=1,
              description="Accepted tokens at depth k per verify step that carried a draft (vLLM's "
                          "per-position acceptance)."),
        panel("Routing share by drafter", [(share_by("drafter", "routing_decisions_total"), "{{drafter}}")],
              unit="percentunit", stack=True, width=8),
        panel("Routing decisions / s by mode",
              [(f"sum by (mode) ({rate('routing_decisions_total')})", "{{mode}}")], width=8),
        panel("Routing score by drafter and domain",
              [(f"avg by (drafter, domain) ({P}routing_score)", "{{drafter}} / {{domain}}")], width=8),
        panel("Fusion share (trunk tokens) by drafter",
              [(share_by("drafter", "fusion_picks_total"), "{{drafter}}")], unit="percentunit", stack=True,
              width=8),
        panel("Fused tokens that survived verification",
              [(ratio_by("drafter", "fusion_picks_accepted_total", "fusion_picks_total"), "{{drafter}}")],
              unit="percentunit", max_value=1, width=8),
        panel("Drafter participation and speculation on/off",
              [(f"avg({P}drafter_participation)", "drafters per request"),
               (f"min({P}speculation_enabled)", "speculation enabled")], width=8),
        panel("Economics: predicted / measured",
              [(f"sum({rate('verify_predicted_seconds_total')}) / sum({rate('verify_seconds_total')})",
                "verify time (cost model)"),
               (f"sum({rate('spec_decode_expected_accepted_tokens_total')}) / sum({rate(acc)})",
                "accepted tokens (gain model)")], width=8,
              description="1 = the model the scheduler decides with was exact over the window; above 1 it "
                          "over-predicts."),
        panel("Speculation level (guard)", [(f"avg({P}speculation_level)", "κ")], width=8,
              description="Multiplier on the value of an expected accepted token the guard learned from "
                          "measured goodput; 0 = speculation off."),
        panel("Draft budget γ per request", quantiles("scheduler_gamma", (0.5, 0.9))
              + [(mean("scheduler_gamma"), "mean")], width=8),
        panel("Draft tokens Γ per micro-batch", quantiles("scheduler_total_gamma", (0.5, 0.9))
              + [(mean("scheduler_total_gamma"), "mean")], width=8),
        panel("Drafter failures and restarts",
              [(f"sum by (drafter) (increase({P}drafter_failures_total{W}))", "{{drafter}} failures"),
               (f"sum by (drafter) (increase({P}drafter_restarts_total{W}))", "{{drafter}} restarts")],
              width=8),
    ])


def pipeline() -> dict:
    busy, idle = "stage_busy_seconds_total", "stage_idle_seconds_total"
    return dashboard("cosine-ray-pipeline", "cosine_ray: pipeline",
                     "Verification pipeline: stage utilisation and bubbles, micro-batch sizes, "
                     "scheduler decision latency.", [
        panel("Stage utilisation", [(f"sum by (stage) ({rate(busy)}) / (sum by (stage) ({rate(busy)})"
                                     f" + sum by (stage) ({rate(idle)}))", "stage {{stage}}")],
              unit="percentunit", max_value=1),
        panel("Pipeline bubbles (idle share)", [(f"sum by (stage) ({rate(idle)}) / (sum by (stage) ({rate(busy)})"
                                                 f" + sum by (stage) ({rate(idle)}))", "stage {{stage}}")],
              unit="percentunit", max_value=1),
        panel("Busy seconds / s by stage", [(f"sum by (stage) ({rate(busy)})", "stage {{stage}}")],
              stack=True, width=8),
        panel("Micro-batch size", quantiles("scheduler_batch_size", (0.5, 0.9))
              + [(mean("scheduler_batch_size"), "mean")], width=8),
        panel("Micro-batches / s", [(f"sum({rate('scheduler_batch_size_count')})", "batches")], width=8),
        panel("Scheduling decision latency", quantiles("scheduler_decision_seconds", (0.5, 0.99))
              + [(mean("scheduler_decision_seconds"), "mean")], unit="s"),
        panel("Draft tokens Γ per micro-batch", quantiles("scheduler_total_gamma", (0.5, 0.9)), width=12),
        panel("Step time by phase", [(f"sum by (phase) ({rate('step_phase_seconds_total')})"
                                      f" / scalar(sum({rate('engine_steps_total')}))", "{{phase}}")],
              unit="s", stack=True, width=12,
              description="Seconds per engine step in each part of it: verify is the target call, the "
                          "rest is the engine's host work (where a GPU waits on Python)."),
        panel("PEARL steps / s by kind", [(f"sum by (kind) ({rate('pearl_steps_total')})", "{{kind}}")],
              stack=True, width=12),
    ])


DASHBOARDS = {"overview.json": overview, "speculation.json": speculation, "pipeline.json": pipeline}


def render_all() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if dashboards/ is out of date")
    args = parser.parse_args(argv)
    stale = []
    for name, text in render_all().items():
        path = OUT_DIR / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            OUT_DIR.mkdir(exist_ok=True)
            path.write_text(text, encoding="utf-8")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/build_dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
