"""EngineClient over the engine deployment's ``DeploymentHandle``: what the ingress uses.

Tokens stream back through a Serve streaming call. Every wait has a deadline: an engine that
dies or stops producing tokens ends the stream with an error output (the ingress turns it
into a 503), never a hang. The engine's first item is ``ACCEPTED`` (a live replica runs the
call), awaited for ``call_timeout_s`` only: a call Serve holds because no engine replica is up
(one was just killed, a new one is starting) gets its 503 within seconds, not after
``token_timeout_s``. Closing the stream early (client disconnect) cancels the call,
which Serve propagates into the engine's generator: the request is aborted there and its
state freed on every stage and drafter. No call here blocks the event loop (no ``ray.get``).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, AsyncIterator, Sequence

from cosine_ray.engine.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "cosine_ray_engine"
"""Serve deployment name of the engine (the ingress deployment is ``cosine_ray``)."""
ACCEPTED = "accepted"
"""The first item of ``EngineServer.generate``'s stream: the call reached a live engine replica."""


class RayEngineClient:
    def __init__(self, handle: Any, *, model_name: str, max_model_len: int, vocab_size: int,
                 token_timeout_s: float = 120.0, call_timeout_s: float = 5.0) -> None:
        self.handle = handle
        """``DeploymentHandle`` of the engine deployment (``runtime.engine_server.EngineServer``)."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_timeout_s = token_timeout_s
        """Longest wait for the next output (covers a stage restart and re-prefill)."""
        self.call_timeout_s = call_timeout_s
        """Deadline of the unary calls (check_request, finish, health, ...: milliseconds when the
        engine is up) and of a stream's ``ACCEPTED``. While no engine replica is up, Serve holds a
        call until one is, so this is also how long a request waits for a restarting engine
        before its 503."""

    async def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        response = getattr(self.handle, method).remote(*args)
        try:
            return await asyncio.wait_for(response, timeout=timeout_s or self.call_timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise

    async def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[RequestOutput]:
        gen = self.handle.options(stream=True).generate.remote(list(prompt_token_ids), params, request_id)
        finished = False
        accepted = False
        try:
            while not finished:
                try:
                    out = await asyncio.wait_for(gen.__anext__(),
                                                 timeout=self.token_timeout_s if accepted else self.call_timeout_s)
                    if not accepted:
                        if out != ACCEPTED:
                            raise RuntimeError(f"the engine's stream began with {out!r}, not {ACCEPTED!r}")
                        accepted = True
                        continue
                except StopAsyncIteration:
                    break
                except (asyncio.TimeoutError, Exception) as exc:
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    log.warning("request %s lost its engine: %r", request_id, exc)
                    gen.cancel()  # a call Serve still holds must never start on the next replica
                    finished = True
                    yield RequestOutput(request_id, [], True, "error", error=f"engine unavailable: {type(exc).__name__}")
                    return
                finished = out.finished
                yield out
        finally:
            if not finished:
                gen.cancel()  # Serve cancels the engine's generator: the request is aborted there

    async def finish(self, request_id: str) -> None:
        """Awaited before the stream is closed: the engine must have it before the cancellation."""
        await self._call("finish", request_id)

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        reason = await self._call("check_request", list(prompt_token_ids), params)
        if reason is not None:
            raise ValueError(reason)

    async def health(self) -> dict[str, Any]:
        return await self._call("health")

    async def describe(self) -> dict[str, Any]:
        return await self._call("describe")

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats")

    async def metrics_snapshot(self, http: tuple[str, dict] | None = None) -> dict[str, Any]:
        return await self._call("metrics_snapshot", http)

    def record_http(self, replica: str, totals: dict) -> None:
        """Fire and forget (never blocks a response): cumulative totals, so a late or lost
        push is repaired by the next one or by this replica's next ``metrics_snapshot``."""
        try:  # a fresh context: not a child call of this request, so a disconnect never cancels it
            contextvars.Context().run(self.handle.record_http.remote, replica, totals)
        except Exception:
            log.debug("could not count an HTTP response", exc_info=True)
