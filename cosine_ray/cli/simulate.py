"""``cosine-ray simulate SCENARIO``: the real engine on a simulated deployment (``cosine_ray.sim``)."""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from cosine_ray.cli.args import CliError, add_cosine_args, cosine_overrides

SCENARIO_HELP = """\
The scenario file (YAML or JSON) describes a deployment and a workload; `--schema` prints its
JSON Schema and docs/simulator.md explains every key. Top-level keys:

  engine        the engine's own config: its scheduler, speculation, runtime and experiments
                parts (as in deploy/engine.yaml: batching, lanes, γ_max, CoSine's switches); the
                real scheduler, routing, fusion, LP and verifier run it
  target        shapes that size the transfers: hidden_size, vocab_size, activation_bytes,
                kv_bytes_per_token, returns (logits | ids: what the last stage ships back)
  latency       named cost models of the whole target on a device: {profile: FILE} (output of
                `cosine-ray profile`), {linear: {c0_ms, c_req_ms, c_tok_ms, c_knee_ms, knee_tokens,
                c_attn_us}} or {roofline: {params_billions, memory_bandwidth_gbs, tflops, ...}},
                each with a `source`
  devices       names of FIFO servers (`engine`, the engine's host, always exists)
  engine_host   {device, step_overhead_ms, step_overhead_per_request_ms}: the engine's host and
                its decision time per step (a constant plus a term per request in the batch)
  stages        [{device, latency, layers}]: the target's pipeline stages in order
  links         engine_stage, stage_stage, engine_drafter: {bandwidth_mbps, latency_ms}
  drafters      [{name, device, latency: {c0_ms, c_req_ms, c_tok_ms} | {profile, drafter},
                acceptance: {DOMAIN|default: {by_depth: [α1, α2, ...], coverage}}, correlation,
                sharpness}]
  workload      num_requests | duration_s | requests: [...]; arrival {request_rate, burstiness,
                schedule: constant|low|high|fluctuating, low_fraction, period_s};
                max_concurrency; domains {DOMAIN: weight}; input_len, output_len, range_ratio;
                shared_prefix {groups, tokens}: system prompts the requests share
  replicas      {count, routing: prefix|least_loaded|round_robin, imbalance, max_attempts,
                failures: [{replica, at_s, restart_s}]}: engine replicas, each a copy of the
                deployment, and when one dies (its requests fail over to the others)
"""


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a deployment and workload on a virtual clock (the real scheduler)",
                       description="Run the engine's real scheduling code (admission, routing eq. 1-3, fusion "
                                   "eq. 4, the LP eq. 5-8, adaptive speculation) on a virtual clock; model "
                                   "forwards, drafter calls and transfers come from latency and acceptance "
                                   "models.\n\n" + SCENARIO_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", nargs="?", help="scenario file (YAML or JSON)")
    p.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a scenario key, e.g. workload.arrival.request_rate=4 (value parsed as YAML; "
                        "KEY=null removes the key)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the summary and per-request results")
    p.add_argument("--schema", action="store_true", help="print the scenario's JSON Schema and exit")
    add_cosine_args(p)


def apply_override(data: dict, assignment: str) -> None:
    """``--set KEY.PATH=VALUE``: the value parsed as YAML, then ``sim.scenario.set_key``."""
    from cosine_ray.sim.scenario import ScenarioError, set_key

    path, sep, value = assignment.partition("=")
    if not sep or not path.strip(".").strip():
        raise CliError(f"--set expects KEY.PATH=VALUE, got {assignment!r}")
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        raise CliError(f"--set {path}: the value is not YAML: {value!r}") from None
    try:
        set_key(data, path, parsed)
    except ScenarioError as exc:
        raise CliError(f"--set {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from cosine_ray.sim.runner import simulate
    from cosine_ray.sim.scenario import SCHEMA, ScenarioError, load, set_engine_settings, validate

    if args.schema:
        json.dump(SCHEMA, sys.stdout, indent=2)
        print()
        return 0
    if not args.scenario:
        raise CliError("give a scenario file (or --schema)")
    try:
        scenario = load(args.scenario)
        for assignment in args.set:
            apply_override(scenario.data, assignment)
        set_engine_settings(scenario.data, **cosine_overrides(args))  # a flag wins over the file
        validate(scenario.data)
        result = simulate(scenario)
    except ScenarioError as exc:
        raise CliError(str(exc)) from None
    except ValueError as exc:  # the engine's config checks and the latency models' inputs
        raise CliError(str(exc).splitlines()[0]) from None
    summary = result.summary()
    print(format_summary(scenario.get("name", args.scenario), summary))
    if args.json:
        payload = {"scenario": scenario.data, "summary": summary,
                   "requests": [{"request_id": r.request.request_id, "domain": r.request.domain,
                                 "input_len": r.request.input_len, "output_len": r.request.output_len,
                                 "arrival_s": r.request.arrival_s, "start_s": r.start_s, "ttft_s": r.ttft_s,
                                 "tpot_s": r.tpot_s, "e2e_s": r.e2e_s, "accepted_length": r.accepted_length,
                                 "routed_to": r.routed_to} for r in result.requests]}
        try:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(payload, f, indent=1)
        except OSError as exc:
            raise CliError(f"cannot write {args.json}: {exc.strerror or exc}") from None
    return 0


def format_summary(name: str, s: dict) -> str:
    lines = [f"scenario {name}: {s['requests']} requests, {s['output_tokens']} output tokens in "
             f"{s['makespan_s']:.2f} simulated s ({s['wall_s']:.1f} s to simulate)",
             f"  throughput   {s['throughput_tok_s']:.2f} tok/s",
             f"  TTFT         mean {s['ttft_mean_s'] * 1e3:.1f} ms, p99 {s['ttft_p99_s'] * 1e3:.1f} ms",
             f"  TPOT         mean {s['tpot_mean_s'] * 1e3:.2f} ms",
             f"  latency      mean {s['e2e_mean_s']:.3f} s",
             f"  accepted     {s['mean_accepted_length']:.2f} tokens per verify step",
             "  busy         " + busy_line(s["utilisation"])]
    if s.get("replicas", 1) > 1 or s.get("resubmissions") or s.get("prefix_hit_rate"):
        share = " / ".join(f"{x:.0%}" for x in s["served_share"])
        lines.insert(-1, f"  replicas     {s['replicas']} (served {share}), prefix cache hits "
                         f"{s['prefix_hit_rate']:.1%}, {s['resubmissions']} resubmitted after a replica died")
    if s.get("pipedec_timesteps"):
        lines.insert(-1, f"  PipeDec      {s['pipedec_timesteps']} timesteps, {s['pipedec_tokens_per_timestep']:.2f} "
                         f"tokens per timestep, hit rate {s['pipedec_hit_rate']:.2f}")
    return "\n".join(lines)


def busy_line(utilisation: dict[str, float], show: int = 6) -> str:
    """The busiest devices and links (a testbed has dozens), then how many more there are."""
    top = sorted(utilisation.items(), key=lambda kv: -kv[1])
    text = ", ".join(f"{k} {v:.0%}" for k, v in top[:show])
    return text + (f" (+{len(top) - show} more, see --json)" if len(top) > show else "")
