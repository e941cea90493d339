"""``vllm bench serve``'s result JSON (``--save-result``), from a run's records, so a run can be
compared with vLLM's own benchmark files by the same tools.

The keys are vLLM's (``vllm/benchmarks/serve.py``): the setup (``date``, ``backend``, ``label``,
``model_id``, ``num_prompts``, ``request_rate``, ``burstiness``, ``max_concurrency``), the totals
(``duration``, ``completed``, ``failed``, ``total_input_tokens``, ``total_output_tokens``,
``request_throughput``, ``request_goodput``, ``output_throughput``, ``total_token_throughput``,
``max_output_tokens_per_s``, ``max_concurrent_requests``), ``mean_/median_/std_/pP_<metric>_ms``
for each of ``ttft``, ``tpot``, ``itl``, ``e2el`` asked for, and with ``--save-detailed`` the
per-request lists (``input_lens``, ``output_lens``, ``ttfts``, ``itls``, ``latencies``,
``start_times``, ``generated_texts``, ``errors``). Where vLLM fills in a value we do the same:
a failed request has TTFT and latency 0 and no ITLs, and a metric with no value is 0.

What differs: ``failed`` counts every request that did not complete (a ``--duration`` cut
leaves some unsent; vLLM sends all), ``start_times`` are seconds of the run's clock, and
``max_output_tokens_per_s`` bins the run's clock by the second, a chunk's tokens spread over it
(vLLM times each token; a speculative step streams several in one chunk). With the servers'
speculation blocks, vLLM's ``spec_decode_*`` keys are filled from them (acceptance rate in
percent, acceptance length = tokens per verify step, drafts = verify steps).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from loadgen.client import RequestRecord
from loadgen.metrics import metric_values_ms, speculation_summary, token_timeline

VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")
"""The latency metrics vLLM's result has (``lpt`` is ours: left out of this file)."""
DETAILED_FIELDS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "generated_texts",
                   "errors")
"""The per-request lists vLLM writes only with ``--save-detailed``."""


def backend_name(endpoint: str) -> str:
    """vLLM's ``--backend`` for the endpoint: ``openai-chat`` or ``openai`` (completions)."""
    return "openai-chat" if endpoint.endswith("/chat/completions") else "openai"


def result_filename(label: str, request_rate: float, max_concurrency: int | None, model_id: str, date: str) -> str:
    """vLLM's default name: ``{label}-{rate}qps[-concurrency{N}]-{model's last path part}-{date}.json``."""
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{label}-{request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"


def vllm_result(records: Sequence[RequestRecord], summary: Mapping[str, Any], *, duration_s: float,
                model_id: str, endpoint: str, label: str | None, num_prompts: int, request_rate: float,
                burstiness: float, max_concurrency: int | None, percentile_metrics: Sequence[str],
                percentiles: Sequence[float], goodput: bool, detailed: bool,
                date: str | None = None) -> dict[str, Any]:
    """The result dict ``vllm bench serve --save-result`` writes, for these records and their
    ``summary`` (``loadgen.metrics.summarize``)."""
    backend = backend_name(endpoint)
    ok = [r for r in records if r.status == "ok"]
    out: dict[str, Any] = {
        "date": date or time.strftime("%Y%m%d-%H%M%S"), "endpoint_type": backend, "backend": backend,
        "label": label, "model_id": model_id, "tokenizer_id": None, "num_prompts": num_prompts,
        "request_rate": request_rate if request_rate < float("inf") else "inf", "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration": duration_s, "completed": len(ok), "failed": len(records) - len(ok),
        "total_input_tokens": summary["total_input_tokens"], "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"],
        "request_goodput": summary.get("request_goodput") if goodput else None,
        "output_throughput": summary["output_throughput"],
        "total_token_throughput": summary["total_token_throughput"],
    }
    if detailed:
        out.update(_details(records))
    _, tokens_per_s = token_timeline(ok, bin_s=1.0)
    out["max_output_tokens_per_s"] = float(tokens_per_s.max()) if tokens_per_s.size else 0.0
    out["max_concurrent_requests"] = peak_concurrency(ok)
    for metric in (m for m in percentile_metrics if m in VLLM_METRICS):
        values = metric_values_ms(ok, metric)
        values = values if values.size else np.zeros(1)  # vLLM: np.mean(values or 0)
        out[f"mean_{metric}_ms"] = float(values.mean())
        out[f"median_{metric}_ms"] = float(np.median(values))
        out[f"std_{metric}_ms"] = float(values.std())
        for p in percentiles:
            word = str(int(p)) if int(p) == p else str(p)
            out[f"p{word}_{metric}_ms"] = float(np.percentile(values, p))
    spec = speculation_summary(records)
    if spec["num_requests_with_stats"] and spec["num_draft_tokens"]:
        out.update(spec_decode_acceptance_rate=100.0 * spec["acceptance_rate"],
                   spec_decode_acceptance_length=spec["mean_accepted_length"],
                   spec_decode_num_drafts=int(spec["num_verify_steps"]),
                   spec_decode_draft_tokens=int(spec["num_draft_tokens"]),
                   spec_decode_accepted_tokens=int(spec["num_accepted_tokens"]))
    return out


def _details(records: Sequence[RequestRecord]) -> dict[str, list]:
    """vLLM's per-request lists, one entry a request in plan order (failed ones as vLLM fills them)."""
    def ok(r: RequestRecord) -> bool:
        return r.status == "ok"

    return {"input_lens": [r.prompt_tokens or 0 for r in records],
            "output_lens": [(r.output_tokens or 0) if ok(r) else 0 for r in records],
            "ttfts": [(r.ttft_s or 0.0) if ok(r) else 0.0 for r in records],
            "itls": [list(r.itl_s) if ok(r) else [] for r in records],
            "latencies": [(r.e2el_s or 0.0) if ok(r) else 0.0 for r in records],
            "start_times": [r.sent_s for r in records],
            "generated_texts": [r.output_text if ok(r) else "" for r in records],
            "errors": [r.error or "" for r in records]}


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most completed requests in flight at once, over half-open [sent, end) intervals."""
    events = sorted([(r.sent_s, 1) for r in records if r.sent_s is not None and r.end_s is not None]
                    + [(r.end_s, -1) for r in records if r.sent_s is not None and r.end_s is not None])
    peak = now = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak
