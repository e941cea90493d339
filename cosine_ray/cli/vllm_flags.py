"""The flags of ``vllm serve`` that ``cosine-ray serve`` takes, mapped onto ours (docs/cli.md
has the table), and the console's: how much Serve and Ray print.

What maps where: the positional model is ``--model``; ``--served-model-name`` the ingress's
``served_model_names``; ``--seed`` the engine's ``seed`` (requests without one);
``--speculative-config`` our drafters and draft budget (``speculative_settings``);
``--chat-template`` and ``--tool-call-parser`` the ingress's ``chat_template`` (the template's
text, read here: the replicas may run on another node) and ``tool_call_parser``;
``--disable-log-stats`` ``runtime.log_stats_interval_s: 0``. ``--enable-auto-tool-choice`` is
accepted and changes nothing: ``tool_choice: auto`` is always served (hermes calls unless
``--tool-call-parser`` says otherwise), where vLLM refuses it without the flag.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from cosine_ray.cli.args import CliError

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "cosine")
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "drafters")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_vllm_args(srv: argparse.ArgumentParser) -> None:
    """vLLM's serve flags that ``add_parser`` of ``cli.serve`` has not already."""
    from cosine_ray.serve.text.tool_parsers import TOOL_CALL_PARSERS

    srv.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                     help="the model, as vLLM's `vllm serve MODEL` (the same as --model)")
    srv.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                     help="the model's id(s) in the API (/v1/models and the requests' `model`); default: --model")
    srv.add_argument("--seed", type=int, default=None,
                     help="seed of the sampling keys of requests that give none: the same requests in the same "
                          "order give the same texts (default: a random key each)")
    srv.add_argument("--speculative-config", default=None, metavar="JSON",
                     help='vLLM\'s speculative config as JSON: {"method": "ngram" | "suffix" | "draft_model" (with '
                          '"model") | "cosine" (our drafter set, or "drafters": "..."), "num_speculative_tokens": N}')
    srv.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's")
    srv.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default=None,
                     help="the format of tool calls in the model's text under tool_choice auto (default hermes)")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM's command lines: tool_choice auto is always served")
    g = srv.add_argument_group("console")
    g.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                   help="what Serve, Ray and the replicas print (default: warnings, plus the engine's stats line)")
    g.add_argument("--access-log", action="store_true",
                   help="print one line per HTTP request (Serve's proxy access log; off by default)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic stats line from the engine (throughput, requests, KV use, acceptance)")
    g.add_argument("--dashboard", action="store_true",
                   help="start the Ray dashboard with a local cluster (off by default: a process and memory)")


def model_flag(args: argparse.Namespace) -> str | None:
    """The model the positional argument or ``--model`` gives (CliError when they differ)."""
    tag, model = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag is not None and model is not None and tag != model:
        raise CliError(f"the model is given twice ({tag!r} and --model {model!r}); give it once")
    return tag if tag is not None else model


def engine_settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """What vLLM's flags give the engine: (config data, settings by their own name for
    ``EngineConfig.replace``); absent flags are left out."""
    data: dict[str, Any] = {}
    settings: dict[str, Any] = {}
    if getattr(args, "seed", None) is not None:
        data["seed"] = args.seed
    if getattr(args, "speculative_config", None) is not None:
        if getattr(args, "drafters", None) is not None or getattr(args, "num_speculative_tokens", None) is not None:
            raise CliError("give --speculative-config or --drafters / --num-speculative-tokens, not both")
        spec = speculative_settings(args.speculative_config)
        data["drafters"] = spec.pop("drafters")
        settings.update(spec)
    if getattr(args, "disable_log_stats", False):
        settings["log_stats_interval_s"] = 0.0
    return data, settings


def speculative_settings(text: str) -> dict[str, Any]:
    """``--speculative-config`` as our settings: ``drafters`` and ``num_speculative_tokens``."""
    try:
        spec = json.loads(text)
    except ValueError as exc:
        raise CliError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise CliError("--speculative-config must be a JSON object, e.g. "
                       '{"method": "ngram", "num_speculative_tokens": 5}')
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise CliError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; cosine_ray takes "
                       f"{', '.join(SPECULATIVE_KEYS)}")
    method = spec.get("method") or ("draft_model" if spec.get("model") else None)
    if method not in SPECULATIVE_METHODS:
        got = f"method {method!r} is not supported" if method else "it needs a method"
        raise CliError(f"--speculative-config: {got}; cosine_ray drafts with {', '.join(SPECULATIVE_METHODS)}")
    for key in ("model", "drafters"):
        if key in spec and (not isinstance(spec[key], str) or not spec[key].strip()):
            raise CliError(f"--speculative-config: {key} must be a non-empty string")
    if method == "draft_model" and not spec.get("model"):
        raise CliError('--speculative-config: method draft_model needs "model" (a model sharing the tokenizer)')
    if "model" in spec and method != "draft_model":
        raise CliError(f'--speculative-config: "model" goes with method draft_model, not {method}')
    if "drafters" in spec and method != "cosine":
        raise CliError(f'--speculative-config: "drafters" goes with method cosine, not {method}')
    drafters = {"ngram": "ngram", "suffix": "suffix", "cosine": spec.get("drafters", "default")}.get(
        method) or f"model:{spec['model']}"
    out: dict[str, Any] = {"drafters": drafters}
    if "num_speculative_tokens" in spec:
        n = spec["num_speculative_tokens"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CliError(f"--speculative-config: num_speculative_tokens must be an integer >= 0, got {n!r}")
        out["num_speculative_tokens"] = n
    return out


def ingress_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ingress args vLLM's flags give (absent flags are left out)."""
    out: dict[str, Any] = {}
    for flag, key in (("served_model_name", "served_model_names"), ("chat_template", "chat_template"),
                      ("tool_call_parser", "tool_call_parser")):
        if getattr(args, flag, None) is not None:
            out[key] = getattr(args, flag)
    return out


def check_ingress_settings(ingress: dict[str, Any]) -> dict[str, Any]:
    """The ingress args of vLLM's flags (or a config file) checked, a chat template file read."""
    from cosine_ray.serve.text.tool_parsers import TOOL_CALL_PARSERS

    out = dict(ingress)
    names = out.get("served_model_names")
    if names is not None:
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n.strip() for n in names):
            raise CliError(f"--served-model-name takes one or more non-empty names, got {names!r}")
        if len(set(names)) != len(names):
            raise CliError(f"--served-model-name gives a name twice: {names}")
        out["served_model_names"] = names
    if out.get("tool_call_parser") is not None and out["tool_call_parser"] not in TOOL_CALL_PARSERS:
        raise CliError(f"tool_call_parser {out['tool_call_parser']!r}: use one of {', '.join(TOOL_CALL_PARSERS)}")
    if out.get("chat_template") is not None:
        from cosine_ray.serve.text.prompts import read_chat_template
        try:
            out["chat_template"] = read_chat_template(out["chat_template"])
        except ValueError as exc:
            raise CliError(f"--chat-template: {exc}") from None
    return out


@dataclass(frozen=True)
class Console:
    """What ``cosine-ray serve`` and its cluster print."""

    log_level: str | None = None
    """``--log-level``; None: Ray's and Serve's own processes warnings only, the replicas info
    (the engine's stats line)."""
    access_log: bool = False
    """Serve's access log, once per HTTP request (the proxy's; a replica's never)."""
    dashboard: bool = False
    """The Ray dashboard with a local cluster."""

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Console":
        return cls(log_level=getattr(args, "log_level", None), access_log=bool(getattr(args, "access_log", False)),
                   dashboard=bool(getattr(args, "dashboard", False)))

    @property
    def system_level(self) -> str:
        """Serve's controller and proxies, Ray in this process."""
        return (self.log_level or "warning").upper()

    @property
    def replica_level(self) -> str:
        return (self.log_level or "info").upper()

    def serve_logging(self) -> dict[str, Any]:
        """``serve.start``'s logging config: the controller and the HTTP proxies."""
        return {"log_level": self.system_level, "enable_access_log": self.access_log}

    def app_logging(self) -> dict[str, Any]:
        """``serve.run``'s logging config: the replicas. Never their access log: the ingress would
        repeat the proxy's line, and the engine would log every call the ingress makes to it."""
        return {"log_level": self.replica_level, "enable_access_log": False}
