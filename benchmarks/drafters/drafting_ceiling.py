"""What a drafter set could gain at most on a workload, without timing noise.

The target's greedy outputs are fixed, so how many tokens a step a set of drafters *could*
commit does not depend on the machine. This script decodes the workload once with the real
target and no drafters, replays every measured turn step by step (c = 1) for each *policy* (a
drafter set and which of its domain experts a turn gets: ``all``, ``own``, ``wrong``,
``random1``, ``random2``, ``own+random1``), and prints per policy the tokens and draft nodes a
step, the accepted (oracle) nodes, and the speed-up over plain decoding projected with this
machine's verify-time model and the drafters' measured ``propose`` time. The replay is a
ceiling for ``fusion=union`` and an estimate for confidence fusion. The output keeps the
decoded turns, which ``--turns FILE`` replays without decoding (docs/benchmarks.md).

    python benchmarks/drafters/drafting_ceiling.py [--workload chat] [--prompts-per-domain 12]
        [--warmup-per-domain 8] [--max-tokens 64] [--budget 8] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from cosine_ray.bench.replay import DecodedTurn, build_drafters, decode_turns, parse_policies, replay, turn_features

DEFAULT_POLICIES = ("none/all;ngram/all;suffix/all;learning/own;learning/wrong;learning/random1;"
                    "learning/own+random1;learning/random2;learning/all;default/own+random1;default/random2")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="drafting_ceiling", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="chat", help="chat | multi-turn | code-edit | template")
    p.add_argument("--prompts-per-domain", type=int, default=12)
    p.add_argument("--warmup-per-domain", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=8, help="draft tokens each asked drafter may propose a step")
    p.add_argument("--tree-budgets", default="0,8",
                   help="comma list: nodes a step's tree keeps, the most confident first (0: the whole union)")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="';'-separated DRAFTERS/ROUTE")
    p.add_argument("--threads", type=int, default=2, help="torch threads for decoding and the profile")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--turns", default=None,
                   help="replay the turns an earlier run wrote to its --out file instead of decoding "
                        "(the workload flags then come from that file)")
    p.add_argument("--out", default="bench-results/drafting_ceiling.json")
    args = p.parse_args(argv)

    def fail(message: str) -> int:
        print(f"drafting_ceiling: {message}", file=sys.stderr)
        return 2
    if min(args.prompts_per_domain, args.budget, args.threads) < 1 or args.warmup_per_domain < 0 \
            or args.max_tokens < 2:
        return fail("--prompts-per-domain, --budget and --threads must be >= 1, --max-tokens >= 2 (the first "
                    "token comes from the prefill), --warmup-per-domain >= 0")
    try:
        policies = parse_policies(args.policies)
    except ValueError as exc:
        return fail(f"--policies: {str(exc).splitlines()[0]}")
    try:
        tree_budgets = [int(b) for b in args.tree_budgets.split(",")]
    except ValueError:
        return fail(f"--tree-budgets must be a comma list of integers, got {args.tree_budgets!r}")
    if not tree_budgets or min(tree_budgets) < 0:
        return fail("--tree-budgets values must be >= 0")

    import torch

    from cosine_ray.bench.engines import start_engine
    from cosine_ray.bench.workloads import bench_workload
    from cosine_ray.datasets import default_prompt_dir
    from cosine_ray.engine.config import config_from_dict, parse_drafters
    from cosine_ray.engine.profile import load_or_profile
    from cosine_ray.engine.worker.features import FeatureStore
    from cosine_ray.models.loader import resolve_checkpoint
    from loadgen.workload import WorkloadError

    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint("smollm2-135m")
    if args.turns:
        try:
            earlier = json.loads(Path(args.turns).read_text())
            warm, measured = ([DecodedTurn(t["domain"], tuple(t["prompt"]), tuple(t["output"]))
                               for t in earlier["turns"][k]] for k in ("warm", "measured"))
            for key in ("workload", "prompts_per_domain", "warmup_per_domain", "max_tokens", "seed"):
                setattr(args, key, earlier["args"][key])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return fail(f"--turns: {args.turns} is not a drafting_ceiling output ({str(exc).splitlines()[0]})")
        print(f"replaying {len(warm)} warm-up and {len(measured)} measured turns from {args.turns}", flush=True)
    else:
        try:
            warm_items, measured_items = bench_workload(args.workload, default_prompt_dir(), args.prompts_per_domain,
                                                        args.warmup_per_domain, args.max_tokens, args.seed)
        except WorkloadError as exc:
            return fail(str(exc))
        tokenizer = checkpoint.load_tokenizer()
        started = time.perf_counter()
        engine = start_engine(config_from_dict({"model": checkpoint.name, "drafters": "none",
                                                "scheduler": {"max_num_seqs": 8}}), checkpoint=checkpoint)
        warm = decode_turns(engine, warm_items, tokenizer, args.max_tokens) if warm_items else []
        measured = decode_turns(engine, measured_items, tokenizer, args.max_tokens)
        del engine
        print(f"decoded {len(warm)} warm-up and {len(measured)} measured turns ({sum(len(t.output) for t in measured)}"
              f" measured tokens) in {time.perf_counter() - started:.0f} s", flush=True)
    config = config_from_dict({"model": checkpoint.name, "drafters": "none", "num_threads": args.threads})
    latency = load_or_profile(config, quick=True)
    print(f"latency model: {latency.c_tok * 1e3:.2f} ms a new token, one request at 200 tokens of context: "
          f"{latency.predict_llm([200], [1]) * 1e3:.1f} ms for 1 token, "
          f"{latency.predict_llm([200], [9]) * 1e3:.1f} ms for 9", flush=True)

    rows = []
    per_turn = None
    if any("head" in {s.kind for s in parse_drafters(text)} for text, _ in policies):
        started = time.perf_counter()
        per_turn = turn_features(checkpoint, measured)
        print(f"target features of the measured turns in {time.perf_counter() - started:.0f} s", flush=True)
    for tree_budget in tree_budgets:
        for drafters_text, route in policies:
            store = FeatureStore() if per_turn is not None else None
            drafters = build_drafters(drafters_text, checkpoint, config, store)  # "none": no drafters
            figures = replay(warm, measured, drafters, route, budget=args.budget, tree_budget=tree_budget,
                             seed=args.seed, latency=latency,
                             features=(store, per_turn) if store is not None else None).figures()
            rows.append({"drafters": drafters_text, "route": route, "tree_budget": tree_budget, **figures})
            print(f"  {drafters_text}/{route}, tree budget {tree_budget or 'none'}: "
                  f"{figures['tokens_per_step']:.3f} tokens a step", flush=True)
    print(f"\n{args.workload}: {len(measured)} measured turns after {len(warm)} warm-up turns, budget "
          f"{args.budget} a drafter, c = 1 replay, threads {args.threads}")
    for tree_budget in tree_budgets:
        table = [r for r in rows if r["tree_budget"] == tree_budget]
        base = next((r for r in table if r["drafters"] == "suffix" and r["route"] == "all"), None)
        print(f"\ntree: {'the union of the proposed paths' if not tree_budget else f'the {tree_budget} most confident nodes'}")
        head = ("| policy | tokens a step | nodes a step | oracle nodes | draft ms a step | projected × plain "
                "| oracle × plain |" + (" tokens a step ÷ suffix | projected ÷ suffix | oracle ÷ suffix |"
                                        if base else ""))
        print(head)
        print("|" + " --- |" * (head.count("|") - 1))
        for r in table:
            line = (f"| {r['drafters']}/{r['route']} | {r['tokens_per_step']:.3f} | {r['nodes_per_step']:.2f} | "
                    f"{r['oracle_nodes_per_step']:.2f} | {r['draft_ms_per_step']:.2f} | "
                    f"{r['projected_speedup']:.3f} | {r['oracle_speedup']:.3f} |")
            if base:
                line += (f" {r['tokens_per_step'] / base['tokens_per_step']:.3f} | "
                         f"{r['projected_speedup'] / base['projected_speedup']:.3f} | "
                         f"{r['oracle_speedup'] / base['oracle_speedup']:.3f} |")
            print(line)
        domains = sorted({d for r in table for d in r["tokens_per_step_by_domain"]})
        print("\ntokens a step by the turns' domain:\n")
        print("| policy | " + " | ".join(domains) + " |")
        print("|" + " --- |" * (len(domains) + 1))
        for r in table:
            by = r["tokens_per_step_by_domain"]
            print(f"| {r['drafters']}/{r['route']} | " + " | ".join(f"{by[d]:.3f}" if d in by else "" for d in domains)
                  + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "benchmarks/drafters/drafting_ceiling.py", "args": vars(args),
                               "measured_turns": len(measured), "warmup_turns": len(warm),
                               "latency_model": latency.to_dict(), "results": rows,
                               "turns": {k: [{"domain": t.domain, "prompt": t.prompt, "output": t.output}
                                             for t in turns] for k, turns in (("warm", warm), ("measured", measured))}},
                              indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
