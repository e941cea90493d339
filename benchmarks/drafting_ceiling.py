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

    python benchmarks/drafting_ceiling.py [--workload mixed] [--prompts-per-domain 12]
        [--warmup-per-domain 8] [--max-tokens 64] [--budget 8] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from cosine_ray.engine.drafters.base import DraftInput, Drafter, FinishedText
from cosine_ray.engine.worker.features import FeatureRecord

if TYPE_CHECKING:
    from cosine_ray.algo.latency_model import LatencyModel
    from cosine_ray.models.checkpoint import Checkpoint

EXPERT_KINDS = ("suffix", "retrieval", "distilled")
ROUTES = ("all", "own", "wrong", "random1", "random2", "own+random1")
DEFAULT_POLICIES = ("none/all;ngram/all;suffix/all;learning/own;learning/wrong;learning/random1;"
                    "learning/own+random1;learning/random2;learning/all;default/own+random1;default/random2")


@dataclass(frozen=True)
class Turn:
    domain: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass
class Replay:
    """One policy's replay of the measured turns."""

    steps: int = 0
    tokens: int = 0
    nodes: int = 0
    oracle_nodes: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    """Predicted verify time of every step with all its nodes."""
    oracle_seconds: float = 0.0
    """Predicted verify time with only the accepted nodes."""
    plain_seconds: float = 0.0
    """Predicted time of plain decoding, one step per token."""
    domains: dict[str, list[int]] = field(default_factory=dict)
    """Domain → [steps, tokens] of its turns."""

    def figures(self) -> dict[str, Any]:
        per_step = 1 / self.steps if self.steps else 0.0
        out = {"steps": self.steps, "tokens": self.tokens, "tokens_per_step": self.tokens * per_step,
               "nodes_per_step": self.nodes * per_step, "oracle_nodes_per_step": self.oracle_nodes * per_step,
               "draft_ms_per_step": 1e3 * self.draft_seconds * per_step,
               "tokens_per_step_by_domain": {d: tokens / steps for d, (steps, tokens) in sorted(self.domains.items())
                                             if steps}}
        if self.plain_seconds:
            out["projected_speedup"] = self.plain_seconds / (self.verify_seconds + self.draft_seconds)
            out["oracle_speedup"] = self.plain_seconds / (self.oracle_seconds + self.draft_seconds)
        return out


def expert_domain(name: str) -> str | None:
    kind, _, source = name.partition(":")
    return source if kind in EXPERT_KINDS and source and not source.endswith(".parquet") else None


def choose(names: Sequence[str], route: str, domain: str, rng: random.Random) -> list[str]:
    """The drafters a step of a turn of ``domain`` asks under ``route``."""
    experts = [n for n in names if expert_domain(n) is not None]
    always = [n for n in names if expert_domain(n) is None]
    own = [n for n in experts if expert_domain(n) == domain]
    others = [n for n in experts if expert_domain(n) != domain]
    if route == "all":
        return list(names)
    if route == "own":
        return always + own
    if route == "wrong":
        return always + rng.sample(others, min(1, len(others)))
    if route in ("random1", "random2"):
        return always + rng.sample(experts, min(int(route[-1]), len(experts)))
    if route == "own+random1":
        return always + own + rng.sample(others, min(1, len(others)))
    raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")


def replay(warm: Sequence[Turn], measured: Sequence[Turn], drafters: Mapping[str, Drafter], route: str, *,
           budget: int, tree_budget: int = 0, seed: int = 0, latency: LatencyModel | None = None,
           features: Any = None) -> Replay:
    """Replay ``measured`` turn by turn with ``drafters`` (name → Drafter) after learning ``warm``.

    A step starts with the turn's prompt and the output committed so far (its last token is the
    step's root); it commits the longest proposed path that matches the output, plus the bonus
    token. ``tree_budget`` > 0 keeps only that many nodes of the union, the most confident
    first (cumulative confidence along the path, as the drafters reported it): the cap the
    engine's ``num_speculative_tokens`` puts on a request's tree. ``latency`` (an
    ``algo.latency_model.LatencyModel``) prices the steps when given. ``features``: (a
    ``FeatureStore`` a feature head reads, the target's features [T, H] of each measured turn's
    prompt + output): each step hands the head the features of the positions committed since."""
    rng = random.Random(seed)
    names = list(drafters)
    out = Replay()

    def learn(turn: Turn, request_id: str) -> None:
        text = FinishedText(request_id, turn.domain, turn.prompt + turn.output, len(turn.prompt))
        for d in drafters.values():
            if hasattr(d, "learn"):
                d.learn([text])

    for i, turn in enumerate(warm):
        learn(turn, f"warm-{i}")
    for i, turn in enumerate(measured):
        request_id = f"turn-{i}"
        y = turn.output
        pos = 1  # the first output token comes from the prefill, as in the engine
        fed = 0  # positions whose features the store has had
        if latency is not None:
            # plain decoding's k-th step has the prompt and k - 1 output tokens cached
            out.plain_seconds += sum(latency.predict_llm([len(turn.prompt) + k - 1], [1]) for k in range(1, len(y)))
        while pos < len(y):
            context = turn.prompt + y[:pos]
            truth = y[pos:]
            value: dict[tuple[int, ...], float] = {}  # node (its path) → best cumulative confidence
            if features is not None:  # what the last stage would have returned: up to the root, exclusive
                store, per_turn = features
                end = len(context) - 1
                store.record(request_id, FeatureRecord(tuple(range(fed, end)), tuple(context[fed:end]), None,
                                                       per_turn[i][fed:end].float()))
                fed = end
            for name in choose(names, route, turn.domain, rng):
                start = time.thread_time()
                proposal = drafters[name].propose([DraftInput(request_id, context, budget)])[0]
                out.draft_seconds += time.thread_time() - start
                for path, confidences in zip(proposal.paths, proposal.confidences):
                    cumulative = 1.0
                    for k in range(1, len(path) + 1):
                        cumulative *= confidences[k - 1]
                        node = tuple(path[:k])
                        value[node] = max(value.get(node, 0.0), cumulative)
            trie = set(value)
            if tree_budget and len(trie) > tree_budget:
                # the most confident nodes. Confidences are at most 1, so no node's value exceeds its
                # parent's, and with ties going to the shorter path the kept nodes stay a tree.
                ranked = sorted(trie, key=lambda n: (-value[n], len(n)))
                trie = set(ranked[:tree_budget])
            best = 0
            while best < len(truth) and truth[:best + 1] in trie:
                best += 1
            best = min(best, len(truth) - 1)  # the last token is a bonus, never a draft
            out.steps += 1
            out.tokens += best + 1
            counts = out.domains.setdefault(turn.domain, [0, 0])
            counts[0] += 1
            counts[1] += best + 1
            out.nodes += len(trie)
            out.oracle_nodes += best
            if latency is not None:
                cached = len(context) - 1  # everything before the root
                out.verify_seconds += latency.predict_llm([cached], [1 + len(trie)])
                out.oracle_seconds += latency.predict_llm([cached], [1 + best])
            pos += best + 1
        for d in drafters.values():
            d.release(request_id)
        learn(turn, request_id)
    return out


def parse_policies(text: str) -> list[tuple[str, str]]:
    from cosine_ray.engine.config import parse_drafters
    policies = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        drafters, sep, route = part.rpartition("/")
        if not sep or route not in ROUTES:
            raise ValueError(f"a policy is DRAFTERS/ROUTE with ROUTE one of {', '.join(ROUTES)}, got {part!r}")
        parse_drafters(drafters)  # raises ValueError naming the accepted forms
        policies.append((drafters, route))
    if not policies:
        raise ValueError("--policies is empty")
    return policies


def build_drafters(text: str, checkpoint: Checkpoint, config: Any, features: Any = None) -> dict[str, Drafter]:
    """Name → drafter; ``features`` (a ``FeatureStore``) for a feature head."""
    from cosine_ray.engine.build import build_drafter
    from cosine_ray.engine.config import parse_drafters
    specs = parse_drafters(text)
    state = checkpoint.load_state_dict() if any(s.kind == "head" for s in specs) else {}
    return {s.name: build_drafter(s, target=checkpoint, target_state=state, target_tokenizer=None, config=config,
                                  features=features) for s in specs}


def turn_features(checkpoint: Checkpoint, turns: Sequence[Turn]) -> list[Any]:
    """The target's features (final-norm hidden states, fp16) [T, H] of each turn's prompt + output."""
    from cosine_ray.distill.teacher import load_hf_target, teacher_forward
    model = load_hf_target(checkpoint.path)
    return [teacher_forward(model, [t.prompt + t.output], 1, True)[0][2] for t in turns]


def decode_turns(engine: Any, items: Sequence[Any], tokenizer: Any, max_tokens: int) -> list[Turn]:
    """Every turn of every conversation, decoded greedily by ``engine`` (a ``LocalEngine`` with no
    drafters), 8 conversations at a time."""
    from cosine_ray.cli.bench import encode_messages
    from cosine_ray.engine.request import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)

    async def one(item) -> list[Turn]:
        history, turns = [], []
        for text in item.turns:
            history.append({"role": "user", "content": text})
            prompt = tuple(encode_messages(tokenizer, history))
            result = await engine.loop.generate_all(list(prompt), params)
            turns.append(Turn(item.domain, prompt, tuple(result.new_token_ids)))
            history.append({"role": "assistant",
                            "content": tokenizer.decode(result.new_token_ids, skip_special_tokens=True)})
        return turns

    async def run_all() -> list[list[Turn]]:
        sem = asyncio.Semaphore(8)

        async def bounded(item):
            async with sem:
                return await one(item)
        try:
            return list(await asyncio.gather(*(bounded(i) for i in items)))
        finally:
            await engine.loop.shutdown()
    return [t for conv in asyncio.run(run_all()) for t in conv]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="drafting_ceiling", description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="mixed", help="mixed | multi-turn | code-edit | template")
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

    from cosine_ray.cli.args import CliError
    from cosine_ray.cli.bench import DEFAULT_PROMPT_DIR, build_conversations
    from cosine_ray.engine.config import config_from_dict, parse_drafters
    from cosine_ray.engine.profile import load_or_profile
    from cosine_ray.engine.worker.features import FeatureStore
    from cosine_ray.models.loader import resolve_checkpoint

    torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint("smollm2-135m")
    if args.turns:
        try:
            earlier = json.loads(Path(args.turns).read_text())
            warm, measured = ([Turn(t["domain"], tuple(t["prompt"]), tuple(t["output"])) for t in earlier["turns"][k]]
                              for k in ("warm", "measured"))
            for key in ("workload", "prompts_per_domain", "warmup_per_domain", "max_tokens", "seed"):
                setattr(args, key, earlier["args"][key])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return fail(f"--turns: {args.turns} is not a drafting_ceiling output ({str(exc).splitlines()[0]})")
        print(f"replaying {len(warm)} warm-up and {len(measured)} measured turns from {args.turns}", flush=True)
    else:
        ns = argparse.Namespace(workload=args.workload, prompt_dir=str(DEFAULT_PROMPT_DIR), seed=args.seed,
                                prompts_per_domain=args.prompts_per_domain,
                                warmup_per_domain=args.warmup_per_domain, max_tokens=args.max_tokens)
        try:
            warm_items, measured_items = build_conversations(ns)
        except CliError as exc:
            return fail(str(exc))
        from cosine_ray.engine.local import LocalEngine
        tokenizer = checkpoint.load_tokenizer()
        started = time.perf_counter()
        engine = LocalEngine(config_from_dict({"model": checkpoint.name, "drafters": "none",
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
    out.write_text(json.dumps({"command": "benchmarks/drafting_ceiling.py", "args": vars(args),
                               "measured_turns": len(measured), "warmup_turns": len(warm),
                               "latency_model": latency.to_dict(), "results": rows,
                               "turns": {k: [{"domain": t.domain, "prompt": t.prompt, "output": t.output}
                                             for t in turns] for k, turns in (("warm", warm), ("measured", measured))}},
                              indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
