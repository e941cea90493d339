"""Fakes for the OpenAI app's in-process tests: an engine client that records what it is asked,
and tokenizers that need no model."""

from __future__ import annotations

import asyncio
from typing import Any

from cosine_ray.engine.request import RequestOutput
from cosine_ray.metrics.registry import MetricsRegistry


class IdTokenizer:
    """Decodes token id i as ``<i>``; no chat template."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


class RecordingEngine:
    """EngineClient fake. Each request streams token 5, one per output, ``max_tokens`` of them
    (or without end with ``endless``), after ``gate`` opens when one is set. Records the
    parameters of ``check_request`` and of each stream (and its tenant), the streams opened and closed, the outputs taken and every
    ``record_http`` push, which it folds into a real ``MetricsRegistry`` (what ``/metrics``
    renders); ``refusal``: the ValueError text ``check_request`` raises."""

    model_name, max_model_len, vocab_size = "fake", 4096, 64

    def __init__(self, *, gate: bool = False, endless: bool = False, refusal: str | None = None) -> None:
        self.gate = asyncio.Event() if gate else None
        self.endless = endless
        self.refusal = refusal
        self.checked: list[Any] = []
        self.streamed: list[Any] = []
        self.tenants: list[Any] = []
        """The ``tenant`` of each stream (``engine.request.Tenant``)."""
        self.num_open = self.num_closed = self.num_outputs = 0
        self.pushes: list[tuple[str, dict]] = []
        self.snapshots = 0
        self.metrics = MetricsRegistry()

    async def check_request(self, prompt_token_ids, params) -> None:
        self.checked.append(params)
        if self.refusal is not None:
            raise ValueError(self.refusal)

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        self.num_open += 1
        self.streamed.append(params)
        self.tenants.append(tenant)
        try:
            if self.gate is not None:
                await self.gate.wait()
            i = 0
            while self.endless or i < params.max_tokens:
                i += 1
                self.num_outputs += 1
                done = not self.endless and i == params.max_tokens
                yield RequestOutput(request_id, [5], done, "length" if done else None)
                await asyncio.sleep(0)
        finally:
            self.num_closed += 1

    async def health(self) -> dict[str, Any]:
        return {"status": "ok"}

    async def metrics_snapshot(self, http=None) -> dict[str, Any]:
        self.snapshots += 1
        if http is not None:
            self.metrics.add_http_totals(*http)
        return self.metrics.snapshot()

    def record_http(self, replica: str, totals: dict) -> None:
        self.pushes.append((replica, totals))
        self.metrics.add_http_totals(replica, totals)


class PromptEngine:
    """EngineClient fake whose outputs are a fixed function of the prompt, so each choice of a
    batch can be checked against the same prompt sent alone: token k of the answer to ``prompt``
    is ``(7 · prompt[-1] + len(prompt) + 3k) mod vocab``; its log-probability and the prompt's
    are fixed functions of token and position (``prompt_logprob``), sent when asked. Records every
    ``check_request`` and stream (prompt, params, request id) and how many streams were closed;
    ``refuse``: prompts (as tuples) ``check_request`` refuses with a ValueError."""

    model_name, max_model_len, vocab_size = "prompt-table", 512, 256

    def __init__(self, refuse: tuple[tuple[int, ...], ...] = ()) -> None:
        self.refuse = set(refuse)
        self.checked: list[tuple[list[int], Any]] = []
        self.streams: list[tuple[list[int], Any, str]] = []
        self.num_closed = 0

    def answer(self, prompt: list[int], n: int) -> list[int]:
        return [(7 * prompt[-1] + len(prompt) + 3 * k) % self.vocab_size for k in range(n)]

    @staticmethod
    def prompt_logprob(token: int, position: int) -> float:
        return -((31 * token + position) % 97) / 10

    async def check_request(self, prompt_token_ids, params) -> None:
        self.checked.append((list(prompt_token_ids), params))
        if tuple(prompt_token_ids) in self.refuse:
            raise ValueError("max_tokens plus the prompt exceed what the engine serves")

    async def stream(self, prompt_token_ids, params, request_id, every_s=0.0, tenant=None):
        from cosine_ray.algo.logits_rules import TokenLogprob

        prompt = list(prompt_token_ids)
        self.streams.append((prompt, params, request_id))
        try:
            prompt_lps = None
            if params.prompt_logprobs is not None:
                prompt_lps = (None,) + tuple(TokenLogprob(t, self.prompt_logprob(t, j))
                                             for j, t in enumerate(prompt[1:], 1))
            for k, token in enumerate(self.answer(prompt, params.max_tokens)):
                done = k == params.max_tokens - 1
                lps = None if params.logprobs is None else (TokenLogprob(token, -0.5 - k / 100, ((token, -0.5 - k / 100),)),)
                yield RequestOutput(request_id, [token], done, "length" if done else None, logprobs=lps,
                                    prompt_logprobs=prompt_lps if k == 0 else None)
                await asyncio.sleep(0)
        finally:
            self.num_closed += 1
