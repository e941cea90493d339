"""The simulator's event core: the virtual-time asyncio loop, FIFO ``Resource`` and ``Link``.

The M/D/1 test is the acceptance test of the event core: a queue whose every waiting time is
known exactly (Lindley's recursion over the same arrivals) and whose mean is known in closed
form (Pollaczek-Khinchine)."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import pytest

from cosine_ray.sim.clock import Link, Resource, SimulationStalled, VirtualEventLoop, now, run_virtual


# ---- M/D/1 -----------------------------------------------------------------------------------

MD1_CUSTOMERS = 30_000
"""Spread of the relative error of the mean wait against P-K, measured offline with Lindley's
recursion (which the event core matches exactly) over 600 seeds at rho = 0.5: sd 2.6 % and 26/600
seeds beyond 5 % at N = 20 000; sd 2.05 %, max 6.2 %, none beyond 7 % at N = 30 000. So N = 30 000
with a 7 % tolerance (3.4 sd); ~1 s of wall time here."""


def _lindley(interarrivals: list[float], service: float) -> list[float]:
    """W_1 = 0, W_{n+1} = max(0, W_n + D - A_{n+1}): the waits of a FIFO single server."""
    waits = [0.0]
    for a in interarrivals[1:]:
        waits.append(max(0.0, waits[-1] + service - a))
    return waits


@pytest.mark.full  # a statistical sweep
@pytest.mark.parametrize("seed", [0, 1])
def test_md1_queue_matches_lindley_exactly_and_pollaczek_khinchine_on_average(seed):
    service, rho = 1.0, 0.5
    rate = rho / service
    rng = random.Random(seed)
    interarrivals = [rng.expovariate(rate) for _ in range(MD1_CUSTOMERS)]  # A_1 is the first arrival
    waits = [math.nan] * MD1_CUSTOMERS

    async def main() -> tuple[float, Resource]:
        server = Resource("server")
        loop = asyncio.get_running_loop()

        async def customer(i: int) -> None:
            arrived = loop.time()
            await server.use(service)
            waits[i] = loop.time() - arrived - service

        customers = []
        for i, a in enumerate(interarrivals):
            await asyncio.sleep(a)
            customers.append(asyncio.create_task(customer(i)))
        await asyncio.gather(*customers)
        return loop.time(), server

    wall = time.perf_counter()
    end, server = run_virtual(main())
    wall = time.perf_counter() - wall

    expected = _lindley(interarrivals, service)
    worst = max(abs(w - e) for w, e in zip(waits, expected))
    assert worst < 1e-6, f"simulated waits differ from Lindley's recursion by up to {worst}"
    assert server.served == MD1_CUSTOMERS and server.busy_s == pytest.approx(MD1_CUSTOMERS * service)
    assert server.queue_length == 0

    pk = rho * service / (2 * (1 - rho))
    mean = statistics.fmean(waits)
    assert abs(mean / pk - 1) < 0.07, f"mean wait {mean:.4f} vs Pollaczek-Khinchine {pk:.4f}"

    # the last customer leaves at its arrival + wait + service: virtual time ran exactly that far
    assert end == pytest.approx(sum(interarrivals) + expected[-1] + service, abs=1e-6)
    assert end > 100 * wall, f"simulated {end:.0f} s took {wall:.2f} s of wall time"


# ---- Resource -------------------------------------------------------------------------------

def test_resource_is_fifo_and_cancelled_waiters_neither_lose_nor_double_the_slot():
    done: dict[str, float] = {}
    server = Resource("stage")
    tasks: dict[str, asyncio.Task] = {}

    async def job(name: str, seconds: float) -> None:
        await server.use(seconds)
        done[name] = now()
        if name == "A":
            # A's release has just handed the slot to B (B's future is set) but B has not run:
            # cancelling B now must pass the slot on, not keep it busy forever
            tasks["B"].cancel()

    async def main() -> None:
        for name in "ABCDEF":
            tasks[name] = asyncio.create_task(job(name, 1.0))
        await asyncio.sleep(0)  # every job has asked for the slot: A holds it, B..F queue in order
        assert server.queue_length == 5
        await asyncio.sleep(0.5)
        tasks["C"].cancel()  # a waiter cancelled while still queued leaves the queue
        await asyncio.sleep(0)
        assert server.queue_length == 4
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        assert [type(r).__name__ for r in results] == ["NoneType", "CancelledError", "CancelledError",
                                                      "NoneType", "NoneType", "NoneType"]
        # the slot is free again afterwards: a late job starts at once
        await asyncio.sleep(10.0)
        start = now()
        await server.use(2.0)
        done["late"] = now() - start

    run_virtual(main())
    # A at 1, then D, E, F back to back (FIFO, one at a time, no gap left by B or C)
    assert done == {"A": pytest.approx(1.0), "D": pytest.approx(2.0), "E": pytest.approx(3.0),
                    "F": pytest.approx(4.0), "late": pytest.approx(2.0)}
    assert list(done) == ["A", "D", "E", "F", "late"]
    assert server.served == 5 and server.busy_s == pytest.approx(6.0)
    assert server.queue_length == 0


def test_resource_cancelled_while_holding_the_slot_releases_it_uncounted():
    server = Resource("stage")
    finished: list[tuple[str, float]] = []

    async def job(name: str, seconds: float) -> None:
        await server.use(seconds)
        finished.append((name, now()))

    async def main() -> None:
        holder = asyncio.create_task(job("holder", 5.0))
        nxt = asyncio.create_task(job("next", 1.0))
        await asyncio.sleep(2.0)
        holder.cancel()
        await asyncio.gather(holder, nxt, return_exceptions=True)

    run_virtual(main())
    assert finished == [("next", pytest.approx(3.0))]
    assert server.served == 1 and server.busy_s == pytest.approx(1.0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_resource_rejects_bad_service_times(bad):
    async def main() -> None:
        await Resource("x").use(bad)

    with pytest.raises(ValueError, match="service time"):
        run_virtual(main())


# ---- Link -----------------------------------------------------------------------------------

def test_link_serialises_messages_then_propagates_them():
    k, size, bandwidth, latency = 5, 12_500, 1e6, 0.05  # 0.1 s on the wire each
    link = Link("wire", bandwidth_bps=bandwidth, latency_s=latency)
    arrived: list[float] = [math.nan] * k

    async def send(i: int) -> None:
        await link.send(size)
        arrived[i] = now()

    async def main() -> None:
        await asyncio.gather(*(send(i) for i in range(k)))

    run_virtual(main())
    expected = [(i + 1) * size * 8 / bandwidth + latency for i in range(k)]
    assert arrived == pytest.approx(expected, abs=1e-9)
    assert link.bytes_sent == k * size
    assert link.wire.busy_s == pytest.approx(k * size * 8 / bandwidth)
    assert link.transfer_s(size) == pytest.approx(size * 8 / bandwidth + latency)


def test_infinite_link_only_adds_latency_and_messages_do_not_queue():
    link = Link("lan", latency_s=0.002)
    arrived: list[float] = []

    async def main() -> None:
        async def send() -> None:
            await link.send(10**9)
            arrived.append(now())

        await asyncio.gather(*(send() for _ in range(3)))

    run_virtual(main())
    assert arrived == pytest.approx([0.002] * 3, abs=1e-12)
    assert link.wire.busy_s == 0.0 and link.transfer_s(10**9) == pytest.approx(0.002)


@pytest.mark.parametrize("kwargs", [{"bandwidth_bps": 0}, {"bandwidth_bps": -1.0}, {"latency_s": -0.1}])
def test_link_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError, match="link bad"):
        Link("bad", **kwargs)


# ---- the loop itself --------------------------------------------------------------------------

def test_simulation_stalls_instead_of_hanging():
    async def forever() -> None:
        await asyncio.get_running_loop().create_future()  # nobody will ever resolve it

    wall = time.perf_counter()
    with pytest.raises(SimulationStalled):
        run_virtual(forever())
    assert time.perf_counter() - wall < 2.0


def test_simulation_stalls_only_when_no_timer_is_left():
    reached: list[float] = []

    async def main() -> None:
        never = asyncio.Event()
        await asyncio.sleep(5.0)  # a pending timer: no stall yet
        reached.append(now())
        await never.wait()

    with pytest.raises(SimulationStalled):
        run_virtual(main())
    assert reached == [pytest.approx(5.0)]
    # the loop was closed and unset cleanly: the next simulation runs from t = 0
    assert run_virtual(_sleep_and_read(1.5)) == pytest.approx(1.5)


async def _sleep_and_read(seconds: float) -> float:
    await asyncio.sleep(seconds)
    return now()


def test_wait_for_times_out_on_virtual_time():
    async def main() -> tuple[float, float, str]:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(loop.create_future(), timeout=10.0)
        timed_out_at = loop.time()
        result = await asyncio.wait_for(asyncio.sleep(3.0, result="in time"), timeout=10.0)
        return timed_out_at, loop.time(), result

    wall = time.perf_counter()
    timed_out_at, end, result = run_virtual(main())
    assert time.perf_counter() - wall < 2.0  # not the 13 simulated seconds
    assert timed_out_at == pytest.approx(10.0, abs=1e-6)
    assert result == "in time" and end == pytest.approx(13.0, abs=1e-6)


def test_virtual_clock_starts_where_asked_and_jumps_over_idle_time():
    loop = VirtualEventLoop(start=100.0)
    try:
        assert loop.time() == 100.0
        wall = time.perf_counter()
        assert loop.run_until_complete(_sleep_and_read(3600.0)) == pytest.approx(3700.0)
        assert time.perf_counter() - wall < 2.0
    finally:
        loop.close()
