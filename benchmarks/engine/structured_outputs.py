"""JSON-schema outputs under speculation: every answer parses and validates, drafters still pay.

5 schemas (nested objects, enums, arrays) × 10 prompts, at temperature 0 and 0.8 (seeded), on
the embedded SmolLM2 with the default drafters and with none, and the plain engine on the same
prompts without the grammar, interleaved round by round. Prints, per round, engine and
temperature: answers that parse and validate (jsonschema), how many were cut by max_tokens,
mean accepted length, tokens/s and the load average; then each round's ratios (drafters over
none, plain under the grammar over plain without it) and greedy texts equal across engines.

    python benchmarks/engine/structured_outputs.py [--max-tokens 256] [--prompts 10]
        [--concurrency 1] [--rounds 3] [--temperatures 0] [--no-plain]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import jsonschema

from cosine_ray.bench.engines import start_engine
from cosine_ray.bench.figures import mean_accepted_length
from cosine_ray.engine.config import EngineConfig, parse_drafters
from cosine_ray.engine.request import SamplingParams, StructuredOutput

SCHEMAS = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60}}, "required": ["name", "age"], "additionalProperties": False},
    "order": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999}, "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 12}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["id", "status", "items"], "additionalProperties": False},
    "review": {"type": "object", "properties": {
        "rating": {"enum": [1, 2, 3, 4, 5]}, "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "summary": {"type": "string", "maxLength": 80}}, "required": ["rating", "sentiment", "summary"],
        "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40},
        "when": {"type": "object", "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 31},
                                                  "month": {"enum": ["jan", "feb", "mar", "apr", "may", "jun"]}},
                 "required": ["day", "month"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
        "required": ["title", "when", "tags"], "additionalProperties": False},
    "recipe": {"type": "object", "properties": {
        "dish": {"type": "string", "maxLength": 30}, "vegetarian": {"type": "boolean"},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 50}, "minItems": 1, "maxItems": 3}},
        "required": ["dish", "vegetarian", "steps"], "additionalProperties": False},
}
TOPICS = ["a customer from Paris", "a late delivery", "a birthday party", "pasta for two", "a broken phone",
          "a music festival", "a new laptop", "a quiet neighbour", "a summer trip", "a bakery visit"]


def prompt_text(schema_name: str, topic: str) -> str:
    return f"Write a JSON {schema_name} about {topic}. Answer with JSON only."


ENGINES = ("default drafters", "no drafters", "plain, no grammar")
"""What one round runs, interleaved: the speculative engine and the plain one under the grammar,
then the plain engine without it (the grammar's own cost: same prompts, its own texts)."""


def run(engine, jobs, *, temperature: float, max_tokens: int, concurrency: int, grammar: bool):
    """Every job through ``engine``, at most ``concurrency`` at once: outputs and wall seconds."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                             structured=StructuredOutput("json_schema", json.dumps(schema)) if grammar else None)
              for i, (_, schema, _) in enumerate(jobs)]

    async def go():
        sem = asyncio.Semaphore(concurrency)

        async def one(ids, sp):
            async with sem:
                return await engine.loop.generate_all(ids, sp)
        try:
            return list(await asyncio.gather(*(one(ids, sp) for (_, _, ids), sp in zip(jobs, params))))
        finally:
            await engine.loop.shutdown()

    start = time.perf_counter()
    outs = asyncio.run(go())
    return outs, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=10, help="prompts per schema (10: 50 requests)")
    p.add_argument("--drafters", default=None, help="drafters of the speculative engine (default: the default set)")
    p.add_argument("--concurrency", type=int, default=0, help="requests at once (0: all of them)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds (ratios are reported per round)")
    p.add_argument("--temperatures", default="0,0.8", help="comma-separated temperatures (0: greedy, texts compared)")
    p.add_argument("--no-plain", action="store_true", help="leave out plain decoding without the grammar")
    args = p.parse_args()
    base = EngineConfig()
    engines = {ENGINES[0]: start_engine(base if args.drafters is None else
                                        base.replace(drafters=parse_drafters(args.drafters)))}
    engines[ENGINES[1]] = start_engine(base.replace(drafters=parse_drafters("none")),
                                       checkpoint=engines[ENGINES[0]].checkpoint)
    engines[ENGINES[2]] = engines[ENGINES[1]]
    tok = engines[ENGINES[1]].tokenizer
    jobs = [(name, schema, engines[ENGINES[1]].encode(prompt_text(name, topic)))
            for name, schema in SCHEMAS.items() for topic in TOPICS[:args.prompts]]
    concurrency = args.concurrency or len(jobs)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    print(f"{len(jobs)} requests ({len(SCHEMAS)} schemas x {args.prompts} prompts), max_tokens {args.max_tokens}, "
          f"concurrency {concurrency}, {args.rounds} round(s), load average {os.getloadavg()[0]:.2f}")
    for label in ENGINES[:2]:  # first calls (compiles, caches) outside the measured rounds
        run(engines[label], jobs[:2], temperature=0.0, max_tokens=8, concurrency=2, grammar=True)
    print(f"{'round':>5} {'engine':18} {'temp':>4} {'valid':>7} {'cut':>4} {'mean acc. len':>13} {'tok/s':>7} "
          f"{'tokens':>7} {'load':>5}")
    rates: dict[tuple[str, float], list[float]] = {}
    greedy: dict[str, list] = {}
    for rnd in range(args.rounds):
        for temperature in temperatures:
            for label in ENGINES[:2] if args.no_plain else ENGINES:
                grammar = label != ENGINES[2]
                outs, seconds = run(engines[label], jobs, temperature=temperature, max_tokens=args.max_tokens,
                                    concurrency=concurrency, grammar=grammar)
                valid = cut = 0
                for (name, schema, _), out in zip(jobs, outs):
                    try:
                        jsonschema.validate(json.loads(tok.decode(out.new_token_ids, skip_special_tokens=True)), schema)
                        valid += 1
                    except (ValueError, jsonschema.ValidationError):
                        cut += out.finish_reason == "length"
                tokens = sum(len(o.new_token_ids) for o in outs)
                steps = sum(o.stats.num_verify_steps for o in outs)
                accepted = sum(o.stats.num_accepted_tokens for o in outs)
                if temperature == 0.0 and grammar:
                    greedy.setdefault(label, [o.new_token_ids for o in outs])
                    if greedy[label] != [o.new_token_ids for o in outs]:
                        print(f"  {label}: greedy texts differ between rounds")
                rates.setdefault((label, temperature), []).append(tokens / seconds)
                print(f"{rnd:>5} {label:18} {temperature:>4} {valid:>3}/{len(outs):<3} {cut:>4} "
                      f"{mean_accepted_length(accepted, steps):>13.2f} {tokens / seconds:>7.1f} {tokens:>7} "
                      f"{os.getloadavg()[0]:>5.2f}")
    for temperature in temperatures:
        for num, den in ((ENGINES[0], ENGINES[1]),) + (() if args.no_plain else ((ENGINES[1], ENGINES[2]),)):
            ratios = [a / b for a, b in zip(rates[(num, temperature)], rates[(den, temperature)])]
            print(f"temp {temperature}: {num} / {den}: {min(ratios):.2f}-{max(ratios):.2f}x "
                  f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    if greedy:
        same = sum(a == b for a, b in zip(greedy[ENGINES[0]], greedy[ENGINES[1]]))
        print(f"greedy texts equal with and without drafters: {same}/{len(jobs)}")


if __name__ == "__main__":
    main()
