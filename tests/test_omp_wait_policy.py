"""Importing cosine_ray makes OpenMP threads wait passively unless the user chose (README
"Threads on a busy machine"): busy-waiting threads collapse a forward when a core is shared."""

import os
import subprocess
import sys

import pytest

CODE = "import cosine_ray, os, torch; print(os.environ.get('OMP_WAIT_POLICY'))"


@pytest.mark.parametrize("given, expected", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_passive_wait_is_the_default_and_a_user_choice_is_kept(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected
