"""Serving benchmark: one run, same machine, held-back prompts:

* single-request tokens/s through the in-process engine and through HTTP (Ray Serve →
  engine deployment → S stage actors), speculation on;
* aggregate tokens/s of 8 concurrent HTTP requests, speculation on and off.

    python benchmarks/serve/serving.py [--stages 2] [--max-tokens 64] [--out bench-results/serving.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx

from cosine_ray.bench.engines import engine_config, start_engine
from cosine_ray.datasets import default_prompt_dir, held_back_prompts
from cosine_ray.engine.local import encode_prompt
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint

DEFAULT_PROMPT_DIR = default_prompt_dir()


async def _chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> int:
    r = await client.post(url, json={"messages": [{"role": "user", "content": prompt}],
                                     "max_tokens": max_tokens, "temperature": 0}, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def _http_figures(base: str, prompts: list[str], max_tokens: int, concurrency: int,
                        single: bool) -> dict[str, float]:
    url = f"{base}/v1/chat/completions"
    out: dict[str, float] = {}
    async with httpx.AsyncClient() as client:
        await _chat(client, url, prompts[0], 4)  # warm-up
        if single:
            tokens, start = 0, time.perf_counter()
            for p in prompts:
                tokens += await _chat(client, url, p, max_tokens)
            out["single_tok_s"] = tokens / (time.perf_counter() - start)
        batch = (prompts * concurrency)[:concurrency]
        start = time.perf_counter()
        counts = await asyncio.gather(*(_chat(client, url, p, max_tokens) for p in batch))
        out[f"concurrent{concurrency}_tok_s"] = sum(counts) / (time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--drafters", default="ngram,retrieval")
    p.add_argument("--prompts-per-domain", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--out", default="bench-results/serving.json")
    args = p.parse_args()
    prompts = [t for _, t in held_back_prompts(DEFAULT_PROMPT_DIR, args.prompts_per_domain, ValueError)]
    results: dict[str, dict[str, float]] = {}

    config = engine_config(args.drafters, num_threads=2, max_num_seqs=args.concurrency)
    checkpoint = resolve_checkpoint(config.model)
    ids = [encode_prompt(checkpoint.load_tokenizer(), t) for t in prompts]
    engine = start_engine(config, checkpoint=checkpoint, warmup=[ids[0]], concurrency=1)
    start = time.perf_counter()
    tokens = sum(len(engine.generate([i], SamplingParams(max_tokens=args.max_tokens))[0].new_token_ids) for i in ids)
    results["local engine"] = {"single_tok_s": tokens / (time.perf_counter() - start)}
    batch = (ids * args.concurrency)[:args.concurrency]
    start = time.perf_counter()
    outs = engine.generate(batch, SamplingParams(max_tokens=args.max_tokens))
    results["local engine"][f"concurrent{args.concurrency}_tok_s"] = \
        sum(len(o.new_token_ids) for o in outs) / (time.perf_counter() - start)
    del engine

    from ray import serve

    from cosine_ray.runtime.cluster import connect
    from cosine_ray.serve.app import build_app
    connect(None)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    base = f"http://127.0.0.1:{args.port}"
    for label, drafters in ((f"http, {args.drafters}", args.drafters), ("http, speculation off", "none")):
        serve.run(build_app({"drafters": drafters, "num_stages": args.stages,
                             "step": {"num_lanes": args.stages, "max_num_seqs": args.concurrency}}),
                  name="cosine_ray", route_prefix="/")
        results[label] = asyncio.run(_http_figures(base, prompts, args.max_tokens, args.concurrency,
                                                   single=True))
        serve.delete("cosine_ray")
    serve.shutdown()

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"stages": args.stages, "max_tokens": args.max_tokens, "prompts": len(prompts),
              "concurrency": args.concurrency, "results": results}
    out.write_text(json.dumps(report, indent=2))
    print(f"\n{len(prompts)} held-back prompts, {args.max_tokens} tokens, greedy, {args.stages} stages")
    print(f"{'path':<32} {'single tok/s':>12} {f'{args.concurrency} concurrent tok/s':>20}")
    for label, row in results.items():
        print(f"{label:<32} {row.get('single_tok_s', 0):>12.2f} {row[f'concurrent{args.concurrency}_tok_s']:>20.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
