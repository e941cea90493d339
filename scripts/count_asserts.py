"""Count ``assert`` statements and ``pytest.raises`` per test function, by AST, and compare two
versions of the tests: no test function may disappear or lose an assertion.

Every function and method under the tests folder is counted (nested functions count towards
the outermost one): the tests (``test_*``), and the helpers, fixtures and fakes that assert for
them. A function is matched by its file and qualified name, or, when its file moved, by its
qualified name alone if that name is unique on both sides.

    python scripts/count_asserts.py --before reorg              # reorg's tests vs the work tree
    python scripts/count_asserts.py --before reorg --after HEAD
    python scripts/count_asserts.py --list                      # the work tree's counts

Exit status 1 when a function is missing or has fewer assertions than before.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def count_checks(node: ast.AST) -> int:
    """``assert`` statements and ``pytest.raises(...)`` calls (``with`` or plain) under ``node``."""
    total = 0
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            total += 1
        elif isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "raises" \
                and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "pytest":
            total += 1
    return total


def functions(source: str) -> dict[str, int]:
    """Qualified name (``Class.method`` or ``func``) -> checks, for module-level functions and
    the methods of module-level classes (nested classes too)."""
    out: dict[str, int] = {}

    def visit(body, prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[prefix + node.name] = count_checks(node)
            elif isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(source).body, "")
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def sources(ref: str | None, root: str) -> dict[str, str]:
    """Path -> text of every .py file under ``root``, at git ``ref`` (None: the work tree)."""
    if ref is None:
        return {str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in sorted((REPO / root).rglob("*.py"))}
    paths = [p for p in _git("ls-tree", "-r", "--name-only", ref, "--", root).splitlines() if p.endswith(".py")]
    return {p: _git("show", f"{ref}:{p}") for p in paths}


def table(ref: str | None, root: str) -> dict[tuple[str, str], int]:
    """(path, qualified name) -> checks."""
    return {(path, name): n for path, text in sources(ref, root).items() for name, n in functions(text).items()}


def compare(before: dict[tuple[str, str], int], after: dict[tuple[str, str], int]) -> list[str]:
    """Problems (missing functions, fewer checks); moved functions are matched by name."""
    problems = []
    names_after = Counter(name for _, name in after)
    names_before = Counter(name for _, name in before)
    by_name = {name: (path, n) for (path, name), n in after.items()}
    for (path, name), n in sorted(before.items()):
        if (path, name) in after:
            got, where = after[(path, name)], path
        elif names_after[name] == 1 and names_before[name] == 1:
            where, got = by_name[name]
        else:
            if name.split(".")[-1].startswith("test_") or n:
                problems.append(f"missing: {path}::{name} ({n} checks before)")
            continue
        if got < n:
            problems.append(f"fewer checks: {path}::{name} {n} -> {where} {got}")
    return problems


def summary(label: str, rows: dict[tuple[str, str], int]) -> str:
    tests = {k: n for k, n in rows.items() if k[1].split(".")[-1].startswith("test_")}
    return (f"{label}: {len(tests)} test functions with {sum(tests.values())} checks; "
            f"{len(rows) - len(tests)} other functions with {sum(rows.values()) - sum(tests.values())} checks")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", metavar="REF", help="git ref of the tests before (e.g. reorg)")
    parser.add_argument("--after", metavar="REF", help="git ref of the tests after (default: the work tree)")
    parser.add_argument("--root", default="tests", help="folder of the tests (default: tests)")
    parser.add_argument("--list", action="store_true", help="print every function's count")
    args = parser.parse_args(argv)
    after = table(args.after, args.root)
    if args.list or not args.before:
        for (path, name), n in sorted(after.items()):
            print(f"{n:4d}  {path}::{name}")
        print(summary(args.after or "work tree", after))
        return 0
    before = table(args.before, args.root)
    print(summary(args.before, before))
    print(summary(args.after or "work tree", after))
    moved = sum(1 for key in before if key not in after)
    problems = compare(before, after)
    print(f"{len(before)} functions before, {moved} of them in another file now; "
          f"{len(set(after) - set(before))} functions new or moved in")
    for line in problems:
        print(line)
    print("OK: every function is still there with at least as many checks" if not problems else
          f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
