"""The ingress reads the engine's stream as fast as it comes and merges what its caller has not
taken yet: a slow client leaves one pending output, not a Ray stream buffered an item a step
(stand-in for Serve's streaming handle, as in ``test_engine_client.py``)."""

from __future__ import annotations

import asyncio

from cosine_ray.algo.logits_rules import TokenLogprob
from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.runtime.engine_client import ACCEPTED, RayEngineClient


class _Stream:
    def __init__(self, items: list) -> None:
        self.items = list(items)
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        await asyncio.sleep(0)
        return self.items.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream
        self.args = None

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args):
        self.args = args
        return self.stream


def test_a_slow_reader_leaves_one_merged_output_and_the_stream_is_drained():
    outputs = [RequestOutput("r", [i], i == 39, "length" if i == 39 else None, 2, i + 1,
                             logprobs=(TokenLogprob(i, -0.5),)) for i in range(40)]
    stream = _Stream([ACCEPTED, *outputs])
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
