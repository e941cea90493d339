"""``cosine-ray``: generate | datastore build | bench | profile.

Bad input (empty prompt, max tokens < 1, negative temperature, unknown drafter, missing
model path, ...) prints one line ``cosine-ray: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from typing import Sequence

from cosine_ray.engine.config import DEFAULT_DRAFTERS


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(f"{message} (see `{self.prog} --help`)")


def add_cosine_args(p: argparse.ArgumentParser) -> None:
    """CoSine's components and their ablation switches (RouterConfig fields)."""
    g = p.add_argument_group("CoSine (ablation switches)")
    g.add_argument("--routing", choices=("expertise", "random"), default=None,
                   help="expertise routing (eq. 1-3) or random drafters (routing off)")
    g.add_argument("--fusion", choices=("confidence", "single", "union"), default=None,
                   help="confidence fusion (eq. 4), the single best drafter (fusion off), or union of paths")
    g.add_argument("--scheduler", choices=("lp", "fcfs"), default=None,
                   help="LP batch scheduler (eq. 5-8) or first-come fixed batches (LP off)")
    g.add_argument("--no-adaptive", dest="adaptive", action="store_false", default=None,
                   help="fixed γ and drafter participation (adaptive speculation off)")
    g.add_argument("--drafters-per-request", type=int, default=None, help="k drafters routed per request (1-3)")


def cosine_router_overrides(args: argparse.Namespace) -> dict:
    """RouterConfig fields given on the command line (absent flags are left out)."""
    names = ("routing", "fusion", "scheduler", "adaptive", "drafters_per_request", "num_speculative_tokens")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def _add_engine_args(p: argparse.ArgumentParser, *, drafters_default: str = DEFAULT_DRAFTERS) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="target model: embedded name, Hugging Face directory or .gguf file")
    p.add_argument("--drafters", default=drafters_default,
                   help="none, or a comma list of ngram, retrieval[:DOMAIN|:FILE.parquet], model:MODEL, self")
    p.add_argument("--num-speculative-tokens", type=int, default=8,
                   help="draft-token budget of each request's tree per step (0 = plain decoding)")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages (layer slices) of the target")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_cosine_args(p)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cosine-ray", description="Collaborative speculative inference on a Ray cluster.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text for one prompt in this process")
    gen.add_argument("prompt", help="the user prompt (sent through the model's chat template)")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token_ids, stats) instead of streaming")

    ds = sub.add_parser("datastore", help="retrieval datastores")
    ds_sub = ds.add_subparsers(dest="datastore_command", required=True, parser_class=_Parser)
    build = ds_sub.add_parser("build", help="run the target on prompts and store its outputs")
    build.add_argument("--domain", required=True)
    build.add_argument("--prompts", required=True, help="JSON lines with a 'prompt' field")
    build.add_argument("--out", default=None, help="output .parquet (default: the packaged location)")
    build.add_argument("--split", choices=("first-half", "all"), default="first-half",
                       help="which prompts to use; the second half is held back for benchmarks")
    build.add_argument("--limit", type=int, default=None, help="use at most this many prompts")
    build.add_argument("--max-tokens", type=int, default=96)
    build.add_argument("--batch-size", type=int, default=8)
    build.add_argument("--model", default="smollm2-135m")

    srv = sub.add_parser("serve", help="start the Ray cluster + OpenAI-compatible HTTP server")
    srv.add_argument("--config", default=None, help="YAML engine config (see deploy/cosine_ray.yaml)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--address", default=None, help="join this Ray cluster instead of starting one")
    srv.add_argument("--model", default=None)
    srv.add_argument("--drafters", default=None)
    srv.add_argument("--stages", type=int, default=None, help="pipeline stages (default 2)")
    srv.add_argument("--num-speculative-tokens", type=int, default=None)
    srv.add_argument("--max-batch-size", type=int, default=None)
    srv.add_argument("--drafters-in-router", default=None, metavar="KINDS",
                     help="drafter kinds run inside the router actor (default: ngram,retrieval, table "
                          "lookups); none = every drafter in an actor of its own")
    add_cosine_args(srv)
    srv.add_argument("--api-key", default=None, help="require this key (or env COSINE_RAY_API_KEY)")
    srv.add_argument("--return-spec-stats", action="store_true",
                     help="add the `cosine_ray` speculation-stats block to every completion")
    srv.add_argument("--metrics-require-key", action="store_true",
                     help="GET /metrics needs the API key too (default: public, like /health)")
    srv.add_argument("--num-cpus", type=int, default=None, help="CPUs of a locally started Ray cluster")
    srv.add_argument("--max-pending-requests", type=int, default=None,
                     help="generations one replica holds at once; one more gets 503 + Retry-After (default 256)")
    srv.add_argument("--request-timeout-s", type=float, default=None,
                     help="a generation running longer is cancelled and answered 408 (default 600)")

    bench = sub.add_parser("bench", help="single-request tokens/s: HF vs cosine_ray drafter sets")
    from cosine_ray.bench import add_bench_args
    add_bench_args(bench)

    prof = sub.add_parser("profile", help="measure the target and drafters; fit the LP scheduler's latency models")
    prof.add_argument("--model", default="smollm2-135m",
                      help="target model: embedded name, Hugging Face directory or .gguf file")
    prof.add_argument("--stages", type=int, default=1, help="pipeline stages (layer slices) of the target")
    prof.add_argument("--drafters", default=DEFAULT_DRAFTERS,
                      help="none, or a comma list of ngram, retrieval[:DOMAIN|:FILE.parquet], model:MODEL, self")
    prof.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    prof.add_argument("--quick", action="store_true", help="small grid, 3 repetitions (what `serve` runs at first start)")
    prof.add_argument("--out", default=None,
                      help="output JSON (default: ~/.cache/cosine_ray/profiles/<model>-<device>-<dtype>-s<stages>.json)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("COSINE_RAY_LOG", "WARNING"))
    try:
        args = build_parser().parse_args(argv)
        if args.command == "generate":
            return _generate(args)
        if args.command == "datastore":
            return _datastore_build(args)
        if args.command == "serve":
            from cosine_ray.serve.launch import run_serve
            return run_serve(args, CliError)
        if args.command == "bench":
            from cosine_ray.bench import run_bench
            return run_bench(args)
        if args.command == "profile":
            return _profile(args)
    except CliError as exc:
        print(f"cosine-ray: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cosine-ray: interrupted", file=sys.stderr)
        return 130
    return 0


# ---- generate -----------------------------------------------------------------------------
def engine_config_from_args(args: argparse.Namespace, *, batch_size: int = 8):
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.router import RouterConfig
    try:
        return EngineConfig(model=args.model, drafters=parse_drafters(args.drafters),
                            num_stages=args.stages, num_threads=args.threads,
                            router=RouterConfig(max_batch_size=batch_size, **cosine_router_overrides(args)))
    except ValueError as exc:
        raise CliError(str(exc)) from None


def sampling_params_from_args(args: argparse.Namespace):
    from cosine_ray.engine.request import SamplingParams
    try:
        return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                              top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    except ValueError as exc:
        raise CliError(str(exc)) from None


def load_engine(config):
    from cosine_ray.engine.local import LocalEngine
    try:
        return LocalEngine(config)
    except (ValueError, OSError) as exc:  # ModelLoadError is a ValueError
        raise CliError(str(exc).splitlines()[0]) from None


def _generate(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise CliError("the prompt is empty; pass some text, e.g. cosine-ray generate \"Hello\"")
    params = sampling_params_from_args(args)
    config = engine_config_from_args(args, batch_size=1)
    engine = load_engine(config)
    prompt_ids = engine.encode(args.prompt, chat=not args.no_chat_template)
    try:
        engine.router.check_request(prompt_ids, params)
    except ValueError as exc:
        raise CliError(str(exc)) from None

    async def run():
        tokens: list[int] = []
        printed = ""
        last = None
        start = time.perf_counter()
        async for out in engine.stream(prompt_ids, params):
            tokens.extend(out.new_token_ids)
            last = out
            if not args.json:
                text = engine.decode(tokens)
                if not text.endswith("\ufffd") and len(text) > len(printed):
                    sys.stdout.write(text[len(printed):])
                    sys.stdout.flush()
                    printed = text
        elapsed = time.perf_counter() - start
        await engine.loop.shutdown()
        return tokens, last, elapsed

    tokens, last, elapsed = asyncio.run(run())
    if last.error:
        raise CliError(f"generation failed: {last.error}")
    stats = last.stats
    summary = {
        "tokens_per_s": round(len(tokens) / elapsed, 3) if elapsed > 0 else None,
        "mean_accepted_length": round(stats.mean_accepted_length, 4),
        "num_verify_steps": stats.num_verify_steps,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted_tokens,
        "num_prompt_tokens": len(prompt_ids),
        "num_output_tokens": len(tokens),
        "finish_reason": last.finish_reason,
        "elapsed_s": round(elapsed, 4),
        "drafters": [s.name for s in config.drafters],
    }
    if args.json:
        print(json.dumps({"text": engine.decode(tokens), "token_ids": tokens, "stats": summary}))
    else:
        sys.stdout.write("\n")
        print(f"[{len(tokens)} tokens, {summary['tokens_per_s']} tok/s, mean accepted length "
              f"{summary['mean_accepted_length']}, {stats.num_verify_steps} verify steps]", file=sys.stderr)
    return 0


# ---- datastore build ----------------------------------------------------------------------
def _datastore_build(args: argparse.Namespace) -> int:
    from cosine_ray.bench import read_prompts
    from cosine_ray.engine.config import EngineConfig
    from cosine_ray.engine.drafters.datastore import Datastore
    from cosine_ray.engine.local import datastore_path, encode_prompt
    from cosine_ray.engine.request import SamplingParams
    from cosine_ray.engine.router import RouterConfig

    if args.max_tokens < 1 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise CliError("--max-tokens, --batch-size and --limit must be >= 1")
    rows = read_prompts(args.prompts, CliError)
    if args.split == "first-half":
        rows = rows[: (len(rows) + 1) // 2]
    if args.limit:
        rows = rows[: args.limit]
    # The ngram drafter only changes speed (lossless), never the stored outputs.
    from cosine_ray.engine.config import parse_drafters
    engine = load_engine(EngineConfig(model=args.model, drafters=parse_drafters("ngram"),
                                      router=RouterConfig(max_batch_size=args.batch_size)))
    prompt_ids = [encode_prompt(engine.tokenizer, r["prompt"]) for r in rows]
    start = time.perf_counter()
    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=args.max_tokens))
    elapsed = time.perf_counter() - start
    store = Datastore.from_sequences(
        [p + o.new_token_ids for p, o in zip(prompt_ids, outs)], domain=args.domain,
        model_name=engine.checkpoint.name, source_ids=[str(r.get("id", i)) for i, r in enumerate(rows)],
        vocab_size=engine.checkpoint.config.vocab_size,
        params={"prompts": os.path.basename(args.prompts), "split": args.split, "limit": args.limit,
                "max_tokens": args.max_tokens})
    out = args.out or datastore_path(engine.checkpoint.name, args.domain)
    path = store.save(out)
    num_out = sum(len(o.new_token_ids) for o in outs)
    print(f"datastore {args.domain}: {len(rows)} prompts, {store.num_tokens} tokens "
          f"({num_out} generated in {elapsed:.1f} s) -> {path}")
    return 0


# ---- profile ------------------------------------------------------------------------------
def _profile(args: argparse.Namespace) -> int:
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.profile import format_table, profile_path, run_profile, save_profile

    if args.stages < 1 or (args.threads is not None and args.threads < 1):
        raise CliError("--stages and --threads must be >= 1")
    try:
        config = EngineConfig(model=args.model, drafters=parse_drafters(args.drafters),
                              num_stages=args.stages, num_threads=args.threads)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    start = time.perf_counter()
    try:
        model = run_profile(config, quick=args.quick)
    except (ValueError, OSError) as exc:  # ModelLoadError is a ValueError
        raise CliError(str(exc).splitlines()[0]) from None
    elapsed = time.perf_counter() - start
    try:
        path = save_profile(model, args.out or profile_path(config))
    except OSError as exc:
        raise CliError(f"cannot write the profile: {exc}") from None
    print(format_table(model))
    print(f"profiled {model.model_name} ({'quick' if args.quick else 'full'}, {model.num_threads} threads) "
          f"in {elapsed:.1f} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
