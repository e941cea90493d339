"""``cosine-ray``: serve | generate | bench | profile | simulate | datastore build | distill.

Bad input (empty prompt, max tokens < 1, negative temperature, unknown drafter, missing
model path, ...) prints one line ``cosine-ray: error: ...`` and exits with status 2. Each
command lives in its own module (``add_parser`` + ``run``); they share ``cli.args``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from cosine_ray.cli import bench, datastore, distill, generate, profile, serve, simulate
from cosine_ray.cli.args import CliError, Parser

COMMANDS = {"generate": generate, "datastore": datastore, "serve": serve, "bench": bench, "profile": profile,
            "simulate": simulate, "distill": distill}


def package_version() -> str:
    """The installed package's version (its metadata; ``unknown`` for a tree that is not installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("cosine_ray")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> Parser:
    parser = Parser(prog="cosine-ray", description="Collaborative speculative inference on a Ray cluster.")
    parser.add_argument("--version", action="version", version=f"cosine-ray {package_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND",
                                help="the command to run (COMMAND --help for its options)")
    for module in COMMANDS.values():
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("COSINE_RAY_LOG", "WARNING"))
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command].run(args)
    except CliError as exc:
        print(f"cosine-ray: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cosine-ray: interrupted", file=sys.stderr)
        return 130
