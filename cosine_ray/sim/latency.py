"""Latency models of simulated devices: the profile we measured, or a stated formula.

A device's cost of a forward of the *whole* target (a stage with a share ``layers`` of it costs
that share) and of a drafter call comes in three forms, each with a ``source``:

- ``profile``: a ``cosine-ray profile`` JSON measured on a device we have, corrected towards its
  measured samples;
- ``linear``: the same T_llm terms entered by hand;
- ``roofline``: a device we do not have, from its datasheet (weights and KV read at the
  bandwidth, 2·params FLOPs a token, both times an ``efficiency``): a knee form of T_llm.

Every form becomes a ``LatencyModel`` the engine's scheduler reads and an exact
``seconds(context_lens, new_tokens)`` the simulator charges (docs/simulator.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from cosine_ray.algo.scheduling.latency_model import LatencyModel, LinearFit, LlmSample, SsmSample, knee_excess

PROFILE_GRID = ((1, 2, 4, 8, 16, 32), (0, 2, 4, 8, 16), (32, 128, 512, 1024))
"""(batch sizes, γ, context lengths) of the samples a formula is fitted from."""


def _shape(context_lens: Sequence[int], new_tokens: Sequence[int]) -> tuple[float, float, float, bool]:
    """Where a forward sits on a profile's grid: (log2 b, log2 new tokens a request,
    log2 context, prefill?)."""
    b = len(new_tokens)
    return (math.log2(b), math.log2(sum(new_tokens) / b), math.log2(1 + sum(context_lens) / b),
            max(context_lens) == 0)


@dataclass(frozen=True, slots=True)
class TargetCost:
    """T_llm of the whole target on one device: ``c0 + c_req·b + c_tok·N + c_knee·max(N−K, 0)
    + c_attn·Σ n_i(l_i+n_i)`` (seconds; the engine's regressors, ``algo.scheduling.latency_model``).

    From a measured profile it also keeps ``corrections``: each sample's measured / fitted
    ratio at its place on the grid (``_shape``). A forward is charged the formula times the
    inverse-square-distance mean of those ratios (prefills with prefills, decodes with
    decodes), so the simulator charges exactly what was measured at a grid point and what the
    fit says far from one. On a CPU a one-token decode can be slower than a five-token one
    (it runs other kernels), which a five-term fit cannot bend to."""

    c0: float
    c_req: float
    c_tok: float
    c_knee: float
    knee_tokens: int
    c_attn: float
    source: str
    corrections: tuple[tuple[tuple[float, float, float, bool], float], ...] = ()

    def seconds(self, context_lens: Sequence[int], new_tokens: Sequence[int]) -> float:
        if not new_tokens:
            return 0.0
        n = sum(new_tokens)
        keys = sum(k * (l + k) for l, k in zip(context_lens, new_tokens))
        fitted = (self.c0 + self.c_req * len(new_tokens) + self.c_tok * n
                  + self.c_knee * knee_excess(n, self.knee_tokens) + self.c_attn * keys)
        return fitted * self.correction(context_lens, new_tokens) if self.corrections else fitted

    def correction(self, context_lens: Sequence[int], new_tokens: Sequence[int]) -> float:
        at = _shape(context_lens, new_tokens)
        num = den = 0.0
        for where, ratio in self.corrections:
            if where[3] != at[3]:
                continue
            d2 = (where[0] - at[0]) ** 2 + (where[1] - at[1]) ** 2 + 0.25 * (where[2] - at[2]) ** 2
            if d2 < 1e-12:
                return ratio
            num += ratio / d2
            den += 1.0 / d2
        return num / den if den else 1.0

    @classmethod
    def from_model(cls, model: LatencyModel, source: str) -> "TargetCost":
        bare = cls(model.c0, model.c_req, model.c_tok, model.c_knee, model.knee_tokens, model.c_attn, source)
        corrections = tuple((_shape(s.context_lens, s.num_new_tokens),
                             s.seconds / bare.seconds(s.context_lens, s.num_new_tokens))
                            for s in model.llm_samples)
        return dataclasses.replace(bare, corrections=corrections)


@dataclass(frozen=True, slots=True)
class DrafterCost:
    """T_ssm of one drafter call: ``c0 + c_req·b + c_tok·Γ`` (b requests, Γ tokens asked)."""

    c0: float
    c_req: float
    c_tok: float

    def seconds(self, num_requests: int, num_tokens: int) -> float:
        if num_requests <= 0:
            return 0.0
        return self.c0 + self.c_req * num_requests + self.c_tok * num_tokens


def load_profile(path: str | Path) -> LatencyModel:
    try:
        return LatencyModel.from_json(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read the profile {path}: {exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not a cosine-ray profile: {exc}") from None


def target_cost(spec: Mapping[str, Any], base_dir: Path) -> tuple[TargetCost, LatencyModel | None]:
    """A validated ``latency`` entry → its cost, and the profile it came from (if one)."""
    source = str(spec.get("source", ""))
    if "profile" in spec:
        path = (base_dir / spec["profile"]).expanduser()
        model = load_profile(path)
        return TargetCost.from_model(model, source or f"measured: {path.name}"), model
    if "linear" in spec:
        p = spec["linear"]
        return TargetCost(p.get("c0_ms", 0.0) / 1e3, p.get("c_req_ms", 0.0) / 1e3, p.get("c_tok_ms", 0.0) / 1e3,
                          p.get("c_knee_ms", 0.0) / 1e3, int(p.get("knee_tokens", 0)),
                          p.get("c_attn_us", 0.0) / 1e6, source), None
    p = spec["roofline"]
    eff_bw = p["memory_bandwidth_gbs"] * 1e9 * p.get("bandwidth_efficiency", 0.7)
    eff_flops = p["tflops"] * 1e12 * p.get("compute_efficiency", 0.5)
    params = p["params_billions"] * 1e9
    weight_bytes = params * p.get("bytes_per_param", 2)
    knee = max(1, round(weight_bytes * eff_flops / (2 * params * eff_bw)))
    per_tok = 2 * params / eff_flops
    # max(W/BW, per_tok·N) = W/BW + per_tok·max(N − K, 0) with K = (W/BW)/per_tok
    return TargetCost(p.get("overhead_ms", 0.0) / 1e3 + weight_bytes / eff_bw, 0.0, 0.0, per_tok, knee,
                      p.get("kv_bytes_per_token", 0) / eff_bw, source), None


def drafter_cost(spec: Mapping[str, Any] | None, name: str, profiles: Mapping[str, LatencyModel]) -> DrafterCost:
    """A drafter's ``latency``: ``{c0_ms, c_req_ms, c_tok_ms}`` or ``{profile: NAME, drafter: D}``
    (the T_ssm fit of drafter D, default the drafter's own name, in the named profile)."""
    if not spec:
        return DrafterCost(0.0, 0.0, 0.0)
    if "profile" in spec:
        model = profiles.get(spec["profile"])
        if model is None:
            raise ValueError(f"drafter {name}: latency model {spec['profile']!r} is not a measured profile")
        key = spec.get("drafter", name)
        if key not in model.ssm:
            raise ValueError(f"drafter {name}: the profile has no T_ssm for {key!r} (it has "
                             f"{', '.join(sorted(model.ssm)) or 'none'})")
        return DrafterCost(*model.ssm[key].coefs)
    return DrafterCost(spec.get("c0_ms", 0.0) / 1e3, spec.get("c_req_ms", 0.0) / 1e3, spec.get("c_tok_ms", 0.0) / 1e3)


def engine_model(stage_costs: Sequence[tuple[TargetCost, float]], drafters: Mapping[str, DrafterCost],
                 *, profile: LatencyModel | None = None) -> LatencyModel:
    """The latency model the simulated engine schedules with: a real profile when every stage
    runs one (its drafter fits replaced by the scenario's), else a fit to samples of the
    pipeline's summed stage costs on ``PROFILE_GRID`` (as ``cosine-ray profile`` would measure)."""
    ssm_samples = [SsmSample(name, b, b * g, max(cost.seconds(b, b * g), 1e-9))
                   for name, cost in drafters.items() for b in PROFILE_GRID[0] for g in PROFILE_GRID[1] if g]
    if profile is not None:
        ssm = {name: LinearFit((c.c0, c.c_req, c.c_tok), 1.0, 0.0, 0) for name, c in drafters.items()}
        return LatencyModel(profile.llm, ssm, profile.model_name, profile.device, profile.dtype,
                            len(stage_costs), profile.num_threads, profile.knee_tokens, profile.llm_samples,
                            tuple(ssm_samples))

    def total(context_lens: Sequence[int], new_tokens: Sequence[int]) -> float:
        return sum(share * cost.seconds(context_lens, new_tokens) for cost, share in stage_costs)

    llm = []
    for ctx in PROFILE_GRID[2]:
        llm.append(LlmSample((0,), (ctx,), total((0,), (ctx,))))
        for b in PROFILE_GRID[0]:
            for g in PROFILE_GRID[1]:
                llm.append(LlmSample((ctx,) * b, (1 + g,) * b, total((ctx,) * b, (1 + g,) * b)))
    return LatencyModel.fit(llm, ssm_samples, model_name="simulated", num_stages=len(stage_costs))
