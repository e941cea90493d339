"""One short real run: ``cosine-loadgen run`` against a real ``cosine-ray serve`` (SmolLM2-135M).

The server is the real CLI on the session Ray cluster (``--address``, ``ray_cluster`` in
tests/conftest.py), 1 stage, the n-gram drafter, started and stopped by loadgen's own
``ServerProcess`` (the code ``compare --launch`` uses: /health wait, SIGINT stop). The run is
small (8 requests: 2 per domain from the held-back halves, 16 tokens, concurrency 2) and checks
the ledger, that acceptance came from each response's ``cosine_ray`` block, and the outputs.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cosine_ray.datasets import PACKAGED_PROMPT_DIR
from loadgen.cli import main
from loadgen.launcher import ServerProcess, free_port

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.ray, pytest.mark.real_model]

REPO = Path(__file__).resolve().parents[2]
PROMPTS_DIR = PACKAGED_PROMPT_DIR
READY_TIMEOUT_S = 360.0


def our_actors() -> list[tuple[str, str]]:
    return sorted((a["namespace"], a["name"]) for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("cosine_ray:") or a["namespace"] == "serve")


@pytest.fixture(scope="module")
def server(ray_cluster, real_checkpoint, tmp_path_factory):
    port = free_port()
    cmd = [sys.executable, "-m", "cosine_ray.cli", "serve", "--address", ray_cluster, "--port", str(port),
           "--drafters", "ngram", "--stages", "1"]
    proc = ServerProcess("cosine-ray", cmd, f"http://127.0.0.1:{port}",
                         tmp_path_factory.mktemp("loadgen-real") / "serve.log", ready_timeout_s=READY_TIMEOUT_S,
                         cwd=REPO)
    with proc:
        proc.wait_ready()
        yield proc
    assert proc.proc.returncode == 0, proc.last_log_line()
    deadline = time.monotonic() + 30
    while (left := our_actors()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"actors left after SIGINT: {left}"


def test_short_real_run(server, tmp_path, capsys):
    out_dir = tmp_path / "out"
    start = time.perf_counter()
    rc = main(["run", "--base-url", server.url, "--dataset-dir", str(PROMPTS_DIR), "--num-prompts", "8",
               "--max-tokens", "16", "--max-concurrency", "2", "--request-rate", "4", "--seed", "1",
               "--goodput", "e2el:60000", "--request-timeout", "180", "--output-dir", str(out_dir), "--no-progress"])
    out, err = capsys.readouterr()
    print(out)
    print(f"[loadgen-real] run took {time.perf_counter() - start:.1f} s")
    assert rc == 0, err
    data = json.loads((out_dir / "summary.json").read_text())
    ledger, s = data["ledger"], data["summary"]
    assert ledger["is_consistent"] and (ledger["planned"], ledger["sent"], ledger["completed"]) == (8, 8, 8)
    assert ledger["num_lost"] == ledger["num_duplicated"] == ledger["num_reused_response_ids"] == 0
    assert set(s["domains"]) == {"code", "math", "instruction", "chat"}
    assert all(d["completed"] == 2 for d in s["domains"].values())
    rows = pq.read_table(out_dir / "requests.parquet").to_pylist()
    assert len(rows) == 8 and len({r["response_id"] for r in rows}) == 8
    for r in rows:
        assert r["status"] == "ok" and r["num_done_markers"] == 1 and r["output_tokens_source"] == "usage"
        assert 1 <= r["output_tokens"] <= 16 and r["output_text"]
        assert r["has_stats"] and r["num_verify_steps"] >= 1
        assert r["num_draft_tokens"] >= r["num_accepted_tokens"] >= 0
        assert r["num_draft_tokens"] == sum(dict(r["drafted_by"]).values())  # the block adds up
        # the server's own definition: (accepted + steps) / steps, read back from the block
        assert r["mean_accepted_length"] == pytest.approx((r["num_accepted_tokens"] + r["num_verify_steps"])
                                                          / r["num_verify_steps"])
        assert all("ngram" in name for name in dict(r["drafted_by"]))  # --drafters ngram only
        assert r["ttft_s"] > 0 and r["e2el_s"] >= r["ttft_s"]
    assert s["speculation"]["num_requests_with_stats"] == 8
    assert s["output_throughput"] > 0 and s["num_good_requests"] == 8
    for name in ("latency_cdf.png", "over_time.png", "acceptance.png", "ledger.jsonl"):
        assert (out_dir / name).stat().st_size > 0
