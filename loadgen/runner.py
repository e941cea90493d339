"""Run a plan: open-loop arrivals, an optional concurrency cap, multi-turn conversations.

One asyncio task per conversation sleeps until its arrival offset, then sends
its turns one after another (turn k+1 right after turn k's answer, with the history). Like
``vllm bench serve``, ``--max-concurrency`` is a semaphore taken *after* the arrival time, so
arrivals stay open-loop and the cap only bounds what is in flight; the wait is recorded as
``queued_s`` and is not part of TTFT/E2EL. ``request_rate = inf`` with a cap is a closed loop.

Failure policy: a failed request is recorded and the run goes on, except a ``connect`` failure
(nothing listens at the URL any more), which stops sending: every request not yet sent becomes
``not_sent`` with the reason, in-flight requests finish. A first SIGINT does the same; a second
one cancels the in-flight requests (recorded as failed ``cancelled``). The records and the
ledger are complete in every case, so partial results can always be written.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx
from tqdm import tqdm

from loadgen.client import RequestRecord, RequestSpec, error_message, send_request
from loadgen.ledger import Ledger
from loadgen.tasks import ScriptedTurn
from loadgen.workload import WorkItem

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True, slots=True)
class RunConfig:
    base_url: str
    """Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)."""
    endpoint: str = CHAT_PATH
    model: str | None = None
    """None = ask GET /v1/models (and omit the field if that fails)."""
    api_key: str | None = None
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    """Deadline for one whole request, connect to [DONE]."""
    connect_timeout_s: float = 10.0
    temperature: float = 0.0
    send_stats: bool = True
    """Ask for the ``cosine_ray`` per-request speculation block."""
    ignore_eos: bool = False
    duration_s: float | None = None
    """Stop sending new requests this many seconds after the start."""
    num_warmups: int = 0
    show_progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"--request-timeout must be > 0 seconds, got {self.request_timeout_s}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"--duration must be > 0 seconds, got {self.duration_s}")
        if self.num_warmups < 0:
            raise ValueError(f"--num-warmups must be >= 0, got {self.num_warmups}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url must start with http:// or https://, got {self.base_url!r}")


@dataclass
class RunResult:
    records: list[RequestRecord]
    ledger: Ledger
    duration_s: float
    started_at: float
    """Unix time of the run's t0."""
    model: str | None = None
    abort_reason: str | None = None


def root_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def request_body(item: WorkItem, history: list[dict[str, str]], cfg: RunConfig, model: str | None,
                 scripted: ScriptedTurn | None = None) -> dict[str, Any]:
    """The request of one turn; a scripted turn adds its prediction and response format."""
    body: dict[str, Any] = {"max_tokens": item.max_tokens, "temperature": cfg.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if scripted is not None:
        body.update(scripted.body_fields())
    if model:
        body["model"] = model
    if cfg.endpoint == CHAT_PATH:
        body["messages"] = list(history)
    else:
        body["prompt"] = list(item.prompt_token_ids) if item.prompt_token_ids is not None else history[-1]["content"]
    if cfg.send_stats:
        body["cosine_ray_stats"] = True
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return {**body, **cfg.extra_body}


class _Run:
    def __init__(self, plan: Sequence[tuple[WorkItem, float]], cfg: RunConfig, clock: Callable[[], float]):
        self.plan, self.cfg, self.clock = plan, cfg, clock
        self.ledger = Ledger()
        self.records: dict[str, RequestRecord] = {}
        self.abort_reason: str | None = None
        self.in_flight: set[asyncio.Task] = set()
        self.model = cfg.model
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.t0 = 0.0
        for item, offset in plan:
            for turn in range(item.num_turns):
                rid = f"{item.conversation_id}-t{turn}"
                self.ledger.record("planned", rid)
                self.records[rid] = RequestRecord(rid, item.conversation_id, turn, item.domain, item.source_id,
                                                  scheduled_s=float(offset))
        self.progress = tqdm(total=len(self.records), unit="req", desc="requests", file=sys.stderr,
                             disable=not cfg.show_progress, dynamic_ncols=True)

    def abort(self, reason: str) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        elif reason.startswith("interrupted"):  # second Ctrl-C: stop in-flight requests too
            for task in list(self.in_flight):
                task.cancel()

    def _not_sent(self, rid: str, reason: str) -> None:
        rec = self.records[rid]
        rec.status, rec.error = "not_sent", reason
        self.ledger.record("not_sent", rid, self.clock() - self.t0, reason=reason)
        self.progress.update(1)

    def _stop_reason(self) -> str | None:
        if self.abort_reason:
            return f"aborted: {self.abort_reason}"
        if self.cfg.duration_s is not None and self.clock() - self.t0 >= self.cfg.duration_s:
            return f"--duration {self.cfg.duration_s:g} s reached"
        return None

    async def conversation(self, client: httpx.AsyncClient, item: WorkItem, offset: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + offset - self.clock()))
        history: list[dict[str, str]] = []
        for turn in range(item.num_turns):
            rid = f"{item.conversation_id}-t{turn}"
            if (reason := self._stop_reason()) is not None:
                for rest in range(turn, item.num_turns):
                    self._not_sent(f"{item.conversation_id}-t{rest}", reason)
                return
            scripted = item.turns[turn] if item.turns and isinstance(item.turns[turn], ScriptedTurn) else None
            if scripted is not None:  # sent as written, whatever was answered before
                history = scripted.chat
            else:
                history.append({"role": "user", "content": item.turns[turn] if item.turns else ""})
            rec = await self.one_request(client, item, rid, turn, history, scripted)
            if rec.status != "ok":
                why = rec.error if rec.status == "not_sent" else f"turn {turn} failed"
                for rest in range(turn + 1, item.num_turns):
                    self._not_sent(f"{item.conversation_id}-t{rest}", why or "not sent")
                return
            history.append({"role": "assistant", "content": rec.output_text})

    async def one_request(self, client: httpx.AsyncClient, item: WorkItem, rid: str, turn: int,
                          history: list[dict[str, str]], scripted: ScriptedTurn | None = None) -> RequestRecord:
        rec = self.records[rid]
        spec = RequestSpec(rid, item.conversation_id, turn, item.domain, item.source_id, self.cfg.endpoint,
                           request_body(item, history, self.cfg, self.model, scripted), rec.scheduled_s or 0.0)
        async with self.semaphore or contextlib.nullcontext():
            rec.queued_s = self.clock() - self.t0 - (rec.scheduled_s or 0.0)
            if (reason := self._stop_reason()) is not None:
                self._not_sent(rid, reason)
                return rec
            self.ledger.record("sent", rid, self.clock() - self.t0)
            task = asyncio.ensure_future(send_request(client, spec, rec, t0=self.t0, clock=self.clock,
                                                      timeout_s=self.cfg.request_timeout_s, headers=self.headers))
            self.in_flight.add(task)
            try:
                await task
            except asyncio.CancelledError:
                rec.status, rec.error_kind, rec.error = "failed", "cancelled", "cancelled by a second interrupt"
                rec.end_s = self.clock() - self.t0
            finally:
                self.in_flight.discard(task)
        if rec.status == "ok":
            self.ledger.record("ok", rid, rec.end_s, done_markers=rec.num_done_markers, response_id=rec.response_id)
        else:
            self.ledger.record("failed", rid, rec.end_s, error_kind=rec.error_kind, error=rec.error)
            if rec.error_kind == "connect":
                self.abort(f"server unreachable ({rec.error})")
        self.progress.update(1)
        return rec

    async def discover_model(self, client: httpx.AsyncClient) -> None:
        try:
            resp = await client.get("/v1/models", headers=self.headers, timeout=self.cfg.connect_timeout_s + 20)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.abort(f"server unreachable: cannot connect to {self.cfg.base_url} ({exc or type(exc).__name__})")
            return
        except httpx.HTTPError:
            return
        if resp.status_code == 200:
            with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
                self.model = str(resp.json()["data"][0]["id"])
        elif resp.status_code == 401:
            self.abort(f"GET /v1/models: HTTP 401: {error_message(resp.content)} (pass --api-key)")

    async def warm_up(self, client: httpx.AsyncClient) -> None:
        for i, (item, _) in enumerate(self.plan[:self.cfg.num_warmups]):
            first = item.turns[0] if item.turns else ""
            scripted = isinstance(first, ScriptedTurn)
            history = first.chat if scripted else [{"role": "user", "content": first}]
            spec = RequestSpec(f"warmup-{i}", item.conversation_id, 0, item.domain, item.source_id, self.cfg.endpoint,
                               request_body(item, history, self.cfg, self.model, first if scripted else None))
            rec = await send_request(client, spec, RequestRecord.for_spec(spec), t0=self.clock(), clock=self.clock,
                                     timeout_s=self.cfg.request_timeout_s, headers=self.headers)
            if rec.status != "ok":
                self.abort(f"warm-up request failed: {rec.error}")
                return

    async def run(self) -> RunResult:
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=self.cfg.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        started = time.time()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGINT, self.abort, "interrupted by the user (Ctrl-C)")
        try:
            async with httpx.AsyncClient(base_url=root_url(self.cfg.base_url), timeout=timeout,
                                         limits=limits) as client:
                if self.model is None:
                    await self.discover_model(client)
                if self.abort_reason is None:
                    await self.warm_up(client)
                self.t0, started = self.clock(), time.time()
                await asyncio.gather(*(self.conversation(client, item, offset) for item, offset in self.plan),
                                     return_exceptions=False)
                duration = self.clock() - self.t0
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(signal.SIGINT)
            self.progress.close()
        return RunResult(list(self.records.values()), self.ledger, duration, started, self.model, self.abort_reason)


def run_plan(plan: Sequence[tuple[WorkItem, float]], cfg: RunConfig, *,
             clock: Callable[[], float] = time.perf_counter) -> RunResult:
    """Blocking entry point (one event loop per run)."""
    async def main() -> RunResult:
        return await _Run(plan, cfg, clock).run()
    return asyncio.run(main())
