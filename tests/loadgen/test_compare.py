"""``cosine-loadgen compare``: same plan against several stubs (URLs or launched processes), the
normalised table, and the launcher's failure handling (server exits, never healthy, ignores SIGINT)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support.loadgen_fixtures import STUB_SCRIPT, rows, write_dataset
from support.stub_server import StubServer

from loadgen.cli import main
from loadgen.launcher import LaunchError, ServerProcess, free_port


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "data", {"code": rows("code", [f"c{i}" for i in range(6)]),
                                             "chat": rows("chat", [f"h{i}" for i in range(6)])})


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_compare_targets_same_plan_and_normalised_table(capsys, tmp_path, dataset):
    # same 12 output tokens everywhere; fewer, fatter chunks = faster (like accepted drafts)
    servers = {"off": StubServer(ttft_s=0.03, chunk_s=0.1, num_chunks=12, tokens_per_chunk=1),
               "vanilla": StubServer(ttft_s=0.03, chunk_s=0.1, num_chunks=4, tokens_per_chunk=3),
               "cosine": StubServer(ttft_s=0.03, chunk_s=0.1, num_chunks=2, tokens_per_chunk=6)}
    out_dir = tmp_path / "cmp"
    for s in servers.values():
        s.start()
    try:
        argv = ["compare", *(a for n, s in servers.items() for a in ("--target", f"{n}={s.url}")),
                "--dataset-dir", str(dataset), "--num-prompts", "4", "--request-rate", "40", "--max-concurrency",
                "2", "--output-dir", str(out_dir), "--no-progress", "--num-warmups", "0"]
        rc = main(argv)
    finally:
        for s in servers.values():
            s.stop()
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "Side by side" in out and "same as off" in out
    comparison = json.loads((out_dir / "comparison.json").read_text())
    rows_by = {r["target"]: r for r in comparison["rows"]}
    assert list(rows_by) == ["off", "vanilla", "cosine"] and comparison["baseline"] == "off"
    assert rows_by["off"]["lpt_vs_baseline"] == 1.0 and rows_by["off"]["throughput_vs_baseline"] == 1.0
    summaries = {n: json.loads((out_dir / n / "summary.json").read_text())["summary"] for n in servers}
    for name in servers:
        row = rows_by[name]
        assert row["lpt_vs_baseline"] == pytest.approx(summaries[name]["mean_lpt_ms"] / summaries["off"]["mean_lpt_ms"])
        assert row["throughput_vs_baseline"] == pytest.approx(
            summaries[name]["output_throughput"] / summaries["off"]["output_throughput"])
        assert (row["identical_to_baseline"], row["compared_with_baseline"]) == (4, 4)
        assert row["completed"] == 4
    # E2EL 30+11·100 = 1130 ms vs 30+3·100 = 330 vs 30+100 = 130: lower latency per token, in that
    # order (each mean of 4 is at least 200 ms apart: one request would have to stall 0.8 s to swap two)
    assert rows_by["cosine"]["lpt_vs_baseline"] < rows_by["vanilla"]["lpt_vs_baseline"] < 1.0
    plans = {n: [(r["request_id"], r["source_id"], r["scheduled_s"])
                 for r in pq.read_table(out_dir / n / "requests.parquet").to_pylist()] for n in servers}
    assert plans["off"] == plans["vanilla"] == plans["cosine"]
    md = (out_dir / "comparison.md").read_text()
    assert md.count("\n") == 5 and "| off | 4/4 |" in md and "1.00×" in md
    for name in ("latency_cdf.png", "over_time.png", "acceptance.png", "normalised.png"):
        assert (out_dir / name).stat().st_size > 1000


@pytest.mark.full  # five stub servers in subprocesses, with start and stop timeouts
def test_compare_launch_mode_survives_bad_servers(capsys, tmp_path, dataset):
    """Five launched stubs: two fine, one exits at start, one never healthy, one ignores SIGINT.
    Every process is gone afterwards; the healthy targets are measured; exit 1 naming the failures."""
    template = f"{shlex.quote(sys.executable)} {shlex.quote(str(STUB_SCRIPT))} --port {{port}} --ttft 0.01 --chunk 0.01"
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    targets = {"off": "--num-chunks 4", "fast": "--num-chunks 2 --tokens-per-chunk 2",
               "broken": "--fail-start", "stuck": "--never-ready", "stubborn": "--ignore-sigint"}
    argv = ["compare", "--launch", template, "--launch-timeout", "3", "--stop-timeout", "1",
            "--dataset-dir", str(dataset), "--num-prompts", "3", "--output-dir", str(tmp_path / "out"), "--no-progress",
            "--no-plots"]
    for name, extra in targets.items():
        argv += ["--launch-target", f"{name}={extra} --pid-file {pid_dir / name}"]
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith("cosine-loadgen: error: broken: the server exited with code 3") and "(+1 more)" in last
    assert "stuck: /health not 200 after 3 s (HTTP 503)" in err
    assert "[stubborn] still running 1 s after SIGINT" in err
    pids = {p.name: int(p.read_text()) for p in pid_dir.iterdir()}
    assert set(pids) == {"off", "fast", "stuck", "stubborn"}  # broken exited before writing one
    assert not any(pid_alive(pid) for pid in pids.values())
    comparison = json.loads((tmp_path / "out" / "comparison.json").read_text())
    assert [r["target"] for r in comparison["rows"]] == ["off", "fast", "stubborn"]
    assert all(r["completed"] == 3 for r in comparison["rows"])
    assert "refusing to start" in (tmp_path / "out" / "broken" / "server.log").read_text()


def test_server_process_is_stopped_when_the_body_raises(tmp_path):
    port = free_port()
    cmd = [sys.executable, str(STUB_SCRIPT), "--port", str(port)]
    with pytest.raises(RuntimeError, match="boom"):
        with ServerProcess("s", cmd, f"http://127.0.0.1:{port}", tmp_path / "s.log", log=lambda m: None) as server:
            server.wait_ready()
            raise RuntimeError("boom")
    assert server.proc.returncode == 0  # stopped by SIGINT, cleanly
    assert "stub: stopped" in (tmp_path / "s.log").read_text()


def test_missing_executable_is_a_launch_error(tmp_path):
    server = ServerProcess("x", ["/nonexistent/cosine-ray", "serve"], "http://127.0.0.1:1", tmp_path / "x.log",
                           log=lambda m: None)
    with pytest.raises(LaunchError, match="x: cannot start '/nonexistent/cosine-ray'"):
        server.start()


@pytest.mark.parametrize("args, message", [
    ([], "compare needs --target NAME=URL"),
    (["--target", "off"], "--target takes NAME=VALUE"),
    (["--target", "a=http://x", "--target", "a=http://y"], "given twice"),
    (["--target", "a=http://127.0.0.1:1"], "--baseline 'off' is not a target"),
    (["--target", "off=http://x", "--launch", "srv --port {port}"], "not both"),
    (["--launch", "srv --port 8000"], "must contain {port}"),
    (["--launch-target", "off="], "--launch-target needs --launch"),
    (["--launch", "srv {port}", "--launch-timeout", "0"], "--launch-timeout"),
])
def test_compare_bad_flags(capsys, tmp_path, dataset, args, message):
    rc = main(["compare", "--dataset-dir", str(dataset), "--output-dir", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "o").exists()


def test_launch_template_placeholders(tmp_path):
    from loadgen.launcher import build_command
    assert build_command("serve --host {host} --port {port}", "--drafters 'a b'", host="h", port=5) == [
        "serve", "--host", "h", "--port", "5", "--drafters", "a b"]
    with pytest.raises(ValueError, match="placeholders"):
        build_command("serve --port {prt}", "", host="h", port=5)
    assert Path(STUB_SCRIPT).is_file()
