"""A virtual clock for asyncio: the engine's own coroutines run unchanged, time is simulated.

``VirtualEventLoop`` is asyncio's selector loop with two changes: ``time()`` reads a virtual
clock, and its selector never sleeps — when every task waits, it *advances* the clock to the
next scheduled timer instead of blocking. So ``asyncio.sleep(d)``, ``asyncio.wait_for`` deadlines
and everything the engine measures with ``loop.time`` run on simulated seconds, and a simulated
hour takes as long as the Python code it runs (the engine's real decisions), not an hour.

The simulated parts of a deployment hold ``Resource``s (a FIFO server: one stage, one drafter
node) and cross ``Link``s (bandwidth and latency); both are built on ``asyncio.sleep`` over the
virtual clock, so they compose with the engine's lanes and deadlines like real devices would.

When every task waits and no timer is scheduled, nothing can ever happen again: the loop raises
``SimulationStalled`` instead of hanging (a real deployment would hang there too).
"""

from __future__ import annotations

import asyncio
import collections
import math
import selectors
from typing import Awaitable, TypeVar

T = TypeVar("T")


class SimulationStalled(RuntimeError):
    """Every task waits for something no scheduled event will ever deliver."""


class _VirtualSelector(selectors.BaseSelector):
    """Polls the real selector (asyncio's self-pipe) without blocking; advances virtual time
    by the loop's timeout instead of waiting it out."""

    def __init__(self, loop_time: list[float]) -> None:
        self._real = selectors.DefaultSelector()
        self._now = loop_time

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: float | None = None):
        ready = self._real.select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise SimulationStalled("every task waits and no simulated event is scheduled")
        self._now[0] += timeout
        return []


class VirtualEventLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0) -> None:
        self._virtual_now = [float(start)]
        super().__init__(selector=_VirtualSelector(self._virtual_now))
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self._virtual_now[0]


def run_virtual(main: Awaitable[T]) -> T:
    """Run ``main`` to completion on a fresh ``VirtualEventLoop`` (time starts at 0)."""
    loop = VirtualEventLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in left:  # as asyncio.run does: a stalled or failed run leaves nothing pending
                t.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def now() -> float:
    return asyncio.get_running_loop().time()


class Resource:
    """A FIFO server with one slot (a pipeline stage, a drafter node, the engine's CPU): ``use``
    waits for the slot, holds it ``seconds`` of simulated time, and releases it in arrival order.
    ``busy_s`` and ``served`` are what it did so far (utilisation = busy_s / elapsed)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_s = 0.0
        self.served = 0
        self._busy = False
        self._queue: collections.deque[asyncio.Future] = collections.deque()

    async def use(self, seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            raise ValueError(f"{self.name}: service time must be a finite number >= 0, got {seconds!r}")
        if self._busy or self._queue:
            waiter = asyncio.get_running_loop().create_future()
            self._queue.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._queue:
                    self._queue.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._release()  # it had been handed the slot: pass it on
                raise
        self._busy = True
        try:
            await asyncio.sleep(seconds)
            self.busy_s += seconds
            self.served += 1
        finally:
            self._release()

    def _release(self) -> None:
        while self._queue:
            waiter = self._queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to it (stays busy)
                return
        self._busy = False

    @property
    def queue_length(self) -> int:
        return len(self._queue)


class Link:
    """A network link: a message of ``b`` bytes occupies the link for ``b·8 / bandwidth``
    seconds (FIFO: messages serialise) and arrives ``latency_s`` after it left."""

    def __init__(self, name: str, *, bandwidth_bps: float = math.inf, latency_s: float = 0.0) -> None:
        if not bandwidth_bps > 0 or latency_s < 0:
            raise ValueError(f"link {name}: bandwidth must be > 0 and latency >= 0")
        self.name = name
        self.bandwidth_bps = float(bandwidth_bps)
        self.latency_s = float(latency_s)
        self.wire = Resource(name)
        self.bytes_sent = 0

    def transfer_s(self, num_bytes: float) -> float:
        """Seconds a message of ``num_bytes`` takes alone on the link."""
        return num_bytes * 8 / self.bandwidth_bps + self.latency_s

    async def send(self, num_bytes: float) -> None:
        self.bytes_sent += int(num_bytes)
        if math.isfinite(self.bandwidth_bps):
            await self.wire.use(num_bytes * 8 / self.bandwidth_bps)
        if self.latency_s:
            await asyncio.sleep(self.latency_s)

