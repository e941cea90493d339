"""The hostile run's table (printed) and ``hostile.json`` (every case's figures and the flags)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Sequence

from rich.table import Table

from loadgen.hostile.run import CaseResult
from loadgen.report import wide_console, write_json


def statuses_text(statuses: Sequence[Any]) -> str:
    """``[400, 400, 200]`` → ``400×2, 200`` (in first-seen order)."""
    counts = Counter(str(s) for s in statuses)
    return ", ".join(f"{s}×{n}" if n > 1 else s for s, n in counts.items()) or "–"


def rows(results: Sequence[CaseResult]) -> list[dict[str, str]]:
    out = []
    for r in results:
        after = "–" if r.after_status is None else f"{r.after_status} in {r.after_s:.1f} s"
        verdict = f"skipped: {r.skipped}" if r.skipped else "ok" if r.ok else "FAIL: " + "; ".join(r.failures)
        out.append({"case": r.name, "status": statuses_text(r.statuses) + (" (hung)" if r.hung else ""),
                    "time (s)": f"{r.seconds:.1f}", "bystander max gap (s)": "–" if r.gap_s is None else
                    f"{r.gap_s:.1f}", "normal request after": after, "result": verdict})
    return out


def print_table(results: Sequence[CaseResult], title: str) -> None:
    table = Table(title=title, title_justify="left")
    data = rows(results)
    for col in (data[0] if data else {"case": ""}):
        table.add_column(col, justify="right" if col in ("time (s)", "bystander max gap (s)") else "left")
    for row in data:
        table.add_row(*row.values())
    console = wide_console()
    console.print(table)
    for r in results:
        for note in r.notes:
            console.print(f"  {r.name}: {note}", highlight=False, markup=False)


def markdown(results: Sequence[CaseResult]) -> str:
    data = rows(results)
    if not data:
        return ""
    head = list(data[0])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(r[h].replace("|", "/") for h in head) + " |" for r in data]
    notes = [f"- {r.name}: {note}" for r in results for note in r.notes]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def write(results: Sequence[CaseResult], out_dir: Path, config: Mapping[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json({"ok": all(r.ok for r in results), "config": dict(config),
                "cases": [r.as_dict() for r in results]}, out_dir / "hostile.json")
    (out_dir / "hostile.md").write_text(markdown(results), encoding="utf-8")
