"""``cosine-ray bench``: single-request tokens/s, HF transformers vs cosine_ray, in one run.

Held-back prompts only: the second half of each domain file in shared/data/prompts (the
first half builds the retrieval datastores). For every prompt, in turn and on the same
machine: HF greedy ``generate``, HF prompt-lookup decoding, then cosine_ray with each
drafter set. Every cosine_ray output is compared token by token with HF greedy (lossless
check). Writes one JSON file with every figure and the ratios, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

def _default_prompt_dir() -> Path:
    """``$COSINE_RAY_PROMPTS``, else ``shared/data/prompts`` beside the checkout."""
    env = os.environ.get("COSINE_RAY_PROMPTS")
    if env:
        return Path(env)
    beside = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "prompts"
    return beside if beside.is_dir() else Path("/work/shared/data/prompts")


DEFAULT_PROMPT_DIR = _default_prompt_dir()
DOMAIN_FILES = {"code": "humaneval.jsonl", "math": "gsm8k.jsonl",
                "instruction": "alpaca.jsonl", "chat": "mtbench.jsonl"}


def read_prompts(path: str | Path, error: type[Exception] = ValueError) -> list[dict[str, Any]]:
    """JSON lines with a non-empty string ``prompt``; raises ``error`` with one line."""
    path = Path(path)
    if not path.is_file():
        raise error(f"prompt file {path} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}:{n}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
                raise error(f"{path}:{n}: each line needs a non-empty string field 'prompt'")
            rows.append(row)
    if not rows:
        raise error(f"prompt file {path} has no prompts")
    return rows


def held_back_prompts(prompt_dir: Path, per_domain: int, error: type[Exception]) -> list[tuple[str, str]]:
    out = []
    for domain, name in DOMAIN_FILES.items():
        rows = read_prompts(prompt_dir / name, error)
        out.extend((domain, r["prompt"]) for r in rows[(len(rows) + 1) // 2:][:per_domain])
    return out


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-dir", default=str(DEFAULT_PROMPT_DIR),
                   help="folder with humaneval/gsm8k/alpaca/mtbench .jsonl")
    p.add_argument("--prompts-per-domain", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafter-sets", default="none;ngram;retrieval;ngram,retrieval;default",
                   help="semicolon-separated --drafters values to measure")
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--prompt-lookup-tokens", type=int, default=8, help="HF prompt_lookup_num_tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="bench-results/bench.json")


def _time_hf(model, prompt_ids: list[int], max_tokens: int, **kwargs) -> tuple[list[int], float]:
    import torch
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False, **kwargs)
    return out[0, len(prompt_ids):].tolist(), time.perf_counter() - start


def run_bench(args: argparse.Namespace) -> int:
    import torch

    from cosine_ray.cli import CliError, load_engine
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.local import encode_prompt
    from cosine_ray.engine.request import SamplingParams
    from cosine_ray.engine.router import RouterConfig

    if args.prompts_per_domain < 1 or args.max_tokens < 1:
        raise CliError("--prompts-per-domain and --max-tokens must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        drafter_sets = [(s.strip(), parse_drafters(s.strip())) for s in args.drafter_sets.split(";")]
    except ValueError as exc:
        raise CliError(str(exc)) from None
    prompts = held_back_prompts(Path(args.prompt_dir), args.prompts_per_domain, CliError)

    engines = {label: load_engine(EngineConfig(
        model=args.model, drafters=specs,
        router=RouterConfig(max_batch_size=1, num_speculative_tokens=args.num_speculative_tokens)))
        for label, specs in drafter_sets}
    first = next(iter(engines.values()))
    tokenizer, checkpoint = first.tokenizer, first.checkpoint
    hf = checkpoint.load_hf_model()
    prompt_ids = [encode_prompt(tokenizer, text) for _, text in prompts]
    params = SamplingParams(max_tokens=args.max_tokens)

    # warm-up: one short run of everything so first-call costs are not measured
    _time_hf(hf, prompt_ids[0], 4)
    _time_hf(hf, prompt_ids[0], 4, prompt_lookup_num_tokens=args.prompt_lookup_tokens)
    for engine in engines.values():
        engine.generate([prompt_ids[0]], SamplingParams(max_tokens=4))

    rows: dict[str, dict[str, Any]] = {}
    references: list[list[int]] = []

    def record(label: str, tokens: int, seconds: float, extra: dict[str, Any] | None = None) -> None:
        row = rows.setdefault(label, {"tokens": 0, "seconds": 0.0, "per_prompt_tok_s": []})
        row["tokens"] += tokens
        row["seconds"] += seconds
        row["per_prompt_tok_s"].append(tokens / seconds)
        for k, v in (extra or {}).items():
            row.setdefault(k, []).append(v)

    for i, ids in enumerate(prompt_ids):
        ref, secs = _time_hf(hf, ids, args.max_tokens)
        references.append(ref)
        record("hf greedy", len(ref), secs)
        out, secs = _time_hf(hf, ids, args.max_tokens, prompt_lookup_num_tokens=args.prompt_lookup_tokens)
        record("hf prompt-lookup", len(out), secs, {"identical": out == ref})
        for label, engine in engines.items():
            start = time.perf_counter()
            result = engine.generate([ids], params)[0]
            secs = time.perf_counter() - start
            ref_cut = ref[:len(result.new_token_ids)]
            record(f"cosine_ray [{label}]", len(result.new_token_ids), secs, {
                "identical": result.new_token_ids == ref_cut and (len(ref) == len(result.new_token_ids)
                                                                  or result.finish_reason == "stop"),
                "mean_accepted_length": result.stats.mean_accepted_length,
                "num_verify_steps": result.stats.num_verify_steps,
                "num_draft_tokens": result.stats.num_draft_tokens,
                "num_accepted_tokens": result.stats.num_accepted_tokens,
            })
        print(f"  prompt {i + 1}/{len(prompt_ids)} ({prompts[i][0]}) done", flush=True)

    base = rows["hf greedy"]["tokens"] / rows["hf greedy"]["seconds"]
    summary = []
    for label, row in rows.items():
        tok_s = row["tokens"] / row["seconds"]
        entry = {"system": label, "tokens": row["tokens"], "seconds": round(row["seconds"], 3),
                 "tokens_per_s": round(tok_s, 3), "ratio_vs_hf_greedy": round(tok_s / base, 3),
                 "median_prompt_tok_s": round(statistics.median(row["per_prompt_tok_s"]), 3)}
        if "identical" in row:
            entry["lossless_identical"] = f"{sum(row['identical'])}/{len(row['identical'])}"
        if "mean_accepted_length" in row:
            steps = sum(row["num_verify_steps"])
            entry["mean_accepted_length"] = round(
                (sum(row["num_accepted_tokens"]) + steps) / steps, 3) if steps else 0.0
            drafted = sum(row["num_draft_tokens"])
            entry["acceptance_rate"] = round(sum(row["num_accepted_tokens"]) / drafted, 3) if drafted else 0.0
        summary.append(entry)

    report = {
        "command": "cosine-ray bench", "model": checkpoint.name, "max_tokens": args.max_tokens,
        "prompts": [{"domain": d, "prompt": t[:80]} for d, t in prompts],
        "split": "second half of each prompt file (held back from datastores)",
        "num_speculative_tokens": args.num_speculative_tokens,
        "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__,
        "results": summary,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    _print_table(summary, len(prompts), args.max_tokens)
    print(f"wrote {out}")
    return 0


def _print_table(summary: list[dict[str, Any]], num_prompts: int, max_tokens: int) -> None:
    print(f"\nsingle request, {num_prompts} held-back prompts, {max_tokens} new tokens, greedy")
    header = f"{'system':<34} {'tok/s':>7} {'vs HF':>6} {'accept len':>10} {'accept rate':>11} {'identical':>9}"
    print(header)
    print("-" * len(header))
    for e in summary:
        print(f"{e['system']:<34} {e['tokens_per_s']:>7.2f} {e['ratio_vs_hf_greedy']:>5.2f}x "
              f"{e.get('mean_accepted_length', ''):>10} {e.get('acceptance_rate', ''):>11} "
              f"{e.get('lossless_identical', ''):>9}")
