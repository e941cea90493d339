"""CoSine's batch scheduler: which requests step now, and how many draft tokens each (eq. 5-8).

The problem is defined in ``algo.scheduling.lp_problem``, whose public names this module re-exports; here
it is solved (``schedule_batch``), next to the baselines: Algorithm 2's trim (``trim_gammas``)
and the "LP off" ablation (``first_come_batch``). Solving is exact (``status == "optimal"``
means proved optimal): when every candidate provably goes, only b = n is solved in plain
Python; otherwise a certified relaxation per batch size b (the coupling rows dropped, so the
problem separates per request and sorting gives a bound and a candidate) often proves its
candidate optimal; otherwise one ``scipy.optimize.milp`` (HiGHS) per b, in bound order, after
exact dominance and symmetry reductions. If even one request exceeds T_max, T_max is dropped
(``"tmax_relaxed"``); if HiGHS fails or times out, first come decides (``"fallback"``). The
details: docs/algorithms.md ("Solving exactly").
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from cosine_ray.algo.scheduling.latency_model import LatencyModel
from cosine_ray.algo.scheduling.lp_problem import (Candidate, Schedule, ScheduleConfig, ScheduleEvaluation, _Problem,
                                        evaluate_schedule, forced_mask, priority_order)

__all__ = [
    "Candidate",
    "Schedule",
    "ScheduleConfig",
    "ScheduleEvaluation",
    "evaluate_schedule",
    "first_come_batch",
    "forced_mask",
    "priority_order",
    "schedule_batch",
    "trim_gammas",
]

_US = 1e6
"""MILP objective and time rows in microseconds (HiGHS tolerances are absolute)."""


# ---- Algorithm 2 and the FCFS baseline --------------------------------------------------------
def trim_gammas(gamma: Mapping[str, int], total_gamma_max: int) -> dict[str, int]:
    """Algorithm 2: while Σγ > Γ_max decrement the largest γ_j; among equal largest the one
    listed last goes first (so earlier = higher-priority requests keep more). Closed form of
    the loop: every γ above a level L ends at L or L+1, the first r of them at L+1."""
    if total_gamma_max < 0:
        raise ValueError("total_gamma_max must be >= 0")
    out = {r: int(v) for r, v in gamma.items()}
    values = list(out.values())
    if sum(values) <= total_gamma_max:
        return out
    if any(v < 0 for v in values):
        raise ValueError("γ values must be >= 0")
    level_sums = [sum(min(v, level) for v in values) for level in range(max(values) + 1)]
    level = max(lv for lv, s in enumerate(level_sums) if s <= total_gamma_max)
    extra = total_gamma_max - level_sums[level]
    above = [r for r, v in out.items() if v > level][:extra]
    return {r: (level + 1 if r in above else min(v, level)) for r, v in out.items()}


def first_come_batch(candidates: Sequence[Candidate], config: ScheduleConfig, gamma: int, *,
                     model: LatencyModel | None = None, status: str = "optimal") -> Schedule:
    """The "LP off" ablation: priority order (running, then arrival), up to max_batch_size,
    waiting ones admitted while they fit in memory (no overtaking), fixed γ (capped per
    request, 0 for prefills), trimmed by Algorithm 2. With a model, T_max drops requests from
    the end (never the first) and the prediction is filled in."""
    start = time.perf_counter()
    cands = [candidates[i] for i in priority_order(candidates)]
    held = sum(c.kv_bytes for c in cands if c.running)
    budget, used = max(0.0, config.kv_budget_bytes - held), 0.0
    batch: list[Candidate] = []
    for c in cands:
        if len(batch) == config.max_batch_size:
            break
        if not c.running:
            if used + c.kv_bytes > budget:
                break
            used += c.kv_bytes
        batch.append(c)
    gam = {c.request_id: 0 if c.prefill_tokens else max(0, min(gamma, config.gamma_max, len(c.gains) - 1))
           for c in batch}
    gam = trim_gammas(gam, config.total_gamma_max)
    step, objective = math.nan, math.nan
    if model is not None and batch:
        while True:
            ev = evaluate_schedule(batch, gam, model, _no_force(config))
            step, objective = ev.predicted_step_s, ev.objective
            if step <= config.t_max_s or len(batch) == 1:
                break
            gam.pop(batch.pop().request_id)
    return Schedule(tuple(c.request_id for c in batch), gam, step, objective,
                    status if batch else "empty", time.perf_counter() - start, "fcfs")


def _no_force(config: ScheduleConfig) -> ScheduleConfig:
    return dataclasses.replace(config, t_max_s=math.inf, kv_budget_bytes=math.inf, max_wait_s=math.inf)


# ---- the solver ---------------------------------------------------------------------------------
class _SolverFailed(RuntimeError):
    pass


def schedule_batch(candidates: Sequence[Candidate], model: LatencyModel, config: ScheduleConfig) -> Schedule:
    """Exact solution of eq. 5-8 (module docstring); deterministic for equal inputs."""
    start = time.perf_counter()
    if not candidates:
        return Schedule((), {}, 0.0, 0.0, "empty", time.perf_counter() - start)
    prob = _Problem(candidates, model, config)
    if not prob.b_values:
        return Schedule((), {}, 0.0, math.inf, "infeasible", time.perf_counter() - start)
    status = "optimal"
    try:
        best, solver, calls = _solve(prob, start)
        if best is None:  # T_max cannot be met: the smallest allowed batch, without T_max
            relaxed = _Problem(candidates, model, _relax_tmax(config, prob.b_values[0]))
            best, solver, more = _solve(relaxed, start)
            calls += more
            prob, status = relaxed, "tmax_relaxed"
    except _SolverFailed:
        fallback = first_come_batch(candidates, config, config.gamma_max, model=model, status="fallback")
        return Schedule(fallback.batch, fallback.gamma, fallback.predicted_step_s, fallback.objective,
                        "fallback", time.perf_counter() - start, "fcfs", lam=prob.lam_value)
    if best is None:
        return Schedule((), {}, 0.0, math.inf, "infeasible", time.perf_counter() - start, solver, calls)
    objective, step, sel, gam = best
    pairs = sorted(zip((int(i) for i in sel), (int(g) for g in gam)))  # priority order
    return Schedule(tuple(prob.ids[i] for i, _ in pairs), {prob.ids[i]: g for i, g in pairs},
                    step, objective, status, time.perf_counter() - start, solver, calls, lam=prob.lam_value)


def _relax_tmax(config: ScheduleConfig, b: int) -> ScheduleConfig:
    return dataclasses.replace(config, max_batch_size=b, t_max_s=math.inf)


_Best = tuple[float, float, Sequence[int], Sequence[int]]


class _Relaxation:
    """Lower bounds per batch size b, and the greedy solutions with a lower bound on each.

    For each b and each time line (z = 0: nobody drafts, γ = 0 only; z = 1 under each
    drafter's line) the problem without its coupling rows separates per request: each takes
    its best γ, and the b best requests (forced ones first, ties to the earliest) are a sort
    away. All b and lines at once, as [lines + 1, B, n, G + 1] arrays; ``v[line][bi][i]`` is
    request i's relaxed value and ``g_best[line][bi][i]`` its γ. A solution's indices are
    built only when asked."""

    def __init__(self, prob: _Problem, *, arrays: bool = False) -> None:
        bs = prob.b_values
        num_b, n, inf = len(bs), len(prob.ids), math.inf
        self.b_values = bs
        self.num_lines = len(prob.lines) + 1
        self.forced = prob.forced_list if prob.num_forced else None
        # each line's extra time per request at γ = g (line 0: none, and no γ > 0)
        extras = [[0.0] + [inf] * (prob.num_g - 1)]
        extras += [[0.0] + [dr + dt * g for g in range(1, prob.num_g)] for _, dr, dt in prob.lines]
        if num_b == 1 and not arrays:  # one b (``_Problem._everyone_goes``): a few hundred floats, in Python
            self._one_b(prob, extras)
            return
        lines = [prob.obj_line(b) for b in bs]
        if all(line == lines[0] for line in lines):  # below the knee: one objective line for every b
            obj = prob.obj_time_at(bs[0])[None, None]  # [1, 1, n, G+1]
        else:
            obj = np.stack([prob.obj_time_at(b) for b in bs])[None]  # [1, B, n, G+1]
        per_b = np.array(extras, dtype=np.float64)[:, None, None, :] + obj
        per_b = per_b / np.array(bs, dtype=np.float64).reshape(1, num_b, 1, 1)  # [L+1, B, n, G+1]
        gain = prob.gain if prob.lam_value > 0 else np.maximum(prob.gain, 0.0)  # λ = 0: no 0·(-inf)
        val = per_b - prob.lam_value * gain
        g_best = np.argmin(val, axis=3)  # [L+1, B, n]
        v = val.min(axis=3)
        if self.forced is None:
            ranked = np.sort(v, axis=2)
        else:  # forced requests first (in priority order), then by value
            ranked = np.take_along_axis(v, np.argsort(np.where(prob.forced, -inf, v), axis=2, kind="stable"), axis=2)
        b0 = bs[0]
        sums = np.cumsum(ranked, axis=2)[:, np.arange(num_b), np.arange(b0 - 1, b0 - 1 + num_b)].tolist()  # [L+1, B]
        self.v, self.g_best = v.tolist(), g_best.tolist()
        # values[line][bi]: the b best, plus the fixed time; a solution that drafts costs at
        # least its line's value, one that does not values[0] (plain Python from here: a
        # decision runs between forwards, on caches the forward has just flushed, where each
        # NumPy call costs ~10 µs)
        offsets = [0.0] + [d0 for d0, _, _ in prob.lines]
        values = [[(lines[bi][0] + offsets[j]) / b + sums[j][bi] for bi, b in enumerate(bs)]
                  for j in range(self.num_lines)]
        plain = values[0]
        self.lows = [min(values[j][bi], plain[bi]) for bi in range(num_b) for j in range(self.num_lines)]
        """Lower bound of each greedy solution, index = bi·(lines + 1) + line."""
        self.bounds = [(min(plain[bi], max(values[j][bi] for j in range(1, self.num_lines))), b)
                       for bi, b in enumerate(bs)]
        """(lower bound of the optimum with b requests, b)."""

    def _one_b(self, prob: _Problem, extras: list[list[float]]) -> None:
        """The same bounds and solutions for a single b, in plain Python: the same IEEE
        operations in the same order as the array path (``test_single_b_relaxation_is_the_array_one``),
        so the same answer bit for bit, without its dozen NumPy calls."""
        b = prob.b_values[0]
        fb = float(b)
        c0_b, c_tok = prob.obj_line(b)
        lam = prob.lam_value
        steps = [c_tok * float(g + 1) for g in range(prob.num_g)]
        obj = [[base + step for base, step in zip(row, steps)] for row in prob.obj_base_rows]
        gains = prob.gain_rows if lam > 0 else [[max(x, 0.0) for x in row] for row in prob.gain_rows]
        forced = self.forced
        self.v, self.g_best, values = [], [], []
        offsets = [0.0] + [d0 for d0, _, _ in prob.lines]
        for j, extra in enumerate(extras):
            v_row, g_row = [], []
            for obj_row, gain_row in zip(obj, gains):
                vals = [(e + o) / fb - lam * a for e, o, a in zip(extra, obj_row, gain_row)]
                best = min(vals)
                v_row.append(best)
                g_row.append(vals.index(best))  # the first minimum, as argmin
            ranked = [v_row[i] for i in sorted(range(len(v_row)), key=_rank_key(v_row, forced))]
            total = 0.0
            for x in ranked[:b]:  # sequential, as cumsum
                total += x
            self.v.append([v_row])
            self.g_best.append([g_row])
            values.append((c0_b + offsets[j]) / fb + total)
        plain = values[0]
        self.lows = [min(values[j], plain) for j in range(self.num_lines)]
        self.bounds = [(min(plain, max(values[j] for j in range(1, self.num_lines))), b)]

    def solution(self, index: int) -> tuple[list[int], list[int]]:
        bi, j = divmod(index, self.num_lines)
        v_row = self.v[j][bi]
        sel = sorted(range(len(v_row)), key=_rank_key(v_row, self.forced))[: self.b_values[bi]]
        g_row = self.g_best[j][bi]
        return sel, [g_row[i] for i in sel]


def _rank_key(v_row: list[float], forced: list[bool] | None):
    """Sort key over request indices: forced requests first, then by relaxed value (a stable
    sort sends ties to the earliest, as the array path's stable argsort)."""
    return v_row.__getitem__ if forced is None else (lambda i: -math.inf if forced[i] else v_row[i])


def _solve(prob: _Problem, start: float) -> tuple[_Best | None, str, int]:
    """Relaxation bounds and certificate, then HiGHS per batch size where needed."""
    best: _Best | None = None
    relaxation = _Relaxation(prob)
    bounds = relaxation.bounds
    if prob.config.use_relaxation:
        best = _best_found(prob, relaxation)
    lower = min(bd for bd, _ in bounds)
    if best is not None and best[0] <= lower + 1e-12 * max(1.0, abs(lower)):
        return best, "relaxation", 0
    calls = 0
    for bound_b, b in sorted(bounds):
        if prob.config.use_relaxation and best is not None and bound_b >= best[0] - 1e-12 * max(1.0, abs(best[0])):
            continue
        remaining = prob.config.time_limit_s - (time.perf_counter() - start)
        if remaining <= 0:
            raise _SolverFailed("time limit")
        found_b = _solve_milp(prob, b, remaining)
        calls += 1
        if found_b is not None:
            objective, step, reason = prob.evaluate(*found_b)
            if not reason and (best is None or objective < best[0]):
                best = (objective, step, found_b[0], found_b[1])
    return best, "milp", calls


def _best_found(prob: _Problem, relaxation: _Relaxation) -> _Best | None:
    """The best feasible greedy solution (Γ repaired by Algorithm 2 where Σγ is too large),
    ties to the earliest found: evaluated in order of their lower bounds, stopping at the first
    bound above the incumbent, so usually one or two of the 2·b_max evaluations are done."""
    best: _Best | None = None
    best_seq = -1
    lows = relaxation.lows
    for seq in sorted(range(len(lows)), key=lows.__getitem__):  # stable
        if best is not None and lows[seq] > best[0]:
            break
        sel, gam = relaxation.solution(seq)
        objective, step, reason = prob.evaluate(sel, gam)
        if reason and sum(gam) > prob.config.total_gamma_max:  # repair Γ with Algorithm 2
            pairs = sorted(zip(sel, gam))
            sel = [i for i, _ in pairs]
            gam = list(trim_gammas(dict(enumerate(g for _, g in pairs)), prob.config.total_gamma_max).values())
            objective, step, reason = prob.evaluate(sel, gam)
        if not reason and (best is None or objective < best[0] or (objective == best[0] and seq < best_seq)):
            best, best_seq = (objective, step, sel, gam), seq
    return best


def _dominance(prob: _Problem, b: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """(kept mask, symmetry pairs (k, j) meaning b_k ≥ b_j) for batch size b.

    k ≽ j: no larger per-request time and no smaller gain at every γ (γ caps included through
    the inf/-inf padding) and memory no worse (k running, or both waiting and m_k ≤ m_j).
    k ≻ j: k ≽ j, and k is strictly better somewhere or earlier in priority order.
    j is dropped when ≥ b requests ≻ it (it could only be chosen with them all); candidate
    dominators are the 4b + 8 requests with the best relaxed value.
    """
    n = len(prob.ids)
    lam = prob.lam(b)
    obj_time = prob.obj_time_at(b)
    score = np.min(obj_time / b - lam * prob.gain, axis=1)
    dom_idx = np.argsort(score, kind="stable")[: 4 * b + 8]
    finite_mem = math.isfinite(prob.mem_budget)

    def geq(a: np.ndarray, c: np.ndarray) -> np.ndarray:  # [len(a), len(c)]: a ≽ c
        ok = np.all(prob.time[a][:, None, :] <= prob.time[c][None, :, :], axis=2)
        ok &= np.all(obj_time[a][:, None, :] <= obj_time[c][None, :, :], axis=2)
        ok &= np.all(prob.gain[a][:, None, :] >= prob.gain[c][None, :, :], axis=2)
        if finite_mem:
            ok &= prob.running[a][:, None] | (~prob.running[c][None, :] & (prob.mem[a][:, None] <= prob.mem[c][None, :]))
        return ok

    everyone = np.arange(n)
    k_geq_j = geq(dom_idx, everyone)  # [K, n]
    j_geq_k = geq(everyone, dom_idx).T  # [K, n]
    strict = k_geq_j & (~j_geq_k | (dom_idx[:, None] < everyone[None, :]))
    strict[np.arange(len(dom_idx)), dom_idx] = False  # nobody dominates itself
    counts = strict.sum(axis=0)
    keep = (counts < b) | prob.forced
    # symmetry rows among kept requests with identical time and gain rows, in priority order
    pairs: list[tuple[int, int]] = []
    last: dict[bytes, int] = {}
    for j in np.flatnonzero(keep):
        key = prob.time[j].tobytes() + obj_time[j].tobytes() + prob.gain[j].tobytes()
        k = last.get(key)
        if k is not None and not prob.forced[j]:
            mem_ok = (not finite_mem) or prob.running[k] or (not prob.running[j] and prob.mem[k] <= prob.mem[j])
            if mem_ok:
                pairs.append((k, int(j)))
        last[key] = int(j)
    return keep, pairs


def _solve_milp(prob: _Problem, b: int, time_limit_s: float) -> tuple[np.ndarray, np.ndarray] | None:
    """One MILP for batch size b; (indices, γ) or None when infeasible. Raises _SolverFailed."""
    keep, pairs = _dominance(prob, b)
    cand = np.flatnonzero(keep)
    if len(cand) < b:
        return None
    # variables: x[i, g] for kept i and g ≤ gmax_i, then z (someone drafts), then t (T_ssm)
    var_i = np.concatenate([np.full(int(prob.gmax[i]) + 1, i) for i in cand])
    var_g = np.concatenate([np.arange(int(prob.gmax[i]) + 1) for i in cand])
    nx = len(var_i)
    z, t = nx, nx + 1
    nv = nx + 2
    lam = prob.lam(b)
    cost = np.zeros(nv)
    cost[:nx] = (prob.obj_time_at(b)[var_i, var_g] / b - lam * prob.gain[var_i, var_g]) * _US
    cost[t] = 1.0 / b  # t is already in μs
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(cols_: np.ndarray, vals_: np.ndarray, lo_: float, hi_: float) -> None:
        nonlocal r
        rows.append(np.full(len(cols_), r))
        cols.append(np.asarray(cols_, dtype=np.int64))
        vals.append(np.asarray(vals_, dtype=np.float64))
        lo.append(lo_)
        hi.append(hi_)
        r += 1

    pos = {int(i): k for k, i in enumerate(cand)}
    row_of_var = np.array([pos[int(i)] for i in var_i])
    # one γ per request (exactly one for a forced request)
    for k, i in enumerate(cand):
        members = np.flatnonzero(row_of_var == k)
        add(members, np.ones(len(members)), 1.0 if prob.forced[i] else 0.0, 1.0)
    xs = np.arange(nx)
    drafting = xs[var_g > 0]
    add(xs, np.ones(nx), b, b)  # Σ b_i = b
    add(np.append(drafting, z), np.append(np.ones(len(drafting)), -b), -np.inf, 0.0)  # z = 1 if anyone drafts
    for d0, dr, dt in prob.lines:  # t ≥ each drafter's time (μs)
        add(np.concatenate([drafting, [z, t]]),
            np.concatenate([-(dr + dt * var_g[drafting]) * _US, [-d0 * _US, 1.0]]), 0.0, np.inf)
    cfg = prob.config
    if int((prob.gmax[cand]).sum()) > cfg.total_gamma_max:
        add(drafting, var_g[drafting].astype(np.float64), -np.inf, cfg.total_gamma_max)
    waiting_x = xs[prob.mem[var_i] > 0]
    if math.isfinite(prob.mem_budget) and len(waiting_x):
        add(waiting_x, prob.mem[var_i[waiting_x]] / max(prob.mem_budget, 1.0), -np.inf,
            prob.mem_budget / max(prob.mem_budget, 1.0))
    if math.isfinite(cfg.t_max_s):
        add(np.append(xs, t), np.append(prob.time[var_i, var_g] * _US, 1.0), -np.inf, (cfg.t_max_s - prob.c0) * _US)
    for k, j in pairs:  # b_k - b_j ≥ 0
        mk, mj = np.flatnonzero(row_of_var == pos[k]), np.flatnonzero(row_of_var == pos[j])
        add(np.concatenate([mk, mj]), np.concatenate([np.ones(len(mk)), -np.ones(len(mj))]), 0.0, np.inf)
    a = coo_array((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r, nv)).tocsr()
    integrality = np.ones(nv)
    integrality[t] = 0
    upper = np.ones(nv)
    upper[t] = np.inf
    with warnings.catch_warnings():  # mip_abs_gap is a HiGHS option scipy passes on with a warning
        warnings.simplefilter("ignore")
        res = milp(cost, integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
                   constraints=LinearConstraint(a, np.array(lo), np.array(hi)),
                   options={"time_limit": time_limit_s, "mip_rel_gap": 0.0, "mip_abs_gap": 0.0})
    if res.status == 2:  # infeasible for this b
        return None
    if res.status != 0 or res.x is None:
        raise _SolverFailed(res.message)
    chosen = np.flatnonzero(res.x[:nx] > 0.5)
    return var_i[chosen].astype(np.int64), var_g[chosen].astype(np.int64)
