"""SIGTERM (what `docker stop` and Kubernetes send) stops ``cosine-ray serve`` the way Ctrl-C
does: a stream in flight finishes, then the CLI exits 0. ``ray.init`` installs its own SIGTERM
handler (``sys.exit`` under Ray's C++ "SIGTERM received" trace), which aborted the server
mid-request; the CLI puts its own back once Ray is up.

The real CLI on a local cluster of its own (as in a container: no ``--address``), the embedded
SmolLM2, one stage in the engine: a greedy stream of 48 tokens with ``ignore_eos`` is started,
and SIGTERM goes to the CLI as soon as its first token arrives."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from support.cli_server import free_port, log_tail, wait_until_serving

pytestmark = [pytest.mark.full, pytest.mark.real_model]

READY_TIMEOUT_S = 420.0
MAX_TOKENS = 48


def stream_completion(url: str, first_token: threading.Event, out: dict) -> None:
    body = {"prompt": "The history of the printing press", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=180) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    out["done"] = out.get("done", 0) + 1
                    continue
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event["error"]
                for choice in event.get("choices") or []:
                    out["text"] = out.get("text", "") + (choice.get("text") or "")
                    if choice.get("text"):
                        first_token.set()
                    if choice.get("finish_reason"):
                        out["finish_reason"] = choice["finish_reason"]
                if event.get("usage"):
                    out["usage"] = event["usage"]
    except httpx.HTTPError as exc:
        out["exception"] = f"{type(exc).__name__}: {exc}"
    finally:
        first_token.set()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits_0(tmp_path, real_checkpoint):
    log_path = tmp_path / "cli.log"
    exe = shutil.which("cosine-ray")
    port = free_port()
    cmd = ([exe] if exe else [sys.executable, "-m", "cosine_ray.cli"]) + [
        "serve", "--port", str(port), "--drafters", "ngram", "--stages", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("COSINE_RAY_API_KEY", "RAY_ADDRESS")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**env, "PYTHONUNBUFFERED": "1"})
    try:
        wait_until_serving(proc, log_path, READY_TIMEOUT_S)
        url = f"http://127.0.0.1:{port}"
        first_token, out = threading.Event(), {}
        client = threading.Thread(target=stream_completion, args=(url, first_token, out), daemon=True)
        client.start()
        assert first_token.wait(180) and "text" in out, f"no first token: {out}\n{log_tail(log_path)}"
        proc.send_signal(signal.SIGTERM)
        sent_at = time.monotonic()
        client.join(120)
        try:
            code = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the CLI still runs 120 s after SIGTERM:\n{log_tail(log_path)}")
        text = log_path.read_text(errors="replace")
        print(f"[sigterm] stream {out.get('usage')}, exit {code} {time.monotonic() - sent_at:.1f} s after SIGTERM")
        assert "SIGTERM received" not in text and "Traceback" not in text, log_tail(log_path, 60)
        assert "cosine_ray: shutting down" in text, log_tail(log_path)
        assert code == 0, f"exit {code}:\n{log_tail(log_path)}"
        # the stream that was in flight got every token and its [DONE]
        assert out.get("status") == 200 and "exception" not in out and "error" not in out, out
        assert out.get("done") == 1 and out.get("finish_reason") == "length", out
        assert out["usage"]["completion_tokens"] == MAX_TOKENS, out
        with pytest.raises(OSError):  # Serve's proxy went with the application
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
