"""``benchmarks/drafters/drafting_ceiling.py`` end to end: bad arguments are one line and exit 2,
and on the real model (one turn a domain, 8 tokens) it decodes, replays and replays again from
its own output (the replay itself: tests/bench/test_drafting_replay.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "drafters" / "drafting_ceiling.py"


@pytest.mark.full  # the script in a subprocess, once per case
@pytest.mark.parametrize("argv, message", [
    (["--policies", "learning/best"], "drafting_ceiling: --policies: a policy is DRAFTERS/ROUTE with ROUTE one of"),
    (["--policies", "nonsense/all"], "drafting_ceiling: --policies: "),
    (["--tree-budgets", "8,x"], "drafting_ceiling: --tree-budgets must be a comma list of integers, got '8,x'"),
    (["--budget", "0"], "drafting_ceiling: --prompts-per-domain, --budget and --threads must be >= 1"),
    (["--max-tokens", "1"], "drafting_ceiling: --prompts-per-domain, --budget and --threads must be >= 1, "
                            "--max-tokens >= 2"),
    (["--turns", "/nonexistent.json"], "drafting_ceiling: --turns: /nonexistent.json is not a drafting_ceiling output"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message):
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.real_model
def test_the_script_replays_the_real_model_outputs(tmp_path):
    out = tmp_path / "ceiling.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--prompts-per-domain", "1", "--warmup-per-domain", "1",
                           "--max-tokens", "8", "--threads", "2", "--tree-budgets", "0,4",
                           "--policies", "none/all;suffix/all;learning/own", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "chat: 4 measured turns after 4 warm-up turns, budget 8 a drafter" in proc.stdout, proc.stdout[-2000:]
    report = json.loads(out.read_text())
    rows = {(r["drafters"], r["route"], r["tree_budget"]): r for r in report["results"]}
    assert set(rows) == {(d, r, b) for d, r in (("none", "all"), ("suffix", "all"), ("learning", "own"))
                         for b in (0, 4)}
    plain = rows["none", "all", 0]
    assert plain["tokens_per_step"] == 1.0 and plain["projected_speedup"] == pytest.approx(1.0)
    for key, row in rows.items():
        assert row["tokens"] == plain["tokens"] > 0  # every policy commits the same output
        if key[2] == 4:
            assert row["nodes_per_step"] <= 4
    assert "| suffix/all |" in proc.stdout and "projected ÷ suffix" in proc.stdout

    again = subprocess.run([sys.executable, str(SCRIPT), "--turns", str(out), "--tree-budgets", "4",
                            "--policies", "suffix/all", "--out", str(tmp_path / "again.json")],
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "replaying 4 warm-up and 4 measured turns" in again.stdout and "decoded" not in again.stdout
    (row,) = json.loads((tmp_path / "again.json").read_text())["results"]
    assert {k: row[k] for k in ("tokens", "steps", "nodes_per_step")} == \
        {k: rows["suffix", "all", 4][k] for k in ("tokens", "steps", "nodes_per_step")}
