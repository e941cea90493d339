"""``cosine-ray bench``: tokens/s of HF transformers and cosine_ray systems on one workload, in one run.

Workloads (``--workload``, the requests ``cosine-loadgen`` sends: ``loadgen.workload`` and
``loadgen.tasks`` build them, docs/benchmarks.md describes them): users' traffic ``chat``,
``json``, ``edit``, ``rag``, ``agent`` and all of them together, ``mixed``; and ``multi-turn``,
``code-edit``, ``template``. Measured conversations come from the held-back half of each prompt
file, ``--warmup-per-domain`` ones from the first half.

Systems (``--systems``, ``;``-separated): ``hf-greedy``, ``hf-prompt-lookup``, and any
``--drafters`` value with engine settings changed by name (``learning@routing=random``:
``EngineConfig.replace``; ``prediction=none|random`` sends no prediction, or random words as
long). Every cosine_ray system × concurrency starts from a fresh engine, and every output is
compared token by token with HF greedy or, without it, ``none`` (plain decoding) or the first
system. HF applies no grammar, so a workload with a schema runs no HF system. ``--rounds N``
interleaves N rounds in seeded shuffled orders and prints medians and the min–max of each
ratio to the same round's ``none``. Conversations, rounds, the HF reference and the figures
are ``cosine_ray.bench``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosine_ray.bench.conversations import (PREDICTIONS, Turn, count_tokens, has_grammar, later_turns,
                                            prediction_counts, run_conversations, run_hf, same_output)
from cosine_ray.bench.figures import routing_shares, spec_figures
from cosine_ray.bench.rounds import Spread, round_order
from cosine_ray.cli.args import (MODEL_HELP, SPEC_TOKENS_HELP, CliError, add_device_args, check_local_device,
                                 runner_from_args)
from cosine_ray.datasets import default_prompt_dir
from cosine_ray.metrics.names import STEP_PHASES

DEFAULT_PROMPT_DIR = default_prompt_dir()
"""``$COSINE_RAY_PROMPTS``, else the packaged ``cosine_ray/data/prompts`` (cosine_ray/datasets.py)."""

HF_SYSTEMS = ("hf-greedy", "hf-prompt-lookup")
DEFAULT_SYSTEMS = "hf-greedy;hf-prompt-lookup;none;ngram;suffix;retrieval;ngram,retrieval;default;learning"
ABLATIONS = ("routing=random", "fusion=single", "scheduler=fcfs", "adaptive=false")
"""The CoSine ablations (``SYSTEM@ABLATION``): routing off, fusion off, LP off, adaptive off."""


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="tokens/s on a workload: HF vs cosine_ray systems")
    p.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    p.add_argument("--prompt-dir", default=str(DEFAULT_PROMPT_DIR),
                   help="folder with humaneval/gsm8k/alpaca/mtbench .jsonl")
    p.add_argument("--workload", default="chat",
                   help="chat | json | edit | rag | agent | mixed (all of them) | multi-turn | code-edit | template")
    p.add_argument("--prompts-per-domain", type=int, default=3,
                   help="measured conversations per domain (× 4 domains; second half of each file)")
    p.add_argument("--warmup-per-domain", type=int, default=0,
                   help="warm-up conversations per domain before the measured ones (first half of each file)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per turn at most (default 64)")
    p.add_argument("--systems", default=None,
                   help=f"(default: {DEFAULT_SYSTEMS}, without the hf ones on a workload with a schema) "
                        "';'-separated: hf-greedy, hf-prompt-lookup, or DRAFTERS[@key=value,...] "
                        "(engine settings by name, e.g. learning@routing=random; prediction=none|random: "
                        "what the edit workload's requests predict); 'ablations' after a "
                        "system adds its four CoSine ablations (e.g. 'learning;ablations')")
    p.add_argument("--drafter-sets", default=None, help="(old flag) ';'-separated --drafters values; "
                   "the same as --systems with hf-greedy;hf-prompt-lookup in front")
    p.add_argument("--concurrency", default="1", help="comma list of concurrent conversations, e.g. 1,8")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help=SPEC_TOKENS_HELP)
    p.add_argument("--prompt-lookup-tokens", type=int, default=8, help="HF prompt_lookup_num_tokens")
    p.add_argument("--repeat-probe", action="store_true",
                   help="send the first measured request again at the end and report its acceptance")
    p.add_argument("--seed", type=int, default=0, help="workload seed (and the rounds' order)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every cosine_ray system x concurrency this many times, interleaved in a "
                        "shuffled order per round; prints medians and min-max of each ratio to none")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_device_args(p)
    p.add_argument("--out", default="bench-results/bench.json", help="where the results are written as JSON")


# ---- systems --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class System:
    name: str
    drafters: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    """Engine settings by name (``EngineConfig.replace``)."""
    prediction: str = "workload"
    """What its scripted requests predict (``bench.conversations.PREDICTIONS``)."""

    @property
    def is_hf(self) -> bool:
        return self.name in HF_SYSTEMS


def parse_systems(text: str) -> list[System]:
    """``hf-greedy;none;learning@routing=random;learning;ablations`` → systems (CliError when bad)."""
    import yaml

    from cosine_ray.engine.config import config_from_dict
    systems: list[System] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        if part == "ablations":
            if not systems or systems[-1].is_hf:
                raise CliError("'ablations' must follow a cosine_ray system in --systems")
            base = systems[-1]
            systems += [parse_systems(f"{base.name}{'@' if '@' not in base.name else ','}{a}")[0] for a in ABLATIONS]
            continue
        if part in HF_SYSTEMS:
            systems.append(System(part))
            continue
        drafters, _, overrides = part.partition("@")
        settings: dict[str, Any] = {}
        for item in filter(None, (o.strip() for o in re.split(r",(?![^\[]*\])", overrides))):  # [a, b] is one value
            key, sep, value = item.partition("=")
            if not sep:
                raise CliError(f"--systems: {item!r} in {part!r} is not KEY=VALUE")
            settings[key.strip()] = yaml.safe_load(value)
        prediction = str(settings.pop("prediction", "workload"))
        if prediction not in PREDICTIONS:
            raise CliError(f"--systems {part!r}: prediction must be one of {', '.join(PREDICTIONS)}")
        try:
            config_from_dict({"drafters": drafters.strip() or "none"}).replace(**settings)
        except ValueError as exc:
            raise CliError(f"--systems {part!r}: {str(exc).splitlines()[0]}") from None
        systems.append(System(part, drafters.strip() or "none", settings, prediction))
    if not systems:
        raise CliError("--systems is empty")
    names = [s.name for s in systems]
    if len(set(names)) != len(names):
        raise CliError(f"--systems names a system twice: {part!r}")
    return systems


# ---- the run --------------------------------------------------------------------------------------

def build_conversations(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """(warm-up, measured) WorkItems: the first and second half of each prompt file."""
    from cosine_ray.bench.workloads import bench_workload
    from loadgen.workload import WorkloadError
    try:
        return bench_workload(args.workload, args.prompt_dir, args.prompts_per_domain, args.warmup_per_domain,
                              args.max_tokens, args.seed)
    except WorkloadError as exc:
        raise CliError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    import torch

    from cosine_ray.bench.engines import start_engine
    from cosine_ray.engine.config import config_from_dict
    from cosine_ray.engine.request import SamplingParams
    from cosine_ray.models.loader import resolve_checkpoint

    if args.prompts_per_domain < 1 or args.max_tokens < 1 or args.warmup_per_domain < 0:
        raise CliError("--prompts-per-domain and --max-tokens must be >= 1, --warmup-per-domain >= 0")
    try:
        concurrencies = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        raise CliError(f"--concurrency must be a comma list of integers, got {args.concurrency!r}") from None
    if not concurrencies or min(concurrencies) < 1:
        raise CliError("--concurrency values must be >= 1")
    if args.rounds < 1:
        raise CliError("--rounds must be >= 1")
    text = f"{';'.join(HF_SYSTEMS)};{args.drafter_sets}" if args.drafter_sets else args.systems
    systems = parse_systems(text or DEFAULT_SYSTEMS)
    check_local_device(args.device)
    warm, measured = build_conversations(args)
    if has_grammar([item.turns for item in warm + measured]):
        if text and any(s.is_hf for s in systems):
            raise CliError(f"--workload {args.workload} constrains answers by a JSON schema, which HF "
                           f"transformers does not apply: leave {', '.join(HF_SYSTEMS)} out of --systems")
        systems = [s for s in systems if not s.is_hf]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        checkpoint = resolve_checkpoint(args.model)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    tokenizer = checkpoint.load_tokenizer()
    params = SamplingParams(max_tokens=args.max_tokens)
    convs = [item.turns for item in measured]
    warm_convs = [item.turns for item in warm]
    domains = [item.domain for item in measured]

    rows: list[dict[str, Any]] = []
    outputs: dict[str, list[list[Turn]]] = {}
    hf = None
    for system in [s for s in systems if s.is_hf]:
        hf = hf or checkpoint.load_hf_model(dtype=getattr(torch, args.dtype)).to(args.device)
        kwargs = {"prompt_lookup_num_tokens": args.prompt_lookup_tokens} if system.name == "hf-prompt-lookup" else {}
        run_hf(hf, tokenizer, [("Hello",)], 4, **kwargs)  # first-call costs are not measured
        start = time.perf_counter()
        outs = run_hf(hf, tokenizer, convs, args.max_tokens, **kwargs)
        secs = time.perf_counter() - start
        outputs[system.name] = outs
        rows.append({"system": system.name, "concurrency": 1, "tokens": count_tokens(outs), "seconds": secs})
        _task_figures(rows[-1], outs)
        print(f"  {system.name}: {rows[-1]['tokens'] / secs:.2f} tok/s", flush=True)

    work = [(s, c) for s in systems if not s.is_hf for c in concurrencies]
    for rnd, (system, c) in round_order(work, args.rounds, "shuffle" if args.rounds > 1 else "fixed", args.seed):
        try:
            config = config_from_dict({"model": args.model, "drafters": system.drafters,
                                       "device": args.device, "dtype": args.dtype, "weights": args.weights,
                                       "kv_cache_memory": args.kv_cache_memory}).replace(
                **{"runner": runner_from_args(args), "max_num_seqs": max(c, 8),
                   "num_speculative_tokens": args.num_speculative_tokens, **system.settings})  # the system's win
            engine = start_engine(config, checkpoint=checkpoint)
        except (ValueError, OSError) as exc:
            raise CliError(str(exc).splitlines()[0]) from None
        row: dict[str, Any] = {"system": system.name, "concurrency": c}
        if args.rounds > 1:
            row["round"] = rnd
        start = time.perf_counter()
        warm_outs = asyncio.run(run_conversations(engine, warm_convs or [("Hello",)],
                                                  params if warm_convs else SamplingParams(max_tokens=4),
                                                  8, tokenizer, system.prediction))
        if warm_convs:
            row["warmup"] = {"tokens": count_tokens(warm_outs), "seconds": time.perf_counter() - start,
                             **_spec_figures(warm_outs)}
        busy, steps = _gpu_busy_seconds(engine), dict(engine.target.stages[0].runner.stats)
        phases, priced = _phase_seconds(engine), _price_counts(engine)
        start = time.perf_counter()
        outs = asyncio.run(run_conversations(engine, convs, params, c, tokenizer, system.prediction))
        secs = time.perf_counter() - start
        if engine.config.device != "cpu":
            row["gpu_busy_share"] = (_gpu_busy_seconds(engine) - busy) / secs
            # steps the first stage ran eagerly / as graphs, and graphs captured, while measured
            row["runner_steps"] = {k: v - steps[k] for k, v in engine.target.stages[0].runner.stats.items()}
        outputs[_output_key(row)] = outs
        routed = ((d, t.stats.routed_to, t.stats.num_routed_steps) for conv, d in zip(outs, domains) for t in conv)
        row.update(tokens=count_tokens(outs), seconds=secs, **_spec_figures(outs),
                   routing_shares=routing_shares(routed, sorted(set(domains))),
                   decision_ms=_decision_ms(engine), step_ms=_step_ms(engine, phases))
        _task_figures(row, outs)
        if args.repeat_probe:
            first = asyncio.run(run_conversations(engine, [convs[0][:1]], params, 1, tokenizer, system.prediction))
            row["repeat_probe"] = {"first": _spec_figures([outs[0][:1]]), "again": _spec_figures(first),
                                   "identical": first[0][0].token_ids == outs[0][0].token_ids}
        by_repeat = _by_repeat(outs, convs)
        if by_repeat is not None:
            row["by_repeat"] = by_repeat
        row["index_bytes"] = _index_bytes(engine)
        guard = engine.core.scheduler.guard
        if guard is not None:  # κ the speculation guard ended the run at (0 = speculation off)
            row["speculation_level"] = guard.levels[guard.current_level(c)]
            row["speculation_levels"] = guard.levels_by_bucket()
        price = _price_figures(engine, priced, c)
        if price is not None:
            row["price"] = price
        rows.append(row)
        gpu = f", GPU busy {row['gpu_busy_share']:.0%} of the time" if "gpu_busy_share" in row else ""
        gpu += f", guard at κ={row['speculation_level']:g}" if "speculation_level" in row else ""
        split = ", ".join(f"{k} {v:.2f}" for k, v in row["step_ms"].items() if k != "steps")
        print(f"  {_output_key(row)}: {row['tokens'] / secs:.2f} tok/s, mean accepted length "
              f"{row['mean_accepted_length']:.2f}{gpu}; ms per step: {split}", flush=True)
        if price is not None:
            print(f"    trees: {price['verified_nodes_per_request_step']:.2f} nodes verified of "
                  f"{price['drafted_nodes_per_request_step']:.2f} drafted per request-step; priced steps: "
                  f"{price['drained_share']:.0%} of request-steps in a drain, {price['held_back_share']:.0%} "
                  f"held back before drafting; token price {_ms(price['token_slope_ms'])} ms measured, "
                  f"{price['fit_c_tok_ms']:.3f} ms fit", flush=True)
        del engine
        gc.collect()  # the next engine sizes its KV pool from the memory this one leaves free

    if "hf-greedy" in outputs or not work:
        ref_name = "hf-greedy" if "hf-greedy" in outputs else next(iter(outputs))
    else:  # plain decoding's (else the first listed system's) first round, not whichever ran first
        first = next(((s, c) for s, c in work if s.name == "none"), work[0])
        ref_name = _output_key({"system": first[0].name, "concurrency": first[1],
                                **({"round": 1} if args.rounds > 1 else {})})
    ref = outputs[ref_name]
    base = next((r["tokens"] / r["seconds"] for r in rows if r["system"] == "hf-greedy"), None)
    off = {(r["concurrency"], r.get("round")): r["tokens"] / r["seconds"] for r in rows if r["system"] == "none"}
    later_off = {(r["concurrency"], r.get("round")): r["later_turns"]["tokens_per_s"]
                 for r in rows if r["system"] == "none" and "later_turns" in r}
    for row in rows:
        outs = outputs[_output_key(row)]
        same = sum(same_output(t, r) for conv, rconv in zip(outs, ref) for t, r in zip(conv, rconv))
        row["lossless_identical"] = f"{same}/{sum(len(c) for c in outs)}"
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        if base:
            row["ratio_vs_hf_greedy"] = row["tokens_per_s"] / base
        if (row["concurrency"], row.get("round")) in off:  # the same round's plain decoding
            row["ratio_vs_off"] = row["tokens_per_s"] / off[row["concurrency"], row.get("round")]
            later = later_off.get((row["concurrency"], row.get("round")))
            if later and "later_turns" in row:
                row["later_turns"]["ratio_vs_off"] = row["later_turns"]["tokens_per_s"] / later

    report = {
        "command": "cosine-ray bench", "model": checkpoint.name, "workload": args.workload,
        "max_tokens": args.max_tokens, "measured_conversations": len(convs),
        "warmup_conversations": len(warm_convs), "lossless_reference": ref_name,
        "conversations": [{"domain": i.domain, "source": i.source_id, "turns": len(i.turns),
                           "prompt": str(i.turns[0])[:80]} for i in measured],
        "split": "measured: second half of each prompt file; warm-up: first half",
        "num_speculative_tokens": args.num_speculative_tokens,
        "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__,
        "results": rows,
    }
    if args.rounds > 1:
        report["rounds"] = args.rounds
        report["summary"] = summarize_rounds(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=float))
    _print_table(report)
    print(f"wrote {out}")
    return 0


def _output_key(row: dict[str, Any]) -> str:
    if row["system"] in HF_SYSTEMS:
        return row["system"]
    return f"{row['system']} c={row['concurrency']}" + (f" round {row['round']}" if "round" in row else "")


def summarize_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cosine_ray system and concurrency over the rounds: median tok/s, the median, min and
    max of its ratio to the same round's ``none``, and whether every round's output matched."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if "round" in r:
            groups.setdefault((r["system"], r["concurrency"]), []).append(r)
    summary = []
    for (system, c), members in groups.items():
        entry: dict[str, Any] = {"system": system, "concurrency": c, "rounds": len(members),
                                 "tokens_per_s": Spread.of([m["tokens_per_s"] for m in members]).median,
                                 "identical_every_round": all(_all_same(m["lossless_identical"]) for m in members)}
        ratios = [m["ratio_vs_off"] for m in members if "ratio_vs_off" in m]
        if ratios:
            spread = Spread.of(ratios)
            entry.update(ratio_vs_off=spread.median, ratio_min=spread.low, ratio_max=spread.high)
        later = [m["later_turns"]["ratio_vs_off"] for m in members if "ratio_vs_off" in m.get("later_turns", {})]
        if later:
            spread = Spread.of(later)
            entry["later_turns"] = {"ratio_vs_off": spread.median, "ratio_min": spread.low, "ratio_max": spread.high}
        summary.append(entry)
    return summary


def _task_figures(row: dict[str, Any], outs: list[list[Turn]]) -> None:
    """A run's accepted and rejected prediction tokens (when its requests predicted), and the
    tokens per second of the turns after each conversation's first (when they have several)."""
    accepted, rejected = prediction_counts(outs)
    if accepted or rejected:
        row["prediction"] = {"accepted": accepted, "rejected": rejected}
    if any(len(conv) > 1 for conv in outs):
        tokens, seconds = later_turns(outs)
        row["later_turns"] = {"tokens": tokens, "seconds": seconds,
                              "tokens_per_s": tokens / seconds if seconds else 0.0}


def _all_same(identical: str) -> bool:
    same, total = identical.split("/")
    return same == total


def _spec_figures(outs: list[list[Turn]]) -> dict[str, float]:
    return spec_figures(t.stats for conv in outs for t in conv)


def _by_repeat(outs: list[list[Turn]], prompts: list[tuple[str, ...]]) -> dict[str, Any] | None:
    """Speculation figures of the measured conversations split into first sends and repeats (a
    conversation whose turns equal an earlier measured one's, word for word: the template
    workload's popular questions); None when nothing repeats."""
    seen: set[tuple[str, ...]] = set()
    first, again = [], []
    for conv, turns in zip(outs, prompts):
        key = tuple(turns)
        (again if key in seen else first).append(conv)
        seen.add(key)
    if not again:
        return None
    return {"first": _spec_figures(first), "repeat": _spec_figures(again),
            "first_sends": len(first), "repeats": len(again)}


def _phase_seconds(engine) -> dict[str, float]:
    """Seconds spent in each part of the engine's steps so far, and the number of steps."""
    m = engine.core.metrics
    out = {p: m.total("cosine_ray:step_phase_seconds", phase=p) for p in STEP_PHASES}
    out["steps"] = m.total("cosine_ray:engine_steps")
    return out


def _step_ms(engine, before: dict[str, float]) -> dict[str, float]:
    """Milliseconds per step in each part since ``before`` (``_phase_seconds``), and the steps."""
    now = _phase_seconds(engine)
    steps = now["steps"] - before["steps"]
    out = {p: 1e3 * (now[p] - before[p]) / steps if steps else 0.0 for p in STEP_PHASES}
    out["steps"] = steps
    return out


def _price_counts(engine) -> tuple[int, int, int, int, int]:
    """The scheduler's price tally and the speculator's node counts so far (``_price_figures``)."""
    t, sp = engine.core.scheduler.tally, engine.core.speculator
    return t.request_steps, t.drained, t.held_back, sp.drafted_nodes, sp.verified_nodes


def _price_figures(engine, before: tuple[int, int, int, int, int], concurrency: int) -> dict | None:
    """How the price cut the trees since ``before``: nodes drafted and verified per decoding
    request-step, the share of priced request-steps in a drain and held back at γ = 0 before
    drafting, and the token price at this concurrency (the batch size's measured slope, None
    before it has one; the latency fit's). None for systems without a price."""
    if not engine.core.scheduler.priced or not engine.core.drafters:
        return None
    steps, drained, held, drafted, verified = (a - b for a, b in zip(_price_counts(engine), before))
    costs = engine.core.scheduler.costs
    slope = costs.token_slope(concurrency)
    per_step = 1.0 / steps if steps else 0.0
    return {"request_steps": steps, "drained_share": drained * per_step, "held_back_share": held * per_step,
            "drafted_nodes_per_request_step": drafted * per_step,
            "verified_nodes_per_request_step": verified * per_step,
            "token_slope_ms": 1e3 * slope if slope is not None else None,
            "fit_c_tok_ms": 1e3 * costs.latency.c_tok}


def _ms(value: float | None) -> str:
    return "none" if value is None else f"{value:.3f}"


def _decision_ms(engine) -> float:
    h = engine.core.metrics.get("cosine_ray:scheduler_decision_seconds")
    return 1e3 * h.sum / h.count if h is not None and h.count else 0.0


def _gpu_busy_seconds(engine) -> float:
    """GPU seconds inside the target's forwards so far, over its stages (0 on CPU)."""
    return sum(s.runner.gpu_busy_seconds() for s in engine.target.stages)


def _index_bytes(engine) -> int:
    """Bytes the drafters' suffix indexes hold (global and per-request; 0 for other drafters)."""
    total = 0
    for d in engine.drafters:
        if hasattr(d, "state_size"):
            size = d.state_size()
            total += size.get("global_bytes", 0) + size.get("local_bytes", 0)
    return total


def _print_table(report: dict[str, Any]) -> None:
    rows = report["results"]
    print(f"\nworkload {report['workload']}: {report['measured_conversations']} measured conversations "
          f"({report['warmup_conversations']} warm-up before), {report['max_tokens']} new tokens per turn, greedy")
    header = (f"{'system':<36} {'c':>3} {'tok/s':>7} {'vs HF':>6} {'vs off':>6} {'acc. len':>8} "
              f"{'acc. rate':>9} {'identical':>9}" + (f" {'round':>5}" if "rounds" in report else ""))
    print(header)
    print("-" * len(header))
    for r in rows:
        vs_hf = f"{r['ratio_vs_hf_greedy']:.2f}x" if "ratio_vs_hf_greedy" in r else ""
        vs_off = f"{r['ratio_vs_off']:.2f}x" if "ratio_vs_off" in r else ""
        acc = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else ""
        rate = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
        rnd = f" {r['round']:>5}" if "round" in r else ""
        print(f"{r['system']:<36} {r['concurrency']:>3} {r['tokens_per_s']:>7.2f} {vs_hf:>6} {vs_off:>6} "
              f"{acc:>8} {rate:>9} {r['lossless_identical']:>9}{rnd}")
    if "summary" in report:
        print(f"\nover {report['rounds']} rounds (each in its own shuffled order; ratio to the same round's none)")
        print(f"{'system':<36} {'c':>3} {'median tok/s':>12} {'vs off: median':>14} {'min-max':>13} {'identical':>9}")
        for e in report["summary"]:
            ratio = f"{e['ratio_vs_off']:.2f}x" if "ratio_vs_off" in e else ""
            spread = f"{e['ratio_min']:.2f}-{e['ratio_max']:.2f}x" if "ratio_vs_off" in e else ""
            same = "all" if e["identical_every_round"] else "NOT all"
            print(f"{e['system']:<36} {e['concurrency']:>3} {e['tokens_per_s']:>12.2f} {ratio:>14} {spread:>13} {same:>9}")
    for r in rows:
        extra = []
        if "prediction" in r:
            extra.append(f"prediction tokens accepted {r['prediction']['accepted']}, rejected "
                         f"{r['prediction']['rejected']}")
        if "later_turns" in r:
            later = r["later_turns"]
            ratio = f" ({later['ratio_vs_off']:.2f}x off)" if "ratio_vs_off" in later else ""
            extra.append(f"turns after the first {later['tokens_per_s']:.2f} tok/s{ratio}")
        if extra:
            print(f"{_output_key(r)}: " + "; ".join(extra))
    for e in report.get("summary", []):
        if "later_turns" in e:
            later = e["later_turns"]
            print(f"turns after the first, {e['system']} c={e['concurrency']}: {later['ratio_vs_off']:.2f}x off "
                  f"({later['ratio_min']:.2f}-{later['ratio_max']:.2f}x over the rounds)")
    for r in rows:
        if "repeat_probe" in r:
            p = r["repeat_probe"]
            print(f"repeat probe, {r['system']} c={r['concurrency']}: first send mean accepted length "
                  f"{p['first']['mean_accepted_length']:.2f} (acceptance {p['first']['acceptance_rate']:.2f}), "
                  f"again {p['again']['mean_accepted_length']:.2f} (acceptance {p['again']['acceptance_rate']:.2f}), "
                  f"identical text: {p['identical']}")
    for r in rows:
        if "by_repeat" in r:
            b = r["by_repeat"]
            print(f"first sends / repeats, {r['system']} c={r['concurrency']}: mean accepted length "
                  f"{b['first']['mean_accepted_length']:.2f} over {b['first_sends']} first sends, "
                  f"{b['repeat']['mean_accepted_length']:.2f} over {b['repeats']} repeats of an earlier measured one")
    for r in rows:
        if r.get("routing_shares") and any(len(v) > 1 for v in r["routing_shares"].values()):
            print(f"routing shares, {r['system']} c={r['concurrency']}: " + "; ".join(
                f"{d}: " + " ".join(f"{k}={v}" for k, v in sh.items()) for d, sh in r["routing_shares"].items()))
