"""The chaos run's verdict: every request accounted for, every answer right, every error clear.

On top of the event ledger (``loadgen.ledger``: lost, duplicated, unknown; **duplicated** here
counts each request recorded twice, given two ``[DONE]``, or sharing its response id with
another request), from the calls themselves:

- **hung**: no outcome by the per-request deadline;
- **wrong text**: a completed answer that differs from its shape's reference, or a partial
  answer (failed, disconnected, hung) that is not a prefix of it: a lost, repeated or wrong
  token;
- **server errors**: any 5xx other than 503 (status or SSE error event of another type), and
  any 4xx (every request sent is valid);
- **unclear errors**: a stream that ended without ``[DONE]`` or an error event, a malformed
  answer, or a broken/refused connection while no fault had taken down the process that
  serves HTTP (the proxy: its own kind, a worker or node kill that hit it, a pause of it).

Per fault: the requests in flight at its time, and how many of them did not complete.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from loadgen.chaos.faults import Fault
from loadgen.chaos.traffic import Call
from loadgen.ledger import Ledger

CHAOS_TERMINAL = ("ok", "failed", "disconnected", "hung")
RECOVERY_TYPES = frozenset({"service_unavailable_error"})
"""Error types a client may see while the server recovers (the documented 503)."""
CONNECTION_KINDS = frozenset({"connect", "broken"})
HTTP_ROLES = frozenset({"proxy"})
"""Processes whose loss breaks client connections."""
GRACE_S = 2.0
"""A connection error within this long after a proxy came back still counts as its fault's."""


def new_ledger() -> Ledger:
    return Ledger(terminal=CHAOS_TERMINAL)


def record_outcome(ledger: Ledger, call: Call) -> None:
    """The call's one terminal event (``done_markers`` only for completed streams)."""
    extra: dict[str, Any] = {"kind": call.kind, "shape": call.shape}
    if call.outcome == "ok":
        extra["response_id"] = call.response_id
        if call.stream:
            extra["done_markers"] = call.num_done
    elif call.error_kind:
        extra.update(error_kind=call.error_kind, error=call.error, http_status=call.http_status)
    ledger.record(call.outcome or "failed", call.request_id, call.end_t, **extra)


def _http_outages(faults: Iterable[Fault]) -> list[tuple[float, float]]:
    """(start, end) of each time a fault took a proxy down (end: its recovery, or open)."""
    out = []
    for f in faults:
        if any(t["role"] in HTTP_ROLES for t in f.targets):
            end = max(x for x in (f.recovered_t, f.resumed_t, f.health_ok_t, f.t) if x is not None)
            out.append((f.t, end + GRACE_S if f.recovered_t is not None else float("inf")))
    return out


def audit(calls: Sequence[Call], ledger: Ledger, references: Mapping[str, str],
          faults: Sequence[Fault]) -> dict[str, Any]:
    """The full verdict; ``ok`` is True only when nothing is wrong."""
    base = ledger.check()
    outages = _http_outages(faults)
    wrong_text, server_errors, unclear, hung, not_ours = [], [], [], [], []
    for c in calls:
        ref = references.get(c.shape)
        if ref is None:
            not_ours.append(c.request_id)
        elif c.outcome == "ok" and c.text != ref:
            wrong_text.append(f"{c.request_id} ({c.shape}): {c.text[:60]!r} != {ref[:60]!r}")
        elif c.outcome != "ok" and not ref.startswith(c.text):
            wrong_text.append(f"{c.request_id} ({c.shape}, {c.outcome}): partial {c.text[:60]!r} is not a prefix")
        if c.outcome == "hung":
            hung.append(c.request_id)
        if c.outcome != "failed":
            continue
        status = c.http_status or 0
        if (c.error_kind == "http" and (status >= 500 and status != 503 or 400 <= status < 500)) or (
                c.error_kind in ("http", "sse_error") and c.error_type not in RECOVERY_TYPES):
            server_errors.append(f"{c.request_id}: {c.error}")
        elif c.error_kind in ("no_done", "malformed") or (
                c.error_kind in CONNECTION_KINDS and not _within(c, outages)):
            unclear.append(f"{c.request_id}: {c.error_kind}: {c.error}")
    oks = [e for e in ledger.events if e["event"] == "ok"]
    by_response: dict[str, set[str]] = {}
    for e in oks:
        if e.get("response_id"):
            by_response.setdefault(e["response_id"], set()).add(e["request_id"])
    duplicated = set(base["problems"].get("duplicated", [])) | set(base["problems"].get("bad_done_markers", []))
    duplicated |= {r for ids in by_response.values() if len(ids) > 1 for r in ids}  # one answer, two requests
    outcomes = Counter(c.outcome for c in calls)
    problems = {"hung": hung, "wrong_text": wrong_text, "server_errors": server_errors,
                "unclear_errors": unclear, "no_reference": not_ours}
    ok = base["is_consistent"] and not any(problems.values())
    return {
        "ok": ok, "requests": len(calls), "outcomes": dict(outcomes),
        "lost": base["num_lost"], "duplicated": max(len(duplicated), base["num_duplicated"]), "hung": len(hung),
        "wrong_text": len(wrong_text),
        "server_errors": len(server_errors), "unclear_errors": len(unclear),
        "errors_by_kind": dict(Counter(f"{c.error_kind}:{c.http_status or c.error_type or ''}"
                                       for c in calls if c.outcome == "failed")),
        "ledger": base, "problems": {k: v[:20] for k, v in problems.items() if v},
    }


def _within(call: Call, windows: Sequence[tuple[float, float]]) -> bool:
    start, end = call.sent_t or 0.0, call.end_t or float("inf")
    return any(start <= w_end and end >= w_start for w_start, w_end in windows)


def touched(fault: Fault, calls_by_id: Mapping[str, Call]) -> dict[str, int]:
    """Of the requests in flight at the fault: how many ended each way."""
    ends = Counter(calls_by_id[r].outcome for r in fault.in_flight if r in calls_by_id)
    return {"in_flight": len(fault.in_flight), "completed": ends.get("ok", 0), "failed": ends.get("failed", 0),
            "hung": ends.get("hung", 0), "disconnected": ends.get("disconnected", 0)}
