"""``cosine-ray distill``: drafters distilled from the target on its own answers to prompt sets.

Generates the target's answers (our engine, batched, resumable, with a progress bar), runs the
target once more over them for its top-k log-probabilities and features, then trains one
domain drafter per domain and a feature head (``cosine_ray.distill``; docs/drafters.md). The
drafters land in ``--out`` (default: the cache, where ``distilled:DOMAIN`` and ``head`` find
them for this target).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cosine_ray.cli.args import CliError


def add_parser(sub) -> None:
    p = sub.add_parser("distill", help="train domain drafters and a feature head on the target's own answers")
    p.add_argument("--model", default="smollm2-135m", help="the target: embedded name, HF directory or .gguf")
    p.add_argument("--domains", default="code,math,instruction,chat",
                   help="comma list of domains: packaged prompt sets, or names given a file with --prompts")
    p.add_argument("--prompts", action="append", default=[], metavar="DOMAIN=FILE",
                   help="JSON lines with a 'prompt' field for DOMAIN (default: the packaged set of the domain)")
    p.add_argument("--split", choices=("first-half", "all"), default="first-half",
                   help="which prompts of each file (the second half of a packaged set is held back for benchmarks)")
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts a domain")
    p.add_argument("--out", default=None, help="output folder (default: CACHE/drafters/MODEL)")
    p.add_argument("--work-dir", default=None, help="answers and teacher shards (default: CACHE/distill/MODEL)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens of each generated answer at most")
    p.add_argument("--samples", type=int, default=0, help="seeded sampled answers per prompt besides the greedy one")
    p.add_argument("--temperature", type=float, default=0.8, help="of the sampled answers")
    p.add_argument("--batch-size", type=int, default=32, help="requests generated at once")
    p.add_argument("--from-datastores", action="store_true",
                   help="reuse the greedy answers the packaged retrieval datastores hold for the same prompts")
    p.add_argument("--no-head", dest="head", action="store_false", help="train no feature head")
    p.add_argument("--no-domain-drafters", dest="domain_drafters", action="store_false",
                   help="train no domain drafters")
    p.add_argument("--init", default=None,
                   help="start each domain drafter from this model's layers (same tokenizer as the target) "
                        "instead of the target's own")
    p.add_argument("--layers", default="0,-1", help="layers the domain drafters start from (negative: from the end)")
    p.add_argument("--vocab-size", type=int, default=4096, help="tokens a domain drafter's head covers")
    p.add_argument("--head-vocab-size", type=int, default=8192, help="tokens the feature head drafts")
    p.add_argument("--shared-epochs", type=int, default=0,
                   help="first train one drafter on every domain's answers for this many epochs; each domain "
                        "drafter then starts from it (0: from the target's layers)")
    p.add_argument("--shared-lr", type=float, default=1e-3, help="learning rate of the shared drafter")
    p.add_argument("--epochs", type=int, default=8, help="epochs of each domain drafter")
    p.add_argument("--head-epochs", type=int, default=10, help="epochs of the feature head")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate of the domain drafters")
    p.add_argument("--head-lr", type=float, default=2e-3, help="learning rate of the feature head")
    p.add_argument("--batch-tokens", type=int, default=256,
                   help="padded tokens in one optimizer step of a domain drafter")
    p.add_argument("--head-batch-tokens", type=int, default=256, help="positions in one optimizer step of the head")
    p.add_argument("--top-k", type=int, default=16, help="target log-probabilities kept per position")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the drafters' training (initialisation, batch order, validation split)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--stop-after", choices=("answers", "teacher"), default=None,
                   help="stop once the answers (or the teacher's log-probabilities) are written")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def _prompts(args: argparse.Namespace) -> tuple[dict, dict]:
    from cosine_ray.datasets import DOMAIN_FILES, domain_file, read_prompts, split_rows
    files = {}
    for item in args.prompts:
        domain, sep, path = item.partition("=")
        if not sep or not domain or not path:
            raise CliError(f"--prompts takes DOMAIN=FILE, got {item!r}")
        files[domain] = path
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    if not domains or len(set(domains)) != len(domains):
        raise CliError("--domains must name each domain once")
    rows, sources = {}, {}
    for d in domains:
        if d not in files and d not in DOMAIN_FILES:
            raise CliError(f"domain {d!r} has no packaged prompt set ({', '.join(DOMAIN_FILES)}); "
                           f"give it one with --prompts {d}=FILE")
        path = files.get(d) or str(domain_file(d, error=CliError))
        picked = split_rows(read_prompts(path, CliError), args.split, CliError)
        rows[d] = picked[:args.limit] if args.limit else picked
        sources[d] = f"{Path(path).name} ({args.split}, {len(rows[d])} prompts)"
    return rows, sources


def _check(args: argparse.Namespace) -> None:
    if min(args.max_tokens, args.batch_size, args.vocab_size, args.head_vocab_size, args.batch_tokens,
           args.head_batch_tokens, args.top_k, args.threads) < 1:
        raise CliError("--max-tokens, --batch-size, --vocab-size, --head-vocab-size, --batch-tokens, "
                       "--head-batch-tokens, --top-k and --threads must be >= 1")
    if min(args.samples, args.epochs, args.shared_epochs, args.head_epochs) < 0 or \
            (args.limit is not None and args.limit < 1):
        raise CliError("--samples, --epochs, --shared-epochs and --head-epochs must be >= 0, --limit >= 1")
    if not (args.temperature > 0 and args.lr > 0 and args.shared_lr > 0 and args.head_lr > 0):
        raise CliError("--temperature, --lr, --shared-lr and --head-lr must be > 0")
    if args.shared_epochs and args.init:
        raise CliError("--shared-epochs trains the target's own layers; it cannot be combined with --init")
    if not args.head and not args.domain_drafters:
        raise CliError("--no-head with --no-domain-drafters leaves nothing to train")


def _layers(text: str) -> tuple[int, ...]:
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CliError(f"--layers takes a comma list of layer indices, got {text!r}") from None
    if not layers:
        raise CliError("--layers is empty")
    return layers


def _check_models(args: argparse.Namespace, layers: tuple[int, ...]) -> None:
    """The target and ``--init`` exist, have tokenizers, and share one (before any work)."""
    from cosine_ray.engine.drafters.models.distilled import tokenizer_fingerprint
    from cosine_ray.models.loader import resolve_checkpoint
    try:
        target = resolve_checkpoint(args.model)
    except ValueError as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    if not target.has_tokenizer:
        raise CliError(f"model {target.name} has no tokenizer: distill needs one to encode the prompts")
    source = target
    if args.init:
        try:
            source = resolve_checkpoint(args.init)
        except ValueError as exc:
            raise CliError(f"--init: {str(exc).splitlines()[0]}") from None
        if not source.has_tokenizer or source.config.vocab_size != target.config.vocab_size or \
                tokenizer_fingerprint(source.load_tokenizer()) != tokenizer_fingerprint(target.load_tokenizer()):
            raise CliError(f"--init {args.init}: its tokenizer is not the target's ({target.name}); a drafter "
                           f"must share the target's tokenizer")
    bad = [i for i in layers if not -source.config.num_layers <= i < source.config.num_layers]
    if bad:
        raise CliError(f"--layers {bad[0]} is outside the {source.config.num_layers} layers of {source.name}")


def run(args: argparse.Namespace) -> int:
    _check(args)
    layers = _layers(args.layers)
    prompts, sources = _prompts(args)
    _check_models(args, layers)
    from cosine_ray.distill.domain import DomainTrainConfig
    from cosine_ray.distill.head import HeadTrainConfig
    from cosine_ray.distill.pipeline import DistillConfig, run_distill
    from cosine_ray.distill.teacher import TeacherConfig
    from cosine_ray.models.loader import cache_root, resolve_checkpoint

    name = resolve_checkpoint(args.model).name
    out = args.out or str(cache_root() / "drafters" / name)
    work = args.work_dir or str(cache_root() / "distill" / name)
    config = DistillConfig(
        model=args.model, out=out, work=work, prompts=prompts, prompt_sources=sources, max_tokens=args.max_tokens,
        samples=args.samples, temperature=args.temperature, batch_size=args.batch_size,
        from_datastores=args.from_datastores, domain_drafters=args.domain_drafters, head=args.head,
        stop_after=args.stop_after, teacher=TeacherConfig(top_k=args.top_k),
        domain=DomainTrainConfig(vocab_size=args.vocab_size, init_layers=layers, init=args.init, epochs=args.epochs,
                                 lr=args.lr, batch_tokens=args.batch_tokens, seed=args.seed, threads=args.threads,
                                 shared_epochs=args.shared_epochs, shared_lr=args.shared_lr),
        head_train=HeadTrainConfig(vocab_size=args.head_vocab_size, epochs=args.head_epochs, lr=args.head_lr,
                                   batch_tokens=args.head_batch_tokens, seed=args.seed, threads=args.threads),
        threads=args.threads, progress=args.progress)
    try:
        report = run_distill(config, log=print)
    except ValueError as exc:
        raise CliError(str(exc).splitlines()[0]) from None
    print(json.dumps({"out": out, "work_dir": work, "seconds": report["seconds"]}))
    return 0
