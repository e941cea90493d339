"""The chaos run's verdict: every request accounted for, every answer right, every error clear.

Two ledgers meet, matched by the id each call sends: the client's (``loadgen.ledger``: one
outcome per planned request; only a harness bug breaks it) and the server's
(``server_ledger.py``: the ids the server answered). **Lost**: the server answered a request
whole and its client did not get it (a connection a proxy fault broke is counted apart), or a
client got a whole answer the server has no record of (unless the record of a killed ingress
replica was out of reach then: unverifiable). **Duplicated**: one id answered twice (status
200), or recorded twice by the client. From the calls: **hung** (no outcome by the deadline),
**wrong text** (a completed choice unlike its reference, a partial one not a prefix of it),
**bad logprobs** (not one entry per token), **bad JSON** (a ``json`` answer that stopped on its
own and is not the schema's object), **server errors** (a 5xx but 503, any 4xx: every request
sent is valid), **unclear errors** (a stream without ``[DONE]`` or an error event, a malformed
answer, a broken or refused connection while no fault had the proxy down), and **failed outside
faults** (load requests no fault overlapped that failed; their fraction is bounded).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

from loadgen.chaos.faults import Fault
from loadgen.chaos.server_ledger import ServerLedger
from loadgen.chaos.shapes import Shape
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
DEFAULT_MAX_FAILED_FRACTION = 0.0
"""Outside faults every request must succeed."""


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


def _fault_end(f: Fault) -> float:
    if f.recovered_t is None:
        return float("inf")
    return max(x for x in (f.recovered_t, f.resumed_t, f.health_ok_t, f.t) if x is not None) + GRACE_S


def _http_outages(faults: Iterable[Fault]) -> list[tuple[float, float]]:
    """(start, end) of each time a fault took a proxy down (end: its recovery, or open)."""
    return [(f.t, _fault_end(f)) for f in faults if any(t["role"] in HTTP_ROLES for t in f.targets)]


def _within(call: Call, windows: Sequence[tuple[float, float]]) -> bool:
    start, end = call.sent_t or 0.0, call.end_t or float("inf")
    return any(start <= w_end and end >= w_start for w_start, w_end in windows)


def cross_check(calls: Sequence[Call], server: ServerLedger, outages: Sequence[tuple[float, float]]) -> dict:
    """The two ledgers against each other (lists of offending ids, with why)."""
    served = server.by_request()
    planned = {c.request_id: c for c in calls}
    blind = server.blind_windows()
    out: dict[str, list[str]] = {k: [] for k in ("undelivered", "unrecorded", "answered_twice", "unknown",
                                                 "undelivered_in_outage", "unverifiable")}
    for rid, entries in served.items():
        call = planned.get(rid)
        if call is None:
            out["unknown"].append(f"{rid}: the server answered an id this run never sent")
            continue
        if sum(1 for e in entries if e["status"] == 200) > 1:
            out["answered_twice"].append(f"{rid}: answered {len(entries)} times "
                                         f"({', '.join(str(e['status']) for e in entries)})")
        if any(e["outcome"] == "ok" for e in entries) and call.outcome in ("failed", "hung"):
            why = f"{rid}: the server answered it whole; the client saw {call.outcome}: {call.error}"
            broken_by_proxy = call.error_kind in CONNECTION_KINDS and _within(call, outages)
            out["undelivered_in_outage" if broken_by_proxy else "undelivered"].append(why)
    for call in calls:
        if call.outcome == "ok" and not any(e["outcome"] == "ok" for e in served.get(call.request_id, [])):
            in_blind = _within(call, blind)
            out["unverifiable" if in_blind else "unrecorded"].append(
                f"{call.request_id}: the client got a whole answer the server has no record of")
    return out


def failed_outside_faults(calls: Sequence[Call], faults: Sequence[Fault]) -> dict[str, Any]:
    windows = [(f.t, _fault_end(f)) for f in faults]
    load = [c for c in calls if c.kind == "load" and not _within(c, windows)]
    failed = [c for c in load if c.outcome == "failed"]
    return {"requests": len(load), "failed": len(failed), "fraction": len(failed) / len(load) if load else 0.0,
            "examples": [f"{c.request_id}: {c.error}" for c in failed[:20]]}


def answer_problems(call: Call, shape: Shape | None, ref: Sequence[str] | None) -> dict[str, str]:
    """What is wrong with one call's answer (kind → why)."""
    out: dict[str, str] = {}
    if ref is None:
        return {"no_reference": f"{call.request_id} ({call.shape})"}
    texts = call.texts or [""]
    if call.outcome == "ok" and list(texts) != list(ref):
        out["wrong_text"] = f"{call.request_id} ({call.shape}): {texts[0][:60]!r} != {ref[0][:60]!r}"
    elif call.outcome != "ok" and (len(texts) > len(ref) or any(not r.startswith(t) for t, r in zip(texts, ref))):
        out["wrong_text"] = (f"{call.request_id} ({call.shape}, {call.outcome}): partial {texts[0][:60]!r} "
                             f"is not a prefix")
    if call.outcome != "ok" or shape is None:
        return out
    if shape.feature == "logprobs" and call.output_tokens is not None and call.logprob_entries != call.output_tokens:
        out["bad_logprobs"] = f"{call.request_id}: {call.logprob_entries} log-probability entries for " \
                              f"{call.output_tokens} tokens"
    if shape.feature == "json" and call.finish_reasons.get(0) == "stop":
        try:
            value = json.loads(call.text)
            good = isinstance(value, dict) and set(value) == {"answer"} and isinstance(value["answer"], str)
        except ValueError:
            good = False
        if not good:
            out["bad_json"] = f"{call.request_id}: {call.text[:80]!r} is not the schema's object"
    return out


def audit(calls: Sequence[Call], ledger: Ledger, references: Mapping[str, Sequence[str]],
          faults: Sequence[Fault], server: ServerLedger, *, shapes: Sequence[Shape] = (),
          max_failed_fraction: float = DEFAULT_MAX_FAILED_FRACTION) -> dict[str, Any]:
    """The full verdict; ``ok`` is True only when nothing is wrong."""
    base = ledger.check()
    outages = _http_outages(faults)
    by_shape = {s.key: s for s in shapes}
    problems: dict[str, list[str]] = {k: [] for k in ("hung", "wrong_text", "bad_logprobs", "bad_json",
                                                      "server_errors", "unclear_errors", "no_reference")}
    for c in calls:
        for kind, why in answer_problems(c, by_shape.get(c.shape), references.get(c.shape)).items():
            problems[kind].append(why)
        if c.outcome == "hung":
            problems["hung"].append(c.request_id)
        if c.outcome != "failed":
            continue
        status = c.http_status or 0
        if (c.error_kind == "http" and (status >= 500 and status != 503 or 400 <= status < 500)) or (
                c.error_kind in ("http", "sse_error") and c.error_type not in RECOVERY_TYPES):
            problems["server_errors"].append(f"{c.request_id}: {c.error}")
        elif c.error_kind in ("no_done", "malformed") or (
                c.error_kind in CONNECTION_KINDS and not _within(c, outages)):
            problems["unclear_errors"].append(f"{c.request_id}: {c.error_kind}: {c.error}")
    cross = cross_check(calls, server, outages)
    if server.error is not None:
        cross["server_ledger_unread"] = [server.error]
    failed = failed_outside_faults(calls, faults)
    lost = cross["undelivered"] + cross["unrecorded"]
    duplicated = sorted(set(base["problems"].get("duplicated", [])) | set(base["problems"].get("bad_done_markers", [])))
    duplicated = cross["answered_twice"] + duplicated
    failing = {**problems, **{k: v for k, v in cross.items() if k not in ("undelivered_in_outage", "unverifiable")}}
    ok = base["is_consistent"] and not any(failing.values()) and failed["fraction"] <= max_failed_fraction
    return {
        "ok": ok, "requests": len(calls), "outcomes": dict(Counter(c.outcome for c in calls)),
        "lost": len(lost), "duplicated": len(duplicated), "hung": len(problems["hung"]),
        "wrong_text": len(problems["wrong_text"]), "bad_logprobs": len(problems["bad_logprobs"]),
        "bad_json": len(problems["bad_json"]), "server_errors": len(problems["server_errors"]),
        "unclear_errors": len(problems["unclear_errors"]),
        "undelivered_in_outage": len(cross["undelivered_in_outage"]), "unverifiable": len(cross["unverifiable"]),
        "failed_outside_faults": {**failed, "max_fraction": max_failed_fraction,
                                  "ok": failed["fraction"] <= max_failed_fraction},
        "server_ledger": server.summary(),
        "errors_by_kind": dict(Counter(f"{c.error_kind}:{c.http_status or c.error_type or ''}"
                                       for c in calls if c.outcome == "failed")),
        "ledger": base,
        "problems": {k: v[:20] for k, v in {**problems, **cross, "lost": lost, "duplicated": duplicated}.items() if v},
    }


def touched(fault: Fault, calls_by_id: Mapping[str, Call]) -> dict[str, int]:
    """Of the requests in flight at the fault: how many ended each way."""
    ends = Counter(calls_by_id[r].outcome for r in fault.in_flight if r in calls_by_id)
    return {"in_flight": len(fault.in_flight), "completed": ends.get("ok", 0), "failed": ends.get("failed", 0),
            "hung": ends.get("hung", 0), "disconnected": ends.get("disconnected", 0)}
