"""The repository stands alone: a copy with nothing beside it, and a non-editable install.

What a new user gets, checked on this machine:

(a) **A clone in an empty folder** (``<tmp>/standalone*/cosine_ray``, nothing beside it: no
    developers' folder next to the checkout). In the clone:
    - the test suite collects without errors (the full suite, ``--full``, collection only);
    - the deploy manifest tests pass (KubeRay CRD schemas shipped in tests/deploy/crds);
    - the data paths work from the packaged prompt sets: ``cosine-ray bench``'s held-back
      (measured) and warm-up conversations, ``cosine-ray datastore build``'s default prompt file, and loadgen's default
      workload (loadgen's CLI against the stub server included);
    - no text file names a path of our machines.
(b) **A non-editable** ``pip install`` of that copy into a fresh virtualenv, imported from a
    working directory outside the repository: ``cosine_ray.datasets`` finds the prompt files, the
    packaged datastores load, and ``cosine_ray``/``loadgen`` are the venv's copies.

Which copy. ``$COSINE_RAY_STANDALONE_SOURCE`` picks it:

- ``clone``: ``git clone`` of the repository, checked out at the committed HEAD. That is exactly
  what a user gets, but it ignores uncommitted work.
- ``worktree``: every file of the working tree that git would commit (tracked files as they are
  now, plus untracked files that are not ignored), copied without ``.git``. This is what the
  repository will be once the working tree is committed. Ignored files (build outputs, caches,
  venvs) are left out, as a clone would leave them out.
- ``auto`` (default): ``clone`` when ``git status`` is clean (CI checks out a clean commit, so
  CI tests a real clone of what it runs), else ``worktree``. A local run with uncommitted
  changes would otherwise test the previous commit: new files would be missing and the test
  would either fail for no reason or pass without seeing the change. The chosen mode is
  printed.

Why the venv uses the test environment's packages. A fully fresh venv that installs every
dependency (torch, Ray, transformers, ...) took 13 minutes and 2 GB on our 2-core development
machines (a plain ``pip install .``, with other jobs running). That is far too long for every CI
run. So the venv sees the site-packages of the interpreter running the tests (through a ``.pth``
file after its own site-packages: a venv's packages when the tests run in one, the system's
otherwise) and the project is installed with ``pip install --no-deps --no-build-isolation``.
(``--system-site-packages`` would show the *base* interpreter's packages instead: in a fresh
virtualenv on a bare Python, that is a setuptools too old to build a wheel and none of the
dependencies.) That is only meaningful if the imported package really is the venv's copy: the
test environment holds the developer's *editable* install, whose setuptools finder sits on
``sys.meta_path``. The check therefore
runs ``python -I`` (no cwd, no PYTHONPATH, no user site) from a folder outside both the
repository and the copy, and it asserts:
- ``cosine_ray.__file__``, ``loadgen.__file__``, the prompt folder and the datastores lie
  inside the venv;
- the distribution's ``direct_url.json`` says the install is not editable;
- any editable finder sits after ``PathFinder``, so it can only answer for modules that the
  venv does not have.

Run time on the 2 shared development cores: 1 to 2 minutes (63 s to 120 s measured, with other
jobs running). Most of it is the full collection and the deploy tests; the venv and the install
take about 3 s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.full  # fresh copies and a fresh venv, pytest runs inside them

REPO = Path(__file__).resolve().parents[1]
SOURCE_ENV = "COSINE_RAY_STANDALONE_SOURCE"
MODES = ("auto", "clone", "worktree")
TIMEOUT_S = 600
# Paths of our development machines that must never appear in the repository, spelled in
# pieces so this file does not match itself.
FORBIDDEN = re.compile(re.escape("../" + "shared") + "|" + r"(?<![\w.])" + re.escape("/" + "work/"))
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".sh", ".json", ".jsonl", ""}


@dataclass(frozen=True)
class Copy:
    root: Path
    """The empty folder the copy was made in."""
    path: Path
    """The copy (``root/cosine_ray``)."""
    mode: str
    env: dict[str, str]
    """Environment for commands in the copy: its own packages first, no dataset overrides."""


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=120).stdout


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    print(f"$ {' '.join(cmd)}  (in {cwd}) -> {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


def _mode() -> str:
    mode = os.environ.get(SOURCE_ENV, "auto")
    if mode not in MODES:
        raise ValueError(f"${SOURCE_ENV}={mode!r}: use one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "worktree" if _git("status", "--porcelain").strip() else "clone"
    return mode


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PYTHONPATH", "COSINE_RAY_PROMPTS", "COSINE_RAY_KUBERAY_CRDS", "PYTEST_ADDOPTS",
                 "COSINE_RAY_FULL_SUITE"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Copy:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout of the repository")
    mode = _mode()
    root = tmp_path_factory.mktemp("standalone")
    dest = root / "cosine_ray"
    if mode == "clone":
        head = _git("rev-parse", "HEAD").strip()
        _git("clone", "--quiet", str(REPO), str(dest), cwd=root)
        _git("checkout", "--quiet", "--detach", head, cwd=dest)
    else:
        names = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
        for name in filter(None, names):
            src = REPO / name
            if src.is_file():  # tracked files deleted in the working tree are skipped
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / name, follow_symlinks=False)
    print(f"[standalone] source mode: {mode}; copy at {dest}")
    env = _base_env()
    env["PYTHONPATH"] = str(dest)  # the copy's packages, also in subprocesses its tests start
    return Copy(root, dest, mode, env)


def _pytest(copy: Copy, *args: str) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args], copy.path, copy.env)


def test_copy_stands_alone(copy):
    assert [p.name for p in copy.root.iterdir()] == ["cosine_ray"], "something lies beside the copy"
    code = "import cosine_ray, loadgen; print(cosine_ray.__file__); print(loadgen.__file__)"
    proc = _run([sys.executable, "-c", code], copy.path, copy.env)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():
        assert Path(line).resolve().is_relative_to(copy.path.resolve()), f"imported {line}, not the copy's"
    offenders = []
    for path in sorted(copy.path.rglob("*")):
        if ".git" in path.relative_to(copy.path).parts or not path.is_file():
            continue
        if path.suffix not in TEXT_SUFFIXES and path.name != "Dockerfile":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        offenders += [f"{path.relative_to(copy.path)}:{n}: {line.strip()}"
                      for n, line in enumerate(text.splitlines(), 1) if FORBIDDEN.search(line)]
    assert offenders == [], "paths of development machines in the repository:\n" + "\n".join(offenders)


def test_suite_collects_without_errors(copy):
    proc = _pytest(copy, "--full", "--collect-only", "-q")
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and "error" not in tail, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.match(r"\d+ tests collected", tail), tail


def test_deploy_manifest_tests_pass(copy):
    proc = _pytest(copy, "tests/deploy", "-q")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.lower()  # the summary lists skips; no summary (nothing skipped), no skips
    summary = out.split("short test summary")[-1] if "short test summary" in out else ""
    assert "crd" not in summary, "a CRD test was skipped"


def test_data_path_tests_pass(copy):
    """The datasets module, loadgen's workload and its CLI run with the default (packaged) prompts."""
    proc = _pytest(copy, "tests/test_datasets.py", "tests/loadgen/test_workload.py",
                   "tests/loadgen/test_cli.py::test_run_defaults_to_the_packaged_held_back_prompts", "-q")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" not in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]


DATA_PATHS = textwrap.dedent("""
    import json, sys
    from collections import Counter
    from pathlib import Path
    import numpy as np
    copy = Path(sys.argv[1]).resolve()
    prompts = copy / "cosine_ray" / "data" / "prompts"

    from cosine_ray import cli, datasets
    from cosine_ray.cli import bench, datastore
    assert datasets.default_prompt_dir() == prompts == bench.DEFAULT_PROMPT_DIR, bench.DEFAULT_PROMPT_DIR
    warm, held = bench.build_conversations(cli.build_parser().parse_args(
        ["bench", "--prompts-per-domain", "3", "--warmup-per-domain", "1"]))
    held_ids = {r["id"] for name in datasets.DOMAIN_FILES.values()
                for r in datasets.second_half(datasets.read_prompts(prompts / name))}
    assert sorted(i.domain for i in held) == sorted(d for d in datasets.DOMAIN_FILES for _ in range(3))
    assert all(i.source_id in held_ids for i in held) and not any(i.source_id in held_ids for i in warm)

    args = cli.build_parser().parse_args(["datastore", "build", "--domain", "math", "--limit", "4"])
    rows = datastore._datastore_rows(args)
    assert Path(args.prompts) == prompts / "gsm8k.jsonl" and [r["id"] for r in rows] == [f"gsm8k/{i}" for i in range(4)]

    from loadgen.workload import DEFAULT_DATASET_DIR, dataset_workload, load_rows, parse_domain_mix
    assert DEFAULT_DATASET_DIR == prompts, DEFAULT_DATASET_DIR
    by_domain = load_rows(DEFAULT_DATASET_DIR)
    items = dataset_workload(by_domain, 40, parse_domain_mix(None, list(by_domain)), np.random.default_rng(0),
                             max_tokens=16)
    assert all(i.source_id in held_ids for i in items)
    print(json.dumps({"bench_prompts": len(held), "datastore_rows": len(rows),
                      "workload": dict(Counter(i.domain for i in items))}))
""")


def test_data_paths_in_the_copy(copy):
    """bench's held-back prompts, datastore build's default file and loadgen's default workload."""
    proc = _run([sys.executable, "-c", DATA_PATHS, str(copy.path)], copy.path, copy.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"bench_prompts": 12, "datastore_rows": 4,
                      "workload": {"code": 10, "math": 10, "instruction": 10, "chat": 10}}, result


INSTALLED = textwrap.dedent("""
    import importlib.machinery, importlib.metadata, json, sys
    from pathlib import Path
    venv = Path(sys.prefix).resolve()
    import cosine_ray, loadgen
    from cosine_ray import datasets
    from loadgen.workload import DEFAULT_DATASET_DIR
    from cosine_ray.engine.drafters.lookup.datastore import Datastore

    def inside(p):
        return Path(p).resolve().is_relative_to(venv)

    finders = [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path]
    prompt_files = sorted(p.name for p in datasets.PACKAGED_PROMPT_DIR.glob("*.jsonl"))
    rows = {d: len(datasets.read_prompts(datasets.domain_file(d))) for d in datasets.DOMAIN_FILES}
    stores = sorted((Path(cosine_ray.__file__).parent / "data" / "datastores" / "smollm2-135m").glob("*.parquet"))
    loaded = {p.stem: (Datastore.load(p).domain, Datastore.load(p).num_tokens) for p in stores}
    direct_url = json.loads(importlib.metadata.distribution("cosine_ray").read_text("direct_url.json") or "{}")
    print(json.dumps({
        "cosine_ray": cosine_ray.__file__, "loadgen": loadgen.__file__,
        "inside": [inside(cosine_ray.__file__), inside(loadgen.__file__), inside(datasets.PACKAGED_PROMPT_DIR),
                   all(inside(p) for p in stores)],
        "loader": type(cosine_ray.__spec__.loader).__name__,
        "finders": finders, "editable": direct_url.get("dir_info", {}).get("editable", False),
        "prompt_files": prompt_files, "rows": rows, "loadgen_default": str(DEFAULT_DATASET_DIR),
        "prompt_dir": str(datasets.PACKAGED_PROMPT_DIR),
        "readme": (datasets.PACKAGED_PROMPT_DIR / "README.md").is_file(), "datastores": loaded}))
""")


def test_non_editable_install_in_a_fresh_venv(copy, tmp_path_factory):
    venv = tmp_path_factory.mktemp("venv") / "venv"
    outside = tmp_path_factory.mktemp("outside")
    env = _base_env()
    proc = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], outside, env)
    assert proc.returncode == 0, proc.stderr
    python = str(venv / ("Scripts" if os.name == "nt" else "bin") / "python")
    proc = _run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], outside, env)
    assert proc.returncode == 0, proc.stderr
    # the packages of the environment running the tests (a venv's own, or the system's), seen by
    # the new venv after its own site-packages: a .pth line appends a folder to sys.path
    # without running the .pth files inside it (the editable install's finder stays out)
    outer = [p for p in sys.path
             if p and os.path.isdir(p) and os.path.basename(p) in ("site-packages", "dist-packages")]
    (Path(proc.stdout.strip().splitlines()[-1]) / "_test_environment.pth").write_text("\n".join(outer) + "\n")
    # that environment's pip and build backend, run by the venv's interpreter, install into the venv
    proc = _run([python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                 "--disable-pip-version-check", "-q", str(copy.path)], outside, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _run([python, "-I", "-c", INSTALLED], outside, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["inside"] == [True, True, True, True], got
    assert not Path(got["cosine_ray"]).resolve().is_relative_to(REPO) and \
        not Path(got["cosine_ray"]).resolve().is_relative_to(copy.path.resolve()), got["cosine_ray"]
    assert got["editable"] is False and got["loader"] == "SourceFileLoader", got
    finders = got["finders"]
    assert all(finders.index(f) > finders.index("PathFinder") for f in finders if "Editable" in f), finders
    assert got["prompt_files"] == ["alpaca.jsonl", "gsm8k.jsonl", "humaneval.jsonl", "mtbench.jsonl"]
    assert got["rows"] == {"code": 164, "math": 1319, "instruction": 175, "chat": 80} and got["readme"]
    assert got["loadgen_default"] == got["prompt_dir"]
    assert {name: domain for name, (domain, _) in got["datastores"].items()} == {
        "chat": "chat", "code": "code", "instruction": "instruction", "math": "math"}
    assert all(tokens > 0 for _, tokens in got["datastores"].values())
