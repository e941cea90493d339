"""EngineClient over the router actor: what the Serve ingress uses.

Tokens stream back through a Ray streaming generator. Every wait has a deadline: a router
that dies or stops producing tokens ends the stream with an error output (the ingress
turns it into a 503), never a hang. Closing the stream early (client disconnect) aborts
the request in the router, which frees its state on every stage and drafter.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import Any, AsyncIterator, Sequence

import ray
from ray.exceptions import RayError

from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.runtime.clients import await_ref

log = logging.getLogger(__name__)


class RayEngineClient:
    def __init__(self, router: Any, *, model_name: str, max_model_len: int, vocab_size: int,
                 token_timeout_s: float = 120.0, call_timeout_s: float = 10.0) -> None:
        self.router = router
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.token_timeout_s = token_timeout_s
        """Longest wait for the next output (covers a stage restart and re-prefill)."""
        self.call_timeout_s = call_timeout_s

    @classmethod
    def from_router(cls, router: Any, **kwargs: Any) -> "RayEngineClient":
        info = ray.get(router.describe.remote(), timeout=60)  # sync constructor path only
        return cls(router, model_name=info["model"], max_model_len=info["max_model_len"],
                   vocab_size=info["vocab_size"], **kwargs)

    async def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
                     request_id: str) -> AsyncIterator[RequestOutput]:
        gen = self.router.generate.options(num_returns="streaming").remote(
            list(prompt_token_ids), params, request_id)
        finished = False
        try:
            while not finished:
                try:
                    ref = await asyncio.wait_for(gen.__anext__(), timeout=self.token_timeout_s)
                    out = await await_ref(ref, self.call_timeout_s)
                except StopAsyncIteration:
                    break
                except (RayError, asyncio.TimeoutError) as exc:
                    log.warning("request %s lost its router: %r", request_id, exc)
                    yield RequestOutput(request_id, [], True, "error", error=f"router unavailable: {type(exc).__name__}")
                    finished = True
                    return
                finished = out.finished
                yield out
        finally:
            if not finished:
                try:
                    self.router.abort.remote(request_id)
                    ray.cancel(gen)
                except Exception:
                    pass

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        reason = await await_ref(self.router.check_request.remote(list(prompt_token_ids), params),
                                 self.call_timeout_s)
        if reason is not None:
            raise ValueError(reason)

    async def health(self) -> dict[str, Any]:
        return await await_ref(self.router.health.remote(), self.call_timeout_s)

    async def stats(self) -> dict[str, Any]:
        return await await_ref(self.router.stats.remote(), self.call_timeout_s)

    async def metrics_snapshot(self, http: tuple[str, dict] | None = None) -> dict[str, Any]:
        return await await_ref(self.router.metrics_snapshot.remote(http), self.call_timeout_s)

    def record_http(self, replica: str, totals: dict) -> None:
        """Fire and forget (never blocks a response): cumulative totals, so a late or lost
        push is repaired by the next one or by this replica's next ``metrics_snapshot``."""
        try:  # a fresh context: not a child call of this request, so a disconnect never cancels it
            contextvars.Context().run(self.router.record_http.remote, replica, totals)
        except Exception:
            log.debug("could not count an HTTP response", exc_info=True)
