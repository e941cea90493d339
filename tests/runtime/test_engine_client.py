"""RayEngineClient's deadlines, against a stand-in for Serve's streaming handle (plumbing only:
the engine-kill tests in tests/serve/test_reliability_serve.py show the same through the real
Serve proxy, when the timing lands a request's call between the kill and the new replica)."""

from __future__ import annotations

import asyncio
import time

from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.runtime.engine_client import ACCEPTED, RayEngineClient


class _Stream:
    """What ``handle.options(stream=True).generate.remote(...)`` returns: items after delays."""

    def __init__(self, items: list[tuple[float, object]]) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            await asyncio.sleep(3600)  # Serve holding a call that no replica has taken
        delay, item = self.items.pop(0)
        await asyncio.sleep(delay)
        return item

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *_):
        return self.stream


def _run(stream: _Stream, *, call_timeout_s: float, token_timeout_s: float) -> tuple[list[RequestOutput], float]:
    client = RayEngineClient(_Handle(stream), model_name="m", max_model_len=64, vocab_size=10,
                             token_timeout_s=token_timeout_s, call_timeout_s=call_timeout_s)

    async def main():
        start = time.monotonic()
        outs = [out async for out in client.stream([1, 2], SamplingParams(max_tokens=2), "r")]
        return outs, time.monotonic() - start

    return asyncio.run(main())


def test_a_call_no_replica_takes_ends_with_an_error_after_the_call_deadline():
    stream = _Stream([])  # nothing ever arrives, not even ACCEPTED
    outs, waited = _run(stream, call_timeout_s=0.2, token_timeout_s=30.0)
    assert waited < 5.0, waited  # the call deadline, not token_timeout_s
    assert [(o.finished, o.finish_reason) for o in outs] == [(True, "error")]
    assert outs[0].error == "engine unavailable: TimeoutError"
    assert stream.cancelled


def test_after_accepted_a_slow_first_token_waits_for_the_token_deadline():
    stream = _Stream([(0.0, ACCEPTED), (0.6, RequestOutput("r", [5], False)), (0.0, RequestOutput("r", [6], True, "length"))])
    outs, _ = _run(stream, call_timeout_s=0.2, token_timeout_s=30.0)  # queued in the engine 0.6 s > 0.2 s
    assert [(o.new_token_ids, o.finished, o.error) for o in outs] == [([5], False, None), ([6], True, None)]
    assert not stream.cancelled


def test_a_stream_that_does_not_begin_with_accepted_is_an_error():
    stream = _Stream([(0.0, RequestOutput("r", [5], True, "length"))])
    outs, _ = _run(stream, call_timeout_s=0.2, token_timeout_s=30.0)
    assert [(o.finished, o.finish_reason, o.error) for o in outs] == [(True, "error", "engine unavailable: RuntimeError")]
