"""Two or more ``cosine-ray serve`` command lines side by side over HTTP: ready time, tokens/s
at concurrency 1 and 8, and whether their texts are the same.

    python benchmarks/serve/serve_ab.py [--rounds 3] [--max-tokens 64] [--prompts-per-domain 4]
        --variant NAME="SERVE ARGS" --variant NAME="SERVE ARGS" ...

Example (the stage actors against the stages in the engine, docs/performance-cpu.md):

    python benchmarks/serve/serve_ab.py --variant actors=--no-stages-in-engine --variant in-engine=

A variant's args may start with environment settings for its server, as in a shell:
``--variant "onednn=COSINE_RAY_CPU_GEMM=onednn --drafters none"``.

Each round starts every variant in turn, in the same order, on a fresh local Ray cluster
(``ray stop`` before each start), and with one client: ``/health`` 200 after the launch
(*ready*), two warm-up requests, then the first ``2 × domains`` held-back prompts one at a time
(c = 1) and all of them 8 at a time (c = 8): chat, greedy, ``--max-tokens`` each. Printed per
round and variant: ready seconds and tok/s (completion tokens over the wall time of the batch);
then per variant the median (min-max) of each, and how many texts equal the first variant's of
round 1, prompt by prompt (greedy: they must all be equal).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import httpx

from cosine_ray.bench.rounds import Spread
from cosine_ray.datasets import held_back_prompts
from loadgen.launcher import ServerProcess, free_port


async def run_batch(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[float, list[str]]:
    """tok/s of the batch and each prompt's text."""
    gate = asyncio.Semaphore(concurrency)
    texts: list[str] = [""] * len(prompts)
    tokens = 0
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i: int, prompt: str) -> None:
            nonlocal tokens
            async with gate:
                r = await client.post(f"{url}/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})
                r.raise_for_status()
                body = r.json()
                texts[i] = body["choices"][0]["message"]["content"]
                tokens += body["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return tokens / (time.perf_counter() - start), texts


def parse_variant(text: str) -> tuple[str, str]:
    name, sep, args = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: use NAME=\"SERVE ARGS\" (the args may be empty)")
    return name, args


def split_env(serve_args: str) -> tuple[dict[str, str], list[str]]:
    """Leading ``KEY=VALUE`` words (environment for the server), then the serve args."""
    words, env = serve_args.split(), {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", type=parse_variant, action="append", required=True,
                    help='NAME="cosine-ray serve args" (twice or more)')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompts-per-domain", type=int, default=4, help="held-back prompts per domain (c = 8 set)")
    args = ap.parse_args(argv)
    if len(args.variant) < 2 or len({n for n, _ in args.variant}) != len(args.variant):
        ap.error("give two or more --variant, each with its own name")
    prompts = [p for _, p in held_back_prompts(None, args.prompts_per_domain)]
    single = prompts[:max(1, len(prompts) // 2)]
    logs = Path(tempfile.mkdtemp(prefix="serve-ab-"))
    rows: dict[str, list[tuple[float, float, float, list[str], list[str]]]] = {n: [] for n, _ in args.variant}
    for rnd in range(1, args.rounds + 1):
        for name, serve_args in args.variant:
            subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], capture_output=True)
            time.sleep(3)
            port = free_port()
            env, words = split_env(serve_args)
            command = [sys.executable, "-m", "cosine_ray.cli", "serve", "--port", str(port), *words]
            with mock.patch.dict(os.environ, env), \
                    ServerProcess(name, command, f"http://127.0.0.1:{port}", logs / f"{name}-{rnd}.log",
                                  log=lambda msg: None) as server:
                ready = server.wait_ready()
                asyncio.run(run_batch(server.url, prompts[:2], 1, args.max_tokens))  # warm-up
                c1, texts1 = asyncio.run(run_batch(server.url, single, 1, args.max_tokens))
                c8, texts8 = asyncio.run(run_batch(server.url, prompts, 8, args.max_tokens))
            rows[name].append((ready, c1, c8, texts1, texts8))
            print(f"round {rnd} {name}: ready {ready:.1f} s, c=1 {c1:.1f} tok/s, c=8 {c8:.1f} tok/s", flush=True)
    first = rows[args.variant[0][0]][0]
    print(f"\n{len(single)} prompts at c = 1, {len(prompts)} at c = 8, {args.max_tokens} tokens, greedy; "
          f"median (min-max) over {args.rounds} round(s); logs in {logs}")
    print("| variant | ready s | c = 1 tok/s | c = 8 tok/s | texts as the first variant's |")
    print("| --- | --- | --- | --- | --- |")
    for name, serve_args in args.variant:
        cells = [Spread.of([r[k] for r in rows[name]]).text(".1f") for k in range(3)]
        same1 = sum(a == b for r in rows[name] for a, b in zip(r[3], first[3]))
        same8 = sum(a == b for r in rows[name] for a, b in zip(r[4], first[4]))
        total1, total8 = len(single) * len(rows[name]), len(prompts) * len(rows[name])
        print(f"| {name} (`{serve_args or 'defaults'}`) | {' | '.join(cells)} | "
              f"{same1}/{total1} and {same8}/{total8} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
