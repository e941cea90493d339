"""Serving metrics of one request (vLLM's names), recorded as its outputs reach the caller.

``engine/loop.py`` makes one ``RequestTimeline`` per request and feeds it every
``RequestOutput`` it hands out; all times come from the engine's clock, the same clock that
stamped ``arrival_time`` and ``admitted_time``. Definitions:

- TTFT: arrival to the first output carrying tokens (the prefill's token);
- queue time: arrival to admission into the running batch, observed with the first token;
- inter-token latency: gap between consecutive token-carrying outputs divided by the tokens
  it carried, observed once per token (a speculative step delivers several at once);
- TPOT: ``(e2e - ttft) / (output tokens - 1)`` per request with at least two tokens;
- e2e: arrival to the finishing output.

Latency histograms cover requests that finished normally (``stop``/``length``);
``request_success{finished_reason}`` counts every ending: ``stop``, ``length``, ``error``, and
``abort`` (client disconnect, timeout). A stop string the HTTP layer found is a ``stop``: the
layer tells the engine (``EngineClient.finish``) before closing the stream. ``prompt_tokens``
counts a prompt once its prefill ran; ``generation_tokens`` counts tokens handed to the caller.
"""

from __future__ import annotations

from typing import Any, Callable

from cosine_ray.metrics.registry import MetricsRegistry

COMPLETED = ("stop", "length")


class RequestTimeline:
    def __init__(self, metrics: MetricsRegistry, clock: Callable[[], float], request: Any) -> None:
        """``request`` is the engine's Request (``arrival_time``, ``admitted_time``,
        ``prompt_token_ids``), read when outputs arrive."""
        self.metrics = metrics
        self.clock = clock
        self.request = request
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_output_tokens = 0
        self.is_finished = False

    def observe(self, new_token_ids: list[int], finished: bool, finish_reason: str | None) -> None:
        """One output handed to the caller."""
        now = self.clock()
        n = len(new_token_ids)
        if n:
            arrival = self.request.arrival_time
            if self.first_token_time is None:
                self.first_token_time = now
                self.metrics.observe("cosine_ray:time_to_first_token_seconds", now - arrival)
                admitted = self.request.admitted_time
                if admitted is not None:
                    self.metrics.observe("cosine_ray:request_queue_time_seconds", admitted - arrival)
                self.metrics.inc("cosine_ray:prompt_tokens", len(self.request.prompt_token_ids))
            else:  # no gap is measured for the first output's tokens
                per_token = (now - self.last_token_time) / n
                for _ in range(n):
                    self.metrics.observe("cosine_ray:inter_token_latency_seconds", per_token)
            self.last_token_time = now
            self.num_output_tokens += n
            self.metrics.inc("cosine_ray:generation_tokens", n)
        if finished:
            self.finish(finish_reason or "error", now)

    def finish(self, reason: str, now: float | None = None) -> None:
        """The request ended (idempotent)."""
        if self.is_finished:
            return
        self.is_finished = True
        now = self.clock() if now is None else now
        self.metrics.inc("cosine_ray:request_success", finished_reason=reason)
        if reason not in COMPLETED:
            return
        e2e = now - self.request.arrival_time
        self.metrics.observe("cosine_ray:e2e_request_latency_seconds", e2e)
        if self.first_token_time is not None and self.num_output_tokens > 1:
            ttft = self.first_token_time - self.request.arrival_time
            self.metrics.observe("cosine_ray:time_per_output_token_seconds",
                                 (e2e - ttft) / (self.num_output_tokens - 1))
