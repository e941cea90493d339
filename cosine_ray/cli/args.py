"""What every ``cosine-ray`` command shares: the one-line user error, the argument groups for
the engine, CoSine's switches and sampling, and building an engine from them."""

from __future__ import annotations

import argparse

from cosine_ray.engine.config import DEFAULT_DRAFTERS


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


RENAMED_FLAGS = {"--drafters-in-router": "--drafters-in-engine"}
"""Old names of flags: a command line that uses one gets an error naming the new flag."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        if message.startswith("unrecognized arguments:"):
            given = {word.split("=", 1)[0] for word in message.split(":", 1)[1].split()}
            for old, new in RENAMED_FLAGS.items():
                if old in given:
                    raise CliError(f"{old} was renamed: use {new}")
        raise CliError(f"{message} (see `{self.prog} --help`)")


DRAFTERS_HELP = ("speculation sources: default, none, learning, or a comma list of ngram, "
                 "retrieval[:DOMAIN|:FILE.parquet], suffix[:DOMAIN|:FILE.parquet], model:MODEL, self (docs/cli.md)")
MODEL_HELP = ("target model: embedded name (smollm2-135m), Hugging Face directory, .gguf file, or Hugging Face "
              "Hub id org/name (org/name/FILE.gguf: one GGUF file of a repository)")
SPEC_TOKENS_HELP = "draft-token budget of each request's tree per step (0 = plain decoding)"
STAGES_HELP = "pipeline stages (contiguous layer slices) of the target; vLLM's --pipeline-parallel-size"


def add_model_source_args(p: argparse.ArgumentParser) -> None:
    """Where a Hub model comes from: ``--revision``, ``--tokenizer``, ``--download-dir``."""
    p.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hugging Face Hub model (default: main)")
    p.add_argument("--tokenizer", default=None,
                   help="take the tokenizer from here instead of the model: embedded name, directory or Hub id")
    p.add_argument("--download-dir", default=None,
                   help="fetch Hub models into this folder instead of huggingface_hub's cache (HF_HOME)")


def model_source_settings(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` fields the model-source flags gave (absent flags are left out)."""
    return {n: getattr(args, n) for n in ("revision", "tokenizer", "download_dir") if getattr(args, n, None) is not None}


def add_cosine_args(p: argparse.ArgumentParser) -> None:
    """CoSine's components and their ablation switches (engine settings: ``cosine_overrides``)."""
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
    g.add_argument("--pipeline-mode", choices=("lanes", "pipedec"), default=None,
                   help="lanes: verify whole trees in micro-batches; pipedec: a request alone in the pool "
                        "runs PipeDec's timestep loop (every stage on another layer of one prediction tree)")
    g.add_argument("--pipedec-width", type=int, default=None, help="PipeDec: tree nodes per layer at most (4)")
    g.add_argument("--pearl", choices=("off", "on", "auto"), default=None,
                   help="PEARL: verify what was drafted ahead while the drafters draft ahead of it; on: "
                        "with nothing drafted ahead verify the root alone while drafting (pre-verify); "
                        "auto: pre-verify only while drafting measures slower than verification")


def cosine_overrides(args: argparse.Namespace) -> dict:
    """The engine settings CoSine's flags gave, by name (``EngineConfig.replace``; absent flags
    are left out)."""
    names = ("routing", "fusion", "scheduler", "adaptive", "drafters_per_request", "num_speculative_tokens",
             "pipeline_mode", "pipedec_width", "pearl")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_device_args(p: argparse.ArgumentParser, *, defaults: bool = True) -> None:
    """``--device`` and ``--dtype`` (``defaults=False``: absent flags stay None, so a config
    file's values stand)."""
    from cosine_ray.models.device import DTYPES
    from cosine_ray.models.weights.native import WEIGHTS_MODES
    p.add_argument("--device", default="cpu" if defaults else None,
                   help="cpu, cuda or cuda:N: where the target and model drafters run (default cpu)")
    p.add_argument("--dtype", choices=DTYPES, default="float32" if defaults else None,
                   help="weights and activations (default float32; the half types pay on CUDA)")
    p.add_argument("--weights", choices=WEIGHTS_MODES, default="dense" if defaults else None,
                   help="dense (default): a GGUF model's weights dequantized to --dtype (fp32 output is "
                        "identical to HF transformers); native: its GGUF blocks kept quantized (Q4_0/Q4_1/Q5_0/"
                        "Q5_1/Q8_0, Q4_K/Q5_K/Q6_K; faster, identical to our own decode on that path); "
                        "auto: native for GGUF models except fp32 on CUDA")
    p.add_argument("--kv-cache-memory", default=None,
                   help="bytes of each stage's paged KV pool, e.g. 2GiB (default: 90%% of free GPU memory "
                        "on CUDA; on CPU it grows as needed up to 20%% of the memory available at start)")
    p.add_argument("--enforce-eager", action="store_true", default=None if not defaults else False,
                   help="never capture CUDA graphs: every step runs eagerly (default: verify steps replay "
                        "CUDA graphs on CUDA)")


def add_batching_args(p: argparse.ArgumentParser) -> None:
    """What a step batches: requests, tokens, and whether prompt prefixes are reused (absent
    flags stay None, so a config file's values or the device's defaults stand)."""
    g = p.add_argument_group("batching")
    g.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int, default=None,
                   help="requests running at once, at most (default 8 on CPU, 64 on CUDA; fewer when "
                        "their KV does not fit)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens one step computes at most; longer prompts are prefilled in chunks "
                        "(default 512 on CPU, 2048 on CUDA)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens a request may reach (default 8192, capped at the model's context)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of prompt prefixes already computed (default: on); --no-enable-prefix-caching "
                        "recomputes every prompt")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help="the same as --no-enable-prefix-caching")


def batching_overrides(args: argparse.Namespace) -> dict:
    """The ``scheduler`` settings the batching flags gave, by name (absent flags are left out)."""
    names = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching")
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def runner_from_args(args: argparse.Namespace) -> str | None:
    """``runtime.runner`` for ``--enforce-eager``: ``eager`` or ``auto``; None where the flag
    defaults to absent (``serve``: a config file's value then stands)."""
    flag = getattr(args, "enforce_eager", None)
    return None if flag is None else ("eager" if flag else "auto")


def check_local_device(device: str) -> None:
    """CliError (one line, exit 2) when this process cannot run on ``device``: CUDA asked for
    on a machine without it, or a GPU index past the last."""
    from cosine_ray.models.device import device_unavailable
    try:
        reason = device_unavailable(device)
    except ValueError as exc:
        raise CliError(f"--device: {exc}") from None
    if reason is not None:
        raise CliError(reason)


def add_engine_args(p: argparse.ArgumentParser, *, drafters_default: str = DEFAULT_DRAFTERS) -> None:
    p.add_argument("--model", default="smollm2-135m", help=MODEL_HELP)
    add_model_source_args(p)
    p.add_argument("--drafters", default=drafters_default, help=DRAFTERS_HELP)
    p.add_argument("--num-speculative-tokens", type=int, default=8, help=SPEC_TOKENS_HELP)
    p.add_argument("--stages", "--pipeline-parallel-size", "-pp", dest="stages", type=int, default=1, help=STAGES_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_device_args(p)
    add_batching_args(p)
    add_cosine_args(p)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                            "whose probability reaches this (default 1.0: all)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed: the same seed gives the same text, with or without speculation")


def engine_config_from_args(args: argparse.Namespace, *, batch_size: int | None = None):
    from cosine_ray.engine.config import EngineConfig, parse_drafters
    check_local_device(args.device)
    runner = runner_from_args(args)
    try:
        config = EngineConfig(model=args.model, drafters=parse_drafters(args.drafters), num_stages=args.stages,
                              num_threads=args.threads, device=args.device, dtype=args.dtype, weights=args.weights,
                              kv_cache_memory=args.kv_cache_memory, **model_source_settings(args))
        return config.replace(**{"max_num_seqs": batch_size, **batching_overrides(args)},  # flags win
                              **({"runner": runner} if runner else {}), **cosine_overrides(args))
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
