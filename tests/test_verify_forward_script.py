"""``benchmarks/kernels/verify_forward.py --shapes`` runs end to end on a tiny random shape and prints
one row per (requests, new tokens) with our time (eager and fixed-shape runner), HF eager's, the static step's and their
ratios (its figures are its own benchmark; here only that it runs and says what it measured)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full  # a benchmark script in a subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernels" / "verify_forward.py"


def test_shapes_mode_prints_every_cell():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "tiny", "--batches", "1,3", "--tokens", "1,4",
                           "--reps", "2", "--context", "16"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| tiny |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1 × 1", "1 × 4", "3 × 1", "3 × 4"]
    for row in rows:
        cells = [c.strip() for c in row.split("|")[3:-1]]
        eager, fixed, hf, static, roofline, vs_static, vs_hf = cells
        assert all(float(x) > 0 for x in (eager, fixed, hf, static)) and roofline == ""  # no bandwidth known on CPU
        assert re.fullmatch(r"[0-9.]+×", vs_static) and re.fullmatch(r"[0-9.]+×", vs_hf)


def test_unknown_shape_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "gpt-5"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "unknown shape(s) gpt-5" in proc.stderr
