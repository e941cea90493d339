"""``GET /metrics`` and the HTTP response counter (the edge of the single-exporter design).

Single exporter: every number lives in one registry in the engine process. Any ingress replica
answers ``/metrics`` by asking its engine client for that registry's snapshot (scrapes arriving
meanwhile share it) and rendering it, so a scrape through any replica gets cluster-wide totals.

Each replica counts its HTTP responses (``HttpCounts``: cumulative totals per (route, status),
per (key name, status), and admission's per-key series, under a random replica id) and hands
them to the registry with every ``/metrics`` call and in pushes (``EngineClient.record_http``,
fire and forget) at most once per ``push_interval_s``: the first response after a quiet spell
pushes at once, the rest at the end of the interval. Only a response to an authenticated request
of a known route starts a push, so 401s and 404s never cost the engine a call (the next push or
scrape carries them). The registry folds totals per replica and ignores a total lower than one
it has, so late or reordered pushes never double count, with any number of replicas; a
restarted replica has a new id. Route labels are route templates or ``unmatched`` and key labels
are key names, never keys, so clients cannot blow up the label set. A scrape's own response is
counted after its snapshot, so it shows up in the next one.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, Callable

from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cosine_ray.metrics.prometheus import CONTENT_TYPE, render
from cosine_ray.serve.errors import error_response
from cosine_ray.serve.guards.tenants import TENANT_SCOPE_KEY

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
SNAPSHOT_TIMEOUT_S = 10.0
UNMATCHED = "unmatched"
PUSH_INTERVAL_S = 1.0
"""Longest a replica's new counts wait before it pushes them to the engine (at most one push
per interval, whatever the traffic)."""
QUIET_STATUSES = frozenset({401, 404})
"""Responses that never start a push: refused or unknown requests cost the engine nothing."""
TENANT_REQUESTS = "cosine_ray:tenant_requests"


def route_label(scope: Scope, known_paths: frozenset[str]) -> str:
    """The matched route's template; the raw path when it is a known route that was answered
    before routing (401, 413); else ``unmatched``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    return scope.get("path") if scope.get("path") in known_paths else UNMATCHED


class HttpCounts:
    """This replica's cumulative response counts (and ``extra``'s series), pushed to the engine."""

    def __init__(self, engine: Any, *, extra: Callable[[], dict] | None = None,
                 push_interval_s: float = PUSH_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.replica = uuid.uuid4().hex
        self.totals: dict[tuple[str, int], int] = {}
        self.tenant_totals: dict[tuple[str, int], int] = {}
        """(key name, status) → responses: the requests each key made."""
        self.extra = extra
        self.push_interval_s = push_interval_s
        self.clock = clock
        self.num_pushes = 0
        self._push = getattr(engine, "record_http", None)  # absent on test fakes
        self._last_push = -float("inf")
        self._pending: asyncio.TimerHandle | None = None
        self.scraping: dict[int, asyncio.Future] = {}
        """The engine snapshot a ``/metrics`` call is reading, per engine (``id``), shared by the
        calls meanwhile."""

    def count(self, route: str, status: int, tenant: str | None = None) -> None:
        """Count one response; ``tenant``: the key name it was authenticated with."""
        key = (route, status)
        self.totals[key] = self.totals.get(key, 0) + 1
        if tenant is not None:
            self.tenant_totals[(tenant, status)] = self.tenant_totals.get((tenant, status), 0) + 1
        if status in QUIET_STATUSES or route == UNMATCHED or self._push is None:
            return  # never engine work for a refused or unknown request: the next push carries it
        self._schedule()

    def _schedule(self) -> None:
        wait = self._last_push + self.push_interval_s - self.clock()
        if wait <= 0:
            self.push()
        elif self._pending is None:
            try:
                self._pending = asyncio.get_running_loop().call_later(wait, self.push)
            except RuntimeError:  # no event loop (a test calling count directly): the scrape carries it
                pass

    def push(self) -> None:
        """Send the totals to the engine now (fire and forget)."""
        if self._pending is not None:
            self._pending.cancel()
            self._pending = None
        self._last_push = self.clock()
        try:
            self._push(*self.snapshot())
            self.num_pushes += 1
        except Exception:  # counting must never break a response
            log.debug("could not push HTTP counts", exc_info=True)

    def snapshot(self) -> tuple[str, dict]:
        """(replica id, cumulative totals) as ``MetricsRegistry.add_http_totals`` takes them."""
        out: dict = dict(self.totals)
        for (tenant, status), n in self.tenant_totals.items():
            out[(TENANT_REQUESTS, (("key", tenant), ("status", str(status))))] = n
        if self.extra is not None:
            out.update(self.extra())
        return self.replica, out


class HttpMetricsMiddleware:
    """Counts every HTTP response by route and status (outermost: sees 401/413/500 too)."""

    def __init__(self, app: ASGIApp, *, counts: HttpCounts,
                 known_paths: Callable[[], frozenset[str]]) -> None:
        self.app = app
        self.counts = counts
        self.known_paths = known_paths

    def _count(self, scope: Scope, status: int) -> None:
        try:
            tenant = scope.get(TENANT_SCOPE_KEY)
            self.counts.count(route_label(scope, self.known_paths()), status,
                              tenant=tenant.name if tenant is not None else None)
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


async def metrics_response(engine: Any, counts: HttpCounts, *, with_http: bool = True) -> Response:
    """Prometheus text exposition of the engine's registry (503 if it cannot be read); with
    ``with_http`` the replica's HTTP counts are folded into it. Scrapes that arrive while one is
    reading the engine share its snapshot: ``/metrics`` is public by default, and a flood of it
    costs the engine one call at a time."""
    try:
        scraping = counts.scraping.get(id(engine))
        if scraping is None or scraping.done() or scraping.get_loop() is not asyncio.get_running_loop():
            scraping = counts.scraping[id(engine)] = asyncio.ensure_future(asyncio.wait_for(
                engine.metrics_snapshot(http=counts.snapshot() if with_http else None), timeout=SNAPSHOT_TIMEOUT_S))
        snapshot = await asyncio.shield(scraping)
    except Exception as exc:
        log.warning("metrics snapshot failed: %s: %s", type(exc).__name__, exc)
        return error_response(503, "the engine's metrics could not be read; retry", headers={"Retry-After": "1"})
    return Response(render(snapshot), media_type=CONTENT_TYPE)
