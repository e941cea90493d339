"""The prefix cache's hit rate and each engine replica's share of a workload of shared system
prompts, against a running ``cosine-ray serve`` (docs/scaling.md):

    cosine-ray serve --engine-replicas 2 --drafters ngram --port 8000 &
    python benchmarks/serve/replica_routing.py http://127.0.0.1:8000 [--passes 2] [--concurrency 8]

Each pass sends 4 system prompts × 16 questions (chat, greedy, 4 tokens, each question under
every system prompt in turn) ``--concurrency`` at a time, and prints the prompt tokens, those
the prefix cache served (``cosine_ray.num_cached_tokens``), their ratio, and how many requests
each replica served (``cosine_ray.engine_replica``). The first pass starts from a cold cache
when the server is fresh; later passes find it warm. Run it against one replica and two to
compare.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time

import httpx

SYSTEMS = [f"You are assistant number {k}. " + " ".join(
    f"Rule {k}.{i}: answer politely and cite sources about topic {k * 7 + i}." for i in range(6)) for k in range(4)]
QUESTIONS = [f"Question {q}: what is {q} plus {q * 3}, and why does it matter?" for q in range(16)]


async def one_pass(client: httpx.AsyncClient, url: str, model: str, concurrency: int) -> None:
    gate = asyncio.Semaphore(concurrency)
    rows: list[tuple[int, int, str | None]] = []

    async def ask(system: str, question: str) -> None:
        async with gate:
            r = await client.post(f"{url}/v1/chat/completions", json={
                "model": model, "max_tokens": 4, "temperature": 0, "cosine_ray_stats": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
            r.raise_for_status()
            body = r.json()
            rows.append((body["usage"]["prompt_tokens"], body["cosine_ray"]["num_cached_tokens"],
                         body["cosine_ray"].get("engine_replica")))

    start = time.monotonic()
    await asyncio.gather(*(ask(s, q) for q in QUESTIONS for s in SYSTEMS))
    prompt, cached = sum(r[0] for r in rows), sum(r[1] for r in rows)
    share = collections.Counter(r[2] for r in rows)
    print(f"{len(rows)} requests in {time.monotonic() - start:.1f} s: prompt tokens {prompt}, cached {cached}, "
          f"hit rate {cached / prompt:.3f}; requests by replica {dict(share.most_common())}", flush=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    key = os.environ.get("COSINE_RAY_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(timeout=300, headers=headers) as client:
        model = (await client.get(f"{args.url}/v1/models")).json()["data"][0]["id"]
        for _ in range(args.passes):
            await one_pass(client, args.url, model, args.concurrency)


if __name__ == "__main__":
    asyncio.run(main())
