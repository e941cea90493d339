"""``benchmarks/engine/step_profile.py`` profiles the bench's measured window on the real model
(here on CPU, 4 short conversations) and prints tok/s and the host-time table; a device it
cannot use is one line and exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full  # a benchmark script in a subprocess

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine" / "step_profile.py"


@pytest.mark.real_model
def test_profiles_the_measured_window():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--drafters", "ngram", "--concurrency", "2",
                           "--prompts-per-domain", "1", "--warmup-per-domain", "1", "--max-tokens", "4",
                           "--rows", "5", "--threads", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "ngram on cpu (float32), c=2: 4 conversations, 16 tokens in" in out, out[-2000:]
    host = out.split("most host time:")[1]
    assert "Self CPU" in host and "aten::" in host
    assert "most device time:" not in out  # no CUDA activity on a CPU run


def test_a_device_it_cannot_use_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda:x"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "step_profile: --device: device 'cuda:x': use cpu, cuda or cuda:N"
