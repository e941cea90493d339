"""The chaos verdict can fail: the audit (loadgen/chaos/audit.py) on fabricated calls and
server records, and whole chaos runs (loadgen/chaos/run.py) against the stub server with a
fault planted in the server: a completion it answered and never delivered, one it delivered
and never recorded, one it answered twice, failures outside any fault, a broken "recovery"
(a stream cut without ``[DONE]``, a token answered twice, a request that never ends, a 500).
The real server's 3-minute run, which must pass the same audit, is test_chaos_serve.py."""

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
from loadgen.chaos.server_ledger import ServerLedger
from loadgen.chaos.shapes import Shape
from loadgen.chaos.traffic import Call, Mix

REF = "w0 w1 w2 w3 "


def call(rid: str, outcome: str, *, text: str = REF, kind: str | None = None, status: int | None = 200,
         etype: str | None = None, stream: bool = False, done: int = 0, t: tuple[float, float] = (1.0, 2.0)) -> Call:
    c = Call(rid, "s000", "load", stream, sent_t=t[0], end_t=t[1], outcome=outcome, texts=[text], http_status=status,
             num_done=done, response_id=f"id-{rid}")
    c.error_kind, c.error_type, c.error = kind, etype, kind and f"{kind} error"
    return c


def ledger_of(calls: list[Call], *, forgotten: tuple[str, ...] = (), twice: tuple[str, ...] = ()):
    ledger = audit_mod.new_ledger()
    for c in calls:
        ledger.record("planned", c.request_id)
        ledger.record("sent", c.request_id, c.sent_t)
        if c.request_id not in forgotten:
            audit_mod.record_outcome(ledger, c)
        if c.request_id in twice:
            audit_mod.record_outcome(ledger, c)
    return ledger


def server_of(calls: list[Call], *, answered: dict[str, list[str]] | None = None) -> ServerLedger:
    """The server's record: each call's own outcome (``ok`` → answered), unless ``answered``
    says what the server recorded for an id (a list of outcomes; [] = nothing)."""
    server = ServerLedger(first_read_t={"r": 0.0}, last_read_t={"r": 100.0}, reads=1)
    for c in calls:
        outcomes = (answered or {}).get(c.request_id, ["ok"] if c.outcome == "ok" else [])
        for outcome in outcomes:
            seq = len(server.entries)
            server.entries[("r", seq)] = {"seq": seq, "request_id": c.request_id, "outcome": outcome,
                                          "status": 200 if outcome == "ok" else 503, "t": seq}
    return server


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
        call("undelivered", "failed", kind="http", status=503, etype="service_unavailable_error", text=""),
        call("unrecorded", "ok"),
        call("answered-twice", "ok"),
    ]
    server = server_of(calls, answered={"undelivered": ["ok"], "unrecorded": [], "answered-twice": ["ok", "ok"],
                                        "cut-by-proxy": ["ok"]})
    verdict = audit_mod.audit(calls, ledger_of(calls), {"s000": [REF]}, [proxy_down], server)
    assert not verdict["ok"]
    assert (verdict["lost"], verdict["duplicated"], verdict["hung"]) == (2, 2, 1), verdict
    assert (verdict["wrong_text"], verdict["server_errors"], verdict["unclear_errors"]) == (2, 2, 2), verdict
    problems = verdict["problems"]
    assert [p.split(":")[0] for p in problems["undelivered"]] == ["undelivered"]
    assert [p.split(":")[0] for p in problems["unrecorded"]] == ["unrecorded"]
    assert [p.split(":")[0] for p in problems["answered_twice"]] == ["answered-twice"]
    assert problems["duplicated"][1] == "two-done"  # the client's own: two [DONE]
    assert verdict["undelivered_in_outage"] == 1  # the server answered, the proxy kill cut it: not lost
    assert [p.split(" ")[0] for p in problems["wrong_text"]] == ["wrong", "bad-prefix"]
    assert [p.split(":")[0] for p in problems["unclear_errors"]] == ["cut-no-fault", "no-done"]
    clean = calls[:6]  # two 503s while no fault ran: above the default bound of failures, within 0.5
    strict = audit_mod.audit(clean, ledger_of(clean), {"s000": [REF]}, [proxy_down], server_of(clean))
    assert not strict["ok"] and strict["failed_outside_faults"]["failed"] == 2, strict
    assert audit_mod.audit(clean, ledger_of(clean), {"s000": [REF]}, [proxy_down], server_of(clean),
                           max_failed_fraction=0.5)["ok"]
    # the client's bookkeeping broken, or the server's record unreadable: no pass either
    assert not audit_mod.audit(clean, ledger_of(clean, forgotten=("ok",)), {"s000": [REF]}, [proxy_down],
                               server_of(clean), max_failed_fraction=0.5)["ok"]
    unread = ServerLedger(error="GET /admin/completions answered 404")
    verdict = audit_mod.audit(clean, ledger_of(clean), {"s000": [REF]}, [proxy_down], unread, max_failed_fraction=0.5)
    assert not verdict["ok"] and verdict["problems"]["server_ledger_unread"], verdict


def test_a_completion_the_record_of_a_killed_replica_took_along_is_unverifiable_not_lost():
    calls = [call("before", "ok", t=(1.0, 2.0)), call("in-the-gap", "ok", t=(11.0, 12.0)),
             call("after", "ok", t=(30.0, 31.0))]
    server = server_of(calls, answered={"in-the-gap": [], "after": []})
    server.first_read_t, server.last_read_t = {"old": 0.0, "new": 20.0}, {"old": 10.0, "new": 40.0}
    verdict = audit_mod.audit(calls, ledger_of(calls), {"s000": [REF]}, [], server)
    assert verdict["unverifiable"] == 1 and verdict["lost"] == 1, verdict  # "after" was readable: lost
    assert verdict["problems"]["unrecorded"][0].startswith("after:")


def test_choices_logprobs_and_json_are_checked():
    shapes = [Shape("n", "d", "/v1/completions", "p", 4, feature="n"),
              Shape("lp", "d", "/v1/completions", "p", 4, feature="logprobs"),
              Shape("js", "d", "/v1/chat/completions", "p", 4, feature="json")]
    refs = {"n": ["a b", "c d"], "lp": [REF], "js": ['{"answer": "x"}'], "js-bad": ['{"answer": 1}']}

    def failed(rid: str, shape: str, texts: list[str]) -> Call:
        return Call(rid, shape, "load", True, outcome="failed", texts=texts, error_kind="sse_error",
                    error_type="service_unavailable_error", error="503")

    good = [Call("n1", "n", "load", False, outcome="ok", texts=["a b", "c d"]), failed("n2", "n", ["a", "c"]),
            Call("lp1", "lp", "load", False, outcome="ok", texts=[REF], output_tokens=4, logprob_entries=4),
            Call("js1", "js", "load", False, outcome="ok", texts=['{"answer": "x"}'], finish_reasons={0: "stop"})]
    bad = [Call("n3", "n", "load", False, outcome="ok", texts=["a b", "c"]), failed("n4", "n", ["a", "x"]),
           Call("lp2", "lp", "load", False, outcome="ok", texts=[REF], output_tokens=4, logprob_entries=3),
           # the text is its reference (a warm-up answer); the schema is what it breaks
           Call("js2", "js-bad", "load", False, outcome="ok", texts=['{"answer": 1}'], finish_reasons={0: "stop"})]
    shapes.append(Shape("js-bad", "d", "/v1/chat/completions", "p", 4, feature="json"))
    for c in good + bad:
        c.sent_t, c.end_t = 1.0, 2.0
    fine = audit_mod.audit(good, ledger_of(good), refs, [], server_of(good), shapes=shapes, max_failed_fraction=0.5)
    assert fine["ok"], fine["problems"]
    verdict = audit_mod.audit(bad, ledger_of(bad), refs, [], server_of(bad), shapes=shapes)
    assert (verdict["wrong_text"], verdict["bad_logprobs"], verdict["bad_json"]) == (2, 1, 1), verdict["problems"]


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
                     plant: tuple[str, int] | None = None, max_kills: int = 1, max_failed_fraction: float = 0.0,
                     monkeypatch: pytest.MonkeyPatch | None = None) -> dict[str, Any]:
    shapes = [Shape(f"s{i:03d}", "chat", path, "hi", 4) for i, path in
              enumerate(["/v1/chat/completions", "/v1/completions"])]
    cfg = ChaosConfig(duration_s=4.0, clients=3, kill_every_s=1.5, kinds=("stage",), max_kills=max_kills,
                      request_timeout_s=request_timeout_s, recovery_timeout_s=30.0, mix=Mix(0.5, 0.0),
                      memory_interval_s=60.0, idle_timeout_s=0.5, seed=1, max_failed_fraction=max_failed_fraction)
    if lose:  # the harness forgets one load request's outcome: the client's ledger must notice
        record, forgotten = audit_mod.record_outcome, []

        def forgetful(ledger, c):
            if c.kind == "load" and not forgotten:
                forgotten.append(c.request_id)
                return
            record(ledger, c)
        monkeypatch.setattr(audit_mod, "record_outcome", forgetful)
    with StubServer(ttft_s=0.02, chunk_s=0.02, num_chunks=4) as stub:
        if plant:
            stub.plant(*plant)
        run = ChaosRun(cfg, stub.url, shapes, find=lambda: [], injector=BreakingInjector(stub, mode, 1.0),
                       log=lambda m: None)
        result = asyncio.run(run.main())
    verdict = audit_mod.audit(result.calls, result.ledger, result.references, result.faults, result.server,
                              shapes=shapes, max_failed_fraction=cfg.max_failed_fraction)
    assert result.references == {"probe": [REF], "s000": [REF], "s001": [REF]}
    assert len(result.faults) == max_kills and all(f.recovered_t is not None for f in result.faults)
    assert result.server.error is None and len(result.server.entries) > 20, result.server.summary()
    run_against_stub.last_result = result
    return verdict


def test_a_run_whose_server_recovers_cleanly_passes(tmp_path):
    verdict = run_against_stub({})
    assert verdict["ok"] and verdict["outcomes"]["ok"] == verdict["requests"] > 20, verdict
    assert verdict["server_ledger"]["entries"] == verdict["requests"]  # every request, answered once
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
    assert verdict["lost"] == verdict["duplicated"] == 0, verdict["problems"]


@pytest.mark.parametrize("planted, counter, problem", [
    ("undelivered", "lost", "undelivered"),  # the server finished it; the client got a closed connection
    ("unrecorded", "lost", "unrecorded"),  # the client got it; the server has no record of answering it
    ("twice", "duplicated", "answered_twice"),  # one request id answered twice
])
def test_a_fault_planted_in_the_server_is_caught(planted, counter, problem):
    verdict = run_against_stub({}, plant=(planted, 1))
    assert not verdict["ok"] and verdict[counter] == 1, verdict["problems"]
    assert len(verdict["problems"][problem]) == 1 and "-c" in verdict["problems"][problem][0]


def test_failures_outside_faults_above_the_bound_fail_the_run():
    """No fault at all, three requests answered 503: above the default bound (0) the run fails;
    the same run with --max-failed-fraction 0.5 passes."""
    verdict = run_against_stub({}, plant=("status=503", 3), max_kills=0)
    failed = verdict["failed_outside_faults"]
    assert failed["failed"] == 3 and failed["requests"] > 20 and not failed["ok"], failed
    assert not verdict["ok"] and verdict["server_errors"] == verdict["lost"] == 0, verdict["problems"]
    assert run_against_stub({}, plant=("status=503", 3), max_kills=0, max_failed_fraction=0.5)["ok"]


def test_a_request_the_harness_forgets_fails_the_verdict(monkeypatch):
    verdict = run_against_stub({}, lose=True, monkeypatch=monkeypatch)
    assert not verdict["ok"] and not verdict["ledger"]["is_consistent"] and verdict["ledger"]["problems"]["lost"]
