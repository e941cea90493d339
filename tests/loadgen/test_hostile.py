"""``cosine-loadgen hostile`` against the stub server: every case runs, is bounded and is
reported (status, time, the bystander's longest gap, the normal request after it), and the
command fails when a case gets a 5xx, passes its deadline, leaves the server unable to answer,
breaks a bar of its own (a server that waits forever for a trickling body, unauthenticated
requests served), or, with ``--max-gap``, starves the bystander. The real server's table is in
docs/loadgen.md."""

from __future__ import annotations

import json
import time

import pytest
from support.stub_server import StubServer

from loadgen.cli import main
from loadgen.hostile.cases import CASES
from loadgen.hostile.report import statuses_text

KEY = "k"
FAST = ["--case-deadline", "20", "--after-deadline", "10", "--hold", "2", "--flood", "40", "--vocab-size", "300"]


def hostile(stub: StubServer, tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / f"out-{time.monotonic_ns()}"
    rc = main(["hostile", "--base-url", stub.url, *FAST, "--output-dir", str(out), *argv])
    return rc, json.loads((out / "hostile.json").read_text())


def test_every_case_runs_bounded_beside_a_bystander(tmp_path, capsys):
    names = [c.name for c in CASES if c.name != "slow-body"]  # the stub waits for a whole body: below
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=3, api_key=KEY) as stub:
        start = time.monotonic()
        rc, data = hostile(stub, tmp_path, "--api-key", KEY, "--cases", ",".join(names))
        took = time.monotonic() - start
    out = capsys.readouterr().out
    assert rc == 0 and data["ok"], data["cases"]
    cases = {c["name"]: c for c in data["cases"]}
    assert list(cases) == names
    for name, case in cases.items():
        assert case["ok"] and not case["hung"] and case["after_status"] == 200, case
        assert case["statuses"] and case["gap_s"] is not None and case["bystander_error"] is None, case
    for name in ("n16-streams", "unread-stream"):  # long enough for the bystander's tokens to be counted
        assert cases[name]["bystander_tokens"] > 0, cases[name]
    assert cases["bad-numbers"]["statuses"] == [200, 200, 200]  # the stub accepts anything: reported as it is
    assert cases["n16-streams"]["statuses"].count(200) == 17  # 16 streams and the small request
    assert set(cases["unauth-flood"]["statuses"]) == {401} and len(cases["unauth-flood"]["statuses"]) == 40
    assert cases["unread-stream"]["statuses"] == ["unread"]
    assert took < 120, f"{took:.0f} s"
    for name in names:
        assert name in out  # the printed table
    assert (tmp_path.glob("out-*/hostile.md")) and "| case | status |" in next(tmp_path.glob("out-*/hostile.md")).read_text()


def test_a_5xx_a_hang_and_a_server_that_stops_answering_fail(tmp_path, capsys):
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=3) as stub:
        stub.forced = {"status": "500"}
        rc, data = hostile(stub, tmp_path, "--cases", "20k-messages")
        (case,) = data["cases"]
        assert rc == 1 and not case["ok"] and case["after_status"] == 500, case
        assert any("5xx (500)" in f for f in case["failures"]) and any("a normal request after it: 500" in f
                                                                        for f in case["failures"])
        stub.forced = {"sleep": "30"}
        rc, data = hostile(stub, tmp_path, "--cases", "stop-ids-vocab", "--case-deadline", "3",
                           "--after-deadline", "2")
        (case,) = data["cases"]
        assert rc == 1 and case["hung"] and 2.5 < case["seconds"] < 10, case
        assert any("no end within the case deadline of 3 s" in f for f in case["failures"])
        assert case["after_status"] == "no answer"
        stub.forced = {}
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("cosine-loadgen: error: 1 of 1 cases failed: stop-ids-vocab")


def test_an_unprotected_server_fails_the_slow_body_and_the_flood(tmp_path):
    """The stub reads a body as long as it takes and has no key: both bars are broken."""
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=3) as stub:
        rc, data = hostile(stub, tmp_path, "--api-key", KEY, "--cases", "slow-body,unauth-flood")
    slow, flood = data["cases"]
    assert rc == 1 and not slow["ok"] and not flood["ok"]
    assert slow["statuses"] == ["no answer"] and "still reading a body" in slow["failures"][0]
    assert flood["failures"] == ["40 requests without the API key were served"]
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=3) as stub:  # no key given: the flood is skipped
        rc, data = hostile(stub, tmp_path, "--cases", "unauth-flood")
    assert rc == 0 and data["cases"][0]["skipped"]


def test_a_starved_bystander_fails_with_max_gap(tmp_path):
    with StubServer(ttft_s=0.01, chunk_s=0.4, num_chunks=8) as stub:
        rc, data = hostile(stub, tmp_path, "--cases", "stop-ids-vocab", "--max-gap", "0.2")
        (case,) = data["cases"]
        assert rc == 1 and case["gap_s"] >= 0.35 and "the bystander waited" in case["failures"][-1], case
        rc, data = hostile(stub, tmp_path, "--cases", "stop-ids-vocab", "--max-gap", "5")
        assert rc == 0, data


@pytest.mark.parametrize("argv, message", [
    (["--cases", "nope"], "--cases: unknown case 'nope'"),
    (["--hold", "200"], "--hold (200) must be shorter than --case-deadline (120)"),
    (["--case-deadline", "0"], "--case-deadline must be > 0"),
    (["--max-gap", "-1"], "--max-gap > 0"),
])
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys):
    assert main(["hostile", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_statuses_are_counted_in_the_order_seen():
    assert statuses_text([400, 400, 200, "closed", 400]) == "400×3, 200, closed" and statuses_text([]) == "–"


def test_a_server_that_is_not_there_is_one_line_and_exit_1(capsys, tmp_path):
    assert main(["hostile", "--base-url", "http://127.0.0.1:9", "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "GET http://127.0.0.1:9/v1/models failed" in err[0], err
