"""``cosine-ray datastore build``: run the target on a prompt set and store prompt + output
tokens (Parquet) for the retrieval drafter."""

from __future__ import annotations

import argparse
import os
import time

from cosine_ray.cli.args import MODEL_HELP, CliError, Parser, load_engine


def add_parser(sub) -> None:
    ds = sub.add_parser("datastore", help="retrieval datastores")
    ds_sub = ds.add_subparsers(dest="datastore_command", required=True, parser_class=Parser,
                               help="build: a datastore from the target's outputs")
    build = ds_sub.add_parser("build", help="run the target on prompts and store its outputs")
    build.add_argument("--domain", required=True,
                       help="code, math, instruction, chat (packaged prompt sets) or a name of yours")
    build.add_argument("--prompts", default=None,
                       help="JSON lines with a 'prompt' field (default: the packaged file of --domain, "
                            "or $COSINE_RAY_PROMPTS/FILE; see cosine_ray/datasets.py)")
    build.add_argument("--out", default=None, help="output .parquet (default: the packaged location)")
    build.add_argument("--split", choices=("first-half", "all"), default="first-half",
                       help="which prompts to use; the second half is held back for benchmarks")
    build.add_argument("--limit", type=int, default=None, help="use at most this many prompts")
    build.add_argument("--max-tokens", type=int, default=96, help="tokens generated per prompt at most")
    build.add_argument("--batch-size", type=int, default=8, help="prompts generated at once")
    build.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)


def _datastore_rows(args: argparse.Namespace) -> list[dict]:
    """The prompt rows a build uses; fills in ``args.prompts`` (default: the packaged file of
    ``--domain``, cosine_ray/datasets.py)."""
    from cosine_ray.datasets import DOMAIN_FILES, domain_file, read_prompts, split_rows

    if args.max_tokens < 1 or args.batch_size < 1 or (args.limit is not None and args.limit < 1):
        raise CliError("--max-tokens, --batch-size and --limit must be >= 1")
    if args.prompts is None:
        if args.domain not in DOMAIN_FILES:
            raise CliError(f"--prompts is required for domain {args.domain!r} "
                           f"(packaged prompt sets: {', '.join(DOMAIN_FILES)})")
        args.prompts = str(domain_file(args.domain, error=CliError))
    rows = split_rows(read_prompts(args.prompts, CliError), args.split, CliError)
    return rows[: args.limit] if args.limit else rows


def run(args: argparse.Namespace) -> int:
    rows = _datastore_rows(args)  # input checks before the engine (torch) is imported
    from cosine_ray.engine.build import datastore_path
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    from cosine_ray.engine.drafters.lookup.datastore import Datastore
    from cosine_ray.engine.local import encode_prompt
    from cosine_ray.engine.request import SamplingParams

    # The ngram drafter only changes speed (lossless), never the stored outputs.
    engine = load_engine(EngineConfig(model=args.model, drafters=parse_drafters("ngram")).replace(
        max_num_seqs=args.batch_size))
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
