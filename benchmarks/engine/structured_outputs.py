"""JSON-schema outputs under speculation: every answer parses and validates, drafters still pay.

5 schemas (nested objects, enums, arrays) × 10 prompts, at temperature 0 and 0.8 (seeded), on
the embedded SmolLM2 with the default drafters and with none, in one run. Prints, per engine
and temperature: answers that parse and validate (jsonschema), how many were cut by
max_tokens, greedy texts equal across the engines, mean accepted length and tokens/s.

    python benchmarks/engine/structured_outputs.py [--max-tokens 256] [--prompts 10]
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=10, help="prompts per schema (10: 50 requests)")
    p.add_argument("--drafters", default=None, help="drafters of the speculative engine (default: the default set)")
    args = p.parse_args()
    base = EngineConfig()
    engines = {"default drafters": start_engine(base if args.drafters is None else
                                                base.replace(drafters=parse_drafters(args.drafters)))}
    engines["no drafters"] = start_engine(base.replace(drafters=parse_drafters("none")),
                                          checkpoint=engines["default drafters"].checkpoint)
    tok = engines["no drafters"].tokenizer
    jobs = [(name, schema, engines["no drafters"].encode(prompt_text(name, topic)))
            for name, schema in SCHEMAS.items() for topic in TOPICS[:args.prompts]]
    print(f"{len(jobs)} requests ({len(SCHEMAS)} schemas x {args.prompts} prompts), max_tokens {args.max_tokens}")
    rows, greedy = [], {}
    for temperature in (0.0, 0.8):
        for label, engine in engines.items():
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=temperature, seed=i,
                                     structured=StructuredOutput("json_schema", json.dumps(schema)))
                      for i, (_, schema, _) in enumerate(jobs)]
            start = time.perf_counter()
            outs = engine.generate([ids for _, _, ids in jobs], params)
            seconds = time.perf_counter() - start
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
            if temperature == 0.0:
                greedy[label] = [o.new_token_ids for o in outs]
            rows.append((label, temperature, valid, len(outs), cut, mean_accepted_length(accepted, steps),
                         tokens / seconds, tokens))
    print(f"{'engine':18} {'temp':>4} {'valid':>7} {'cut':>4} {'mean acc. len':>13} {'tok/s':>7} {'tokens':>7}")
    for label, temperature, valid, n, cut, mal, rate, tokens in rows:
        print(f"{label:18} {temperature:>4} {valid:>3}/{n:<3} {cut:>4} {mal:>13.2f} {rate:>7.1f} {tokens:>7}")
    same = sum(a == b for a, b in zip(greedy["default drafters"], greedy["no drafters"]))
    print(f"greedy texts equal with and without drafters: {same}/{len(jobs)}")


if __name__ == "__main__":
    main()
