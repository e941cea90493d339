"""Two engine replicas behind the real ``cosine-ray serve`` CLI: one is killed mid-stream and
every stream it held goes on, on the other, from the tokens it had sent.

The CLI serves a tiny random model with SmolLM2's tokenizer on the session's Ray cluster with
``--engine-replicas 2`` (stages in each engine, one thread each). Concurrent streams (the
``openai`` client over HTTP), greedy and seeded, run while the replica that serves the most of
them is killed (``ray.kill`` of its Serve replica actor, found by the
``x-cosine-ray-engine-replica`` header its streams carry). Every stream must end without an
error event, with the text of Hugging Face's greedy decoding (greedy) or of the same request run
uninterrupted before the kill (seeded).
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid

import httpx
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from support.cli_server import free_port, launch_serve, log_tail, wait_until_serving  # noqa: E402
from support.engine_app import engine_replicas, stop_and_clean  # noqa: E402
from support.hf_reference import hf_greedy  # noqa: E402
from support.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402
from cosine_ray.serve.generation import ENGINE_REPLICA_HEADER  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.real_model]

API_KEY = "replicas-" + uuid.uuid4().hex
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Once upon a time, in a small village,",
           "def fibonacci(n):", "Water boils at 100 degrees Celsius because", "one two three four five six",
           "The capital of France is", "In 1969, astronauts", "Lists: apples, pears, plums,"]
SEEDED = 4
"""The first SEEDED prompts also run seeded (temperature 0.8, seed = their index)."""
MAX_TOKENS = 160
READY_TIMEOUT_S = 360.0


def note(msg: str) -> None:
    print(f"[replicas] {msg}", flush=True)


@pytest.fixture(scope="module")
def server(ray_cluster, tmp_path_factory, real_checkpoint):
    root = tmp_path_factory.mktemp("replicas")
    ckpt = write_tiny_checkpoint(root / "tiny-smollm2", tokenizer_from=real_checkpoint, seed=7)
    port, log_path = free_port(), root / "cli.log"
    proc, log = launch_serve(["--port", str(port), "--address", ray_cluster, "--model", str(ckpt.path),
                              "--drafters", "ngram", "--stages", "1", "--stages-in-engine", "--engine-replicas", "2",
                              "--request-timeout-s", "300"], log_path, {"COSINE_RAY_API_KEY": API_KEY})
    try:
        tok = ckpt.load_tokenizer()
        hf = ckpt.load_hf_model()
        refs = [tok.decode(hf_greedy(hf, [int(t) for t in tok(p)["input_ids"]], MAX_TOKENS), skip_special_tokens=True)
                for p in PROMPTS]
        wait_until_serving(proc, log_path, READY_TIMEOUT_S)
        assert len(engine_replicas()) == 2, engine_replicas()
        yield f"http://127.0.0.1:{port}", refs
    finally:
        rc, left = stop_and_clean(proc, log)
        note(f"CLI stopped (exit {rc}); log tail:\n{log_tail(log_path, 15)}")
        assert not left, f"actors still alive after cleanup: {left}"


def requests() -> list[dict]:
    greedy = [{"prompt": p, "temperature": 0} for p in PROMPTS]
    seeded = [{"prompt": p, "temperature": 0.8, "seed": i} for i, p in enumerate(PROMPTS[:SEEDED])]
    return [{**r, "max_tokens": MAX_TOKENS} for r in greedy + seeded]


def test_streams_of_a_killed_engine_replica_end_on_the_other_with_the_uninterrupted_text(server):
    url, refs = server
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=30).json()["data"][0]["id"]
    asks = requests()

    async def uninterrupted(ask: dict) -> str:
        return (await client.completions.create(model=model, **ask)).choices[0].text

    async def streamed(ask: dict, progress: dict, i: int) -> str:
        stream = await client.completions.create(model=model, stream=True, extra_body={"cosine_ray_stats": True},
                                                 **ask)
        progress[i] = [stream.response.headers.get(ENGINE_REPLICA_HEADER), 0, False, None]
        text = ""
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            progress[i][1] += 1
            progress[i][3] = (chunk.to_dict().get("cosine_ray") or {}).get("engine_replica") or progress[i][3]
        progress[i][2] = True
        return text

    async def main():
        seeded_refs = await asyncio.gather(*(uninterrupted(a) for a in asks[len(PROMPTS):]))
        progress: dict[int, list] = {}
        tasks = [asyncio.create_task(streamed(a, progress, i)) for i, a in enumerate(asks)]
        deadline = time.monotonic() + 120
        # every stream has begun (a replica's batch may hold some back until others end) and each
        # one still running has a few chunks: the kill lands mid-answer
        while len(progress) < len(asks) or any(p[1] < 3 for p in progress.values() if not p[2]):
            failed = {i: t.exception() for i, t in enumerate(tasks) if t.done() and t.exception()}
            assert time.monotonic() < deadline and not failed, (progress, failed)
            await asyncio.sleep(0.05)
        victim, _ = collections.Counter(p[0] for p in progress.values() if not p[2]).most_common(1)[0]
        (name,) = [n for n in engine_replicas() if n.endswith(f"#{victim}")]
        on_victim = [i for i, p in progress.items() if p[0] == victim and not p[2]]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        note(f"killed engine replica {victim}: {len(on_victim)} of {len(asks)} streams mid-answer on it")
        texts = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 240)
        return seeded_refs, texts, on_victim, victim, progress

    seeded_refs, texts, on_victim, victim, progress = asyncio.run(main())
    assert on_victim, "no stream was still running on the killed replica"
    errors = [t for t in texts if isinstance(t, BaseException)]
    assert not errors, errors  # an SSE error event raises in the openai client
    assert texts == refs + list(seeded_refs)  # greedy: HF's text; seeded: the uninterrupted run's
    ended_on = {i: progress[i][3] for i in on_victim}
    assert all(r not in (None, victim) for r in ended_on.values()), ended_on  # the stats block names the survivor
