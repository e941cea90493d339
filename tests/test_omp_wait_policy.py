"""Importing cosine_ray lets OpenMP threads spin briefly before they sleep unless the user chose
how they wait (OMP_WAIT_POLICY or GOMP_SPINCOUNT): a thread woken from sleep for each of a CPU
step's parallel regions slows the step. It also bounds oneDNN's per-shape caches
(docs/choices.md, "CPU threads and memory")."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.full  # each test starts a Python that imports torch and cosine_ray

CODE = ("import cosine_ray, os, torch; "
        "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))")


@pytest.mark.parametrize("given, expected", [({}, "None 30000"), ({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE None"),
                                             ({"GOMP_SPINCOUNT": "0"}, "None 0")])
def test_a_short_spin_is_the_default_and_a_user_choice_is_kept(given, expected):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", CODE], env={**env, **given}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected


CACHES = ("import cosine_ray, os, torch; "
          "print(os.environ.get('LRU_CACHE_CAPACITY'), os.environ.get('ONEDNN_PRIMITIVE_CACHE_CAPACITY'))")


@pytest.mark.parametrize("given, expected", [(None, "64 64"), ("1024", "1024 1024")])
def test_onednn_shape_caches_are_bounded_by_default_and_a_user_choice_is_kept(given, expected):
    """oneDNN's two per-shape caches grew the engine's heap ~0.8 MiB per request with their
    default 1024 entries (cosine_ray/__init__.py); importing cosine_ray bounds them at 64."""
    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    if given is not None:
        env["LRU_CACHE_CAPACITY"] = env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = given
    out = subprocess.run([sys.executable, "-c", CACHES], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == expected
