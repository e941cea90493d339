"""The LP batch scheduler's problem (eq. 5-8): its inputs (``Candidate``, ``ScheduleConfig``), its
answer (``Schedule``), and the objective and constraints over the candidates in priority order
(``_Problem``, ``evaluate_schedule``, ``forced_mask``, ``priority_order``). ``algo.scheduling.lp_schedule``
solves it. Paper (CoSine §4.3) → code::

    b_i ∈ {0,1}, γ_i ≥ 1   one-hot x[i, g] over g = 0..G_i; b_i = Σ_g x[i, g], γ_i = Σ_g g·x[i, g] ≥ 0
    Γ ≤ Γ_max              Σ_i γ_i ≤ total_gamma_max
    T_ttl ≤ T_max          c0 + Σ_i share_i(γ_i) + T_ssm(b_draft, Γ) ≤ t_max_s (varlen T_llm shares,
                           token terms taken at their tangent)
    Σ b_i m_i ≤ M_max      KV bytes of admitted waiting requests ≤ M_max − what running ones hold
    min T/b + λΓ           min T_ttl / b − λ_b · Σ_i gains_i(γ_i)

γ_i = 0 lets a request decode plainly; the reward is *expected accepted* tokens; λ defaults to
T0 / b*², the first-order value of a token at plain decoding's time per token; a prefill counts
in T_ttl but, in the objective, as the decode step it turns into; a request that waited
``max_wait_s`` is forced in; ties go to the earlier candidate in priority order. Each choice and
why: docs/algorithms.md ("The LP batch scheduler").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

import numpy as np

from cosine_ray.algo.scheduling.latency_model import LatencyModel


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
    """> 0: this step prefills that many of its tokens (a new or resumed request; a chunk of a
    long prompt) after the ``context_len`` already in its cache; it drafts nothing (γ = 0)."""

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
    lam: float = math.nan
    """λ of eq. 8 this decision used (seconds per expected accepted token); TreeSelection
    prices the drafted trees with it, divided by the measured goodput and times the guard's
    level (``engine.owners.scheduler``, ``algo.tree_selection.TreePrice``)."""


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
    """The candidates in priority order: rows as Python lists (``time_rows[i][g]`` ↔ x[i, g]),
    the same as arrays on first use (``time``, ``gain``, ... for the MILP and dominance)."""

    def __init__(self, candidates: Sequence[Candidate], model: LatencyModel, config: ScheduleConfig) -> None:
        # built row by row in Python, arrays only when a path needs them: for the few requests
        # of one step that is faster than many small NumPy calls (a scheduling decision runs
        # between forwards, on caches the forward has just flushed)
        order = priority_order(candidates)
        if len({c.request_id for c in candidates}) != len(candidates):
            raise ValueError("candidate request ids must be unique")
        self.config, self.model = config, model
        self.mem_budget = max(0.0, config.kv_budget_bytes - float(sum(c.kv_bytes for c in candidates if c.running)))
        # a waiting request that alone exceeds the memory left can never be chosen
        cands = [c for c in (candidates[i] for i in order) if c.running or c.kv_bytes <= self.mem_budget]
        n = len(cands)
        self.ids = [c.request_id for c in cands]
        self.running_list = [c.running for c in cands]
        self.waited_list = [c.waited_s for c in cands]
        self.mem_list = [0.0 if c.running else float(c.kv_bytes) for c in cands]
        self.gmax_list = [0 if c.prefill_tokens else min(len(c.gains) - 1, config.gamma_max) for c in cands]
        G = max(self.gmax_list, default=0)
        self.num_g = G + 1
        # the token terms are convex (the latency model's knee) and couple the requests; the LP
        # keeps one share per request by using tangents. T_ttl (the T_max row, the predicted
        # step) uses the tangent at the reference batch: the b_ref requests of λ's plain step,
        # each with its root (or its prompt). The objective counts a prefill as the decode step
        # it turns into, and for each batch size b takes the tangent at the plain decode step of
        # b requests (``obj_line``), so T_ttl / b of a plain step is the model's own at every b.
        # One tangent for all b, touching past the knee, has the intercept c0 − c_knee·K, which
        # can be negative, and a negative T_ttl / b is least at b = 1: every admission would run
        # as the new prompt alone while the running requests idle.
        b_ref = max(1, min(config.max_batch_size, n))
        c0, c_tok = model.tangent(sum(c.prefill_tokens or 1 for c in cands[:b_ref]))
        c_req, c_attn = model.c_req, model.c_attn
        inf = math.inf
        time_rows, obj_base_rows, gain_rows = [], [], []
        for c, gm in zip(cands, self.gmax_list):
            if c.prefill_tokens:  # its prefill (chunk); in the objective, the decode step it turns into
                p, ctx = float(c.prefill_tokens), float(c.context_len)
                time_rows.append([c_req + c_tok * p + c_attn * p * (ctx + p)] + [inf] * G)
                obj_base_rows.append([c_req + c_attn * (ctx + p + 1)] + [inf] * G)
            else:  # per-request T_llm share of 1 + γ new tokens
                ctx = float(c.context_len)
                ks = [float(k) for k in range(1, gm + 2)]
                time_rows.append([c_req + c_tok * k + c_attn * k * (ctx + k) for k in ks] + [inf] * (G - gm))
                obj_base_rows.append([c_req + c_attn * k * (ctx + k) for k in ks] + [inf] * (G - gm))
            gain_rows.append(list(c.gains[: gm + 1]) + [-inf] * (G - gm))
        self.time_rows, self.obj_base_rows, self.gain_rows = time_rows, obj_base_rows, gain_rows
        """``obj_base_rows[i][g]``: request i's objective time at γ = g without its γ + 1 tokens'
        cost, which ``obj_line(b)`` prices per batch size (every row's γ = g has g + 1 tokens)."""
        self.c0 = c0
        """Intercept of T_ttl (the T_max row and the predicted step)."""
        self._model = model
        self._obj_lines: dict[int, tuple[float, float]] = {}
        self._obj_times: dict[float, np.ndarray] = {}
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
        if any(w >= config.max_wait_s for w in self.waited_list):
            self.forced_list = forced_mask(self.waited, self.mem, config, self.mem_budget).tolist()
        else:
            self.forced_list = [False] * n
        self.forced_ids = [i for i, f in enumerate(self.forced_list) if f]
        self.num_forced = len(self.forced_ids)
        c0_ref, c_tok_ref = self.obj_line(b_ref)
        self.plain_share = sum(row[0] for row in obj_base_rows) / n + c_tok_ref if n else 0.0
        self.b_values = list(range(max(1, self.num_forced), min(config.max_batch_size, n) + 1))
        if len(self.b_values) > 1 and self._everyone_goes():
            self.b_values = [n]
        if config.lam is not None:
            self.lam_value = config.lam
        else:
            self.lam_value = (c0_ref + b_ref * self.plain_share) / (b_ref * b_ref)

    def _everyone_goes(self) -> bool:
        """True when every optimum schedules all n candidates, so only b = n need be solved
        (exact; the common step, where every candidate runs and nothing binds).

        One objective line for every b (no knee between 1 and n), intercept c0' > 0. Any
        feasible schedule S of b < n requests, with any γ and drafter line, has the objective
        (C + Q_S)/b − λ·A_S, C ≥ c0' (the line's intercept plus the drafters' fixed time) and
        Q_S = Σ_S q_i(γ_i), each q_i(γ_i) ≥ p_i = its plain share (time rows grow with γ, the
        drafters' per-request terms are ≥ 0). Adding a request k ∉ S at γ = 0 leaves A_S,
        Γ and the drafters' time as they are and gives (C + Q_S + p_k)/(b + 1) − λ·A_S, which
        is strictly lower iff p_k < (C + Q_S)/b, and (C + Q_S)/b ≥ c0'/(n − 1) + min p. So
        when max p − min p < c0'/(n − 1) (with a margin for rounding), every schedule of
        fewer than n requests is strictly beaten by a larger one, if the larger one stays
        feasible: nothing can make it infeasible when no candidate adds memory (all running,
        or no KV cap) and even every request at its largest γ meets T_max."""
        n = len(self.ids)
        cfg = self.config
        if n < 2 or n > cfg.max_batch_size:
            return False
        c0_b, c_tok_b = self.obj_line(n)
        if self.obj_line(1) != (c0_b, c_tok_b) or not c0_b > 0:
            return False
        if math.isfinite(self.mem_budget) and any(self.mem_list):
            return False
        if any(x < 0 for line in self.lines for x in line):
            return False
        gmax = self.gmax_list
        widest = self.c0 + sum(row[g] for row, g in zip(self.time_rows, gmax)) \
            + self.ssm_time(sum(1 for g in gmax if g), sum(gmax))
        if not widest <= cfg.t_max_s:
            return False
        plain = [row[0] for row in self.obj_base_rows]
        return max(plain) - min(plain) < (1.0 - 1e-9) * c0_b / (n - 1)

    def obj_line(self, b: int) -> tuple[float, float]:
        """(intercept, per-token cost) of the objective's time at batch size b: the tangent of
        the token terms at the plain decode step of b requests (exact there)."""
        line = self._obj_lines.get(b)
        if line is None:
            line = self._obj_lines[b] = self._model.tangent(b)
        return line

    def obj_time_at(self, b: int) -> np.ndarray:  # [n, G+1]: the objective's time share at batch size b (read only)
        c_tok = self.obj_line(b)[1]
        out = self._obj_times.get(c_tok)  # one array per distinct line: below the knee, one for every b
        if out is None:
            out = self._obj_times[c_tok] = self.obj_base + c_tok * np.arange(1, self.num_g + 1, dtype=np.float64)
        return out

    # ---- the same as arrays, on first use ----------------------------------------------------
    def _rows(self, rows: list[list[float]]) -> np.ndarray:
        return np.array(rows, dtype=np.float64).reshape(len(self.ids), self.num_g)

    @cached_property
    def time(self) -> np.ndarray:  # [n, G+1]: step time share, inf beyond γ caps
        return self._rows(self.time_rows)

    @cached_property
    def obj_base(self) -> np.ndarray:  # [n, G+1]: ``obj_base_rows`` (read only)
        return self._rows(self.obj_base_rows)

    @cached_property
    def gain(self) -> np.ndarray:  # [n, G+1]: -inf beyond γ caps
        return self._rows(self.gain_rows)

    @cached_property
    def running(self) -> np.ndarray:
        return np.array(self.running_list, dtype=bool)

    @cached_property
    def waited(self) -> np.ndarray:
        return np.array(self.waited_list, dtype=np.float64)

    @cached_property
    def mem(self) -> np.ndarray:  # KV bytes of waiting requests, 0 for running ones
        return np.array(self.mem_list, dtype=np.float64)

    @cached_property
    def gmax(self) -> np.ndarray:
        return np.array(self.gmax_list, dtype=np.int64)

    @cached_property
    def forced(self) -> np.ndarray:
        return np.array(self.forced_list, dtype=bool).reshape(len(self.ids))

    def lam(self, b: int) -> float:
        """λ of eq. 8 (the same for every b; ``b`` is kept for a per-b rule)."""
        return self.lam_value

    def ssm_time(self, num_drafting: int, total_gamma: int) -> float:
        if num_drafting == 0:
            return 0.0
        return max(d0 + dr * num_drafting + dt * total_gamma for d0, dr, dt in self.lines)

    def evaluate(self, sel: Sequence[int], gam: Sequence[int]) -> tuple[float, float, str]:
        """(objective, T_ttl, violation or "") of indices ``sel`` with draft budgets ``gam``
        (plain Python over the rows; sums exactly rounded, so independent of the order)."""
        sel = [int(i) for i in sel]
        gam = [int(g) for g in gam]
        b = len(sel)
        if b == 0:
            return math.inf, 0.0, "empty batch"
        total_gamma = sum(gam)
        t_ssm = self.ssm_time(sum(1 for g in gam if g), total_gamma)
        time_rows, base_rows, gain_rows = self.time_rows, self.obj_base_rows, self.gain_rows
        step = self.c0 + math.fsum(time_rows[i][g] for i, g in zip(sel, gam)) + t_ssm
        c0_b, c_tok_b = self.obj_line(b)
        share = math.fsum(base_rows[i][g] for i, g in zip(sel, gam)) + c_tok_b * (b + total_gamma)
        objective = (c0_b + share + t_ssm) / b - self.lam(b) * math.fsum(gain_rows[i][g] for i, g in zip(sel, gam))
        cfg = self.config
        if b > cfg.max_batch_size:
            return objective, step, f"batch of {b} > max_batch_size {cfg.max_batch_size}"
        gmax = self.gmax_list
        if any(g > gmax[i] for i, g in zip(sel, gam)):
            return objective, step, "a γ_i exceeds its cap"
        if total_gamma > cfg.total_gamma_max:
            return objective, step, f"Σγ = {total_gamma} > total_gamma_max {cfg.total_gamma_max}"
        if math.isfinite(self.mem_budget) and math.fsum(self.mem_list[i] for i in sel) > self.mem_budget:
            return objective, step, "waiting admissions exceed the KV budget"
        if step > cfg.t_max_s:
            return objective, step, f"T_ttl {step:.6f} s > t_max_s {cfg.t_max_s}"
        if self.forced_ids and not set(self.forced_ids) <= set(sel):
            return objective, step, "a request that waited max_wait_s is left out"
        return objective, step, ""


def forced_mask(waited_s: np.ndarray, waiting_bytes: np.ndarray, config: ScheduleConfig,
                mem_budget: float) -> np.ndarray:
    """Requests (priority order) that waited max_wait_s: oldest first, up to the batch size,
    waiting ones (``waiting_bytes`` > 0; running ones pass 0) only while they fit in the
    ``mem_budget`` left by the running ones."""
    forced = np.zeros(len(waited_s), dtype=bool)
    overdue = np.flatnonzero(waited_s >= config.max_wait_s)
    if not len(overdue):
        return forced
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
