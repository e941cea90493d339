"""Simulated vs measured on this machine: the capacity simulator's validation.

For each pipeline depth S (in-process stages) and speculation off / on, the same held-back
prompts run for real through ``LocalEngine`` at each concurrency, then through ``cosine-ray
simulate``'s runner with the latency profile measured for this setup and what one calibration
run on other prompts tells (``Recorder``: the engine's host time per step, each drafter's T_ssm
and acceptance by depth per domain, their correlation), for the same request lengths. Prints
TTFT, TPOT, throughput and mean accepted length, measured | simulated | error, per (S,
speculation, concurrency); the target is every cell within 15 % (docs/benchmarks.md).

    python benchmarks/sim/sim_validation.py --threads 1 --stages 1,2 --concurrency 1,8 --prompts-per-domain 3
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from cosine_ray.algo.scheduling.latency_model import LinearFit
from cosine_ray.bench.conversations import encode_messages
from cosine_ray.bench.engines import engine_config, start_engine
from cosine_ray.datasets import held_back_prompts
from cosine_ray.engine.config import DEFAULT_DRAFTERS, EngineConfig
from cosine_ray.engine.local import LocalEngine
from cosine_ray.engine.profile import load_or_profile, profile_path
from cosine_ray.engine.request import SamplingParams
from cosine_ray.models.loader import resolve_checkpoint
from cosine_ray.sim.latency import load_profile
from cosine_ray.sim.runner import SimRequest, simulate
from cosine_ray.sim.world import DRAFTER_CALLS, call_size
from cosine_ray.sim.scenario import Scenario, validate

METRICS = ("ttft_ms", "tpot_ms", "tpot_pooled_ms", "throughput", "accepted")


class Recorder:
    """What a calibration run tells the simulator, recorded around the real engine's calls:

    - per forward step, the requests in its batch and the engine's host time: wall time in
      ``EngineCore.step`` outside the target forward and the drafter calls, plus the
      ``EngineLoop``'s own time since the step before (handing out tokens, the learner,
      asyncio), which the simulator's loop spends in no virtual time; the host time of a step
      without a forward is carried into the next one, which the simulator charges;
    - per target forward, its shape and time (to check the profile the simulator charges);
    - per drafter call, its size (``sim.world.call_size``) and time;
    - per proposal (``propose``, or fusion's first ``continue_chains`` round, which asks each
      drafter for its own chain from the root), the context and the chain, so its acceptance is
      measured on the very steps the engine took."""

    def __init__(self, engine: LocalEngine) -> None:
        self.reset()
        core, target = engine.core, engine.target
        step, score = core.step, target.score

        async def timed_step(lane=None):
            t = time.perf_counter()
            if self._last_end is not None:  # the loop's own work between two steps
                self._carry += t - self._last_end
            try:
                return await step(lane)
            finally:
                self._last_end = time.perf_counter()
                self._carry += self._last_end - t - self._inside
                self._inside = 0.0
                if self._items:
                    self.host.append((self._items, max(self._carry, 1e-6)))
                    self._carry, self._items = 0.0, 0

        def timed_score(items):
            t = time.perf_counter()
            try:
                return score(items)
            finally:
                dt = time.perf_counter() - t
                self._inside += dt
                self._items += len(items)
                self.forwards.append(([it.start_position for it in items], [len(it.token_ids) for it in items], dt,
                                      all(it.parent_ids is not None for it in items)))

        core.step, target.score = timed_step, timed_score
        for client in core.drafters:
            for method in DRAFTER_CALLS:
                setattr(client.worker, method, self._wrap(client.worker.name, method, getattr(client.worker, method)))

    def reset(self) -> None:
        self.host: list[tuple[int, float]] = []
        self.forwards: list[tuple[list[int], list[int], float, bool]] = []
        self.calls: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
        self.proposals: dict[str, list[tuple[tuple[int, ...], tuple[tuple[int, float], ...] | None]]] = defaultdict(list)
        self._inside = self._carry = 0.0
        self._items = 0
        self._last_end: float | None = None

    def _wrap(self, name: str, method: str, fn):
        def timed(queries, *a, **k):
            t = time.perf_counter()
            out = fn(queries, *a, **k)
            dt = time.perf_counter() - t
            self._inside += dt
            b, tokens, _ = call_size(method, queries)
            self.calls[name].append((b, tokens, dt))
            if method == "propose":
                by_id = {p.request_id: p for p in out}
                for q in queries:
                    prop = by_id.get(q.request_id)
                    if prop is not None and prop.paths:
                        path = tuple(zip(prop.paths[0], prop.confidences[0]))
                    else:
                        path = None
                    self.proposals[name].append((tuple(q.context_token_ids), path))
            elif method == "continue_chains":  # fusion's first round asks each drafter's own chain: prefix ()
                for q, chains in zip(queries, out):
                    for prefix, chain in zip(q.prefixes, chains):
                        if not prefix:
                            path = tuple((int(c[0][0]), float(c[0][1])) for c in itertools.takewhile(bool, chain))
                            self.proposals[name].append((tuple(q.context_token_ids), path or None))
            return out
        return timed

    def host_fit(self) -> tuple[float, float]:
        """(ms per step, ms per request in the batch): least squares on the recorded steps, each
        clipped at 5× the median step (a one-off stall, e.g. the first step after a warm-up on
        other lengths, otherwise decides the slope)."""
        cap = 5 * statistics.median(h for _, h in self.host)
        fit = fit_absolute([(1.0, b) for b, _ in self.host], [min(h, cap) for _, h in self.host])
        return 1e3 * fit.coefs[0], 1e3 * fit.coefs[1]

    def host_ms(self) -> tuple[float, float]:
        """(mean host ms a step, mean requests a step) measured."""
        n = max(len(self.host), 1)
        return 1e3 * sum(h for _, h in self.host) / n, sum(b for b, _ in self.host) / n

    def drafter_costs(self) -> dict[str, dict[str, float]]:
        """Each drafter's T_ssm = c0 + c_req·b + c_tok·Γ fitted to its real calls (ms)."""
        out = {}
        for name, calls in self.calls.items():
            fit = fit_absolute([(1.0, b, g) for b, g, _ in calls], [max(s, 1e-7) for _, _, s in calls])
            out[name] = {k: round(1e3 * c, 5) for k, c in zip(("c0_ms", "c_req_ms", "c_tok_ms"), fit.coefs)}
        return out

    def profile_ratio(self, model) -> float:
        """Σ measured / Σ predicted forward seconds: how far the profile is from this run."""
        pred = sum(model.predict_llm(ctx, new) for ctx, new, _, _ in self.forwards)
        return sum(f[2] for f in self.forwards) / pred if pred else 0.0

    def decode(self) -> tuple[float, float]:
        """Forwards without a prefill: (tokens scored, ms) per forward."""
        rows = [(sum(new), s) for _, new, s, decode in self.forwards if decode]
        n = max(len(rows), 1)
        return sum(t for t, _ in rows) / n, 1e3 * sum(s for _, s in rows) / n


def fit_absolute(rows: list[tuple[float, ...]], seconds: list[float]) -> LinearFit:
    """Non-negative least squares on *absolute* residuals: ``LinearFit.fit`` minimises relative
    ones, weighted by y² they become absolute, so the fit matches total time (what the
    simulator adds up), not the typical call."""
    return LinearFit.fit(rows, seconds, weights=[y * y for y in seconds])


def run_real(engine: LocalEngine, prompts: list[list[int]], concurrency: int, max_tokens: int):
    """Closed loop at ``concurrency``: per request (ttft, tpot, e2e, tokens, accepted length)."""
    params = SamplingParams(max_tokens=max_tokens)
    rows: list[dict] = [None] * len(prompts)  # type: ignore[list-item]

    async def main():
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int, ids: list[int]) -> None:
            async with sem:
                start = time.perf_counter()
                first = last = None
                tokens: list[int] = []
                stats = None
                async for out in engine.loop.generate(ids, params):
                    if out.new_token_ids:
                        last = time.perf_counter()
                        first = first or last
                    tokens.extend(out.new_token_ids)
                    stats = out.stats or stats
                n = len(tokens)
                rows[i] = {"ttft": first - start, "tpot": (last - first) / (n - 1) if n > 1 else 0.0,
                           "start": start, "end": last, "tokens": tokens,
                           "steps": stats.num_verify_steps if stats else n,
                           "accepted": stats.num_accepted_tokens if stats else 0}
        try:
            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            await engine.loop.shutdown()
    asyncio.run(main())
    return rows


def figures(rows: list[dict]) -> dict[str, float]:
    tokens = sum(len(r["tokens"]) for r in rows)
    steps = sum(r["steps"] for r in rows)
    committed = sum(r["accepted"] for r in rows) + steps  # the engine's convention: bonus included
    return {"ttft_ms": 1e3 * statistics.fmean(r["ttft"] for r in rows),
            "tpot_ms": 1e3 * statistics.fmean(r["tpot"] for r in rows if len(r["tokens"]) > 1),
            **tpot_spread([(r["tpot"], len(r["tokens"])) for r in rows]),
            "throughput": tokens / (max(r["end"] for r in rows) - min(r["start"] for r in rows)),
            "accepted": committed / steps if steps else 0.0}


def tpot_spread(per_request: list[tuple[float, int]]) -> dict[str, float]:
    """TPOT pooled over every decoded token (Σ decode time / Σ tokens after the first), and the
    coefficient of variation of the requests' TPOTs. The mean TPOT weighs each request alike,
    so requests that differ more (a hard prompt drafts badly all along) raise it above the
    pooled one."""
    rows = [(t, n) for t, n in per_request if n > 1]
    tpots = [t for t, _ in rows]
    cv = statistics.pstdev(tpots) / statistics.fmean(tpots) if len(tpots) > 1 else 0.0
    return {"tpot_pooled_ms": 1e3 * sum(t * (n - 1) for t, n in rows) / sum(n - 1 for _, n in rows),
            "tpot_cv": cv}


def measure_acceptance(recorder: Recorder, prompts: list[list[int]], outputs: list[list[int]],
                       domains: list[str], gamma: int) -> tuple[dict[str, dict[str, dict]], float]:
    """drafter → {acceptance: domain → {by_depth, coverage}, sharpness}, and the drafters'
    correlation, from the chains
    the drafters proposed in a real run, scored against the text that run produced (the
    target's greedy text: the engine is lossless). These are the positions the engine's steps
    landed on, with the draft lengths it asked for; measuring at every position of the text
    instead over-weights easy stretches (the engine crosses them in a few steps and spends most
    steps on hard text). Sharpness: the drafter's mean confidence in its right tokens minus
    that in its wrong ones (the simulator's confidence is ``(1 − s)·α_d + s·[right]``).
    Correlation: from how often two drafters are right at depth 1 at the same step, against
    the simulator's model (``sim.world``: a share ρ of draws shared)."""
    trials = {n: defaultdict(lambda: [[0, 0] for _ in range(gamma)]) for n in recorder.proposals}
    covered = {n: defaultdict(lambda: [0, 0]) for n in recorder.proposals}
    first: dict[tuple[int, int], dict[str, bool]] = defaultdict(dict)
    confidence = {n: {True: [], False: []} for n in recorder.proposals}
    for name, records in recorder.proposals.items():
        for context, path in records:
            k = next(i for i, p in enumerate(prompts) if context[:len(p)] == tuple(p))
            done = len(context) - len(prompts[k])
            truth, domain = outputs[k][done:], domains[k]
            covered[name][domain][1] += 1
            if path is None:
                continue
            covered[name][domain][0] += 1
            m = 0
            for d, (tok, conf) in enumerate(path[:min(len(truth), gamma)]):
                trials[name][domain][d][1] += 1
                confidence[name][tok == truth[d]].append(conf)
                if tok != truth[d]:
                    break
                trials[name][domain][d][0] += 1
                m += 1
            first[(k, done)][name] = m > 0
    pairs = []
    for at in first.values():
        names = sorted(at)
        pairs += [(a, b, at[a], at[b]) for i, a in enumerate(names) for b in names[i + 1:]]
    out: dict[str, dict[str, dict]] = {}
    for name, per_domain in trials.items():
        pooled = [[sum(t[i][0] for t in per_domain.values()), sum(t[i][1] for t in per_domain.values())]
                  for i in range(gamma)]
        default = alphas_of(pooled, [0.0] * gamma)
        hit, n = (sum(v[i] for v in covered[name].values()) for i in (0, 1))
        model = {"default": {"by_depth": default, "coverage": round(hit / n, 4) if n else 0.0}}
        for domain, by_depth in per_domain.items():
            hit, n = covered[name][domain]
            model[domain] = {"by_depth": alphas_of(by_depth, default), "coverage": round(hit / n, 4) if n else 0.0}
        right, wrong = confidence[name][True], confidence[name][False]
        sharpness = statistics.fmean(right) - statistics.fmean(wrong) if right and wrong else 0.3
        out[name] = {"acceptance": model, "sharpness": round(min(max(sharpness, 0.0), 1.0), 4)}
    return out, estimate_correlation(pairs)


def alphas_of(counts: list[list[int]], fallback: list[float], min_trials: int = 5) -> list[float]:
    """α_d = hits / trials per depth; a depth with fewer than ``min_trials`` trials takes the
    fallback's α (the pooled domains), and where that is unknown too, the last α measured (a
    rarely reached depth is reached in repetitive text, where the next token is as likely)."""
    out: list[float] = []
    for d, (hit, n) in enumerate(counts):
        if n >= min_trials:
            out.append(round(hit / n, 4))
        elif fallback[d] > 0 or not out:
            out.append(fallback[d])
        else:
            out.append(out[-1])
    return out


def estimate_correlation(pairs: list[tuple[str, str, bool, bool]]) -> float:
    """ρ with P(both right) = ρ²·min(a, b) + (1 − ρ²)·a·b, pooled over drafter pairs."""
    by_pair: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for a, b, ra, rb in pairs:
        c = by_pair[(a, b)]
        c[0] += 1
        c[1] += ra
        c[2] += rb
        c[3] += ra and rb
    num = den = 0.0
    for n, ha, hb, both in by_pair.values():
        pa, pb, pab = ha / n, hb / n, both / n
        span = min(pa, pb) - pa * pb
        if span > 1e-9:
            num += n * (pab - pa * pb)
            den += n * span
    rho2 = min(max(num / den, 0.0), 1.0) if den else 0.0
    return round(rho2 ** 0.5, 4)


def scenario_for(config: EngineConfig, profile: Path, calib: dict, requests: list[SimRequest], concurrency: int,
                 hidden: int, vocab: int) -> Scenario:
    s = config.num_stages
    data = {
        "name": f"validation-s{s}-{'spec' if calib['skills'] else 'off'}-c{concurrency}",
        "engine": {"scheduler": {"max_num_seqs": config.scheduler.max_num_seqs},
                   "speculation": {"num_speculative_tokens": config.speculation.num_speculative_tokens}},
        "target": {"hidden_size": hidden, "vocab_size": vocab},
        "latency": {"cpu": {"profile": profile.name, "source": "cosine-ray profile on this machine"}},
        "devices": ["cpu0"],
        "engine_host": {"device": "cpu0", "step_overhead_ms": calib["host_ms"][0],
                   "step_overhead_per_request_ms": calib["host_ms"][1]},
        "stages": [{"device": "cpu0", "latency": "cpu", "layers": 1.0 / s} for _ in range(s)],
        "drafters": [{"name": name, "device": "cpu0", "latency": calib["drafter_ms"][name],
                      "acceptance": skill["acceptance"], "sharpness": skill["sharpness"],
                      "correlation": calib["correlation"]}
                     for name, skill in calib["skills"].items()],
        "workload": {"requests": [{"domain": r.domain, "input_len": r.input_len, "output_len": r.output_len}
                                  for r in requests], "max_concurrency": concurrency},
    }
    validate(data)
    return Scenario(data, profile.parent)


def calibrate(engine: LocalEngine, recorder: Recorder, config: EngineConfig, prompts: list[list[int]],
              domains: list[str], concurrency: int, max_tokens: int) -> dict:
    """One real run on prompts the validation does not use: the host time per step (a constant
    and a term per request), each drafter's T_ssm from its real calls, and the drafters'
    acceptance and correlation on the steps the engine took."""
    recorder.reset()
    rows = run_real(engine, prompts, concurrency, max_tokens)
    skills, correlation = ({}, 0.0)
    if config.drafters:
        skills, correlation = measure_acceptance(recorder, prompts, [r["tokens"] for r in rows], domains,
                                                     config.speculation.num_speculative_tokens)
    host = recorder.host_fit()
    return {"host_ms": [round(v, 4) for v in host], "drafter_ms": recorder.drafter_costs(),
            "skills": skills, "correlation": correlation,
            "profile_ratio": round(recorder.profile_ratio(load_profile(profile_path(config))), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--prompts-per-domain", type=int, default=3)
    ap.add_argument("--calibration-prompts-per-domain", type=int, default=3,
                    help="held-back prompts after the validation's, run once at --calibration-concurrency")
    ap.add_argument("--calibration-concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--keep-profile", action="store_true",
                    help="use the stored profile of each setup instead of measuring it again first")
    ap.add_argument("--json", default=None, help="write every figure here too")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    stages = [int(x) for x in args.stages.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    n = args.prompts_per_domain
    held = held_back_prompts(None, n + args.calibration_prompts_per_domain)
    per_domain = defaultdict(list)
    for d, p in held:
        per_domain[d].append(p)
    valid = [(d, p) for d, ps in per_domain.items() for p in ps[:n]]
    calib_set = [(d, p) for d, ps in per_domain.items() for p in ps[n:]]
    results, calibrations = [], {}
    for s in stages:
        configs = {"off": engine_config("none", num_stages=s, num_threads=args.threads, num_speculative_tokens=0),
                   "on": engine_config(DEFAULT_DRAFTERS, num_stages=s, num_threads=args.threads)}
        for mode, config in configs.items():
            if not args.keep_profile:  # a profile from another day can be 10-20 % off this machine now
                profile_path(config).unlink(missing_ok=True)
            load_or_profile(config, quick=True)  # the engine and the simulator read the same profile
            checkpoint = resolve_checkpoint(config.model)
            tokenizer = checkpoint.load_tokenizer()
            encode = lambda rows: [encode_messages(tokenizer, [{"role": "user", "content": p}]) for _, p in rows]
            prompts, domains = encode(valid), [d for d, _ in valid]
            cfg = checkpoint.config
            engine = start_engine(config, checkpoint=checkpoint, warmup=prompts[:2], warmup_tokens=8, concurrency=2)
            recorder = Recorder(engine)
            calib = calibrate(engine, recorder, config, encode(calib_set), [d for d, _ in calib_set],
                              args.calibration_concurrency, args.max_tokens)
            calibrations[f"s{s}-{mode}"] = calib
            print(json.dumps({"stages": s, "speculation": mode, "calibration": calib}), file=sys.stderr, flush=True)
            for c in concurrency:
                recorder.reset()
                rows = run_real(engine, prompts, c, args.max_tokens)
                host_ms, batch = recorder.host_ms()
                real = figures(rows)
                reqs = [SimRequest(f"r{i:06d}", d, len(p), len(r["tokens"]), 0.0)
                        for i, (d, p, r) in enumerate(zip(domains, prompts, rows))]
                scn = scenario_for(config, profile_path(config), calib, reqs, c, cfg.hidden_size, cfg.vocab_size)
                result = simulate(scn)
                sim = result.summary()
                simf = {"ttft_ms": 1e3 * sim["ttft_mean_s"], "tpot_ms": 1e3 * sim["tpot_mean_s"],
                        **tpot_spread([(q.tpot_s, q.num_tokens) for q in result.requests]),
                        "throughput": sim["throughput_tok_s"], "accepted": sim["mean_accepted_length"]}
                real["decode_tokens"], real["decode_ms"] = recorder.decode()
                simf["decode_tokens"], simf["decode_ms"] = sim["decode_tokens_per_forward"], sim["decode_forward_ms"]
                row = {"stages": s, "speculation": mode, "concurrency": c, "measured": real, "simulated": simf,
                       "host_ms": host_ms, "host_model_ms": calib["host_ms"][0] + calib["host_ms"][1] * batch,
                       "profile_ratio": round(recorder.profile_ratio(load_profile(profile_path(config))), 3)}
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(f"\n| S | speculation | c | " + " | ".join(f"{m} (meas / sim / err)" for m in METRICS)
          + " | TPOT CV (meas / sim) | host ms/step (meas / model) | forward meas/profile"
          + " | decode forward tokens, ms (meas / sim) |")
    print("| --- " * (7 + len(METRICS)) + "|")
    for r in results:
        cells = []
        for m in METRICS:
            a, b = r["measured"][m], r["simulated"][m]
            cells.append(f"{a:.2f} / {b:.2f} / {(b / a - 1) if a else 0:+.1%}")
        print(f"| {r['stages']} | {r['speculation']} | {r['concurrency']} | " + " | ".join(cells)
              + f" | {r['measured']['tpot_cv']:.2f} / {r['simulated']['tpot_cv']:.2f}"
              + f" | {r['host_ms']:.2f} / {r['host_model_ms']:.2f} | {r['profile_ratio']:.3f} | "
              + f"{r['measured']['decode_tokens']:.1f}, {r['measured']['decode_ms']:.1f} / "
              + f"{r['simulated']['decode_tokens']:.1f}, {r['simulated']['decode_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"calibrations": calibrations, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
