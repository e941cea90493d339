"""``cosine-loadgen run --save-result``: ``vllm bench serve``'s result JSON, written from the same
run as summary.json and checked against the run's own per-request records (requests.parquet),
against the stub server's controlled timing."""

from __future__ import annotations

import json
import re

import numpy as np
import pyarrow.parquet as pq
import pytest
from support.loadgen_fixtures import rows, write_dataset
from support.stub_server import StubServer

from loadgen.cli import main
from loadgen.vllm_result import DETAILED_FIELDS, peak_concurrency

VLLM_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests")
"""The keys of vllm/benchmarks/serve.py's result (without --save-detailed)."""


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data", {"code": rows("code", [f"code {i}" for i in range(6)])})


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out + err


def test_the_result_has_vllms_keys_and_the_runs_numbers(capsys, tmp_path, dataset):
    out_dir = tmp_path / "out"
    with StubServer(ttft_s=0.03, chunk_s=0.01, num_chunks=3, tokens_per_chunk=2, hold_until=6) as stub:
        rc, out = run(capsys, "run", "--base-url", stub.url, "--dataset-dir", str(dataset), "--split", "all",
                      "--num-prompts", "6", "--output-dir", str(out_dir), "--no-progress", "--no-plots",
                      "--save-result", "--metric-percentiles", "50,99,99.9")
        server_peak = stub.max_active
    assert rc == 0, out
    (path,) = out_dir.glob("openai-chat-*.json")
    assert re.fullmatch(r"openai-chat-infqps-stub-model-\d{8}-\d{6}\.json", path.name), path.name
    assert f"vllm result: {path}" in out
    result = json.loads(path.read_text())
    for key in VLLM_KEYS:
        assert key in result, key
    assert not set(DETAILED_FIELDS) & set(result)  # vllm writes the lists only with --save-detailed
    assert (result["backend"], result["endpoint_type"], result["label"], result["model_id"]) == (
        "openai-chat", "openai-chat", None, "stub-model")
    assert (result["num_prompts"], result["request_rate"], result["burstiness"], result["max_concurrency"]) == (
        6, "inf", 1.0, None)
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 36)
    summary = json.loads((out_dir / "summary.json").read_text())["summary"]
    for key in ("total_input_tokens", "request_throughput", "output_throughput", "total_token_throughput"):
        assert result[key] == summary[key], key
    assert result["duration"] == pytest.approx(summary["duration"])
    # each latency figure from the run's own records, as vllm computes it (numpy, ms)
    table = pq.read_table(out_dir / "requests.parquet").to_pylist()
    ttfts = np.array([r["ttft_s"] for r in table]) * 1000
    itls = np.array([x for r in table for x in r["itl_s"]]) * 1000
    assert result["mean_ttft_ms"] == pytest.approx(ttfts.mean()) and result["mean_ttft_ms"] >= 30
    assert result["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99.9))
    assert result["median_itl_ms"] == pytest.approx(np.median(itls)) and result["std_itl_ms"] == pytest.approx(itls.std())
    assert {"mean_tpot_ms", "p50_e2el_ms", "p99_e2el_ms"} <= set(result) and not any("lpt" in k for k in result)
    # every request held until all six arrived: six in flight at once, on both sides
    assert result["max_concurrent_requests"] == server_peak == 6
    assert result["max_output_tokens_per_s"] > 0
    # the speculation blocks as vllm's spec_decode keys (acceptance rate in percent)
    spec = summary["speculation"]
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * spec["acceptance_rate"])
    assert result["spec_decode_draft_tokens"] == spec["num_draft_tokens"] > 0
    assert result["spec_decode_accepted_tokens"] == spec["num_accepted_tokens"]
    assert result["spec_decode_acceptance_length"] == pytest.approx(spec["mean_accepted_length"])


def test_detailed_lists_a_chosen_name_and_failed_requests_as_vllm_fills_them(capsys, tmp_path):
    data = write_dataset(tmp_path / "data", {"code": rows("code", ["ok 1", "[[status=500]]", "ok 2"])})
    result_dir = tmp_path / "results"
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=2) as stub:
        rc, out = run(capsys, "run", "--base-url", stub.url, "--dataset-dir", str(data), "--split", "all",
                      "--num-prompts", "3", "--max-concurrency", "1", "--request-rate", "100",
                      "--output-dir", str(tmp_path / "out"), "--no-progress", "--no-plots", "--save-result",
                      "--save-detailed", "--result-dir", str(result_dir), "--result-filename", "mine.json",
                      "--label", "cosine", "--endpoint", "completions")
    assert rc == 1, out  # a request failed: exit 1, and the result is written all the same
    result = json.loads((result_dir / "mine.json").read_text())
    assert (result["label"], result["backend"], result["max_concurrency"], result["request_rate"]) == (
        "cosine", "openai", 1, 100.0)
    assert (result["completed"], result["failed"]) == (2, 1)
    for key in DETAILED_FIELDS:
        assert len(result[key]) == 3, key
    failed = next(i for i, e in enumerate(result["errors"]) if e)
    assert result["ttfts"][failed] == 0.0 and result["itls"][failed] == [] and result["output_lens"][failed] == 0
    assert result["generated_texts"][failed] == "" and "500" in result["errors"][failed]
    done = [i for i in range(3) if i != failed]
    assert all(result["ttfts"][i] > 0 and result["latencies"][i] >= result["ttfts"][i] for i in done)
    texts = [r["output_text"] for r in pq.read_table(tmp_path / "out" / "requests.parquet").to_pylist()
             if r["status"] == "ok"]
    assert [result["generated_texts"][i] for i in done] == texts and texts[0].startswith("w0 w1")
    assert result["max_concurrent_requests"] == 1  # --max-concurrency 1: never two in flight


def test_peak_concurrency_counts_half_open_intervals():
    class R:
        def __init__(self, sent, end):
            self.sent_s, self.end_s = sent, end

    assert peak_concurrency([R(0, 1), R(1, 2), R(2, 3)]) == 1  # one ends as the next starts
    assert peak_concurrency([R(0, 2), R(1, 3), R(1.5, 1.6)]) == 3
    assert peak_concurrency([]) == 0
