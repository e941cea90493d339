"""One hostile case at a time, each with a bystander beside it and a normal request after it.

For each case: wait for ``/health`` (up to ``after_deadline_s``); start the **bystander**, an
ordinary greedy stream of ``BYSTANDER_TOKENS`` tokens (another one when it ends; with the other
key, ``Target.other_api_key``, when one is given, as is the normal request), and let it
reach its first token (at most ``after_deadline_s``); run the case under ``case_deadline_s``; stop the bystander; send a
**normal request** (8 greedy tokens), which must be answered with 200 within
``after_deadline_s``. The bystander's longest gap is the longest wait between two of its
tokens, its first one after the start of a stream included. A case fails on any 5xx, on
passing its deadline (hung), on a bar of its own (``Seen.failures``), when the normal request
after it is not answered, and, with ``max_gap_s``, on a longer bystander gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import httpx

from loadgen.hostile.cases import COMPLETIONS, Case, Seen, Target

BYSTANDER_TOKENS = 64


@dataclass
class CaseResult:
    name: str
    what: str
    statuses: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    hung: bool = False
    gap_s: float | None = None
    """The bystander's longest wait between tokens while the case ran."""
    bystander_tokens: int = 0
    bystander_error: str | None = None
    after_status: Any = None
    after_s: float | None = None
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.skipped is not None or not self.failures

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class Bystander:
    """Greedy streams one after another; the times its tokens arrive."""

    def __init__(self, client: httpx.AsyncClient, target: Target) -> None:
        self.client, self.target = client, target
        self.ready = asyncio.Event()
        """Set at its first token, or at its first error (the case then runs anyway)."""
        self.last_t: float | None = None
        self.max_gap = 0.0
        self.tokens = 0
        self.error: str | None = None
        self.task: asyncio.Task | None = None

    async def _stream(self) -> None:
        body = {"prompt": "The history of the printing press", "max_tokens": BYSTANDER_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, **({"model": self.target.model} if self.target.model else {})}
        async with self.client.stream("POST", COMPLETIONS, json=body, headers=self.target.other_headers) as resp:
            if resp.status_code != 200:
                self.error = self.error or f"HTTP {resp.status_code}"
                self.ready.set()
                await asyncio.sleep(1.0)
                return
            async for line in resp.aiter_lines():
                if line.startswith("data:") and _has_text(line[5:]):
                    self._tick()

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.last_t is not None:
            self.max_gap = max(self.max_gap, now - self.last_t)
        self.last_t = now
        self.tokens += 1
        self.ready.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self._stream()
            except httpx.HTTPError as exc:
                self.error = self.error or type(exc).__name__
                self.ready.set()
                await asyncio.sleep(1.0)

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._loop())

    def measure_from_now(self) -> None:
        """Gaps count from here: the wait before the case is not the case's doing."""
        self.max_gap, self.last_t, self.tokens = 0.0, time.perf_counter(), 0

    async def stop(self) -> float:
        """The longest gap, the wait since the last token included."""
        if self.last_t is not None:
            self.max_gap = max(self.max_gap, time.perf_counter() - self.last_t)
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        return self.max_gap


def _has_text(data: str) -> bool:
    try:
        event = json.loads(data)
    except ValueError:
        return False
    return isinstance(event, dict) and any(isinstance(c, dict) and c.get("text") for c in event.get("choices") or [])


async def wait_healthy(client: httpx.AsyncClient, deadline_s: float) -> bool:
    end = time.perf_counter() + deadline_s
    while time.perf_counter() < end:
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/health", timeout=10.0)).status_code == 200:
                return True
        await asyncio.sleep(1.0)
    return False


async def normal_request(client: httpx.AsyncClient, target: Target, deadline_s: float) -> tuple[Any, float]:
    start = time.perf_counter()
    body = {"prompt": "Hello", "max_tokens": 8, "temperature": 0, **({"model": target.model} if target.model else {})}
    try:
        resp = await client.post(COMPLETIONS, json=body, headers=target.other_headers, timeout=deadline_s)
        return resp.status_code, time.perf_counter() - start
    except httpx.TimeoutException:
        return "no answer", time.perf_counter() - start
    except httpx.HTTPError as exc:
        return type(exc).__name__, time.perf_counter() - start


async def run_case(case: Case, target: Target, *, case_deadline_s: float, after_deadline_s: float,
                   max_gap_s: float | None) -> CaseResult:
    result = CaseResult(case.name, case.what)
    if case.needs_key and not target.api_key:
        result.skipped = "needs --api-key (the server's key)"
        return result
    client = target.client
    if not await wait_healthy(client, after_deadline_s):
        result.notes.append(f"/health was not 200 for {after_deadline_s:g} s before the case")
    bystander = Bystander(client, target)
    bystander.start()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(bystander.ready.wait(), after_deadline_s)
    bystander.measure_from_now()
    seen, start = Seen(), time.perf_counter()
    try:
        await asyncio.wait_for(case.run(target, seen), case_deadline_s)
    except TimeoutError:
        result.hung = True
    except httpx.TimeoutException:
        result.hung = True
    except (httpx.HTTPError, OSError) as exc:
        seen.statuses.append(type(exc).__name__)
    result.seconds = time.perf_counter() - start
    result.gap_s = await bystander.stop()
    result.bystander_tokens, result.bystander_error = bystander.tokens, bystander.error
    result.statuses, result.notes, result.failures = seen.statuses, result.notes + seen.notes, list(seen.failures)
    result.after_status, result.after_s = await normal_request(client, target, after_deadline_s)
    fives = [s for s in seen.statuses if isinstance(s, int) and s >= 500]
    if fives:
        result.failures.append(f"{len(fives)} answer(s) 5xx ({', '.join(sorted({str(s) for s in fives}))})")
    if result.hung:
        result.failures.append(f"no end within the case deadline of {case_deadline_s:g} s")
    if result.after_status != 200:
        result.failures.append(f"a normal request after it: {result.after_status}")
    if max_gap_s is not None and result.gap_s is not None and result.gap_s > max_gap_s:
        result.failures.append(f"the bystander waited {result.gap_s:.1f} s between tokens (max {max_gap_s:g})")
    return result


async def run_cases(cases: Sequence[Case], target: Target, *, case_deadline_s: float, after_deadline_s: float,
                    max_gap_s: float | None, log: Callable[[str], None] = print) -> list[CaseResult]:
    results = []
    for case in cases:
        log(f"[hostile] {case.name}: {case.what}")
        result = await run_case(case, target, case_deadline_s=case_deadline_s, after_deadline_s=after_deadline_s,
                                max_gap_s=max_gap_s)
        log(f"[hostile] {case.name}: {'ok' if result.ok else 'FAIL'} in {result.seconds:.1f} s, "
            f"bystander gap {result.gap_s or 0:.1f} s" + (f"; {'; '.join(result.failures)}" if result.failures else ""))
        results.append(result)
    return results
