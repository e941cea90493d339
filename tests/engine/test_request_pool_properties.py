"""Property test: the core's request pool as a state machine.

Hypothesis drives arbitrary sequences of add / abort / step (including aborts of unknown,
waiting, running and already finished ids, and aborts between a step's start and its end)
against a ``EngineCore`` over the KV-protocol-checking ``TableTarget`` (tests/support/fakes.py)
and drafters. After every operation:

* every request is in exactly one place (waiting, running or finished) and the batch bound holds;
* ``abort`` answers True exactly for a waiting or running request;
* the target holds KV only for requests the core still tracks (running or to release);
* no output arrives for a request after its abort or after its final output.

After draining: no KV and no speculative level left on the target, no request released twice,
nothing left in routing, scheduling or the gain model, and every request that ran to the end produced exactly the
target's greedy continuation (abort traffic never changes anyone else's text).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.core import EngineCore

from support.factories import engine_config
from support.fakes import PROMPTS, VOCAB, FakeDrafter, OracleDrafter, TableTarget  # noqa: E402

MAX_BATCH = 3

ops_st = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("abort_mid_step"), st.integers(0, 20), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
), max_size=40)


class YieldingTarget(TableTarget):
    """Scoring takes a loop turn, so an abort can land while a step is in flight."""

    async def score(self, items):
        await asyncio.sleep(0)
        return await super().score(items)


class Model:
    """What the pool should look like."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.prompt: dict[str, list[int]] = {}
        self.max_tokens: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()


def check_invariants(core: EngineCore, target: TableTarget, model: Model) -> None:
    waiting = [r.request_id for r in core.waiting]
    running = list(core.running)
    assert len(waiting) == len(set(waiting)) and not set(waiting) & set(running)
    assert len(running) <= MAX_BATCH
    for rid in model.ids:
        places = (rid in waiting) + (rid in running) + (rid in model.finished | model.aborted)
        assert places == 1, f"{rid} is in {places} places"
    tracked = set(running) | set(core.pool.to_release)
    assert set(target.committed) <= tracked, f"KV held for untracked requests: {set(target.committed) - tracked}"


async def run_ops(ops, target: TableTarget, drafters) -> tuple[EngineCore, Model]:
    core = EngineCore(engine_config(max_num_seqs=MAX_BATCH, num_speculative_tokens=4, fusion="union",
                                 scheduler="fcfs", adaptive=False, drafters_per_request=2),
                    target, drafters, vocab_size=VOCAB)
    model = Model()

    def absorb(outputs, dropped: frozenset[str] = frozenset()) -> None:
        for out in outputs:
            rid = out.request_id
            if rid in dropped:  # computed before its abort landed: the engine loop drops it
                assert not out.finished
                continue
            assert rid not in model.aborted, f"output for aborted {rid}"
            assert rid not in model.finished, f"output after the final one for {rid}"
            model.tokens[rid].extend(out.new_token_ids)
            if out.finished:
                assert out.finish_reason in ("length", "stop"), out
                model.finished.add(rid)

    def abort(index: int) -> None:
        rid = model.ids[index % len(model.ids)] if model.ids else "never-added"
        expected = rid in model.ids and rid not in model.finished and rid not in model.aborted
        assert core.abort(rid) is expected, rid
        if expected:
            model.aborted.add(rid)

    for op, a, b in ops:
        if op == "add":
            rid = f"r{len(model.ids)}"
            core.add_request(rid, PROMPTS[a], SamplingParams(max_tokens=b))
            model.ids.append(rid)
            model.prompt[rid], model.max_tokens[rid], model.tokens[rid] = PROMPTS[a], b, []
        elif op == "abort":
            abort(a)
        elif op == "abort_mid_step":  # the abort lands while the target is scoring
            task = asyncio.ensure_future(core.step())
            await asyncio.sleep(0)
            rid = model.ids[a % len(model.ids)] if model.ids else "never-added"
            expected = rid in model.ids and rid not in model.finished and rid not in model.aborted
            if core.abort(rid):
                assert expected, rid
                model.aborted.add(rid)
                absorb(await task, frozenset({rid}))
            else:
                absorb(await task)
                assert not expected, f"abort refused {rid}, which was live"
        else:
            absorb(await core.step())
        check_invariants(core, target, model)
    for _ in range(2000):  # drain
        if not core.has_work:
            break
        absorb(await core.step())
        check_invariants(core, target, model)
    assert not core.has_work
    return core, model


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops_st)
def test_add_abort_finish_sequences_never_leak_or_double_release(ops):
    target = YieldingTarget()
    oracle, empty = OracleDrafter("oracle", target, max_len=3), FakeDrafter("empty")
    core, model = asyncio.run(run_ops(ops, target, [oracle, empty]))
    assert target.committed == {} and target.last == {}, "KV left on the target after draining"
    released = Counter(target.released)
    assert all(n == 1 for n in released.values()), f"released twice: {released}"
    assert set(target.scored) <= set(released), "a request that got KV was never released"
    for drafter in (oracle, empty):
        assert all(n == 1 for n in Counter(drafter.released).values())
    assert model.finished | model.aborted == set(model.ids)
    for rid in model.finished:
        assert model.tokens[rid] == target.greedy(model.prompt[rid], model.max_tokens[rid]), rid
    # routing vectors, scheduling history and gain predictions live on the Request: none may
    # still be referenced by the engine (pool, release queue, twins)
    assert core.num_tracked_requests == 0, "request state left behind"
