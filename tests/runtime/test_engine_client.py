"""RayEngineClient's deadlines, against a stand-in for Serve's streaming handle (plumbing only:
the engine-kill tests in tests/serve/test_reliability_serve.py show the same through the real
Serve proxy, when the timing lands a request's call between the kill and the new replica)."""

from __future__ import annotations

import asyncio
import time

from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.runtime.engine_client import ACCEPTED, ALIVE, RayEngineClient, coalesced, with_heartbeats


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
        self.aborted: list[str] = []
        """Request ids of the ``abort`` calls that reached the engine."""

    def options(self, **_):
        return self

    @property
    def abort(self):
        handle = self

        class Method:
            @staticmethod
            async def remote(request_id: str) -> bool:
                handle.aborted.append(request_id)
                return False

        return Method

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


def test_closing_a_stream_early_also_aborts_the_request_by_id():
    """Serve's cancellation is best effort: the client aborts the id too, with its own
    deadline, and only for a stream that did not finish."""
    handle = _Handle(_Stream([(0.0, ACCEPTED)] + [(0.0, RequestOutput("r", [5], False))] * 5))
    client = RayEngineClient(handle, model_name="m", max_model_len=64, vocab_size=10, call_timeout_s=1.0)

    async def main():
        stream = client.stream([1, 2], SamplingParams(max_tokens=8), "r")
        await stream.__anext__()
        await stream.aclose()  # the client went away
        await asyncio.sleep(0.05)  # the abort runs in the background
        return list(handle.aborted)

    assert asyncio.run(main()) == ["r"] and handle.stream.cancelled
    finished = _Handle(_Stream([(0.0, ACCEPTED), (0.0, RequestOutput("r", [6], True, "length"))]))
    client.handle = finished

    async def to_the_end():
        outs = [out async for out in client.stream([1, 2], SamplingParams(max_tokens=1), "r")]
        await asyncio.sleep(0.05)
        return outs

    assert len(asyncio.run(to_the_end())) == 1 and finished.aborted == [] and not finished.stream.cancelled


def test_a_slow_reader_leaves_one_merged_output_and_the_stream_is_drained():
    """The engine's stream is read as fast as it comes and what the caller has not taken yet is
    merged: a slow client leaves one pending output, not a Ray stream buffered an item a step."""
    outputs = [RequestOutput("r", [i], i == 39, "length" if i == 39 else None, 2, i + 1,
                             logprobs=(TokenLogprob(i, -0.5),)) for i in range(40)]
    stream = _Stream([(0.0, ACCEPTED), *((0.0, out) for out in outputs)])
    client = RayEngineClient(_Handle(stream), model_name="m", max_model_len=64, vocab_size=64)

    async def main():
        it = client.stream([1, 2], SamplingParams(max_tokens=40, logprobs=0), "r")
        first = await it.__anext__()
        await asyncio.sleep(0.05)  # the client does not read: the engine's items keep coming
        left_unread = len(stream.items)
        rest = [out async for out in it]
        return first, left_unread, rest

    first, left_unread, rest = asyncio.run(main())
    assert first.new_token_ids == [0] and left_unread == 0
    assert len(rest) == 1, [o.new_token_ids for o in rest]
    merged = rest[0]
    assert merged.new_token_ids == list(range(1, 40)) and merged.finished and merged.finish_reason == "length"
    assert [lp.token_id for lp in merged.logprobs] == list(range(1, 40)) and merged.num_output_tokens == 40
    assert not stream.cancelled


def test_an_accepted_stream_that_goes_silent_ends_with_an_error_heartbeats_keep_it_open():
    """After ACCEPTED the engine sends outputs or ALIVE; a stream silent for token_timeout_s
    lost its engine even if Ray never says so. Heartbeats are not outputs."""
    silent = _Stream([(0.0, ACCEPTED), (0.0, RequestOutput("r", [5], False))])  # then nothing, ever
    outs, waited = _run(silent, call_timeout_s=0.2, token_timeout_s=0.5)
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([5], None), ([], "error")]
    assert waited < 5.0 and silent.cancelled
    beating = _Stream([(0.0, ACCEPTED)] + [(0.2, ALIVE)] * 6 + [(0.2, RequestOutput("r", [6], True, "length"))])
    outs, waited = _run(beating, call_timeout_s=0.2, token_timeout_s=0.5)  # 1.4 s in all, no gap of 0.5 s
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([6], "length")] and waited > 1.0
    assert not beating.cancelled


def test_with_heartbeats_fills_silences_and_closing_it_closes_the_source():
    closed = []

    async def source():
        try:
            yield 1
            await asyncio.sleep(0.35)
            yield 2
            await asyncio.sleep(3600)  # a request still queued when its caller leaves
            yield 3
        finally:
            closed.append(True)

    async def main():
        beats = with_heartbeats(source(), every_s=0.1)
        got = [await beats.__anext__()]
        while got[-1] != 2:
            got.append(await beats.__anext__())
        got.append(await beats.__anext__())  # a beat while the source waits
        await beats.aclose()
        return got

    got = asyncio.run(main())
    assert got[0] == 1 and got[-1] == ALIVE and got.count(ALIVE) >= 3 and set(got) == {1, 2, ALIVE}, got
    assert closed == [True]


class _Outputs:
    """An engine's outputs for one request, one per ``tick`` of a fake clock; records its close."""

    def __init__(self, outs: list[RequestOutput], clock: list[float], tick: float) -> None:
        self.outs, self.clock, self.tick, self.closed = outs, clock, tick, False

    async def gen(self):
        try:
            for out in self.outs:
                self.clock[0] += self.tick
                yield out
        finally:
            self.closed = True


def _lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5, ())


def _coalesce(outs: list[RequestOutput], every_s: float, tick: float) -> tuple[list[RequestOutput], _Outputs]:
    clock = [0.0]
    source = _Outputs(outs, clock, tick)

    async def main():
        return [o async for o in coalesced(source.gen(), every_s, clock=lambda: clock[0])]

    return asyncio.run(main()), source


def test_outputs_are_merged_to_one_per_interval_and_the_last_goes_at_once():
    outs = [RequestOutput("r", [t], False, num_output_tokens=t, logprobs=(_lp(t),),
                          prompt_logprobs=(None, _lp(9)) if t == 1 else None) for t in range(1, 8)]
    outs.append(RequestOutput("r", [8, 9], True, "length", num_output_tokens=9, logprobs=(_lp(8), _lp(9))))
    merged, source = _coalesce(outs, every_s=0.1, tick=0.03)  # a step every 30 ms: 4 steps an item
    assert [o.new_token_ids for o in merged] == [[1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert [o.finished for o in merged] == [False, True] and merged[-1].finish_reason == "length"
    assert [lp.token_id for o in merged for lp in o.logprobs] == list(range(1, 10))
    assert merged[0].prompt_logprobs == (None, _lp(9)) and merged[1].prompt_logprobs is None
    assert [o.num_output_tokens for o in merged] == [4, 9] and source.closed


def test_no_interval_passes_every_output_through():
    outs = [RequestOutput("r", [t], t == 3, "stop" if t == 3 else None) for t in (1, 2, 3)]
    merged, _ = _coalesce(outs, every_s=0.0, tick=0.001)
    assert merged == outs


def test_closing_the_merged_stream_closes_the_engines():
    """The client went away: the engine's generator is closed, which aborts the request."""
    clock = [0.0]
    source = _Outputs([RequestOutput("r", [t], False) for t in range(100)], clock, 0.2)

    async def main():
        merged = coalesced(source.gen(), 0.1, clock=lambda: clock[0])
        first = await merged.__anext__()
        await merged.aclose()
        return first

    assert asyncio.run(main()).new_token_ids == [0] and source.closed
