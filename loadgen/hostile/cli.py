"""``cosine-loadgen hostile``: the flags, and the run end to end.

Exit codes: 0 every case passed (no 5xx, none past its deadline, none over its own bar, the
normal request after each answered 200, and with ``--max-gap`` no longer bystander gap); 1 a
case failed, or the server was not there; 2 bad flags (one line, nothing sent).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx

from loadgen.hostile import report
from loadgen.hostile.cases import CASES, Target
from loadgen.hostile.run import run_cases


def add_parser(sub: Any) -> None:
    h = sub.add_parser("hostile", help="hostile requests, a bystander stream beside each: who starves, what breaks")
    h.add_argument("--base-url", default="http://127.0.0.1:8000")
    h.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="the server's key (default $OPENAI_API_KEY); the unauthenticated flood needs it")
    h.add_argument("--other-api-key", default=None,
                   help="a second key of the server (another tenant): the bystander, the normal request after "
                        "each case and n16-streams' small request use it (default: --api-key)")
    h.add_argument("--model", default=None, help="model field (default: the first of GET /v1/models)")
    h.add_argument("--cases", default="all", help=f"comma list of: {', '.join(c.name for c in CASES)} (or all)")
    h.add_argument("--case-deadline", type=float, default=120.0, help="seconds a case may take; past it: hung")
    h.add_argument("--after-deadline", type=float, default=60.0,
                   help="seconds for the normal request after each case (and /health before it)")
    h.add_argument("--max-gap", type=float, default=None,
                   help="fail a case whose bystander waited longer than this between tokens (default: report only)")
    h.add_argument("--hold", type=float, default=60.0,
                   help="seconds the slow body trickles (the unread stream holds at most 30)")
    h.add_argument("--flood", type=int, default=2000, help="requests of the unauthenticated flood")
    h.add_argument("--vocab-size", type=int, default=49152, help="the model's vocabulary (stop_token_ids, prompts)")
    h.add_argument("--output-dir", type=Path, default=None, help="default: loadgen-results/hostile-<time>")


def select(names: str) -> list:
    if names.strip() == "all":
        return list(CASES)
    by_name = {c.name: c for c in CASES}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        raise ValueError(f"--cases: unknown case {unknown[0] if unknown else names!r}; "
                         f"choose from all, {', '.join(by_name)}")
    return [by_name[n] for n in wanted]


def check(args: argparse.Namespace) -> list:
    cases = select(args.cases)
    for name in ("case_deadline", "after_deadline", "hold"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.hold >= args.case_deadline:
        raise ValueError(f"--hold ({args.hold:g}) must be shorter than --case-deadline ({args.case_deadline:g})")
    if args.flood < 1 or args.vocab_size < 2 or (args.max_gap is not None and not args.max_gap > 0):
        raise ValueError("--flood must be >= 1, --vocab-size >= 2 and --max-gap > 0")
    return cases


async def _run(args: argparse.Namespace, cases: list) -> list:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.case_deadline, connect=10.0)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), timeout=timeout, limits=limits) as client:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            card = (await client.get("/v1/models", headers=headers, timeout=30)).json()["data"][0]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ConnectionError(f"GET {args.base_url}/v1/models failed ({type(exc).__name__}): "
                                  f"is the server up, and is --api-key its key?") from None
        target = Target(client, args.base_url.rstrip("/"), args.api_key, args.model or str(card["id"]),
                        args.vocab_size, int(card.get("max_model_len") or 2048), hold_s=args.hold, flood=args.flood,
                        other_api_key=args.other_api_key)
        return await run_cases(cases, target, case_deadline_s=args.case_deadline,
                               after_deadline_s=args.after_deadline, max_gap_s=args.max_gap)


def run_hostile(args: argparse.Namespace, fail: Any) -> int:
    try:
        cases = check(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    out_dir = args.output_dir or Path("loadgen-results") / f"hostile-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        results = asyncio.run(_run(args, cases))
    except ConnectionError as exc:
        fail(str(exc))
        return 1
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("api_key", "other_api_key")}
    report.write(results, out_dir, config)
    report.print_table(results, f"Hostile requests against {args.base_url}")
    print(f"results: {out_dir}")
    failed = [r.name for r in results if not r.ok]
    if failed:
        fail(f"{len(failed)} of {len(results)} cases failed: {', '.join(failed)} (see {out_dir / 'hostile.json'})")
        return 1
    return 0


class UsageError(ValueError):
    """Bad flags (exit 2)."""
