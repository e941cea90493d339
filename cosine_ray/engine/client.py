"""What a front end (the HTTP ingress, the CLI) needs from an engine, local or on Ray."""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol, Sequence

from cosine_ray.engine.request import NO_TENANT, RequestOutput, SamplingParams, Tenant


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str, every_s: float = 0.0, tenant: Tenant = NO_TENANT) -> AsyncIterator[RequestOutput]:
        """Outputs until ``finished``; closing the iterator early aborts the request. With
        ``every_s`` > 0 the caller needs no output sooner than that apart (not streaming to
        its client): outputs that cross a process may be merged (``runtime.engine_client.coalesced``).
        ``tenant``: whose request it is (the API key's name and OpenAI's ``user``), for the
        engine's fair share between tenants. Outputs the caller has not taken yet are merged
        into one, so a slow caller costs the engine one pending output."""
        ...

    async def finish(self, request_id: str) -> None:
        """The caller ends a streaming request as a normal completion (the HTTP layer found a
        stop string); it closes the stream next, which frees the request as an abort would,
        but the engine counts it as ``finished_reason="stop"`` with its latency."""
        ...

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError (``engine.request.RequestRefused``: the field and the reason) if the
        request cannot be served; a grammar is compiled off the event loop, once per spec."""
        ...

    async def health(self) -> dict[str, Any]:
        """{"status": "ok"|"recovering"|..., ...}; raises if the engine is unreachable."""
        ...

    async def metrics_snapshot(self, http: tuple[str, dict] | None = None) -> dict[str, Any]:
        """``MetricsRegistry.snapshot()`` of the engine's one registry, read now (GET /metrics),
        after folding in ``http`` = (replica id, cumulative {(route, status): n})."""
        ...

    def record_http(self, replica: str, totals: dict) -> None:
        """Push one ingress replica's cumulative HTTP counts; must not block."""
        ...


class LocalEngineClient:
    """EngineClient over an in-process LocalEngine (tests, single-process serving)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.model_name = engine.checkpoint.name
        self.max_model_len = engine.core.config.scheduler.max_model_len
        self.vocab_size = engine.checkpoint.config.vocab_size

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               request_id: str, every_s: float = 0.0, tenant: Tenant = NO_TENANT) -> AsyncIterator[RequestOutput]:
        return self.engine.loop.generate(prompt_token_ids, params, request_id, tenant)  # in-process: nothing to save

    async def finish(self, request_id: str) -> None:
        self.engine.loop.finish(request_id)

    async def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        await self.engine.core.prepare_request(prompt_token_ids, params)

    async def health(self) -> dict[str, Any]:
        core = self.engine.core
        return {"status": "ok", "running": len(core.running), "waiting": len(core.waiting)}

    async def metrics_snapshot(self, http: tuple[str, dict] | None = None) -> dict[str, Any]:
        core = self.engine.core
        if http is not None:
            core.metrics.add_http_totals(*http)
        for index, stage in enumerate(self.engine.target.stages):
            core.exporter.stage_utilisation(index, *stage.utilisation(), source="local")
        return self.engine.loop.metrics_snapshot()

    def record_http(self, replica: str, totals: dict) -> None:
        self.engine.core.metrics.add_http_totals(replica, totals)
