"""CoSine's batch scheduler: which requests step now, and how many draft tokens each (eq. 5-8).

Paper → code (papers/cosine.md §4.3, DESIGN §4)::

    b_i ∈ {0,1}        x[i, g] ∈ {0,1} one-hot over g = 0..G_i, b_i = Σ_g x[i, g]
    γ_i ≥ 1            γ_i = Σ_g g·x[i, g] ≥ 0: γ_i = 0 turns speculation off for request i
    l = max l_i        varlen cost: each request adds its own T_llm share (latency_model)
    Γ ≤ Γ_max          Σ_i γ_i ≤ total_gamma_max
    T_ttl ≤ T_max      T_ttl = c0 + Σ_i share_i(γ_i) + T_ssm(b_draft, Γ) ≤ t_max_s
    Σ b_i m_i ≤ M_max  Σ_{waiting, selected} m_i ≤ max(0, M_max − Σ_{running} m_i)
    min T/b + λΓ       min  T_ttl / b  −  λ_b · Σ_i gains_i(γ_i)

Interpretations (each differs from, or makes precise, the paper's text):

- **Sign and reward.** The paper writes ``+λΓ`` while saying λ rewards verified tokens; we
  use ``−λ``, and reward the *expected accepted* tokens ``gains_i(γ_i)`` rather than raw Γ
  (drafting a token nobody will accept only costs time). Gains are concave in γ, so γ_i is
  chosen through one-hot binaries x[i, g] and the reward is linear in them.
- **λ = None** is derived from the latency model: ``λ = T0 / b*²`` where b* is the largest
  batch the pool allows (min(max_batch_size, schedulable requests)) and ``T0 = c0 + b*·s̄``
  its predicted plain-decode step (s̄ = mean per-request T_llm share of the decode candidates
  at γ=0). Why: what we want is time per token ``T / (b + A)`` (A = Σ gains: a step of b
  requests yields b + A tokens); to first order in A around the plain full batch that is
  ``T/b − (T0/b*²)·A`` — eq. 8 with this λ. So at that batch size drafting is chosen iff
  ``T − T0 < (T0/b*)·A``, i.e. iff it raises tokens per second; speculation is switched off
  (all γ=0) when draft gains do not pay for their verify and draft time, and on when they do.
  For b* = 1 this is the brief's "per-request plain decode time"; the extra 1/b* is because
  A sums over the batch. One λ per decision keeps objectives of different b comparable (a
  λ that depends on b would favour tiny batches whenever gains are high).
- **T_ttl / b is nonlinear in b**: we enumerate b = 1..max_batch_size; for fixed b the
  objective is linear (λ_b too). T_ssm = max over drafters (epigraph variable t ≥ each
  drafter's linear time, times an indicator z = "someone drafts"), or their sum when
  ``parallel_drafters`` is False.
- **Running requests already hold their KV**, so M_max only limits admissions of waiting ones.
- **Waiting requests prefill**: a candidate with ``prefill_tokens > 0`` costs a prefill of that
  many tokens in T_ttl (so in T_max and the prediction) and drafts nothing (γ = 0), as in the
  router's step. In the *objective* it counts as the decode step it turns into (its prompt
  as context, one new token): every admitted request pays its prefill exactly once whenever
  it is admitted, so the prefill is not a throughput cost of *this* decision, while the
  larger running batch it leads to is a gain. With the real prefill cost in T/b, eq. 8 would
  never admit anyone voluntarily (a prefill is many decode steps' worth of work). T_max
  bounds how much prefill one step may carry (like a chunked-prefill token budget).
- **No starvation**: a candidate that waited ``max_wait_s`` or more is *forced* into the batch
  (oldest first, up to max_batch_size, waiting ones only while they fit in memory).
- **T_max infeasible** (even the best single request is slower than T_max): T_max is
  dropped and the best batch of the smallest allowed size (1, or the forced ones) is
  returned, status ``"tmax_relaxed"``: some request must always advance.
- **Ties** are deterministic: candidates are put in priority order (running first, then
  longest waited, then request id) and every tie goes to the earlier one.

Solving (exact; ``status == "optimal"`` means proved optimal):

1. *Certified relaxation*: for each b and each drafter's time line, drop the coupling
   constraints (Γ_max, M_max, T_max): the problem separates per request, and the b best
   requests (each with its best γ) are found by sorting. These are lower bounds of the true
   optimum; if one of these greedy solutions is feasible and meets the smallest bound, it is
   optimal and no MILP is solved (the common case when no constraint binds).
2. Otherwise one ``scipy.optimize.milp`` (HiGHS) per batch size b, in order of the lower
   bounds, skipping b whose bound cannot beat the incumbent. Requests dominated by ≥ b others
   (no better cost, no better gains at any γ, memory no worse) are removed first, and
   equal requests get symmetry rows b_k ≥ b_j (priority order); both are exact (exchange
   argument: swapping a dominated request for its dominator never hurts).
3. HiGHS failing or hitting ``time_limit_s``: ``first_come_batch`` with status "fallback".
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from cosine_ray.algo.latency_model import LatencyModel

_US = 1e6
"""MILP objective and time rows in microseconds (HiGHS tolerances are absolute)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    request_id: str
    context_len: int
    """l_i: tokens already in this request's KV cache."""
    kv_bytes: int
    """m_i: KV bytes it holds (running) or will hold once admitted (waiting)."""
    gains: tuple[float, ...]
    """gains[g]: expected accepted draft tokens with γ_i = g; gains[0] = 0, nondecreasing."""
    running: bool
    """Already admitted: holds its KV whether scheduled this step or not."""
    waited_s: float = 0.0
    """Time since it last advanced (fairness, tie-break)."""
    prefill_tokens: int = 0
    """> 0: this step is its prefill (a waiting request, or a restore) of that many tokens
    from an empty cache; it drafts nothing (γ = 0)."""

    def __post_init__(self) -> None:
        gains = self.gains
        if not isinstance(gains, tuple):
            object.__setattr__(self, "gains", gains := tuple(float(x) for x in gains))
        if not gains or gains[0] != 0:
            raise ValueError(f"{self.request_id}: gains must start with gains[0] = 0")
        if any(not (b >= a) for a, b in zip(gains, gains[1:])) or not math.isfinite(gains[-1]):
            raise ValueError(f"{self.request_id}: gains must be finite and nondecreasing")
        if self.context_len < 0 or self.kv_bytes < 0 or self.prefill_tokens < 0:
            raise ValueError(f"{self.request_id}: context_len, kv_bytes, prefill_tokens must be >= 0")
        if not (self.waited_s >= 0 and math.isfinite(self.waited_s)):
            raise ValueError(f"{self.request_id}: waited_s must be a finite number >= 0")

    @classmethod
    def make_dummy(cls, request_id: str = "r0", *, context_len: int = 128, running: bool = True,
                   gains: tuple[float, ...] = (0.0, 0.8, 1.4, 1.8, 2.0)) -> "Candidate":
        return cls(request_id, context_len, 1 << 20, gains, running)


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    max_batch_size: int = 8
    """Requests stepped at once (b ≤ this)."""
    gamma_max: int = 8
    """Per-request cap on γ_i."""
    total_gamma_max: int = 64
    """Γ_max (eq. 6): draft tokens verified per step over the batch."""
    t_max_s: float = 1.0
    """T_max (eq. 7): predicted step time cap; inf = none."""
    kv_budget_bytes: float = float("inf")
    """M_max (eq. 7): KV bytes all running + admitted requests may hold."""
    lam: float | None = None
    """λ (eq. 8), seconds per expected accepted token; None = λ_b = T0(b)/b² (module doc)."""
    time_limit_s: float = 0.05
    """HiGHS time limit for the whole decision; beyond it: FCFS fallback."""
    max_wait_s: float = 2.0
    """A candidate that waited this long is forced into the batch (no starvation)."""
    parallel_drafters: bool = True
    """Drafters run concurrently (Ray actors: T_ssm = max) or one after another (sum)."""
    drafters: tuple[str, ...] | None = None
    """Drafters whose T_ssm counts; None = every drafter in the latency model."""
    use_relaxation: bool = True
    """Return a relaxation solution when it is certified optimal (no HiGHS call); False =
    always solve with HiGHS (benchmarks and tests of the MILP path)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1 or self.gamma_max < 0 or self.total_gamma_max < 0:
            raise ValueError("max_batch_size must be >= 1, gamma_max and total_gamma_max >= 0")
        if not self.t_max_s > 0 or not self.kv_budget_bytes >= 0:
            raise ValueError("t_max_s must be > 0 and kv_budget_bytes >= 0 (inf = no cap)")
        if self.lam is not None and not (math.isfinite(self.lam) and self.lam >= 0):
            raise ValueError("lam must be None or a finite number >= 0")
        if not self.time_limit_s > 0 or not self.max_wait_s > 0:
            raise ValueError("time_limit_s and max_wait_s must be > 0")


@dataclass(frozen=True, slots=True)
class Schedule:
    batch: tuple[str, ...]
    """Scheduled request ids (b_i = 1), in priority order."""
    gamma: dict[str, int]
    """γ_i per scheduled request (0 = no drafting for it)."""
    predicted_step_s: float
    objective: float
    status: str
    """optimal | tmax_relaxed | fallback | empty | infeasible."""
    solve_s: float
    solver: str = "none"
    """How it was found: relaxation (certified greedy) | milp | fcfs | none."""
    num_milp: int = 0
    """HiGHS calls made for this decision."""


@dataclass(frozen=True, slots=True)
class ScheduleEvaluation:
    objective: float
    predicted_step_s: float
    feasible: bool
    reason: str = ""


# ---- the problem in arrays (priority order) ---------------------------------------------------
def _priority_key(c: Candidate) -> tuple[bool, float, str]:
    return (not c.running, -c.waited_s, c.request_id)


def priority_order(candidates: Sequence[Candidate]) -> list[int]:
    """Running first, then the longest waited, then request id."""
    return sorted(range(len(candidates)), key=lambda i: _priority_key(candidates[i]))


class _Problem:
    """The candidates in priority order, as arrays (x[i, g] ↔ ``time[i, g]``, ``gain[i, g]``)."""

    def __init__(self, candidates: Sequence[Candidate], model: LatencyModel, config: ScheduleConfig) -> None:
        n_all = len(candidates)
        ids_all = [c.request_id for c in candidates]
        if len(set(ids_all)) != n_all:
            raise ValueError("candidate request ids must be unique")
        cols = np.array([(c.running, c.waited_s, c.kv_bytes, c.context_len, c.prefill_tokens, len(c.gains))
                         for c in candidates], dtype=np.float64).reshape(n_all, 6)
        is_running = cols[:, 0] > 0
        order = np.lexsort((np.array(ids_all, dtype=str), -cols[:, 1], ~is_running))  # = priority_order
        self.config, self.model = config, model
        self.mem_budget = max(0.0, config.kv_budget_bytes - float(cols[is_running, 2].sum()))
        # a waiting request that alone exceeds the memory left can never be chosen
        order = order[is_running[order] | (cols[order, 2] <= self.mem_budget)]
        cols = cols[order]
        n = len(order)
        self.ids = [ids_all[i] for i in order]
        self.running = cols[:, 0] > 0
        self.waited = cols[:, 1]
        self.mem = np.where(self.running, 0.0, cols[:, 2])
        prefill = cols[:, 4]
        is_prefill = prefill > 0
        self.gmax = np.minimum(cols[:, 5].astype(np.int64) - 1, config.gamma_max)
        self.gmax[is_prefill] = 0
        G = int(self.gmax.max()) if n else 0
        g = np.arange(G + 1)
        _, c_req, c_tok, c_attn = model.llm.coefs
        ctx = cols[:, 3:4].copy()  # [n, 1]
        new = np.broadcast_to(1.0 + g, (n, G + 1)).copy()  # [n, G+1] new tokens: 1 + γ
        ctx[is_prefill, 0] = 0.0
        new[is_prefill, 0] = prefill[is_prefill]
        self.time = c_req + c_tok * new + c_attn * new * (ctx + new)  # [n, G+1] per-request T_llm share
        # objective share: a prefill counts as the decode step it turns into (module doc)
        self.obj_time = self.time.copy()
        self.obj_time[is_prefill, 0] = c_req + c_tok + c_attn * (prefill[is_prefill] + 1)
        pad = (0.0,) * (G + 1)
        self.gain = np.array([(candidates[i].gains + pad)[: G + 1] for i in order],
                             dtype=np.float64).reshape(n, G + 1)
        valid = g[None, :] <= self.gmax[:, None]
        self.time[~valid] = np.inf
        self.obj_time[~valid] = np.inf
        self.gain[~valid] = -np.inf
        self.g = g
        self.c0 = model.llm.coefs[0]
        # drafter time lines (d0, d_req, d_tok); sequential drafters add up into one line
        names = list(model.ssm if config.drafters is None else config.drafters)
        unknown = [name for name in names if name not in model.ssm]
        if unknown:
            raise ValueError(f"no T_ssm fit for drafter(s) {unknown}; profiled: {sorted(model.ssm)} "
                             f"(re-run `cosine-ray profile --drafters ...`)")
        lines = [model.ssm[name].coefs for name in names]
        if lines and not config.parallel_drafters:
            lines = [tuple(map(sum, zip(*lines)))]
        self.lines = lines or [(0.0, 0.0, 0.0)]
        self.forced = forced_mask(self.waited, self.mem, config, self.mem_budget)
        self.num_forced = int(self.forced.sum())
        self.plain_share = float(self.obj_time[:, 0].mean()) if n else 0.0
        self.b_values = list(range(max(1, self.num_forced), min(config.max_batch_size, n) + 1))
        if config.lam is not None:
            self.lam_value = config.lam
        else:
            b_ref = max(1, min(config.max_batch_size, n))
            self.lam_value = (self.c0 + b_ref * self.plain_share) / (b_ref * b_ref)

    def lam(self, b: int) -> float:
        """λ of eq. 8 (the same for every b; ``b`` is kept for a per-b rule)."""
        return self.lam_value

    def ssm_time(self, num_drafting: int, total_gamma: int) -> float:
        if num_drafting == 0:
            return 0.0
        return max(d0 + dr * num_drafting + dt * total_gamma for d0, dr, dt in self.lines)

    def evaluate(self, sel: np.ndarray, gam: np.ndarray) -> tuple[float, float, str]:
        """(objective, T_ttl, violation or "") of indices ``sel`` with draft budgets ``gam``."""
        b = len(sel)
        if b == 0:
            return math.inf, 0.0, "empty batch"
        t_ssm = self.ssm_time(int((gam > 0).sum()), int(gam.sum()))
        step = self.c0 + float(self.time[sel, gam].sum()) + t_ssm
        objective = (self.c0 + float(self.obj_time[sel, gam].sum()) + t_ssm) / b \
            - self.lam(b) * float(self.gain[sel, gam].sum())
        cfg = self.config
        if b > cfg.max_batch_size:
            return objective, step, f"batch of {b} > max_batch_size {cfg.max_batch_size}"
        if np.any(gam > self.gmax[sel]):
            return objective, step, "a γ_i exceeds its cap"
        if int(gam.sum()) > cfg.total_gamma_max:
            return objective, step, f"Σγ = {int(gam.sum())} > total_gamma_max {cfg.total_gamma_max}"
        if float(self.mem[sel].sum()) > self.mem_budget:
            return objective, step, "waiting admissions exceed the KV budget"
        if step > cfg.t_max_s:
            return objective, step, f"T_ttl {step:.6f} s > t_max_s {cfg.t_max_s}"
        if self.num_forced and not np.all(np.isin(np.flatnonzero(self.forced), sel)):
            return objective, step, "a request that waited max_wait_s is left out"
        return objective, step, ""


def forced_mask(waited_s: np.ndarray, waiting_bytes: np.ndarray, config: ScheduleConfig,
                mem_budget: float) -> np.ndarray:
    """Requests (priority order) that waited max_wait_s: oldest first, up to the batch size,
    waiting ones (``waiting_bytes`` > 0; running ones pass 0) only while they fit in the
    ``mem_budget`` left by the running ones."""
    forced = np.zeros(len(waited_s), dtype=bool)
    overdue = np.flatnonzero(waited_s >= config.max_wait_s)
    overdue = overdue[np.lexsort((overdue, -waited_s[overdue]))]
    used, count = 0.0, 0
    for i in overdue:
        if count == config.max_batch_size:
            break
        if used + waiting_bytes[i] <= mem_budget:
            forced[i], used, count = True, used + waiting_bytes[i], count + 1
    return forced


def evaluate_schedule(candidates: Sequence[Candidate], gamma: Mapping[str, int], model: LatencyModel,
                      config: ScheduleConfig) -> ScheduleEvaluation:
    """Objective, predicted step time and feasibility of scheduling ``gamma``'s requests with
    those γ: the same definitions ``schedule_batch`` optimises (tests' brute force uses it)."""
    prob = _Problem(candidates, model, config)
    index = {rid: i for i, rid in enumerate(prob.ids)}
    if any(rid not in index for rid in gamma):
        missing = [rid for rid in gamma if rid not in index]
        return ScheduleEvaluation(math.inf, math.nan, False, f"not schedulable: {missing}")
    sel = np.array(sorted(index[r] for r in gamma), dtype=np.int64)
    gam = np.array([int(gamma[prob.ids[i]]) for i in sel], dtype=np.int64)
    if np.any(gam < 0):
        return ScheduleEvaluation(math.inf, math.nan, False, "negative γ")
    gam_c = np.minimum(gam, prob.gmax[sel])
    objective, step, reason = prob.evaluate(sel, gam_c)
    if np.any(gam != gam_c):
        reason = reason or "a γ_i exceeds its cap"
    return ScheduleEvaluation(objective, step, not reason, reason)


# ---- Algorithm 2 and the FCFS baseline --------------------------------------------------------
def trim_gammas(gamma: Mapping[str, int], total_gamma_max: int) -> dict[str, int]:
    """Algorithm 2: while Σγ > Γ_max decrement the largest γ_j; among equal largest the one
    listed last goes first (so earlier = higher-priority requests keep more). Closed form of
    the loop: every γ above a level L ends at L or L+1, the first r of them at L+1."""
    if total_gamma_max < 0:
        raise ValueError("total_gamma_max must be >= 0")
    ids = list(gamma)
    values = np.array([int(gamma[r]) for r in ids], dtype=np.int64)
    if values.size == 0 or values.sum() <= total_gamma_max:
        return {r: int(v) for r, v in zip(ids, values)}
    if np.any(values < 0):
        raise ValueError("γ values must be >= 0")
    level_sums = [int(np.minimum(values, level).sum()) for level in range(int(values.max()) + 1)]
    level = max(lv for lv, s in enumerate(level_sums) if s <= total_gamma_max)
    extra = total_gamma_max - level_sums[level]
    out = np.minimum(values, level)
    above = np.flatnonzero(values > level)
    out[above[:extra]] = level + 1
    return {r: int(v) for r, v in zip(ids, out)}


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
                        "fallback", time.perf_counter() - start, "fcfs")
    if best is None:
        return Schedule((), {}, 0.0, math.inf, "infeasible", time.perf_counter() - start, solver, calls)
    objective, step, sel, gam = best
    order = np.argsort(sel, kind="stable")
    sel, gam = sel[order], gam[order]
    return Schedule(tuple(prob.ids[i] for i in sel), {prob.ids[i]: int(g) for i, g in zip(sel, gam)},
                    step, objective, status, time.perf_counter() - start, solver, calls)


def _relax_tmax(config: ScheduleConfig, b: int) -> ScheduleConfig:
    return dataclasses.replace(config, max_batch_size=b, t_max_s=math.inf)


_Best = tuple[float, float, np.ndarray, np.ndarray]


def _smallest(values: np.ndarray, pool: np.ndarray, k: int) -> np.ndarray:
    """The k entries of ``pool`` with the smallest ``values`` (ties: earliest index), O(n)."""
    if k <= 0:
        return pool[:0]
    if k >= len(pool):
        return pool
    v = values[pool]
    threshold = np.partition(v, k - 1)[k - 1]
    less = pool[v < threshold]
    return np.concatenate([less, pool[v == threshold][: k - len(less)]])


def _solve(prob: _Problem, start: float) -> tuple[_Best | None, str, int]:
    """Relaxation bounds and certificate, then HiGHS per batch size where needed."""
    best: _Best | None = None
    bounds: list[tuple[float, int]] = []
    forced_idx = np.flatnonzero(prob.forced)
    free_idx = np.flatnonzero(~prob.forced)
    no_draft = np.zeros(len(prob.ids), dtype=np.int64)
    line_bases = [prob.obj_time + dr * (prob.g > 0) + dt * prob.g for _, dr, dt in prob.lines]  # [n, G+1] each
    rows = np.arange(len(prob.ids))
    use_relaxation = prob.config.use_relaxation
    for b in prob.b_values:
        lam, k = prob.lam(b), b - len(forced_idx)
        # z = 0 (nobody drafts): per-request value time[i, 0] / b
        v0 = prob.obj_time[:, 0] / b
        sel = np.concatenate([forced_idx, _smallest(v0, free_idx, k)])
        bound_b = prob.c0 / b + float(v0[sel].sum())
        found = [(sel, no_draft[sel])]
        line_bound = -math.inf
        for (d0, _, _), base in zip(prob.lines, line_bases):  # z = 1 under each drafter's time line
            val = base / b - lam * prob.gain
            g_best = np.argmin(val, axis=1)
            v = val[rows, g_best]
            sel = np.concatenate([forced_idx, _smallest(v, free_idx, k)])
            line_bound = max(line_bound, (prob.c0 + d0) / b + float(v[sel].sum()))
            found.append((sel, g_best[sel]))
        bounds.append((min(bound_b, line_bound), b))
        if use_relaxation:
            for sel, gam in found:
                objective, step, reason = prob.evaluate(sel, gam)
                if reason and gam.sum() > prob.config.total_gamma_max:  # repair Γ with Algorithm 2
                    order = np.argsort(sel, kind="stable")
                    sel = sel[order]
                    gam = np.array(list(trim_gammas(dict(enumerate(gam[order].tolist())),
                                                    prob.config.total_gamma_max).values()), dtype=np.int64)
                    objective, step, reason = prob.evaluate(sel, gam)
                if not reason and (best is None or objective < best[0]):
                    best = (objective, step, sel, gam)
    lower = min(bd for bd, _ in bounds)
    if best is not None and best[0] <= lower + 1e-12 * max(1.0, abs(lower)):
        return best, "relaxation", 0
    calls = 0
    for bound_b, b in sorted(bounds):
        if use_relaxation and best is not None and bound_b >= best[0] - 1e-12 * max(1.0, abs(best[0])):
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
    score = np.min(prob.obj_time / b - lam * prob.gain, axis=1)
    dom_idx = np.argsort(score, kind="stable")[: 4 * b + 8]
    finite_mem = math.isfinite(prob.mem_budget)

    def geq(a: np.ndarray, c: np.ndarray) -> np.ndarray:  # [len(a), len(c)]: a ≽ c
        ok = np.all(prob.time[a][:, None, :] <= prob.time[c][None, :, :], axis=2)
        ok &= np.all(prob.obj_time[a][:, None, :] <= prob.obj_time[c][None, :, :], axis=2)
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
        key = prob.time[j].tobytes() + prob.obj_time[j].tobytes() + prob.gain[j].tobytes()
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
    cost[:nx] = (prob.obj_time[var_i, var_g] / b - lam * prob.gain[var_i, var_g]) * _US
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
