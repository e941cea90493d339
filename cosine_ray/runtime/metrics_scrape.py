"""Scrape-time metrics that live outside the engine process: read them with deadlines.

The engine replica holds the one ``MetricsRegistry`` of the deployment (single exporter: it sees
every request, drafter call and verify step). Two figures are counted elsewhere and read here
when ``/metrics`` is scraped:

- ``stage_busy_seconds`` / ``stage_idle_seconds``: each stage worker times its own
  ``forward`` (``StageWorker.utilisation``), read without ever holding up a scrape
  (``StageUtilisationReader``).
- ``drafter_restarts``: ``ActorSlot.num_respawns`` of each drafter slot (a drafter killed for
  good and spawned again by the engine). Restarts Ray performs by itself (``max_restarts``)
  keep the slot's handle and are not counted.
"""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Sequence

from cosine_ray.metrics.exporter import EngineMetrics
from cosine_ray.runtime.clients import ActorSlot, await_ref

READ_DEADLINE_S = 30.0
"""Longest wait for one stage's reading (in the background; covers a long queue of forwards)."""
SCRAPE_WAIT_S = 0.2
"""How long a scrape waits for a fresh reading before exporting the previous one."""


def _read_stage_utilisation(host: Any) -> tuple[float, float, str]:
    """Runs inside a stage actor: (busy s, idle s, incarnation)."""
    busy, idle = host.utilisation()
    return busy, idle, host.incarnation


async def collect_stage_utilisation(metrics: EngineMetrics, stage_slots: Sequence[ActorSlot],
                                    *, timeout_s: float = READ_DEADLINE_S) -> None:
    readings = await asyncio.gather(
        *(await_ref(slot.handle.__ray_call__.remote(_read_stage_utilisation), timeout_s)
          for slot in stage_slots), return_exceptions=True)
    for index, (slot, reading) in enumerate(zip(stage_slots, readings)):
        if isinstance(reading, BaseException):
            metrics.collection_failed(slot.name)
            continue
        busy, idle, incarnation = reading
        metrics.stage_utilisation(index, busy, idle, incarnation)


class StageUtilisationReader:
    """At most one stage read in flight; a scrape waits ``SCRAPE_WAIT_S`` for it at most.

    The read goes through ``__ray_call__`` (runs a function on the actor instance, as Ray's own
    compiled graphs and collectives do), so the stage actor needs no metrics method. A stage
    actor runs one call at a time, so under load the read waits behind the queued forwards: a
    scrape therefore starts it in the background, gives it ``SCRAPE_WAIT_S`` (an idle pipeline
    answers in milliseconds, so the scrape sees fresh values) and otherwise exports the previous
    reading; the values lag by at most one scrape under load. Each reading is folded in per
    actor incarnation (``MetricsRegistry.add_cumulative``): a restarted stage starts from zero
    without the exported counter ever going down. A read that misses its deadline (dead or
    restarting stage) counts one ``metrics_collection_failures{source="cosine_ray:stage:i"}``."""

    def __init__(self, metrics: EngineMetrics, stage_slots: Sequence[ActorSlot]) -> None:
        self.metrics = metrics
        self.stage_slots = stage_slots
        self._task: asyncio.Task | None = None

    async def refresh(self, wait_s: float = SCRAPE_WAIT_S) -> None:
        if self._task is None or self._task.done():
            # A fresh context: the reads must not be children of this scrape call. Serve cancels
            # a request whose client left (Prometheus' scrape timeout), and Ray then cancels the
            # calls the cancelled actor method made, here calls queued on the stage actors.
            self._task = asyncio.get_running_loop().create_task(
                collect_stage_utilisation(self.metrics, self.stage_slots), context=contextvars.Context())
        await asyncio.wait({self._task}, timeout=wait_s)  # never cancels the read


def collect_drafter_restarts(metrics: EngineMetrics, drafter_slots: Sequence[ActorSlot],
                             drafter_names: Sequence[str]) -> None:
    for slot, name in zip(drafter_slots, drafter_names):
        metrics.drafter_restarts(name, slot.num_respawns, slot.name)
