"""The chaos verdict can fail: the audit (loadgen/chaos/audit.py) on fabricated calls, and whole
chaos runs (loadgen/chaos/run.py) against the stub server whose "recovery" is broken on
purpose: a request lost by the harness, a stream cut without ``[DONE]``, a token answered
twice, a request that never ends, a 500. The real server's 3-minute run, which must pass the
same audit, is test_chaos_serve.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from support.stub_server import StubServer

from loadgen.chaos import audit as audit_mod
from loadgen.chaos import report
from loadgen.chaos.faults import Fault
from loadgen.chaos.run import ChaosConfig, ChaosRun
from loadgen.chaos.traffic import Call, Mix, Shape

REF = "w0 w1 w2 w3 "


def call(rid: str, outcome: str, *, text: str = REF, kind: str | None = None, status: int | None = 200,
         etype: str | None = None, stream: bool = False, done: int = 0, t: tuple[float, float] = (1.0, 2.0)) -> Call:
    c = Call(rid, "s000", "load", stream, sent_t=t[0], end_t=t[1], outcome=outcome, text=text, http_status=status,
             num_done=done, response_id=f"id-{rid}")
    c.error_kind, c.error_type, c.error = kind, etype, kind and f"{kind} error"
    return c


def ledger_of(calls: list[Call], *, lost: tuple[str, ...] = (), twice: tuple[str, ...] = ()):
    ledger = audit_mod.new_ledger()
    for c in calls:
        ledger.record("planned", c.request_id)
        ledger.record("sent", c.request_id, c.sent_t)
        if c.request_id not in lost:
            audit_mod.record_outcome(ledger, c)
        if c.request_id in twice:
            audit_mod.record_outcome(ledger, c)
    return ledger


def test_the_audit_counts_every_way_a_request_can_go_wrong():
    proxy_down = Fault(0, "proxy", 10.0, "SIGKILL", [{"pid": 1, "role": "proxy"}], recovered_t=20.0)
    calls = [
        call("ok", "ok"),
        call("ok-stream", "ok", stream=True, done=1),
        call("recovering", "failed", kind="http", status=503, etype="service_unavailable_error", text=""),
        call("sse-503", "failed", kind="sse_error", etype="service_unavailable_error", text="w0 "),
        call("cut-by-proxy", "failed", kind="broken", status=None, text="w0 w1 ", t=(9.0, 10.5)),
        call("left", "disconnected", text="w0 "),
        # what must fail the verdict:
        call("wrong", "ok", text="w0 w1 w1 w2 "),
        call("bad-prefix", "failed", kind="sse_error", etype="service_unavailable_error", text="w0 w0 "),
        call("hung", "hung", kind="timeout", status=None, text="w0 "),
        call("500", "failed", kind="http", status=500, etype=None, text=""),
        call("sse-500", "failed", kind="sse_error", etype="server_error", text=""),
        call("cut-no-fault", "failed", kind="broken", status=None, text="w0 ", t=(30.0, 31.0)),
        call("no-done", "failed", kind="no_done", text="w0 w1 "),
        call("two-done", "ok", stream=True, done=2),
        call("lost", "ok"),
        call("answered-twice", "ok"),
    ]
    verdict = audit_mod.audit(calls, ledger_of(calls, lost=("lost",), twice=("answered-twice",)), {"s000": REF},
                              [proxy_down])
    assert not verdict["ok"]
    assert (verdict["lost"], verdict["duplicated"], verdict["hung"]) == (1, 2, 1), verdict
    assert (verdict["wrong_text"], verdict["server_errors"], verdict["unclear_errors"]) == (2, 2, 2), verdict
    problems = verdict["problems"]
    assert [p.split(" ")[0] for p in problems["wrong_text"]] == ["wrong", "bad-prefix"]
    assert [p.split(":")[0] for p in problems["unclear_errors"]] == ["cut-no-fault", "no-done"]
    clean = [c for c in calls[:6]]
    assert audit_mod.audit(clean, ledger_of(clean), {"s000": REF}, [proxy_down])["ok"]


# ---- whole runs against the stub ------------------------------------------------------------------

class BreakingInjector:
    """A fault that turns the stub's answers broken (``mode``) until its "recovery" ends."""

    def __init__(self, stub: StubServer, mode: dict[str, str], broken_s: float) -> None:
        self.stub, self.mode, self.broken_s = stub, mode, broken_s

    def inject(self, kind: str, index: int, t: float) -> Fault:
        self.stub.forced = dict(self.mode)
        return Fault(index, kind, t, "SIGKILL", [{"pid": 0, "role": "stage"}])

    def follow_up(self, fault: Fault, clock: Any) -> None:
        time.sleep(self.broken_s)
        self.stub.forced = {}
        fault.resumed_t = clock()

    def resume_all(self) -> None:
        self.stub.forced = {}


def run_against_stub(mode: dict[str, str], *, request_timeout_s: float = 10.0, lose: bool = False,
                     monkeypatch: pytest.MonkeyPatch | None = None) -> dict[str, Any]:
    shapes = [Shape(f"s{i:03d}", "chat", path, "hi", 4) for i, path in
              enumerate(["/v1/chat/completions", "/v1/completions"])]
    cfg = ChaosConfig(duration_s=4.0, clients=3, kill_every_s=1.5, kinds=("stage",), max_kills=1,
                      request_timeout_s=request_timeout_s, recovery_timeout_s=30.0, mix=Mix(0.5, 0.0),
                      memory_interval_s=60.0, idle_timeout_s=0.5, seed=1)
    if lose:  # the harness forgets one load request's outcome: the ledger must notice
        record, forgotten = audit_mod.record_outcome, []

        def forgetful(ledger, c):
            if c.kind == "load" and not forgotten:
                forgotten.append(c.request_id)
                return
            record(ledger, c)
        monkeypatch.setattr(audit_mod, "record_outcome", forgetful)
    with StubServer(ttft_s=0.02, chunk_s=0.02, num_chunks=4) as stub:
        run = ChaosRun(cfg, stub.url, shapes, find=lambda: [], injector=BreakingInjector(stub, mode, 1.0),
                       log=lambda m: None)
        result = asyncio.run(run.main())
    verdict = audit_mod.audit(result.calls, result.ledger, result.references, result.faults)
    assert result.references == {"probe": REF, "s000": REF, "s001": REF}
    assert len(result.faults) == 1 and result.faults[0].recovered_t is not None
    run_against_stub.last_result = result
    return verdict


def test_a_run_whose_server_recovers_cleanly_passes(tmp_path):
    verdict = run_against_stub({})
    assert verdict["ok"] and verdict["outcomes"]["ok"] == verdict["requests"] > 20, verdict
    # the report of that run: files next to each other, the fault with how its in-flight requests ended
    data = report.write(run_against_stub.last_result, verdict, tmp_path, footprint=None, slope_bound=0.5, config={})
    for name in ("chaos.json", "chaos.png", "ledger.jsonl", "calls.jsonl", "memory.csv"):
        assert (tmp_path / name).stat().st_size > 0
    (fault,) = data["faults"]
    assert fault["kind"] == "stage" and fault["in_flight"] == fault["completed"] > 0 and fault["recovery_s"] > 0
    assert not data["verdict"]["ok"] and not data["verdict"]["memory_ok"]  # no process could be judged
    assert json.loads((tmp_path / "chaos.json").read_text())["audit"]["ok"]


@pytest.mark.parametrize("mode, counter", [
    ({"no_done": ""}, "unclear_errors"),  # streams cut without [DONE] or an error event
    ({"repeat": ""}, "wrong_text"),  # a token answered twice after the "recovery"
    ({"status": "500"}, "server_errors"),
    ({"sleep": "30"}, "hung"),  # requests that never end (client deadline 2 s)
])
def test_a_broken_recovery_fails_the_verdict(mode, counter):
    verdict = run_against_stub(mode, request_timeout_s=2.0)
    assert not verdict["ok"] and verdict[counter] > 0, verdict
    assert verdict["lost"] == 0  # every request still has its one outcome


def test_a_lost_request_fails_the_verdict(monkeypatch):
    verdict = run_against_stub({}, lose=True, monkeypatch=monkeypatch)
    assert not verdict["ok"] and verdict["lost"] == 1 and verdict["ledger"]["problems"]["lost"], verdict
