"""``cosine-loadgen hostile --other-api-key``: the bystander, the normal request after each case
and the small request beside ``n16-streams`` come from a second key (another tenant), while the
case's own requests use ``--api-key``: what one client does to another (the real server's
table is in docs/loadgen.md)."""

from __future__ import annotations

import json
import time

from support.stub_server import StubServer

from loadgen.cli import main

FAST = ["--case-deadline", "20", "--after-deadline", "10", "--hold", "2", "--flood", "40", "--vocab-size", "300"]


def test_the_other_key_carries_the_bystander_the_small_request_and_the_normal_one(tmp_path):
    with StubServer(ttft_s=0.01, chunk_s=0.01, num_chunks=3, api_key=("key-a", "key-b")) as stub:
        out = tmp_path / "out"
        rc = main(["hostile", "--base-url", stub.url, *FAST, "--api-key", "key-a", "--other-api-key", "key-b",
                   "--cases", "n16-streams", "--output-dir", str(out)])
        data = json.loads((out / "hostile.json").read_text())
        time.sleep(0.2)
        bodies = [body for _, body in stub.received]
        keys = list(stub.keys_used)
    (case,) = data["cases"]
    assert rc == 0 and case["ok"] and case["bystander_tokens"] > 0, case
    streams = [k for k, b in zip(keys, bodies) if b.get("n") == 16]
    others = [k for k, b in zip(keys, bodies) if b.get("n") != 16]  # bystanders, the small and the normal request
    assert streams == ["key-a"] * 16 and others and set(others) == {"key-b"}, keys
    assert any("small request (the other key): 200" in n for n in case["notes"]), case["notes"]
    assert "other_api_key" not in data["config"] and "key-b" not in (out / "hostile.json").read_text()
