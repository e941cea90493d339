"""The serving engine's claims, each side by side in one run (the embedded model, in-process):

    python benchmarks/engine/serving_engine.py prefix      # shared system prompt and MT-bench second turns
    python benchmarks/engine/serving_engine.py chunked     # a ~6,000-token prompt beside 4 streams
    python benchmarks/engine/serving_engine.py preemption  # 32 requests in a KV budget of ~4 contexts

``prefix``: every request with and without the prefix cache, in interleaved rounds: prompt tokens
computed, TTFT p50 of the requests after the first, identical greedy text (and HF greedy in fp32
with ``--hf``). ``chunked``: the longest gap between two tokens of a running stream while the
long prompt prefills, against that prompt's TTFT, with chunked prefill (the default token
budget) and without (a budget that takes the whole prompt in one step). ``preemption``: every
request finishes, the preemptions counted, and the greedy text against our own plain decode
with an unbounded pool (and HF greedy with ``--hf``). Prints a table; ``--json FILE`` keeps it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from cosine_ray.bench.conversations import encode_messages
from cosine_ray.bench.engines import engine_config, start_engine
from cosine_ray.bench.reference import count_identical, hf_greedy_all
from cosine_ray.bench.rounds import Interleaving, Spread, paired_ratios
from cosine_ray.bench.workloads import fixed_length_prompts
from cosine_ray.datasets import DOMAIN_FILES, domain_prompts
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint


def engine(checkpoint, drafters: str, **settings) -> LocalEngine:
    return start_engine(engine_config(drafters, model=str(checkpoint.name), num_threads=2, **settings),
                        checkpoint=checkpoint)


async def timed(eng: LocalEngine, prompt: list[int], params: SamplingParams, rid: str) -> dict:
    """One request through the engine: its tokens, arrival-relative token times, cached tokens."""
    start, times, tokens, cached = time.perf_counter(), [], [], 0
    async for out in eng.stream(prompt, params, rid):
        now = time.perf_counter() - start
        times += [now] * len(out.new_token_ids)
        tokens += out.new_token_ids
        if out.stats is not None:
            cached = out.stats.num_cached_tokens
    return {"tokens": tokens, "times": times, "cached": cached, "prompt": len(prompt)}


def text_prompt(tokenizer, text: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return encode_messages(tokenizer, messages)


def long_text(tokenizer, num_tokens: int, domain: str = "math") -> str:
    """First-half prompts of a domain joined until they make ``num_tokens`` tokens."""
    parts, total = [], 0
    for row in domain_prompts(domain, "first-half"):
        parts.append(row["prompt"])
        total += len(tokenizer(row["prompt"])["input_ids"])
        if total >= num_tokens:
            break
    ids = tokenizer("\n".join(parts))["input_ids"][:num_tokens]
    return tokenizer.decode(ids)


# ---- prefix caching ---------------------------------------------------------------------------
def prefix_workloads(tokenizer, args) -> dict[str, list[list[list[int]]]]:
    """workload → waves of prompts: a wave runs after the one before it finished."""
    system = "Answer using the reference material below when it helps.\n\n" + long_text(tokenizer, args.system_tokens)
    questions = [r["prompt"] for d in DOMAIN_FILES for r in domain_prompts(d)[:args.questions_per_domain]]
    shared = [[text_prompt(tokenizer, questions[0], system)], [text_prompt(tokenizer, q, system) for q in questions[1:]]]
    convs = [r["turns"] for r in domain_prompts("chat")[:args.conversations]]
    return {"shared-system-prompt": shared, "mt-bench": [[text_prompt(tokenizer, c[0]) for c in convs]], "turns": convs}


async def run_waves(eng: LocalEngine, waves, params: SamplingParams, tag: str) -> list[dict]:
    out = []
    for w, wave in enumerate(waves):
        out += await asyncio.gather(*(timed(eng, p, params, f"{tag}-{w}-{i}") for i, p in enumerate(wave)))
    return out


async def second_turns(eng, tokenizer, convs, firsts, params, tag) -> list[dict]:
    """MT-bench's second turns: the prompt holds the first turn and its answer."""
    prompts = []
    for conv, first in zip(convs, firsts):
        prompts.append(encode_messages(tokenizer, [
            {"role": "user", "content": conv[0]},
            {"role": "assistant", "content": tokenizer.decode(first["tokens"], skip_special_tokens=True)},
            {"role": "user", "content": conv[1]}]))
    return await asyncio.gather(*(timed(eng, p, params, f"{tag}-t2-{i}") for i, p in enumerate(prompts)))


def prefix(args, checkpoint) -> dict:
    tokenizer = checkpoint.load_tokenizer()
    loads = prefix_workloads(tokenizer, args)
    params = SamplingParams(max_tokens=args.max_tokens)
    rows, texts = [], {}
    interleaving = Interleaving("alternate")
    for rnd in range(args.rounds):
        for caching in interleaving.order((True, False), rnd + 1):
            eng = engine(checkpoint, args.drafters, enable_prefix_caching=caching)

            async def go():
                try:
                    shared = await run_waves(eng, loads["shared-system-prompt"], params, "s")
                    firsts = await run_waves(eng, loads["mt-bench"], params, "m")
                    seconds = await second_turns(eng, tokenizer, loads["turns"], firsts, params, "m")
                    return {"shared-system-prompt": shared, "mt-bench (both turns)": firsts + seconds,
                            "mt-bench second turns": seconds}
                finally:
                    await eng.loop.shutdown()

            for workload, results in asyncio.run(go()).items():
                after = results[1:] if workload == "shared-system-prompt" else results
                rows.append({"round": rnd, "workload": workload, "cache": caching,
                             "prompt_tokens": sum(r["prompt"] for r in results),
                             "computed_tokens": sum(r["prompt"] - r["cached"] for r in results),
                             "ttft_p50_s": statistics.median(r["times"][0] for r in after)})
                texts.setdefault((workload, caching), []).append([r["tokens"] for r in results])
    identical = {w: all(t == texts[(w, False)][0] for t in texts[(w, True)] + texts[(w, False)])
                 for w, _ in texts}
    print(f"{'workload':24} {'cache':>5} {'prompt tok':>10} {'computed':>9} {'TTFT p50 (rounds)':>28}")
    for workload in dict.fromkeys(r["workload"] for r in rows):
        for caching in (True, False):
            rs = [r for r in rows if r["workload"] == workload and r["cache"] == caching]
            ttfts = Spread.of([r["ttft_p50_s"] for r in rs])
            print(f"{workload:24} {'on' if caching else 'off':>5} {rs[0]['prompt_tokens']:>10} "
                  f"{rs[0]['computed_tokens']:>9} {ttfts.median:>10.3f} s ({ttfts.low:.3f}-{ttfts.high:.3f})")
        on = [r for r in rows if r["workload"] == workload and r["cache"]]
        off = {r["round"]: r for r in rows if r["workload"] == workload and not r["cache"]}
        ratios = Spread.of(paired_ratios([r["ttft_p50_s"] for r in on], [off[r["round"]]["ttft_p50_s"] for r in on]))
        print(f"{'':24} computed on/off {on[0]['computed_tokens'] / off[0]['computed_tokens']:.2f}, TTFT p50 on/off "
              f"{ratios.text()}, identical text: {identical[workload]}")
    result = {"rows": rows, "identical": identical}
    if args.hf:
        result["hf_identical"] = hf_check(checkpoint, loads["shared-system-prompt"][0] + loads["shared-system-prompt"][1],
                                          texts[("shared-system-prompt", True)][0], args.max_tokens)
        print(f"shared-system-prompt identical to HF greedy (fp32): {result['hf_identical']}")
    return result


def hf_check(checkpoint, prompts, outputs, max_tokens: int, *, ignore_eos: bool = False) -> str:
    """How many outputs equal HF transformers' greedy decoding in fp32."""
    return count_identical(outputs, hf_greedy_all(checkpoint, prompts, max_tokens, ignore_eos=ignore_eos))


# ---- chunked prefill ----------------------------------------------------------------------------
def chunked(args, checkpoint) -> dict:
    tokenizer = checkpoint.load_tokenizer()
    streams = [text_prompt(tokenizer, r["prompt"]) for r in domain_prompts("instruction")[:args.streams]]
    long_prompt = text_prompt(tokenizer, "Summarise the problems below.\n\n" + long_text(tokenizer, args.long_tokens))
    rows, texts = [], {}
    interleaving = Interleaving("alternate")
    for rnd in range(args.rounds):
        for budget in interleaving.order((None, 8192), rnd + 1):
            eng = engine(checkpoint, args.drafters, max_num_batched_tokens=budget)

            async def go():
                try:
                    tasks = [asyncio.ensure_future(timed(eng, p, SamplingParams(max_tokens=args.stream_tokens,
                                                                                ignore_eos=True), f"s{i}"))
                             for i, p in enumerate(streams)]
                    await asyncio.sleep(args.delay_s)  # the streams run before the long prompt comes
                    arrived = time.perf_counter()
                    long_out = await timed(eng, long_prompt, SamplingParams(max_tokens=args.long_max_tokens), "long")
                    outs = await asyncio.gather(*tasks)
                    return arrived, long_out, outs
                finally:
                    await eng.loop.shutdown()

            start = time.perf_counter()
            arrived, long_out, outs = asyncio.run(go())
            ttft = long_out["times"][0]
            window = (arrived - start, arrived - start + ttft)  # the streams' clock started with them
            gaps = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:]) if b > window[0] and a < window[1]]
            rows.append({"round": rnd, "chunked": budget is None, "long_prompt_tokens": len(long_prompt),
                         "ttft_s": ttft, "longest_gap_s": max(gaps, default=0.0)})
            texts.setdefault(budget is None, []).append(long_out["tokens"])
    print(f"long prompt: {len(long_prompt)} tokens beside {len(streams)} streams")
    print(f"{'prefill':10} {'long TTFT s':>12} {'longest gap s':>14} {'gap / TTFT (rounds)':>24}")
    for mode in (True, False):
        rs = [r for r in rows if r["chunked"] == mode]
        ratios = Spread.of(paired_ratios([r["longest_gap_s"] for r in rs], [r["ttft_s"] for r in rs]))
        print(f"{'chunked' if mode else 'whole':10} {statistics.median(r['ttft_s'] for r in rs):>12.2f} "
              f"{statistics.median(r['longest_gap_s'] for r in rs):>14.2f} {ratios.median:>10.2f} "
              f"({ratios.low:.2f}-{ratios.high:.2f})")
    identical = all(t == texts[False][0] for t in texts[True] + texts[False])
    print(f"long prompt's output identical chunked and whole: {identical}")
    return {"rows": rows, "identical": identical}


# ---- preemption ---------------------------------------------------------------------------------
def preemption(args, checkpoint) -> dict:
    prompts = fixed_length_prompts(checkpoint.load_tokenizer(), args.requests, args.prompt_tokens)
    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    per_token = checkpoint.config.num_layers * 2 * checkpoint.config.num_kv_heads * checkpoint.config.head_dim * 4
    budget = args.contexts * (args.prompt_tokens + args.output_tokens + 16) * per_token
    results = {}
    for name, memory in (("budget", budget), ("unbounded", None)):
        eng = engine(checkpoint, args.drafters, kv_cache_memory=memory, max_num_seqs=args.requests)

        async def go():
            try:
                return await asyncio.gather(*(timed(eng, p, params, f"r{i}") for i, p in enumerate(prompts)),
                                            return_exceptions=True)
            finally:
                await eng.loop.shutdown()

        start = time.perf_counter()
        outs = asyncio.run(go())
        done = [o for o in outs if isinstance(o, dict) and len(o["tokens"]) == args.output_tokens]
        results[name] = {"seconds": time.perf_counter() - start, "completed": len(done), "outs": outs,
                         "preemptions": eng.core.scheduler.num_preemptions}
        kv = f"{memory / 2**20:.1f} MiB" if memory else "as needed"
        print(f"{name:10} KV {kv:>10}: {len(done)}/{len(prompts)} complete, "
              f"{results[name]['preemptions']} preemptions, {results[name]['seconds']:.0f} s")
    same = sum(isinstance(a, dict) and isinstance(b, dict) and a["tokens"] == b["tokens"]
               for a, b in zip(results["budget"]["outs"], results["unbounded"]["outs"]))
    print(f"identical to the unbounded run (plain growth, no preemption): {same}/{len(prompts)}")
    out = {k: {kk: vv for kk, vv in v.items() if kk != "outs"} for k, v in results.items()}
    out["identical"] = f"{same}/{len(prompts)}"
    if args.hf:
        out["hf_identical"] = hf_check(checkpoint, prompts, [o["tokens"] for o in results["budget"]["outs"]],
                                       args.output_tokens, ignore_eos=True)
        print(f"identical to HF greedy (fp32): {out['hf_identical']}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("claim", choices=("prefix", "chunked", "preemption"))
    p.add_argument("--drafters", default="default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hf", action="store_true", help="also compare with HF transformers' greedy decoding (fp32)")
    p.add_argument("--json", default=None)
    g = p.add_argument_group("prefix")
    g.add_argument("--system-tokens", type=int, default=1000)
    g.add_argument("--questions-per-domain", type=int, default=3)
    g.add_argument("--conversations", type=int, default=8)
    g = p.add_argument_group("chunked")
    g.add_argument("--streams", type=int, default=4)
    g.add_argument("--stream-tokens", type=int, default=600)
    g.add_argument("--long-tokens", type=int, default=6000)
    g.add_argument("--long-max-tokens", type=int, default=8)
    g.add_argument("--delay-s", type=float, default=5.0)
    g = p.add_argument_group("preemption")
    g.add_argument("--requests", type=int, default=32)
    g.add_argument("--prompt-tokens", type=int, default=256)
    g.add_argument("--output-tokens", type=int, default=256)
    g.add_argument("--contexts", type=int, default=4, help="the KV budget holds this many requests' contexts")
    args = p.parse_args()
    checkpoint = resolve_checkpoint("smollm2-135m")
    result = {"prefix": prefix, "chunked": chunked, "preemption": preemption}[args.claim](args, checkpoint)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
