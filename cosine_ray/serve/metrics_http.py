"""``GET /metrics`` and the HTTP response counter (the edge of the single-exporter design).

Single exporter: every engine-side number lives in one registry in the engine process (it
sees every request, drafter call, verify step and stage). Any ingress replica answers
``/metrics`` by asking its engine client for that registry's snapshot and rendering it
(``metrics/prometheus.py``), so a Prometheus scrape through the Serve port gets cluster-wide
totals whichever replica Serve routes it to, and nothing is summed twice.

HTTP responses are counted where they happen, at each replica (``HttpCounts``: cumulative
totals per (route, status) and a random replica id), and the totals go to the same registry
two ways: after every response, fire and forget (``EngineClient.record_http``), and with every
``/metrics`` call (``metrics_snapshot(http=...)``). The registry folds totals per replica and
ignores a total lower than one it already has, so pushes may arrive late or out of order (Ray
does not order calls to an async actor) without double counting; a scrape through replica R
always includes all of R's earlier responses, and other replicas' within a push's latency.
No ``replica`` label is needed and the totals stay exact with any number of replicas; a
restarted replica has a new id and starts from zero. Route labels are route templates
(``/v1/models/{model_id:path}``) or ``unmatched``, so unknown paths cannot blow up the label
set. A scrape's own response is counted after its snapshot, so it shows up in the next one.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosine_ray.metrics.prometheus import CONTENT_TYPE, render

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
SNAPSHOT_TIMEOUT_S = 10.0
UNMATCHED = "unmatched"


def route_label(scope: Scope, known_paths: frozenset[str]) -> str:
    """The matched route's template; the raw path when it is a known route that was answered
    before routing (401, 413); else ``unmatched``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    return scope.get("path") if scope.get("path") in known_paths else UNMATCHED


class HttpCounts:
    """This replica's cumulative response counts, pushed to the engine after each response."""

    def __init__(self, engine: Any) -> None:
        self.replica = uuid.uuid4().hex
        self.totals: dict[tuple[str, int], int] = {}
        self._push = getattr(engine, "record_http", None)  # absent on test fakes

    def count(self, route: str, status: int) -> None:
        key = (route, status)
        self.totals[key] = self.totals.get(key, 0) + 1
        if self._push is not None:
            try:
                self._push(self.replica, dict(self.totals))
            except Exception:  # counting must never break a response
                log.debug("could not push HTTP counts", exc_info=True)

    def snapshot(self) -> tuple[str, dict[tuple[str, int], int]]:
        return self.replica, dict(self.totals)


class HttpMetricsMiddleware:
    """Counts every HTTP response by route and status (outermost: sees 401/413/500 too)."""

    def __init__(self, app: ASGIApp, *, counts: HttpCounts,
                 known_paths: Callable[[], frozenset[str]]) -> None:
        self.app = app
        self.counts = counts
        self.known_paths = known_paths

    def _count(self, scope: Scope, status: int) -> None:
        try:
            self.counts.count(route_label(scope, self.known_paths()), status)
        except Exception:  # counting must never break a response
            log.debug("could not count an HTTP response", exc_info=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status: int | None = None

        async def counted_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start" and status is None:
                status = int(message["status"])
                self._count(scope, status)
            await send(message)

        try:
            await self.app(scope, receive, counted_send)
        except BaseException:
            if status is None:
                self._count(scope, 500)
            raise


async def metrics_response(engine: Any, counts: HttpCounts) -> Response:
    """Prometheus text exposition of the engine's registry (503 if it cannot be read)."""
    try:
        snapshot = await asyncio.wait_for(engine.metrics_snapshot(http=counts.snapshot()),
                                          timeout=SNAPSHOT_TIMEOUT_S)
    except Exception as exc:
        log.warning("metrics snapshot failed: %s: %s", type(exc).__name__, exc)
        return Response(f"# metrics unavailable: {type(exc).__name__}\n", status_code=503,
                        media_type="text/plain", headers={"Retry-After": "1"})
    return Response(render(snapshot), media_type=CONTENT_TYPE)
