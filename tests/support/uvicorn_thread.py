"""An ASGI app served by a real uvicorn on a free loopback port, in a background thread
(in-process HTTP tests: the real ``openai`` client, schemathesis, disconnects)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Callable

import uvicorn


def serve_in_thread(app: Any) -> tuple[str, Callable[[], None]]:
    """Start serving ``app``; returns its base URL and a ``stop()`` that shuts it down."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "uvicorn did not start"

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop
