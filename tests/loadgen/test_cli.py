"""``cosine-loadgen run`` end to end against the stub: outputs, exit codes, one-line errors,
partial results when requests fail or the server goes away."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.loadgen_fixtures import rows, write_dataset
from support.stub_server import StubServer

from loadgen.cli import main
from loadgen.launcher import free_port
from loadgen.ledger import Ledger

REPO = Path(__file__).resolve().parents[2]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("cosine-loadgen: error: "), err
    return lines[0]


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data", {
        "code": rows("code", [f"code {i}" for i in range(4)]),
        "math": rows("math", [f"math {i}" for i in range(4)]),
    })


def test_run_writes_every_output(capsys, tmp_path, dataset):
    out_dir = tmp_path / "out"
    with StubServer(ttft_s=0.02, chunk_s=0.01, num_chunks=3, tokens_per_chunk=2) as stub:
        rc, out, err = run_cli(capsys, "run", "--base-url", stub.url + "/v1", "--dataset-dir", str(dataset),
                               "--split", "all", "--num-prompts", "6", "--request-rate", "50", "--seed", "3",
                               "--goodput", "ttft:5000", "e2el:10000", "--percentile-metrics", "ttft,e2el,lpt",
                               "--metric-percentiles", "50,95", "--output-dir", str(out_dir), "--no-progress")
        received = stub.received_ids()
    assert rc == 0 and err == "", err
    assert "Successful requests" in out and "By domain" in out and "By drafter" in out
    assert f"results: {out_dir}" in out
    data = json.loads((out_dir / "summary.json").read_text())
    s = data["summary"]
    assert (s["completed"], s["failed"], s["num_good_requests"]) == (6, 0, 6)
    assert "p95_ttft_ms" in s and "p95_lpt_ms" in s and "p99_ttft_ms" not in s
    assert s["total_output_tokens"] == 36 and data["model"] == "stub-model"
    assert data["config"]["domain_mix"] == {"code": 0.5, "math": 0.5} and data["config"]["seed"] == 3
    assert data["ledger"]["is_consistent"] and data["ledger"]["planned"] == 6
    table = pq.read_table(out_dir / "requests.parquet").to_pylist()
    assert sorted(r["request_id"] for r in table) == sorted(received)  # server saw each id exactly once
    assert len(set(received)) == 6
    assert {r["domain"] for r in table} == {"code", "math"} and all(r["status"] == "ok" for r in table)
    assert all(dict(r["drafted_by"]) == {"ngram": 3, "retrieval": 3} for r in table)
    assert Ledger.read(out_dir / "ledger.jsonl").check() == data["ledger"]
    for name in ("latency_cdf.png", "over_time.png", "acceptance.png"):
        assert (out_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_seed_same_plan(capsys, tmp_path, dataset):
    def plan(seed: str, name: str) -> list[tuple]:
        with StubServer(ttft_s=0.0, chunk_s=0.0, num_chunks=1) as stub:
            rc, _, _ = run_cli(capsys, "run", "--base-url", stub.url, "--dataset-dir", str(dataset), "--num-prompts",
                               "5", "--request-rate", "100", "--seed", seed, "--output-dir", str(tmp_path / name),
                               "--no-progress", "--no-plots")
        assert rc == 0
        return [(r["request_id"], r["source_id"], r["scheduled_s"])
                for r in pq.read_table(tmp_path / name / "requests.parquet").to_pylist()]

    assert plan("1", "a") == plan("1", "b") != plan("2", "c")


def test_failed_requests_exit_1_with_partial_results(capsys, tmp_path):
    data = write_dataset(tmp_path / "data", {"code": rows("code", [
        "ok 1", "ok 2", "[[status=500]]", "[[malformed]]", "[[sse_error]]", "[[sleep=3]]"])})
    out_dir = tmp_path / "out"
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=2) as stub:
        rc, out, err = run_cli(capsys, "run", "--base-url", stub.url, "--dataset-dir", str(data), "--split", "all",
                               "--num-prompts", "6", "--request-timeout", "0.5", "--output-dir", str(out_dir),
                               "--no-progress")
    assert rc == 1
    line = one_error_line(err)
    assert "2 of 6 requests completed; 4 failed" in line and str(out_dir) in line
    table = {r["source_id"]: r for r in pq.read_table(out_dir / "requests.parquet").to_pylist()}
    kinds = {sid: (r["status"], r["error_kind"]) for sid, r in table.items()}
    assert kinds == {"code/0": ("ok", None), "code/1": ("ok", None), "code/2": ("failed", "http"),
                     "code/3": ("failed", "malformed"), "code/4": ("failed", "sse_error"),
                     "code/5": ("failed", "timeout")}
    data = json.loads((out_dir / "summary.json").read_text())
    assert data["summary"]["errors"] == {"http": 1, "malformed": 1, "sse_error": 1, "timeout": 1}
    assert data["ledger"]["is_consistent"] and data["ledger"]["failed"] == 4


def test_unreachable_server(capsys, tmp_path, dataset):
    out_dir = tmp_path / "out"
    rc, _, err = run_cli(capsys, "run", "--base-url", f"http://127.0.0.1:{free_port()}", "--dataset-dir",
                         str(dataset), "--num-prompts", "4", "--output-dir", str(out_dir), "--no-progress")
    assert rc == 1
    assert "server unreachable" in one_error_line(err)
    data = json.loads((out_dir / "summary.json").read_text())
    assert data["ledger"]["not_sent"] == 4 and data["ledger"]["is_consistent"]


def test_unreachable_server_with_model_given(capsys, tmp_path, dataset):
    """No model discovery: the first request fails to connect, the rest are not sent."""
    out_dir = tmp_path / "out"
    rc, _, err = run_cli(capsys, "run", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m",
                         "--dataset-dir", str(dataset), "--num-prompts", "6", "--request-rate", "20",
                         "--output-dir", str(out_dir), "--no-progress")
    assert rc == 1 and "aborted: server unreachable" in one_error_line(err)
    table = pq.read_table(out_dir / "requests.parquet").to_pylist()
    assert {r["error_kind"] for r in table if r["status"] == "failed"} == {"connect"}
    statuses = [r["status"] for r in table]
    assert statuses.count("failed") >= 1 and statuses.count("not_sent") >= 1 and "ok" not in statuses


def test_server_dying_mid_run_keeps_what_was_measured(capsys, tmp_path, dataset):
    out_dir = tmp_path / "out"
    stub = StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=2).start()
    killer = threading.Timer(0.6, stub.stop)
    killer.start()
    try:
        rc, _, err = run_cli(capsys, "run", "--base-url", stub.url, "--dataset-dir", str(dataset), "--split", "all",
                             "--num-prompts", "20", "--request-rate", "10", "--burstiness", "1000",
                             "--output-dir", str(out_dir), "--no-progress")
    finally:
        killer.join()
    assert rc == 1 and "server unreachable" in one_error_line(err)
    table = pq.read_table(out_dir / "requests.parquet").to_pylist()
    statuses = [r["status"] for r in table]
    assert len(table) == 20 and statuses.count("ok") >= 3 and statuses.count("not_sent") >= 5
    assert json.loads((out_dir / "summary.json").read_text())["ledger"]["is_consistent"]


@pytest.mark.parametrize("args, message", [
    (["--request-rate", "-1"], "--request-rate must be > 0"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--request-rate", "abc"], "invalid float value"),
    (["--burstiness", "0"], "--burstiness"),
    (["--schedule", "fluctuating"], "finite --request-rate"),
    (["--schedule", "weekly"], "invalid choice"),
    (["--domain-mix", "poetry=1"], "unknown domain 'poetry'"),
    (["--domain-mix", "code=0,math=0"], "sum to more than 0"),
    (["--domain-mix", "code=-0.5"], ">= 0"),
    (["--percentile-metrics", "ttft,latency"], "unknown metric 'latency'"),
    (["--metric-percentiles", "0"], "(0, 100]"),
    (["--goodput", "ttft=10"], "--goodput takes KEY:MS"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--temperature", "-0.1"], "--temperature"),
    (["--duration", "-3"], "--duration"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--workload", "random", "--endpoint", "chat"], "use --endpoint completions"),
    (["--multi-turn", "--endpoint", "completions"], "--multi-turn needs the chat endpoint"),
    (["--endpoint", "/v1/embeddings"], "--endpoint must be chat or completions"),
    (["--base-url", "localhost:8000"], "--base-url must start with http"),
    (["--workload", "random", "--random-token-range", "5"], "--random-token-range"),
    (["--bogus-flag"], "unrecognized arguments"),
])
def test_bad_flags_exit_2_with_one_line(capsys, tmp_path, dataset, args, message):
    out_dir = tmp_path / "out"
    base = ["run", "--dataset-dir", str(dataset), "--output-dir", str(out_dir), "--no-progress"]
    rc, out, err = run_cli(capsys, *base, *args)
    assert rc == 2 and message in one_error_line(err)
    assert not out_dir.exists()  # nothing was sent or written


def test_malformed_dataset_exits_2_naming_the_line(capsys, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.jsonl").write_text('{"id": "1", "domain": "code", "prompt": "p"}\n{"id": 2, "domain": \n')
    rc, _, err = run_cli(capsys, "run", "--dataset-dir", str(bad), "--output-dir", str(tmp_path / "o"))
    assert rc == 2 and f"{bad / 'x.jsonl'}:2: not valid JSON" in one_error_line(err)


def test_console_entry_point_runs_as_a_module():
    """``python -m loadgen.cli`` (what the ``cosine-loadgen`` script calls) gives one line + exit 2."""
    proc = subprocess.run([sys.executable, "-m", "loadgen.cli", "run", "--request-rate", "-2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "cosine-loadgen: error: --request-rate must be > 0 (or inf), got -2.0"


def test_random_workload_sends_token_ids_to_completions(capsys, tmp_path):
    with StubServer(ttft_s=0.0, chunk_s=0.0, num_chunks=2) as stub:
        rc, _, err = run_cli(capsys, "run", "--base-url", stub.url, "--workload", "random", "--random-input-len", "5",
                             "--random-output-len", "3", "--random-token-range", "10,20", "--num-prompts", "3",
                             "--output-dir", str(tmp_path / "o"), "--no-progress", "--no-plots")
        bodies = [b for _, b in stub.received]
    assert rc == 0, err
    assert len(bodies) == 3
    for body in bodies:
        assert len(body["prompt"]) == 5 and all(10 <= t < 20 for t in body["prompt"]) and body["max_tokens"] == 3
        assert "messages" not in body and body["temperature"] == 0.0 and body["stream"] is True
    data = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert data["config"]["endpoint"] == "/v1/completions" and list(data["summary"]["domains"]) == ["random"]


def test_run_defaults_to_the_packaged_held_back_prompts(capsys, tmp_path, monkeypatch):
    """No --dataset-dir: the prompt sets packaged with cosine_ray, second half of each file."""
    monkeypatch.delenv("COSINE_RAY_PROMPTS", raising=False)
    from cosine_ray.datasets import DOMAIN_FILES, PACKAGED_PROMPT_DIR, read_prompts, second_half
    held_back = {r["prompt"] for name in DOMAIN_FILES.values()
                 for r in second_half(read_prompts(PACKAGED_PROMPT_DIR / name))}
    with StubServer(ttft_s=0.0, chunk_s=0.0, num_chunks=1) as stub:
        rc, out, err = run_cli(capsys, "run", "--base-url", stub.url, "--num-prompts", "8", "--request-rate",
                               "inf", "--max-tokens", "4", "--seed", "0", "--output-dir", str(tmp_path / "o"),
                               "--no-progress")
        bodies = [b for _, b in stub.received]
    assert rc == 0, err
    assert len(bodies) == 8 and all(b["messages"][-1]["content"] in held_back for b in bodies)
    data = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert {d: v["completed"] for d, v in data["summary"]["domains"].items()} == {
        "code": 2, "math": 2, "instruction": 2, "chat": 2}


def test_loadgen_never_imports_cosine_ray_or_ray():
    """loadgen is HTTP only: importing every module pulls in neither cosine_ray nor ray."""
    code = ("import sys, loadgen.cli, loadgen.compare, loadgen.launcher, loadgen.report, loadgen.plots; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('cosine_ray', 'ray', 'torch')); "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
