"""RayEngineClient's failover against a stand-in for Serve's handle with several engine
replicas (plumbing: tests/serve/test_engine_replicas.py kills a real replica mid-stream), and the
engine router's choice of a home replica."""

from __future__ import annotations

import asyncio
import types
from typing import Any

from ray.serve.request_router import PendingRequest

from cosine_ray.engine.request import RequestOutput, SamplingParams
from cosine_ray.runtime.engine_client import ACCEPTED, Accepted, RayEngineClient
from cosine_ray.runtime.engine_router import PREFIX_TOKENS, PrefixAffinityRouter, home_order, prefix_key


class _Died(Exception):
    """What a call to a replica that died raises (Ray's ActorDiedError in a real handle)."""


class _Attempt:
    """One streaming call: its items, then (``dies``) the replica's death."""

    def __init__(self, items: list[Any], dies: bool) -> None:
        self.items, self.dies, self.cancelled = list(items), dies, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.items:
            return self.items.pop(0)
        if self.dies:
            raise _Died("the replica died")
        await asyncio.sleep(3600)

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """Hands out ``attempts`` in turn and records each call's arguments."""

    def __init__(self, attempts: list[_Attempt]) -> None:
        self.attempts = list(attempts)
        self.calls: list[tuple[tuple, dict]] = []
        self.aborted: list[tuple[str, dict]] = []
        self.finished: list[tuple[str, dict]] = []

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.attempts.pop(0)

    def _recorder(self, into: list):
        class Method:
            @staticmethod
            async def remote(request_id: str, **kwargs) -> bool:
                into.append((request_id, kwargs))
                return True

        return Method

    @property
    def abort(self):
        return self._recorder(self.aborted)

    @property
    def finish(self):
        return self._recorder(self.finished)


def out(tokens: list[int], done: bool = False) -> RequestOutput:
    return RequestOutput("r", tokens, done, "length" if done else None)


def collect(client: RayEngineClient, max_tokens: int = 6) -> list[RequestOutput]:
    async def main():
        outs = [o async for o in client.stream([1, 2, 3], SamplingParams(max_tokens=max_tokens), "r")]
        await asyncio.sleep(0.05)  # the explicit aborts run in the background
        return outs

    return asyncio.run(main())


def test_a_stream_whose_replica_dies_goes_on_elsewhere_from_its_tokens():
    handle = _Handle([_Attempt([Accepted("a"), out([10, 11]), out([12])], dies=True),
                      _Attempt([Accepted("b"), out([13, 14]), out([15], True)], dies=False)])
    client = RayEngineClient(handle, model_name="m", max_model_len=64, vocab_size=64, failover_attempts=3)
    outs = collect(client)
    assert [t for o in outs for t in o.new_token_ids] == [10, 11, 12, 13, 14, 15]  # none repeated, none lost
    assert all(o.error is None for o in outs) and outs[-1].finished
    (first, first_kw), (second, second_kw) = handle.calls
    assert first[2] == "r" and first_kw == {}
    assert second[0] == [1, 2, 3] and second[2] == "r~1" and second_kw == {"resume_token_ids": (10, 11, 12)}
    assert handle.aborted == [("r", {"engine_replica": "a"})]  # the lost call, on the replica it ran on


def test_attempts_are_bounded_and_one_replica_keeps_the_fail_fast_contract():
    dying = [_Attempt([Accepted(f"x{i}"), out([i])], dies=True) for i in range(5)]
    handle = _Handle(dying)
    client = RayEngineClient(handle, model_name="m", max_model_len=64, vocab_size=64, failover_attempts=2)
    outs = collect(client, max_tokens=10)
    assert [t for o in outs for t in o.new_token_ids] == [0, 1, 2]
    assert outs[-1].finish_reason == "error" and outs[-1].error == "engine unavailable: _Died"
    assert len(handle.calls) == 3  # the first call and two resubmissions
    single = _Handle([_Attempt([ACCEPTED, out([7])], dies=True), _Attempt([ACCEPTED, out([8], True)], dies=False)])
    outs = collect(RayEngineClient(single, model_name="m", max_model_len=64, vocab_size=64))
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([7], None), ([], "error")]
    assert len(single.calls) == 1


def test_a_first_call_no_replica_accepts_in_time_is_not_resubmitted():
    """No replica up at admission: the 503 of one replica, within the call deadline."""
    handle = _Handle([_Attempt([], dies=False), _Attempt([Accepted("b"), out([1], True)], dies=False)])
    client = RayEngineClient(handle, model_name="m", max_model_len=64, vocab_size=64, call_timeout_s=0.2,
                             failover_attempts=3)
    outs = collect(client)
    assert [(o.finish_reason, o.error) for o in outs] == [("error", "engine unavailable: TimeoutError")]
    assert len(handle.calls) == 1


def test_finish_goes_to_the_replica_and_id_the_stream_runs_under():
    handle = _Handle([_Attempt([Accepted("a"), out([10])], dies=True),
                      _Attempt([Accepted("b"), out([11])], dies=False)])
    client = RayEngineClient(handle, model_name="m", max_model_len=64, vocab_size=64, failover_attempts=1)

    async def main():
        it = client.stream([1, 2], SamplingParams(max_tokens=8), "r")
        got = [await it.__anext__(), await it.__anext__()]
        assert client.replica_of("r") == "b"
        await client.finish("r")
        await it.aclose()
        return got

    got = asyncio.run(main())
    assert [o.new_token_ids for o in got] == [[10], [11]]
    assert handle.finished == [("r~1", {"engine_replica": "b"})]
    assert client.replica_of("r") is None


def test_a_prefix_has_one_home_and_a_replica_that_leaves_moves_only_its_own_prefixes():
    replicas = ["r1", "r2", "r3"]
    system = list(range(100, 100 + PREFIX_TOKENS))
    homes = {home_order(prefix_key(system + [q, q + 1]), replicas)[0] for q in range(20)}
    assert len(homes) == 1  # every question after one system prompt: one replica
    keys = [prefix_key([p] * PREFIX_TOKENS) for p in range(200)]
    before = {k: home_order(k, replicas)[0] for k in keys}
    assert {"r1", "r2", "r3"} == set(before.values())  # prefixes spread over the replicas
    after = {k: home_order(k, ["r1", "r3"])[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r2")


class _Replica:
    def __init__(self, unique_id: str) -> None:
        self.replica_id = types.SimpleNamespace(unique_id=unique_id)


class _Loads:
    def __init__(self, loads: dict[str, int]) -> None:
        self.loads = loads

    def get(self, replica_id) -> int | None:
        return self.loads.get(replica_id.unique_id)


def choose(loads: dict[str, int], method: str, args: list, kwargs: dict | None = None) -> list[list[str]]:
    """``PrefixAffinityRouter.choose_replicas`` over replicas r1..r3 with these queue lengths."""
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # Serve's own state is not needed here
    router._replica_queue_len_cache = _Loads(loads)
    router.initialize_state(imbalance=4)

    async def main():  # a PendingRequest makes its future on the running loop
        request = PendingRequest(args=args, kwargs=kwargs or {}, metadata=types.SimpleNamespace(call_method=method))
        return await router.choose_replicas([_Replica(r) for r in ("r1", "r2", "r3")], request)

    ranks = asyncio.run(main())
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_the_router_ranks_a_prefix_home_first_unless_it_is_overloaded_and_pins_named_calls():
    prompt = list(range(40))
    home = home_order(prefix_key(prompt), ["r1", "r2", "r3"])[0]
    ranks = choose({}, "generate", [prompt, None, "id"])
    assert ranks[0] == [home] and len(ranks[1]) == 2 and home not in ranks[1]
    loaded = {"r1": 0, "r2": 0, "r3": 0, home: 5}  # 5 more than the least loaded > 4
    ranks = choose(loaded, "generate", [prompt, None, "id"])
    assert len(ranks) == 1 and len(ranks[0]) == 2  # two random choices, the home among the candidates
    assert choose(loaded, "abort", ["id"], {"engine_replica": "r2"}) == [["r2"]]
    assert len(choose({}, "abort", ["id"], {"engine_replica": "gone"})[0]) == 2  # its replica died: any
    assert len(choose({}, "health", [])[0]) == 2


def test_engine_replicas_become_the_engine_deployments_serve_settings():
    """One replica: the deployment as before (Serve's own router); N: N replicas and our router;
    MIN,MAX: Serve's autoscaling on the engine's batch of ongoing requests (Serve validates them)."""
    from cosine_ray.serve.app import build_app

    def engine_settings(replicas):
        app = build_app({"allow_unauthenticated": True, "cluster": {"engine_replicas": replicas}})
        config = app._bound_deployment.init_args[0]._bound_deployment._deployment_config
        scaling = config.autoscaling_config
        return (scaling.initial_replicas if scaling else config.num_replicas,
                scaling and (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests),
                config.request_router_config.request_router_class.rsplit(".", 1)[-1].rsplit(":", 1)[-1])

    assert engine_settings(1) == (1, None, "PowerOfTwoChoicesRequestRouter")
    assert engine_settings(2) == (2, None, "PrefixAffinityRouter")
    assert engine_settings("auto") == (1, (1, 4, 8), "PrefixAffinityRouter")
    assert engine_settings("2,3") == (2, (2, 3, 8), "PrefixAffinityRouter")
