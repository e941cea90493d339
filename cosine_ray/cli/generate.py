"""``cosine-ray generate``: one prompt in this process, streamed to the terminal or as JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from cosine_ray.cli.args import (CliError, add_engine_args, add_sampling_args, engine_config_from_args, load_engine,
                                 sampling_params_from_args)


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt in this process")
    gen.add_argument("prompt", help="the user prompt (sent through the model's chat template)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token_ids, stats) instead of streaming")


def run(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise CliError("the prompt is empty; pass some text, e.g. cosine-ray generate \"Hello\"")
    params = sampling_params_from_args(args)
    config = engine_config_from_args(args, batch_size=1)
    engine = load_engine(config)
    prompt_ids = engine.encode(args.prompt, chat=not args.no_chat_template)
    try:
        engine.core.check_request(prompt_ids, params)
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
        "pipeline_mode": config.speculation.pipeline_mode,
        "pipedec_timesteps": stats.pipedec_timesteps,
        "pipedec_tokens": stats.pipedec_tokens,
        "pipedec_hits": stats.pipedec_hits,
    }
    if args.json:
        print(json.dumps({"text": engine.decode(tokens), "token_ids": tokens, "stats": summary}))
    else:
        sys.stdout.write("\n")
        print(f"[{len(tokens)} tokens, {summary['tokens_per_s']} tok/s, mean accepted length "
              f"{summary['mean_accepted_length']}, {stats.num_verify_steps} verify steps]", file=sys.stderr)
    return 0
