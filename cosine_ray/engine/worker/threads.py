"""How many torch threads an in-process CPU forward uses, chosen while it runs.

``import cosine_ray`` lets OpenMP threads spin briefly between parallel regions
(``GOMP_SPINCOUNT``, ``cosine_ray/__init__.py``): a decode step runs ~120 of them (one per
projection), and on an idle machine a sleeping thread takes longer to wake for each than the
region takes to run. When another process keeps a core busy, the same spinning threads lose
the scheduler's favour and every region waits for a time slice, so a multi-thread step becomes
many times slower; one thread has no region to wait for. ``ThreadGovernor`` times the steps,
now and then runs a few on the other count (all threads or one) and keeps whichever is faster
(docs/choices.md, "CPU threads and memory"). Our CPU kernels give the same sums on any thread
count (``tests/models/test_cpu_gemm.py``), so switching never changes a token.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch


class ThreadGovernor:
    """Alternate between ``most`` threads and one, keeping the faster.

    Steps are compared only with steps of the same size class (rows rounded up to a power of
    two), from the current count's recent steps. A probe of ``probe_steps`` steps on the other
    count replaces the current one when its steps take at most ``gain`` of the time; probes
    come after ``first_probe`` steps, and twice as far apart after each probe that changes
    nothing (up to ``last_probe``)."""

    def __init__(self, most: int, *, probe_steps: int = 4, first_probe: int = 16, last_probe: int = 1024,
                 gain: float = 0.85, set_threads: Callable[[int], None] = torch.set_num_threads,
                 get_threads: Callable[[], int] = torch.get_num_threads,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if most < 2:
            raise ValueError(f"a thread governor needs at least 2 threads to choose from, not {most}")
        self.most, self.threads = most, most
        self.probe_steps, self.first_probe, self.last_probe, self.gain = probe_steps, first_probe, last_probe, gain
        self._set_threads, self._get_threads, self._clock = set_threads, get_threads, clock
        self._interval = first_probe
        self._since_probe = 0
        self._recent: dict[int, deque[float]] = {}
        """Size class -> the current count's latest step seconds."""
        self._probe: list[tuple[int, float]] | None = None
        self.switches = 0

    @property
    def probing(self) -> bool:
        return self._probe is not None

    @contextmanager
    def step(self, rows: int) -> Iterator[None]:
        """Time one step of ``rows`` new tokens, on this governor's count (set again if someone
        else changed it: another engine in the same process)."""
        wanted = self._other() if self._probe is not None else self.threads
        if self._get_threads() != wanted:
            self._set_threads(wanted)
        start = self._clock()
        yield
        self.record(rows, self._clock() - start)

    def record(self, rows: int, seconds: float) -> None:
        size = max(rows, 1).bit_length()
        if self._probe is not None:
            self._probe.append((size, seconds))
            if len(self._probe) >= self.probe_steps:
                self._decide()
            return
        self._recent.setdefault(size, deque(maxlen=16)).append(seconds)
        self._since_probe += 1
        if self._since_probe >= self._interval:
            self._probe = []
            self._set_threads(self._other())

    def _other(self) -> int:
        return 1 if self.threads == self.most else self.most

    def _decide(self) -> None:
        ratios = [s / statistics.median(self._recent[size]) for size, s in self._probe if size in self._recent]
        self._probe, self._since_probe = None, 0
        if ratios and statistics.median(ratios) <= self.gain:
            self.threads, self._interval, self._recent = self._other(), self.first_probe, {}
            self.switches += 1
        else:
            self._interval = min(2 * self._interval, self.last_probe)
        self._set_threads(self.threads)
