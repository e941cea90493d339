"""An ASGI app served by a real uvicorn on a free loopback port, in a background thread
(in-process HTTP tests: the real ``openai`` client, schemathesis, disconnects)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any, Callable, Iterator

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


@contextlib.contextmanager
def serve_engines(engines: dict[str, Any], model_name: str) -> Iterator[dict[str, tuple[str, Any]]]:
    """Each local engine behind its own OpenAI app while the block runs: name → (url, engine)."""
    from cosine_ray.engine.client import LocalEngineClient
    from cosine_ray.serve.openai_app import build_openai_app
    with contextlib.ExitStack() as stack:
        served = {}
        for name, engine in engines.items():
            url, stop = serve_in_thread(build_openai_app(LocalEngineClient(engine), engine.tokenizer,
                                                         model_name=model_name))
            stack.callback(stop)
            served[name] = (url, engine)
        yield served
