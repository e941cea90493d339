"""The Ray runtime on a real local cluster: the engine deployment, pipeline stage actors,
drafter actors.

Tiny random-weight model with SmolLM2's tokenizer (vocab 49152; N(0, 0.2) weights leave no
near-ties, so greedy outputs must match exactly). One local Ray cluster for the session
(``ray_cluster``, see conftest.py) and one Serve application per pipeline depth S (the engine
deployment owns its stages and drafters; deploying S=3 after S=1 replaces the engine and its
actors). The tests talk to the engine through its ``DeploymentHandle`` (``RayEngineClient``,
what the ingress uses). Tests run in file order: S=1, S=3, then S=2 for everything else
(names, drafter and stage faults, cancellation, concurrency). Every wait has a deadline: a hang
fails the test.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import pytest
import torch

ray = pytest.importorskip("ray")

from ray import serve  # noqa: E402

from cosine_ray.engine.config import EngineConfig, parse_drafters  # noqa: E402
from cosine_ray.engine.local import LocalEngine, encode_prompt  # noqa: E402
from cosine_ray.engine.request import RequestOutput, SamplingParams  # noqa: E402
from cosine_ray.runtime.cluster import NAMESPACE, actor_name  # noqa: E402
from cosine_ray.runtime.engine_client import RayEngineClient  # noqa: E402
from support.engine_app import deploy, engine_call, engine_handle, engine_replicas  # noqa: E402
from support.hf_reference import hf_greedy  # noqa: E402
from support.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model]

MAX_TOKENS = 40
LONG_MAX_TOKENS = 300
"""Fault tests: long enough that the kill lands mid-generation."""
GAMMA = 6
STAGE_RECOVERY_S = 120.0
"""A restarted stage actor re-imports torch and reloads its slice (~10-30 s here)."""
DRAFTERS = {1: "ngram", 2: "ngram,self", 3: "self"}
"""Per pipeline depth (fewer actors = faster start); S=2 hosts the fault tests: "self" (the
target drafting for itself) always proposes, so "its drafts are routed again" is observable."""
SELF_DRAFTER = actor_name("drafter", 1)
MIN_TREE_CONFIDENCE = 0.0
"""Verify every draft node: the tiny random model's own (self-drafter) probabilities are mostly
below the default threshold, and these tests need trees in flight across the stages."""

CHAT_TEXTS = [
    "Write a haiku about the sea.",
    "List the planets of the solar system, in order.",
    "Repeat after me: one two three, one two three, one two three.",
    "Explain recursion to a five year old.",
]


def _timed(label: str, start: float) -> None:
    print(f"[ray-cluster] {label}: {time.perf_counter() - start:.1f} s", flush=True)


# ---- references --------------------------------------------------------------------------------

@dataclass
class Tiny:
    ckpt: Any
    tokenizer: Any
    prompts: list[list[int]]
    """8 prompts: 4 chat-templated texts and 4 raw token-id lists."""
    refs: list[list[int]]
    """HF greedy, MAX_TOKENS each."""
    long_prompt: list[int]
    long_ref: list[int]
    """HF greedy, LONG_MAX_TOKENS."""
    long_ref3: list[int]
    """HF greedy of prompts[3], LONG_MAX_TOKENS."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, real_checkpoint) -> Tiny:
    start = time.perf_counter()
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("ray-tiny") / "tiny-smollm2",
                                 tokenizer_from=real_checkpoint, seed=7)
    tok = ckpt.load_tokenizer()
    g = torch.Generator().manual_seed(99)
    vocab = ckpt.config.vocab_size
    raw = [torch.randint(100, vocab, (n,), generator=g).tolist() for n in (5, 17, 33)]
    raw.append(list(range(1000, 1012)) * 4)  # repetitive: the n-gram drafter has matches
    prompts = [encode_prompt(tok, t) for t in CHAT_TEXTS] + raw
    hf = ckpt.load_hf_model()
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    long_prompt = encode_prompt(tok, "Tell me a very long story about a lighthouse keeper.")
    long_ref = hf_greedy(hf, long_prompt, LONG_MAX_TOKENS)
    long_ref3 = hf_greedy(hf, prompts[3], LONG_MAX_TOKENS)
    # the premise of exact comparison: the references run to max_tokens (no EOS)
    assert all(len(r) == MAX_TOKENS for r in refs) and len(long_ref) == len(long_ref3) == LONG_MAX_TOKENS
    _timed("tiny checkpoint + HF references", start)
    return Tiny(ckpt, tok, prompts, refs, long_prompt, long_ref, long_ref3)


# ---- engines ----------------------------------------------------------------------------------

def engine_config_data(tiny: Tiny, num_stages: int, *, stages_in_engine: bool = False) -> dict[str, Any]:
    return {"model": str(tiny.ckpt.path), "drafters": DRAFTERS[num_stages], "num_stages": num_stages,
            "scheduler": {"num_lanes": num_stages, "max_num_seqs": 8},
            "speculation": {"num_speculative_tokens": GAMMA},
            "runtime": {"stage_recovery_s": STAGE_RECOVERY_S},
            # fixed γ: the random tiny model's drafts are verified
            "experiments": {"min_tree_confidence": MIN_TREE_CONFIDENCE, "adaptive": False},
            "cluster": {"stage_deadline_s": 30.0, "drafters_in_engine": "none",  # every drafter an actor
                        "stages_in_engine": stages_in_engine}}


class Engines:
    """One Serve application at a time; deploying another S replaces the engine."""

    def __init__(self, tiny: Tiny) -> None:
        self.tiny = tiny
        self.deployed: tuple[int, bool] | None = None
        self.info: dict[str, Any] = {}
        self.client: RayEngineClient | None = None

    def get(self, num_stages: int, *, stages_in_engine: bool = False) -> tuple[dict[str, Any], RayEngineClient]:
        if self.deployed != (num_stages, stages_in_engine):
            start = time.perf_counter()
            self.deployed = None
            self.info = deploy(engine_config_data(self.tiny, num_stages, stages_in_engine=stages_in_engine))
            ENGINE_NAMESPACE["current"] = self.info["namespace"]
            self.client = RayEngineClient(engine_handle(), model_name=self.info["model"],
                                          max_model_len=self.info["max_model_len"],
                                          vocab_size=self.info["vocab_size"], token_timeout_s=180.0,
                                          call_timeout_s=30.0)
            self.deployed = (num_stages, stages_in_engine)
            where = " in the engine" if stages_in_engine else ""
            _timed(f"engine with {num_stages} stage(s){where} + drafters [{DRAFTERS[num_stages]}] ready", start)
        return self.info, self.client


@pytest.fixture(scope="module")
def engines(ray_cluster, tiny) -> Engines:
    pool = Engines(tiny)
    yield pool
    start = time.perf_counter()
    serve.shutdown()  # the session cluster's next user starts Serve with its own HTTP options
    _timed("Serve shut down", start)


@pytest.fixture
def engine2(engines):
    """The S=2 engine (ngram + self drafters), shared by every fault/concurrency test."""
    return engines.get(2)


# ---- helpers -----------------------------------------------------------------------------------

def run(coro: Awaitable, timeout_s: float = 240.0):
    """Run a test body with an overall deadline: nothing may hang."""
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout_s))


@dataclass
class Result:
    tokens: list[int]
    last: RequestOutput | None
    num_outputs: int
    elapsed_s: float


async def collect(client: RayEngineClient, prompt: list[int], max_tokens: int, *,
                  on_output: Callable[[int, RequestOutput], Awaitable[bool | None]] | None = None,
                  request_id: str | None = None) -> Result:
    """Stream one request; ``on_output(n, out)`` returning True closes the stream early."""
    start = time.perf_counter()
    tokens: list[int] = []
    last = None
    n = 0
    agen = client.stream(prompt, SamplingParams(max_tokens=max_tokens), request_id or uuid.uuid4().hex)
    try:
        async for out in agen:
            n += 1
            tokens.extend(out.new_token_ids)
            last = out
            if on_output is not None and await on_output(n, out):
                break
    finally:
        await agen.aclose()
    return Result(tokens, last, n, time.perf_counter() - start)


def is_idle(stats: dict[str, Any]) -> bool:
    return (stats["running"] == 0 and stats["waiting"] == 0
            and all(kv["requests"] == 0 and kv["tokens"] == 0 for kv in stats["kv"])
            and all(d.get("requests") == 0 for d in stats["drafters"].values()))


def endings(snapshot: dict) -> dict[str, float]:
    """Requests the engine ended, by finish reason (``cosine_ray:request_success``)."""
    return {dict(k)["finished_reason"]: v for k, v in snapshot.get("cosine_ray:request_success", {}).items()}


async def wait_endings(client: RayEngineClient, before: dict, n: int, timeout_s: float = 30.0) -> dict[str, float]:
    """The finish reasons counted since ``before`` once ``n`` more requests ended (or the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:  # the engine's generator ends (and counts) once Serve delivers the cancellation
        after = endings(await client.metrics_snapshot())
        delta = {r: after[r] - before.get(r, 0) for r in after if after[r] != before.get(r, 0)}
        if sum(delta.values()) >= n or time.monotonic() > deadline:
            return delta
        await asyncio.sleep(0.1)


async def wait_idle(client: RayEngineClient, timeout_s: float) -> dict[str, Any]:
    """Poll the engine's stats() until no state is held anywhere; the last stats if it never is."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await client.stats()
        if is_idle(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.1)


ENGINE_NAMESPACE: dict[str, str] = {}
"""The deployed engine's actor namespace (set by ``Engines.get``; read inside event loops too)."""


def actor(name: str):
    """A stage or drafter actor of the running engine (its own namespace)."""
    return ray.get_actor(name, namespace=ENGINE_NAMESPACE["current"])


def wait_actor_back(name: str, old_incarnation: str | None, timeout_s: float = 180.0) -> str:
    """Block until the named actor answers ping with a new incarnation."""
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            incarnation = ray.get(actor(name).ping.remote(), timeout=10)
            if incarnation != old_incarnation:
                return incarnation
        except Exception as exc:  # not registered yet / restarting / starting
            last_exc = exc
        time.sleep(0.5)
    raise AssertionError(f"actor {name} did not come back within {timeout_s} s (last error: {last_exc!r})")


def ping(name: str) -> str:
    return ray.get(actor(name).ping.remote(), timeout=60)


def our_named_actors() -> dict[str, str]:
    """name -> namespace of every live named actor whose name is ours."""
    return {a["name"]: a["namespace"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("cosine_ray:")}


# ---- (a) pipeline depth changes nothing ----------------------------------------------------------

def test_stages_in_the_engine_match_hf_greedy(engines, tiny):
    """``cluster.stages_in_engine``: the same two stages run inside the engine replica, one after
    another; the text is HF's greedy text, no stage actor exists, and the stages' busy time
    reaches the metrics."""
    info, client = engines.get(2, stages_in_engine=True)
    assert info["stages"] == [] and info["config"]["stages_in_engine"] is True
    prompts, refs = tiny.prompts[:4] + tiny.prompts[-1:], tiny.refs[:4] + tiny.refs[-1:]

    async def main():
        return await asyncio.gather(*(collect(client, p, MAX_TOKENS) for p in prompts))

    results = run(main(), 180)
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert res.tokens == ref, f"prompt {i}: stages in the engine differ from greedy"
        assert res.last.finish_reason == "length" and res.last.error is None
    stats = [r.last.stats for r in results]
    assert sum(s.accepted_by.get("self", 0) for s in stats) > 0  # the self drafter's actor drafted
    assert not any(name.startswith("cosine_ray:stage:") for name in our_named_actors())
    assert set(engine_call("actor_pids")) == {"engine", actor_name("drafter", 0), actor_name("drafter", 1)}
    idle = run(wait_idle(client, 5.0), 30)
    assert is_idle(idle) and len(idle["kv"]) == 2
    busy = run(client.metrics_snapshot(), 30)["cosine_ray:stage_busy_seconds"]
    assert len(busy) == 2 and all(v > 0 for v in busy.values())


@pytest.mark.parametrize("num_stages", [1, 3, 2])  # 2 last: the tests below reuse its engine
def test_pipeline_matches_local_engine_and_hf_greedy(engines, tiny, num_stages):
    _, client = engines.get(num_stages)
    prompts, refs = tiny.prompts[:4] + tiny.prompts[-1:], tiny.refs[:4] + tiny.refs[-1:]

    start = time.perf_counter()
    local = LocalEngine(EngineConfig(model=str(tiny.ckpt.path), drafters=parse_drafters(DRAFTERS[num_stages]), num_stages=num_stages).replace(
            num_speculative_tokens=GAMMA, max_num_seqs=8, min_tree_confidence=MIN_TREE_CONFIDENCE, adaptive=False),
                        checkpoint=tiny.ckpt)
    local_outs = local.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.new_token_ids for o in local_outs] == refs, "in-process engine differs from HF greedy"
    _timed(f"S={num_stages}: in-process LocalEngine reference", start)

    async def main():
        return await asyncio.gather(*(collect(client, p, MAX_TOKENS) for p in prompts))

    start = time.perf_counter()
    results = run(main(), 180)
    _timed(f"S={num_stages}: {len(prompts)} concurrent requests via Ray", start)
    for i, (res, ref) in enumerate(zip(results, refs)):
        assert res.tokens == ref, f"prompt {i}: Ray pipeline (S={num_stages}) differs from greedy"
        assert res.last.finished and res.last.finish_reason == "length" and res.last.error is None
        assert res.last.num_output_tokens == MAX_TOKENS
    stats = [r.last.stats for r in results]
    assert sum(s.num_draft_tokens for s in stats) > 0, "no drafts were verified at all"
    if "self" in DRAFTERS[num_stages]:  # the target drafting for itself is always right
        assert sum(s.accepted_by.get("self", 0) for s in stats) > 0
    assert is_idle(run(wait_idle(client, 5.0), 30))


# ---- (b) actor names ---------------------------------------------------------------------------

def test_actor_names_and_namespace(engine2):
    info, client = engine2
    expected = {actor_name("stage", 0), actor_name("stage", 1), actor_name("drafter", 0), actor_name("drafter", 1)}
    assert expected == {"cosine_ray:stage:0", "cosine_ray:stage:1", "cosine_ray:drafter:0", "cosine_ray:drafter:1"}
    namespace = info["namespace"]
    assert namespace == f"{NAMESPACE}.{info['engine_id']}" and NAMESPACE == "cosine_ray"
    # the S=3 engine's actors went with it (stage:2 is gone); only this engine's remain
    deadline = time.monotonic() + 30
    while (names := our_named_actors()).keys() != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    assert names == {n: namespace for n in expected}
    assert len(engine_replicas()) == 1
    assert info["stages"] == [actor_name("stage", 0), actor_name("stage", 1)]
    assert info["drafters"] == ["ngram", "self"]
    # the engine's handles are the named actors
    handles = engine_call("actor_handles")
    assert set(handles) == expected
    for name, h in handles.items():
        assert ray.get(h.ping.remote(), timeout=30) == ping(name)


# ---- (c) a drafter dies mid-generation -----------------------------------------------------------

@pytest.mark.parametrize("no_restart", [True, False], ids=["killed-for-good", "ray-restarts-it"])
def test_drafter_killed_mid_generation(engine2, tiny, no_restart):
    _, client = engine2
    before = run(client.stats(), 30)
    old = ping(SELF_DRAFTER)
    killed_at: list[int] = []

    async def kill_after_two(n: int, out: RequestOutput) -> None:
        if n == 2:
            ray.kill(actor(SELF_DRAFTER), no_restart=no_restart)
            killed_at.append(out.num_output_tokens)

    start = time.perf_counter()
    res = run(collect(client, tiny.long_prompt, LONG_MAX_TOKENS, on_output=kill_after_two), 240)
    _timed(f"drafter kill (no_restart={no_restart}): request done, {res.num_outputs} outputs", start)
    assert killed_at and killed_at[0] < LONG_MAX_TOKENS, "the kill did not land mid-generation"
    assert res.tokens == tiny.long_ref
    assert res.last.finish_reason == "length" and res.last.error is None

    stats = run(client.stats(), 60)
    print(f"[ray-cluster] stats after drafter kill: failures={stats['drafter_failures']} "
          f"respawns={stats['respawns']}", flush=True)
    assert stats["drafter_failures"].get("self", 0) > before["drafter_failures"].get("self", 0)
    respawned = stats["respawns"][SELF_DRAFTER] - before["respawns"][SELF_DRAFTER]
    if no_restart:  # Ray will not bring it back: the engine's slot spawned a new one
        assert respawned == 1
    else:  # Ray restarted it under the same handle
        assert respawned == 0
    for name in (actor_name("stage", 0), actor_name("stage", 1), actor_name("drafter", 0)):
        assert stats["respawns"][name] == before["respawns"][name]

    # the drafter is back and routed to again
    start = time.perf_counter()
    wait_actor_back(SELF_DRAFTER, old)
    _timed("drafter back", start)

    async def until_drafted_by_self() -> Result:
        for _ in range(30):  # its first calls may still be queued behind its start-up
            res = await collect(client, tiny.prompts[0], MAX_TOKENS)
            assert res.tokens == tiny.refs[0]
            if res.last.stats.drafted_by.get("self", 0) > 0:
                return res
            await asyncio.sleep(0.5)
        raise AssertionError("the drafter came back but was never routed to again")

    res = run(until_drafted_by_self(), 120)
    assert res.last.stats.accepted_by.get("self", 0) > 0
    assert is_idle(run(wait_idle(client, 5.0), 30))


# ---- (d) a stage dies mid-generation -------------------------------------------------------------

@pytest.mark.parametrize("stage, no_restart", [(1, False), (0, True)],
                         ids=["ray-restarts-stage1", "stage0-killed-for-good"])
def test_stage_killed_mid_generation_recovers(engine2, tiny, stage, no_restart):
    """The stage's KV is gone: Ray restarts it (no_restart=False) or the engine's slot spawns a
    new one (no_restart=True); the engine re-prefills every running request from prompt +
    committed tokens and the text is unchanged. (Had the stage not come back within
    stage_recovery_s, the requests would end cleanly with finish_reason "error".) Two requests
    are in flight, one per lane, so both lanes hit the lost stage."""
    _, client = engine2
    name = actor_name("stage", stage)
    old = ping(name)
    before = run(client.stats(), 30)
    killed = asyncio.Event()

    async def kill_after_two(n: int, out: RequestOutput) -> None:
        if n == 2 and not killed.is_set():
            killed.set()
            ray.kill(actor(name), no_restart=no_restart)

    async def main():
        start = time.perf_counter()
        other = asyncio.ensure_future(collect(client, tiny.prompts[3], LONG_MAX_TOKENS))
        victim = await collect(client, tiny.long_prompt, LONG_MAX_TOKENS, on_output=kill_after_two)
        return victim, await other, time.perf_counter() - start

    victim, other, elapsed = run(main(), STAGE_RECOVERY_S + 120)
    print(f"[ray-cluster] stage {stage} killed (no_restart={no_restart}): finished in {elapsed:.1f} s; "
          f"victim {victim.last.finish_reason!r} ({len(victim.tokens)} tokens, error={victim.last.error!r}), "
          f"other {other.last.finish_reason!r} ({len(other.tokens)} tokens)", flush=True)
    assert killed.is_set()
    for res in (victim, other):  # nothing hung, nothing wrong was streamed
        assert res.last.finished and res.last.finish_reason in ("length", "error")
    assert victim.tokens == tiny.long_ref[:len(victim.tokens)]
    assert other.tokens == tiny.long_ref3[:len(other.tokens)]
    # The stage comes back well within stage_recovery_s, so both requests are re-prefilled
    # and finish with the greedy text; nothing is streamed twice.
    for label, res in (("victim", victim), ("other", other)):
        assert res.last.finish_reason == "length", f"{label} request failed: {res.last.error}"
    assert victim.tokens == tiny.long_ref and other.tokens == tiny.long_ref3
    assert elapsed < STAGE_RECOVERY_S + 60

    assert ping(name) != old, "the stage was not replaced"
    stats = run(wait_idle(client, 5.0), 30)
    assert is_idle(stats), f"state left behind after the stage restart: {stats}"
    respawned = {n: stats["respawns"][n] - before["respawns"][n] for n in stats["respawns"]}
    # Ray restarted it under the same handle, or the slot spawned exactly one replacement
    assert respawned == {n: int(no_restart and n == name) for n in respawned}
    # the pipeline serves new requests normally
    res = run(collect(client, tiny.prompts[1], MAX_TOKENS), 120)
    assert res.tokens == tiny.refs[1] and res.last.finish_reason == "length"


# ---- (e) cancellation frees state ----------------------------------------------------------------

def test_closing_the_stream_early_frees_all_state(engine2, tiny):
    _, client = engine2

    async def close_after_two(n: int, out: RequestOutput) -> bool:
        return n >= 2

    async def main():
        before = endings(await client.metrics_snapshot())
        stays = asyncio.ensure_future(collect(client, tiny.prompts[2], MAX_TOKENS))
        leavers = await asyncio.gather(*(collect(client, p, LONG_MAX_TOKENS, on_output=close_after_two)
                                         for p in (tiny.long_prompt, tiny.prompts[5])))
        survivor = await stays
        return leavers, survivor, await wait_idle(client, 30.0), await wait_endings(client, before, 3)

    leavers, stays, stats, ended = run(main(), 180)
    for res in leavers:
        assert res.num_outputs == 2 and not res.last.finished
        assert len(res.tokens) < LONG_MAX_TOKENS
    assert stays.tokens == tiny.refs[2] and stays.last.finish_reason == "length"
    assert is_idle(stats), f"state left behind after cancellation: {stats}"
    assert ended == {"abort": 2, "length": 1}  # the leavers were cut, not run to their end

    # a lone cancelled request: everything is freed soon after closing the stream, by the abort
    async def lone():
        before = endings(await client.metrics_snapshot())
        res = await collect(client, tiny.long_prompt, LONG_MAX_TOKENS, on_output=close_after_two)
        closed = time.perf_counter()
        stats = await wait_idle(client, 30.0)
        return res, stats, time.perf_counter() - closed, await wait_endings(client, before, 1)

    res, stats, took, ended = run(lone(), 120)
    print(f"[ray-cluster] cancelled request's state freed in {took:.2f} s", flush=True)
    assert res.num_outputs == 2
    assert is_idle(stats), f"state still held 30 s after the stream was closed: {stats}"
    assert ended == {"abort": 1}  # freed by the cancellation: the request did not run to its length


def test_finish_then_close_counts_stop_not_abort(engine2, tiny):
    """What the ingress does when a stop string appears: ``finish`` (an engine call), then
    close the stream. The engine frees the request and counts it as ``stop``, with latency."""
    _, client = engine2

    def e2e_count(snapshot: dict) -> int:
        return sum(h.count for h in snapshot.get("cosine_ray:e2e_request_latency_seconds", {}).values())

    async def main():
        before = await client.metrics_snapshot()
        rid = uuid.uuid4().hex

        async def finish_after_two(n: int, out: RequestOutput) -> bool:
            if n < 2:
                return False
            await client.finish(rid)
            return True

        res = await collect(client, tiny.long_prompt, LONG_MAX_TOKENS, on_output=finish_after_two, request_id=rid)
        stats = await wait_idle(client, 5.0)
        deadline = time.monotonic() + 10
        while True:  # the engine's generator ends (and counts) once Serve delivers the cancellation
            after = await client.metrics_snapshot()
            if sum(endings(after).values()) > sum(endings(before).values()) or time.monotonic() > deadline:
                return before, after, res, stats
            await asyncio.sleep(0.1)

    before, after, res, stats = run(main(), 120)
    assert res.num_outputs == 2 and not res.last.finished
    assert is_idle(stats), f"state left behind: {stats}"
    b, a = endings(before), endings(after)
    assert {r: a.get(r, 0) - b.get(r, 0) for r in set(a) | set(b)} == {"stop": 1, **{r: 0 for r in (set(a) | set(b)) - {"stop"}}}
    assert e2e_count(after) == e2e_count(before) + 1


# ---- (f) concurrency ---------------------------------------------------------------------------

def test_eight_concurrent_requests_complete(engine2, tiny):
    _, client = engine2

    async def main():
        return await asyncio.gather(*(collect(client, p, MAX_TOKENS) for p in tiny.prompts))

    start = time.perf_counter()
    results = run(main(), 180)
    _timed("8 concurrent requests (S=2)", start)
    assert len(results) == 8
    for i, (res, ref) in enumerate(zip(results, tiny.refs)):
        assert res.last.finished and res.last.finish_reason == "length", f"request {i}: {res.last}"
        assert res.tokens == ref, f"request {i} differs from greedy under concurrency"
    assert is_idle(run(wait_idle(client, 5.0), 30))
