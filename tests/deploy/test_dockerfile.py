"""deploy/Dockerfile checked statically (no Docker daemon here, so the image is never built).

What runs: the Dockerfile parses into instructions; both build variants (cpu, cuda) are
handled; the pinned torch and Ray versions satisfy pyproject.toml and match the manifests'
`rayVersion`; the CMD's program is a console script of pyproject.toml whose target imports
and whose arguments the real CLI parser accepts; the `python -c` snippets of RUN lines compile
and import names that exist (the model pre-fetch names an embedded model); every COPY source
exists, is not excluded by .dockerignore, and together they hold what `pip install .` needs;
the image has the C compiler the kernel build looks for and builds the kernels as the runtime
user, runs as a non-root user, and checks its health on the served port's `/health`.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib
import json
import re
import shlex
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import support.k8s_checks as k

DOCKERFILE = k.REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = k.REPO / ".dockerignore"
PYPROJECT = tomllib.loads((k.REPO / "pyproject.toml").read_text(encoding="utf-8"))


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with comments dropped and backslash continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continuation are ignored by Docker too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


INSTRUCTIONS = instructions(DOCKERFILE.read_text(encoding="utf-8"))


def _args() -> dict[str, str]:
    args = {}
    for word, rest in INSTRUCTIONS:
        if word == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def _one(word: str) -> str:
    found = [rest for w, rest in INSTRUCTIONS if w == word]
    assert len(found) == 1, f"expected one {word}, found {len(found)}"
    return found[0]


def _pyproject_requirement(name: str) -> Requirement:
    reqs = [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    (req,) = [r for r in reqs if r.name == name]
    return req


def test_instructions_parse_and_start_from_a_base_image():
    words = [w for w, _ in INSTRUCTIONS]
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "CMD", "ENTRYPOINT", "LABEL",
             "HEALTHCHECK"}
    assert set(words) <= known, set(words) - known
    assert words.index("FROM") < words.index("RUN")
    base = _one("FROM")
    assert base == "${BASE_IMAGE}" and _args()["BASE_IMAGE"].startswith("python:3.11")


def test_both_variants_are_handled():
    args = _args()
    assert args["VARIANT"] == "cpu"
    (torch_run,) = [rest for w, rest in INSTRUCTIONS if w == "RUN" and "torch==$TORCH_VERSION" in rest]
    assert re.search(r"\bcpu\)\s*pip install --index-url \"\$TORCH_CPU_INDEX\"", torch_run)
    assert re.search(r"\bcuda\)\s*pip install \"torch==\$TORCH_VERSION\"", torch_run)
    assert re.search(r"\*\)\s*echo .*exit 2", torch_run), "an unknown VARIANT must stop the build"
    assert args["TORCH_CPU_INDEX"] == "https://download.pytorch.org/whl/cpu"


def test_pinned_versions_satisfy_pyproject_and_the_manifests():
    args = _args()
    assert args["TORCH_VERSION"] == "2.13.0"
    assert Version(args["TORCH_VERSION"]) in _pyproject_requirement("torch").specifier
    assert Version(args["RAY_VERSION"]) in _pyproject_requirement("ray").specifier
    for variant in k.VARIANTS:
        (doc,) = k.ray_docs(k.render_kustomization(k.K8S_DIR / variant))
        assert k.cluster_spec(doc)["rayVersion"] == args["RAY_VERSION"]


def resolve_entry_point(cmd: list[str]):
    """(callable, parsed args) for an exec-form CMD running a pyproject console script.
    Raises KeyError (no such script), ImportError/AttributeError (target missing) or
    SystemExit (the CLI rejects the arguments)."""
    program, *argv = cmd
    target = PYPROJECT["project"]["scripts"][program]
    module_name, _, func_name = target.partition(":")
    func = getattr(importlib.import_module(module_name), func_name)
    from cosine_ray.cli import CliError, build_parser

    try:
        parsed = build_parser().parse_args(argv)
    except CliError as exc:  # the CLI's parser raises instead of exiting
        raise SystemExit(str(exc)) from None
    return func, parsed


def test_entry_point_is_a_console_script_that_resolves_and_parses():
    cmd = json.loads(_one("CMD"))
    assert isinstance(cmd, list), "CMD must be in exec (JSON) form"
    assert not [w for w, _ in INSTRUCTIONS if w == "ENTRYPOINT"], "KubeRay replaces the command; keep CMD only"
    func, parsed = resolve_entry_point(cmd)
    assert callable(func)
    assert parsed.command == "serve" and parsed.host == "0.0.0.0"
    exposed = {int(p) for p in _one("EXPOSE").split()}
    assert parsed.port in exposed


@pytest.mark.parametrize("cmd,error", [
    (["cosine-rai", "serve"], KeyError),
    (["cosine-ray", "serv"], SystemExit),
    (["cosine-ray", "serve", "--prot", "8000"], SystemExit),
])
def test_a_broken_entry_point_is_caught(cmd, error):
    with pytest.raises(error):
        resolve_entry_point(cmd)


def _python_snippets() -> list[str]:
    """The CODE of every ``python -c CODE`` in RUN lines, tokenised like a POSIX shell
    (quotes respected, ``&&`` / ``;`` as separate tokens); ``$VAR`` is left as text."""
    snippets = []
    for word, rest in INSTRUCTIONS:
        if word != "RUN":
            continue
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        for i in range(len(tokens) - 2):
            if tokens[i] == "python" and tokens[i + 1] == "-c":
                snippets.append(tokens[i + 2])
    return snippets


def test_python_snippets_compile_and_import_existing_names():
    from cosine_ray.models.loader import EMBEDDED_MODELS

    snippets = _python_snippets()
    assert len(snippets) >= 2
    prefetched = []
    for code in snippets:
        tree = ast.parse(code)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name} does not exist"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "resolve_checkpoint":
                prefetched.append(ast.literal_eval(node.args[0]))
    assert prefetched == ["smollm2-135m"] and prefetched[0] in EMBEDDED_MODELS


def test_model_cache_env_is_the_one_the_loader_reads():
    from cosine_ray.models.loader import CACHE_ENV

    env = " ".join(rest for w, rest in INSTRUCTIONS if w == "ENV")
    assert re.search(rf"\b{CACHE_ENV}=/\S+", env)
    users = [rest for w, rest in INSTRUCTIONS if w == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image runs as a non-root user"
    prefetch_at = next(i for i, (w, rest) in enumerate(INSTRUCTIONS) if "resolve_checkpoint" in rest)
    user_at = max(i for i, (w, _) in enumerate(INSTRUCTIONS) if w == "USER")
    assert user_at < prefetch_at, "fetch the model as the runtime user so it owns the cache"


def _ignored(relpath: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns we use (no `!` exceptions): a path is excluded
    when it or one of its parent folders matches a pattern."""
    parts = relpath.split("/")
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        for pattern in patterns:
            if fnmatch.fnmatchcase(prefix, pattern) or \
               (pattern.startswith("**/") and fnmatch.fnmatchcase(parts[i - 1], pattern[3:])):
                return True
    return False


def _dockerignore() -> list[str]:
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "update _ignored() for `!` patterns"
    return patterns


def test_copy_sources_exist_are_not_ignored_and_cover_the_package():
    patterns = _dockerignore()
    copied = []
    for word, rest in INSTRUCTIONS:
        if word != "COPY":
            continue
        *sources, _dest = rest.split()
        for src in sources:
            assert (k.REPO / src).exists(), f"COPY source {src} does not exist"
            assert not _ignored(src, patterns), f"COPY source {src} is excluded by .dockerignore"
            copied.append(src)
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"]}
    needed |= {inc.rstrip("*") for inc in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert needed <= set(copied), f"pip install . needs {needed - set(copied)}"
    for package_dir in ("cosine_ray", "loadgen"):
        for path in (k.REPO / package_dir).rglob("*.py"):
            assert not _ignored(str(path.relative_to(k.REPO)), patterns), path


@pytest.mark.parametrize("path,ignored", [
    ("tests/deploy/test_dockerfile.py", True), (".git/config", True),
    ("cosine_ray/__pycache__/cli.cpython-311.pyc", True), ("cosine_ray.egg-info/PKG-INFO", True),
    ("cosine_ray/cli.py", False), ("pyproject.toml", False),
])
def test_dockerignore_matcher(path, ignored):
    assert _ignored(path, _dockerignore()) is ignored


def test_the_image_serves_only_with_a_key_unless_told_otherwise(monkeypatch):
    """The CMD listens on 0.0.0.0: the CLI's exposure check refuses it without a key (one line
    naming the ways out), takes COSINE_RAY_API_KEY from `docker run -e`, and the documented
    `docker run` passes that variable."""
    from cosine_ray.cli import CliError
    from cosine_ray.cli.serve import _ingress_args, check_exposure

    _, parsed = resolve_entry_point(json.loads(_one("CMD")))
    monkeypatch.delenv("COSINE_RAY_API_KEY", raising=False)
    with pytest.raises(CliError, match=r"--host 0\.0\.0\.0 .*--api-key KEY \(or COSINE_RAY_API_KEY\), "
                                       r"or --allow-unauthenticated"):
        check_exposure(parsed.host, _ingress_args(parsed, None))
    monkeypatch.setenv("COSINE_RAY_API_KEY", "from-docker-run")
    assert check_exposure(parsed.host, _ingress_args(parsed, None))["api_key"] == "from-docker-run"
    runs = [line for line in DOCKERFILE.read_text(encoding="utf-8").splitlines() if "docker run --" in line]
    assert runs and all(re.search(r"-e COSINE_RAY_API_KEY\b", line) for line in runs), runs


def _apt_packages() -> set[str]:
    """The packages of every ``apt-get install`` in RUN lines."""
    packages: set[str] = set()
    for word, rest in INSTRUCTIONS:
        if word != "RUN":
            continue
        for command in re.split(r"&&|;", rest):
            tokens = command.split()
            if tokens[:2] == ["apt-get", "install"]:
                packages |= {t for t in tokens[2:] if not t.startswith("-")}
    return packages


def _run_index(text: str) -> int:
    (index,) = [i for i, (w, rest) in enumerate(INSTRUCTIONS) if w == "RUN" and text in rest]
    return index


def test_the_image_has_a_compiler_and_builds_the_kernels_as_the_runtime_user():
    """Without a C compiler the kernels never build and the server silently runs PyTorch's slower
    projections: the image installs the compiler the build looks for (``cc``/``gcc``) with the C
    headers, and builds the library at image build, failing the build if it does not build."""
    import inspect

    from cosine_ray.models.kernels import build

    assert {"gcc", "libc6-dev"} <= _apt_packages()
    assert '"cc"' in inspect.getsource(build.library) and '"gcc"' in inspect.getsource(build.library)
    (code,) = [c for c in _python_snippets() if "library()" in c]
    tree = ast.parse(code)
    assert any(isinstance(n, ast.ImportFrom) and n.module == "cosine_ray.models.kernels.build"
               and [a.name for a in n.names] == ["library"] for n in ast.walk(tree))
    assert any(isinstance(n, ast.Assert) for n in ast.walk(tree)), "a failed kernel build must stop the image build"
    user_at = max(i for i, (w, _) in enumerate(INSTRUCTIONS) if w == "USER")
    build_at = _run_index("library()")
    assert user_at < build_at and _run_index("apt-get install") < build_at, \
        "build the kernels after the compiler is installed, as the runtime user (the cache is theirs)"


def test_the_image_runs_as_a_non_root_user():
    users = [rest for w, rest in INSTRUCTIONS if w == "USER"]
    assert users and users[-1] not in ("root", "0")
    (created,) = [rest for w, rest in INSTRUCTIONS if w == "RUN" and "useradd" in rest]
    assert re.search(rf"useradd .*\b{re.escape(users[-1])}\b", created), "the USER must be created"
    assert _run_index("useradd") < max(i for i, (w, _) in enumerate(INSTRUCTIONS) if w == "USER")


def test_the_health_check_asks_health_on_the_served_port():
    health = _one("HEALTHCHECK")
    options, _, command = health.partition("CMD ")
    assert command, "HEALTHCHECK must run a command"
    flags = dict(re.findall(r"--([\w-]+)=(\S+)", options))
    assert {"interval", "timeout", "start-period", "retries"} <= set(flags)
    assert int(flags["start-period"].rstrip("s")) >= 300, "the first start loads the model: give it time"
    _, parsed = resolve_entry_point(json.loads(_one("CMD")))
    url = re.search(r"http://(\S+?):(\d+)(/\S*)", command)
    assert url and url.group(3) == "/health" and int(url.group(2)) == parsed.port
    assert url.group(1) in ("127.0.0.1", "localhost")
    assert command.split()[0] in _apt_packages() | {"python"}, "the checker must be installed in the image"
    assert "|| exit 1" in command, "any failure must read as unhealthy (exit 1), never as Docker's reserved 2"
