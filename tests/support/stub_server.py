"""A small OpenAI-shaped streaming server with controlled timing and injectable faults.

In-process (``StubServer(...).start()`` → a thread) or as a script (``python stub_server.py --port
N``; the ``compare --launch`` tests). Every streamed answer is:

    role chunk (chat only, empty content) ─ sleep ttft_s ─ content chunk 0 ─ sleep chunk_s ─ … chunk n−1
    ─ final chunk (finish_reason, ``cosine_ray`` block if asked) ─ usage chunk (if asked) ─ [DONE]

so TTFT ≈ ttft_s, ITL ≈ chunk_s, E2EL ≈ ttft_s + (n−1)·chunk_s, output tokens = n·tokens_per_chunk;
the text is ``w0 w1 … w{tokens−1}`` whatever the chunking (two stubs with the same token count
give identical outputs, like a lossless server with and without speculation).
The prompt (last user message, or the completion prompt) may carry directives:

    [[status=503]]  answer that status with an OpenAI error body        [[malformed]]  a non-JSON event
    [[sse_error]]   an error event after the first chunk, then [DONE]    [[no_done]]    omit [DONE]
    [[drop]]        close the connection after the first chunk           [[sleep=S]]    sleep S s first
    [[accept=A/D]]  stats block with A accepted of D drafted tokens (default accept_default)
    [[repeat]]      send the first chunk twice (a token answered twice)

``forced`` holds directives applied to every request while set (the chaos tests' broken
"recoveries"). A request with ``"stream": false`` gets one JSON completion with the same text.

Like cosine_ray, it records each POST that carries ``X-Request-Id`` (status, ``ok``/``error``)
and serves the record at ``GET /admin/completions``. ``plant(directive, count)`` applies a
directive to the next ``count`` load requests of a chaos run (ids with ``-c``): faults of the
server's own bookkeeping, ``[[unrecorded]]`` (answered, not recorded), ``[[undelivered]]``
(recorded as answered, connection closed instead), ``[[twice]]`` (recorded as answered twice).

The stats block also has fields loadgen does not know (``domain``, ``drafters_used``), to check
they are tolerated. Received request ids (``X-Request-Id``) and bodies are kept for assertions,
and ``events`` logs each request's arrival and the end of its streamed answer (just before its
``[DONE]``, so a client cannot act on an answer before its end is logged). Two ways to test timing
by events rather than seconds: ``hold_until=N`` holds every answer until N requests have
arrived, and ``lockstep=Lockstep()`` makes the stub and the client share a logical clock.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

DIRECTIVE = re.compile(r"\[\[(\w+)(?:=([^\]]*))?\]\]")
PATIENCE_S = 10.0
"""How long a held answer or a lockstep line waits for what it waits for; only a client that
gets it wrong makes it wait that long."""


class Lockstep:
    """A logical clock shared by the stub and one client at a time: ``now()`` (the client's
    clock) is the number of SSE data lines the stub has written, and the stub writes its next
    line only once the client has read the clock since the last one. A client that stamps each
    line as it arrives thus gets exact counts, whatever the machine's speed; one that stamps
    lines late (at the end of the stream, say) makes each line wait ``PATIENCE_S`` and gets
    other counts."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.written = 0
        self.read = 0

    def now(self) -> float:
        with self.cond:
            self.read = self.written
            self.cond.notify_all()
            return float(self.written)

    def next_line(self) -> None:
        """Before the stub writes a line: wait for the client to have read the clock since the
        last one, then count this one (before it is on the wire, so the client never reads a
        line the clock does not count yet)."""
        with self.cond:
            self.cond.wait_for(lambda: self.read == self.written, timeout=PATIENCE_S)
            self.written += 1


class _HTTPServer(ThreadingHTTPServer):
    request_queue_size = 128  # a flood of connections waits in the backlog, as on a real server


class StubServer:
    def __init__(self, *, ttft_s: float = 0.05, chunk_s: float = 0.02, num_chunks: int = 4,
                 tokens_per_chunk: int = 1, accept_default: tuple[int, int] = (3, 6), healthy: bool = True,
                 port: int = 0, model: str = "stub-model", api_key: str | tuple[str, ...] | None = None,
                 hold_until: int = 0,
                 lockstep: Lockstep | None = None) -> None:
        self.ttft_s, self.chunk_s, self.num_chunks = ttft_s, chunk_s, num_chunks
        self.tokens_per_chunk, self.accept_default, self.healthy = tokens_per_chunk, accept_default, healthy
        self.model, self.hold_until, self.lockstep = model, hold_until, lockstep
        self.api_key = api_key
        """With a key (or a tuple of keys), every route but /health answers 401 without
        ``Authorization: Bearer KEY`` of one of them."""
        self.keys_used: list[str] = []
        """The key of each POST that was let in, in order of arrival."""
        self.lock = threading.Condition()
        self.received: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, str]] = []
        """("start", request id) when a request arrives, ("end", request id) just before a streamed
        answer's ``[DONE]``."""
        self.forced: dict[str, str] = {}
        self.num_active = self.max_active = 0
        self.replica = f"stub-{id(self):x}"
        self.completions: list[dict[str, Any]] = []
        self.planted: list[str] = []
        self.httpd = _HTTPServer(("127.0.0.1", port), _handler(self))
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def start(self) -> "StubServer":
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> "StubServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def received_ids(self) -> list[str]:
        with self.lock:
            return [rid for rid, _ in self.received]

    def plant(self, directive: str, count: int = 1) -> None:
        """``directive`` (e.g. ``unrecorded``, ``status=503``) on the next ``count`` load requests."""
        with self.lock:
            self.planted += [f"[[{directive}]]"] * count

    def record(self, request_id: str, status: int, outcome: str) -> None:
        with self.lock:
            self.completions.append({"seq": len(self.completions), "request_id": request_id, "status": status,
                                     "outcome": outcome, "path": "", "t": time.time()})

    def page(self, query: dict[str, list[str]]) -> dict[str, Any]:
        ours = (query.get("replica") or [""])[0] == self.replica
        after = int((query.get("after") or ["-1"])[0]) if ours else -1
        with self.lock:
            return {"replica": self.replica, "oldest": 0, "next": len(self.completions), "dropped": 0,
                    "entries": [e for e in self.completions if e["seq"] > after]}


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else ""


def _handler(stub: StubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _json(self, status: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def send_response(self, code: int, message: str | None = None) -> None:
            self.status = code
            super().send_response(code, message)

        def _refused(self) -> bool:
            keys = (stub.api_key,) if isinstance(stub.api_key, str) else stub.api_key
            if keys is None or self.headers.get("Authorization") in {f"Bearer {k}" for k in keys}:
                return False
            self._json(401, {"error": {"message": "missing or invalid API key", "type": "authentication_error"}})
            return True

        def do_GET(self) -> None:
            if self.path != "/health" and self._refused():
                return
            if self.path.startswith("/admin/completions"):
                self._json(200, stub.page(parse_qs(urlparse(self.path).query)))
            elif self.path == "/health":
                self._json(200 if stub.healthy else 503, {"status": "ok" if stub.healthy else "starting"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": "not found", "type": "not_found_error"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self._refused():
                return
            with stub.lock:
                stub.keys_used.append(self.headers.get("Authorization", "").removeprefix("Bearer "))
            self.rid = rid = self.headers.get("X-Request-Id", "")
            with stub.lock:
                stub.received.append((rid, body))
                stub.events.append(("start", rid))
                planted = stub.planted.pop(0) if stub.planted and "-c" in rid else ""
                stub.lock.notify_all()
                stub.lock.wait_for(lambda: len(stub.received) >= stub.hold_until, timeout=PATIENCE_S)
            directives = {**dict(DIRECTIVE.findall(_prompt_text(body) + planted)), **stub.forced}
            with stub.lock:
                stub.num_active += 1
                stub.max_active = max(stub.max_active, stub.num_active)
            self.status, ended = None, False
            try:
                if "undelivered" in directives:
                    stub.record(rid, 200, "ok")
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self._answer(body, directives)
                ended = True
            finally:
                with stub.lock:
                    stub.num_active -= 1
                bad = body.get("stream") is not False and {"sse_error", "no_done", "drop", "malformed"} & set(directives)
                outcome = "ok" if ended and self.status == 200 and not bad else "error" if ended else "incomplete"
                for _ in range(0 if not rid or "undelivered" in directives or "unrecorded" in directives
                               else 2 if "twice" in directives else 1):
                    stub.record(rid, self.status, outcome)

        def _answer(self, body: dict[str, Any], directives: dict[str, str]) -> None:
            if "sleep" in directives:
                time.sleep(float(directives["sleep"]))
            if "status" in directives:
                status = int(directives["status"])
                kind = "service_unavailable_error" if status == 503 else "server_error"
                return self._json(status, {"error": {"message": f"injected status {status}", "type": kind,
                                                     "param": None, "code": None}})
            if body.get("stream") is False:
                return self._complete(body, directives)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                self._stream(body, directives)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _complete(self, body: dict[str, Any], directives: dict[str, str]) -> None:
            n = stub.num_chunks * stub.tokens_per_chunk
            text = "".join(f"w{i} " for i in range(n))
            if "repeat" in directives:
                text = "".join(f"w{i} " for i in range(stub.tokens_per_chunk)) + text
            time.sleep(stub.ttft_s + stub.chunk_s * (stub.num_chunks - 1))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if "messages" in body else {"index": 0, "text": text, "finish_reason": "length"})
            self._json(200, {"id": f"cmpl-{threading.get_ident()}-{time.monotonic_ns()}", "model": stub.model,
                             "choices": [choice], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                            "total_tokens": 7 + n}})

        def _send(self, obj: Any) -> None:
            data = obj if isinstance(obj, str) else json.dumps(obj)
            if obj == "[DONE]":
                with stub.lock:
                    stub.events.append(("end", self.rid))
            if stub.lockstep:
                stub.lockstep.next_line()
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

        def _stream(self, body: dict[str, Any], directives: dict[str, str]) -> None:
            is_chat = "messages" in body
            base = {"id": f"cmpl-{threading.get_ident()}-{time.monotonic_ns()}", "created": 0, "model": stub.model}

            def chunk(text: str | None, finish: str | None = None) -> dict[str, Any]:
                if is_chat:
                    delta = {} if text is None else {"content": text}
                    choice = {"index": 0, "delta": delta, "finish_reason": finish}
                else:
                    choice = {"index": 0, "text": text or "", "finish_reason": finish}
                return {**base, "choices": [choice]}

            if is_chat:
                self._send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            time.sleep(stub.ttft_s)
            for i in range(stub.num_chunks):
                if i:
                    time.sleep(stub.chunk_s)
                k = stub.tokens_per_chunk
                self._send(chunk("".join(f"w{i * k + j} " for j in range(k))))
                if i == 0 and "repeat" in directives:
                    self._send(chunk("".join(f"w{j} " for j in range(k))))
                if i == 0 and "drop" in directives:
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if i == 0 and "malformed" in directives:
                    self._send("{this is not json")
                if i == 0 and "sse_error" in directives:
                    self._send({"error": {"message": "injected stream error", "type": "server_error"}})
                    self._send("[DONE]")
                    return
            last = chunk(None, "length")
            if body.get("cosine_ray_stats"):
                accepted, drafted = (int(v) for v in directives["accept"].split("/")) if "accept" in directives \
                    else stub.accept_default
                out_tokens = stub.num_chunks * stub.tokens_per_chunk
                last["cosine_ray"] = {
                    "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
                    "mean_accepted_length": out_tokens / stub.num_chunks, "num_verify_steps": stub.num_chunks,
                    "drafted_by": {"ngram": drafted - drafted // 2, "retrieval": drafted // 2},
                    "accepted_by": {"ngram": accepted - accepted // 2, "retrieval": accepted // 2},
                    "domain": "stub", "drafters_used": ["ngram", "retrieval"]}
            self._send(last)
            if (body.get("stream_options") or {}).get("include_usage"):
                n = stub.num_chunks * stub.tokens_per_chunk
                self._send({**base, "choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n,
                                                             "total_tokens": 7 + n}})
            if "no_done" not in directives:
                self._send("[DONE]")

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft", type=float, default=0.02)
    p.add_argument("--chunk", type=float, default=0.01)
    p.add_argument("--num-chunks", type=int, default=4)
    p.add_argument("--tokens-per-chunk", type=int, default=1)
    p.add_argument("--fail-start", action="store_true", help="exit 3 at once (a server that cannot start)")
    p.add_argument("--never-ready", action="store_true", help="/health answers 503 forever")
    p.add_argument("--ignore-sigint", action="store_true", help="needs SIGTERM/SIGKILL to stop")
    p.add_argument("--pid-file", default=None)
    args = p.parse_args()
    if args.fail_start:
        print("stub: refusing to start (--fail-start)", flush=True)
        sys.exit(3)
    server = StubServer(ttft_s=args.ttft, chunk_s=args.chunk, num_chunks=args.num_chunks,
                        tokens_per_chunk=args.tokens_per_chunk, healthy=not args.never_ready, port=args.port)
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(str(__import__("os").getpid()))
    stop = threading.Event()
    signal.signal(signal.SIGINT, (lambda *_: None) if args.ignore_sigint else (lambda *_: stop.set()))
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    print(f"stub: serving at {server.url}", flush=True)
    stop.wait()
    server.stop()
    print("stub: stopped", flush=True)


if __name__ == "__main__":
    main()
