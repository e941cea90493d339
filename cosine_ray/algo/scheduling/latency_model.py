"""Measured latency models of one speculative step: T_llm (verify) and T_ssm (draft), eq. 7.

CoSine models the step time as ``T_ttl = max_n T_ssm,n + T_llm`` and measures both terms. This
module fits them to samples taken by ``engine/profile.py`` (``cosine-ray profile``); only
``LatencyModel.default()``, for unit tests, is a guessed constant. Our target forward has no
padding, so T_llm is fitted in varlen form over the step's new tokens N = Σ n_i::

    T_llm = c0 + c_req·b + c_tok·N + c_knee·max(N − K, 0) + c_attn·Σ n_i·(l_i + n_i)

The knee K (``knee_tokens``, chosen by the fit from ``KNEE_CANDIDATES``) makes the token cost
convex, a roofline; since it couples a step's requests, nodes are priced at the local slope
(``token_slope``) and the LP uses a tangent (``tangent``). ``predict_llm_paper`` is the paper's
``T_llm(b, l, Γ)``, an upper bound. T_ssm per drafter is ``c0 + c_req·b + c_tok·Γ``, the max
over drafters that run in parallel, the sum over those that run in turn. Fits are non-negative
least squares on relative residuals. Why each choice: docs/algorithms.md ("Latency models").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import nnls

SCHEMA_VERSION = 2
"""2 added the knee (``c_knee``, ``knee_tokens``); a version-1 profile still loads, with no knee
(c_knee = 0, exactly its old linear model) until the engine's first refit finds one."""
LLM_TERMS = ("c0", "c_req", "c_tok", "c_knee", "c_attn")
KNEE_CANDIDATES = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
"""K values the fit tries (tokens in one forward)."""
KNEE_MIN_GAIN = 0.05
"""A knee is kept only when it lowers the weighted relative squared error by this share (one
more coefficient always fits noise a little better)."""
KNEE_MIN_SIDE = 3
"""A candidate K needs this many samples on each side (N ≤ K and N > K) to be tried."""
SSM_TERMS = ("c0", "c_req", "c_tok")


# ---- samples ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LlmSample:
    """One measured target forward (all stages) of a varlen batch."""

    context_lens: tuple[int, ...]
    """l_i: tokens already in each request's KV cache."""
    num_new_tokens: tuple[int, ...]
    """n_i: new tokens of each request (1 + γ_i tree nodes, or the prompt at a prefill)."""
    seconds: float
    """Median wall time of the forward."""

    def __post_init__(self) -> None:
        if not self.context_lens or len(self.context_lens) != len(self.num_new_tokens):
            raise ValueError("context_lens and num_new_tokens must be non-empty and equal length")
        if min(self.context_lens) < 0 or min(self.num_new_tokens) < 1:
            raise ValueError("context lengths must be >= 0 and new-token counts >= 1")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"seconds must be a positive number, got {self.seconds!r}")

    def features(self, knee_tokens: int = 0) -> tuple[float, float, float, float, float]:
        return llm_features(self.context_lens, self.num_new_tokens, knee_tokens)


@dataclass(frozen=True, slots=True)
class SsmSample:
    """One measured ``propose`` call of one drafter for a batch."""

    drafter: str
    num_requests: int
    """b: requests in the call (each with a budget > 0)."""
    num_draft_tokens: int
    """Γ: total draft budget of the call."""
    seconds: float

    def __post_init__(self) -> None:
        if not self.drafter or self.num_requests < 1 or self.num_draft_tokens < 0:
            raise ValueError("an SsmSample needs a drafter name, num_requests >= 1, num_draft_tokens >= 0")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"seconds must be a positive number, got {self.seconds!r}")


def llm_features(context_lens: Sequence[int], num_new_tokens: Sequence[int],
                 knee_tokens: int = 0) -> tuple[float, float, float, float, float]:
    """(1, b, N, max(N − K, 0), Σ n_i·(l_i + n_i)) with N = Σ n_i: the regressors of T_llm
    (K = ``knee_tokens``; 0 = no knee, the fourth regressor is 0)."""
    b = len(num_new_tokens)
    n_tok = sum(num_new_tokens)
    attn = sum(n * (l + n) for l, n in zip(context_lens, num_new_tokens))
    return 1.0, float(b), float(n_tok), float(knee_excess(n_tok, knee_tokens)), float(attn)


def knee_excess(num_tokens: float, knee_tokens: int) -> float:
    """max(N − K, 0): the tokens past the knee (0 without one)."""
    return max(num_tokens - knee_tokens, 0) if knee_tokens > 0 else 0


def token_seconds(num_tokens: float, c_tok: float, c_knee: float, knee_tokens: int) -> float:
    """The token terms of T_llm for N new tokens: ``c_tok·N + c_knee·max(N − K, 0)`` (convex)."""
    return c_tok * num_tokens + c_knee * knee_excess(num_tokens, knee_tokens)


# ---- one linear fit ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LinearFit:
    """``seconds = coefs · features`` with non-negative coefficients, and how well it fits."""

    coefs: tuple[float, ...]
    r2: float
    max_rel_error: float
    num_samples: int
    rel_sse: float = field(default=0.0, compare=False)
    """Σ w·((pred − y) / y)²: what the fit minimised (to compare fits of other regressors)."""

    def predict(self, features: Sequence[float]) -> float:
        return float(sum(c * f for c, f in zip(self.coefs, features)))

    @classmethod
    def fit(cls, rows: Sequence[Sequence[float]], seconds: Sequence[float],
            weights: Sequence[float] | None = None) -> "LinearFit":
        """NNLS on relative residuals: minimise Σ w·((A x − y) / y)² subject to x ≥ 0."""
        a = np.asarray(rows, dtype=np.float64)  # [num_samples, num_terms]
        y = np.asarray(seconds, dtype=np.float64)  # [num_samples]
        if a.ndim != 2 or a.shape[0] != y.shape[0] or a.shape[0] == 0:
            raise ValueError("need at least one sample with one row of features each")
        w = np.ones_like(y) if weights is None else np.sqrt(np.asarray(weights, dtype=np.float64))  # [num_samples]
        scale = np.maximum(np.abs(a).max(axis=0), 1e-300)  # column scaling for conditioning
        x, rnorm = nnls((a / scale) * (w / y)[:, None], w)
        x = x / scale
        pred = a @ x
        ss_res = float(((pred - y) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
        return cls(tuple(float(v) for v in x), r2, float(np.max(np.abs(pred - y) / y)), int(len(y)),
                   float(rnorm) ** 2)

    def to_dict(self, names: Sequence[str]) -> dict[str, Any]:
        return {"coefs": dict(zip(names, self.coefs)), "r2": self.r2,
                "max_rel_error": self.max_rel_error, "num_samples": self.num_samples}

    @classmethod
    def from_dict(cls, data: Any, names: Sequence[str], where: str) -> "LinearFit":
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object")
        coefs = data.get("coefs")
        if not isinstance(coefs, dict) or set(coefs) != set(names):
            raise ValueError(f"{where}.coefs must have exactly the keys {', '.join(names)}")
        values = [coefs[n] for n in names]
        if any(not _is_number(v) or v < 0 for v in values):
            raise ValueError(f"{where}.coefs must be finite numbers >= 0")
        for key in ("r2", "max_rel_error"):
            if not _is_number(data.get(key)):
                raise ValueError(f"{where}.{key} must be a finite number")
        if not isinstance(data.get("num_samples"), int) or data["num_samples"] < 0:
            raise ValueError(f"{where}.num_samples must be an integer >= 0")
        return cls(tuple(float(v) for v in values), float(data["r2"]), float(data["max_rel_error"]),
                   int(data["num_samples"]))


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---- the model --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class LatencyModel:
    llm: LinearFit
    """T_llm over (1, b, N, max(N − K, 0), Σ n_i (l_i + n_i)) — see the module docstring."""
    ssm: Mapping[str, LinearFit]
    """drafter name -> T_ssm over (1, b, Γ)."""
    model_name: str = "unknown"
    device: str = "cpu"
    dtype: str = "float32"
    num_stages: int = 1
    num_threads: int | None = None
    """torch intra-op threads during the measurement (None: torch's default)."""
    knee_tokens: int = 0
    """K: new tokens per forward beyond which each costs ``c_knee`` more (0 = no knee)."""
    llm_samples: tuple[LlmSample, ...] = field(default=(), repr=False)
    ssm_samples: tuple[SsmSample, ...] = field(default=(), repr=False)

    # -- the T_llm terms by name ----------------------------------------------------------
    @property
    def c0(self) -> float:
        return self.llm.coefs[0]

    @property
    def c_req(self) -> float:
        return self.llm.coefs[1]

    @property
    def c_tok(self) -> float:
        return self.llm.coefs[2]

    @property
    def c_knee(self) -> float:
        return self.llm.coefs[3]

    @property
    def c_attn(self) -> float:
        return self.llm.coefs[4]

    # -- prediction ------------------------------------------------------------------------
    def predict_llm(self, context_lens: Sequence[int], num_new_tokens: Sequence[int]) -> float:
        """Varlen target forward: l_i cached and n_i new tokens per request (seconds)."""
        if len(context_lens) != len(num_new_tokens):
            raise ValueError("context_lens and num_new_tokens must have the same length")
        if not num_new_tokens:
            return 0.0
        return self.llm.predict(llm_features(context_lens, num_new_tokens, self.knee_tokens))

    def token_seconds(self, num_tokens: float) -> float:
        """The token terms of T_llm for N new tokens (``token_seconds``)."""
        return token_seconds(num_tokens, self.c_tok, self.c_knee, self.knee_tokens)

    def token_slope(self, num_tokens: float) -> float:
        """What the next token costs in a forward that already has ``num_tokens`` new ones."""
        return self.token_seconds(num_tokens + 1) - self.token_seconds(num_tokens)

    def tangent(self, num_tokens: float) -> tuple[float, float]:
        """(c0', c_tok'): the straight line that touches the token terms at ``num_tokens`` with the
        next token's slope, as an intercept and a per-token cost. ``c0' + c_req·b + c_tok'·N +
        c_attn·…`` equals T_llm at N = ``num_tokens`` and never exceeds it elsewhere (convexity)."""
        if float(num_tokens).is_integer():  # exact: one line below the knee, one past it (no rounding)
            if self.knee_tokens > 0 and num_tokens >= self.knee_tokens:
                return self.c0 - self.c_knee * self.knee_tokens, self.c_tok + self.c_knee
            return self.c0, self.c_tok
        slope = self.token_slope(num_tokens)
        return self.c0 + self.token_seconds(num_tokens) - slope * num_tokens, slope

    def predict_llm_paper(self, b: int, l: int, total_gamma: int, gamma_max: int) -> float:
        """The paper's T_llm(b, l, Γ): b + Γ new tokens, each over at most l + 1 + γ_max keys.
        An upper bound of ``predict_llm`` for any batch with max context l and per-request γ ≤ γ_max."""
        if b <= 0:
            return 0.0
        n_tok = b + total_gamma
        return self.c0 + self.c_req * b + self.token_seconds(n_tok) + self.c_attn * n_tok * (l + 1 + gamma_max)

    def predict_ssm(self, drafter: str, num_requests: int, num_draft_tokens: int) -> float:
        """One drafter's ``propose`` for b requests with total budget Γ (0 when nothing drafts)."""
        if num_requests <= 0 or num_draft_tokens <= 0:
            return 0.0
        fit = self.ssm.get(drafter)
        if fit is None:
            raise KeyError(f"no T_ssm fit for drafter {drafter!r}; profiled: {sorted(self.ssm)}")
        return fit.predict((1.0, float(num_requests), float(num_draft_tokens)))

    def predict_ssm_step(self, num_requests: int, num_draft_tokens: int, *, parallel: bool = True,
                         drafters: Iterable[str] | None = None) -> float:
        """Drafting time of a step: max over the drafters (parallel) or their sum (sequential)."""
        names = list(self.ssm if drafters is None else drafters)
        times = [self.predict_ssm(n, num_requests, num_draft_tokens) for n in names]
        if not times:
            return 0.0
        return max(times) if parallel else sum(times)

    def predict_step(self, context_lens: Sequence[int], gammas: Sequence[int], *,
                     parallel_drafters: bool = True) -> float:
        """T_ttl (eq. 7) of a decode step: drafting (requests with γ_i > 0) plus verification."""
        drafting = [g for g in gammas if g > 0]
        t_ssm = self.predict_ssm_step(len(drafting), sum(drafting), parallel=parallel_drafters)
        return t_ssm + self.predict_llm(context_lens, [1 + g for g in gammas])

    # -- fitting ---------------------------------------------------------------------------
    @classmethod
    def fit(cls, llm_samples: Sequence[LlmSample], ssm_samples: Sequence[SsmSample] = (), *,
            model_name: str = "unknown", device: str = "cpu", dtype: str = "float32",
            num_stages: int = 1, num_threads: int | None = None,
            llm_weights: Sequence[float] | None = None) -> "LatencyModel":
        """``llm_weights``: one per LLM sample (e.g. recent live steps over the start-up profile).
        T_llm is fitted without a knee and with each ``KNEE_CANDIDATES`` K that has
        ``KNEE_MIN_SIDE`` samples on either side; the best K is kept when it beats no knee by
        ``KNEE_MIN_GAIN`` (module docstring)."""
        if not llm_samples:
            raise ValueError("need at least one target-forward sample to fit T_llm")
        knee, llm = fit_llm(llm_samples, llm_weights)
        ssm: dict[str, LinearFit] = {}
        for name in sorted({s.drafter for s in ssm_samples}):
            rows = [s for s in ssm_samples if s.drafter == name]
            ssm[name] = LinearFit.fit([(1.0, s.num_requests, s.num_draft_tokens) for s in rows],
                                      [s.seconds for s in rows])
        return cls(llm, ssm, model_name, device, dtype, num_stages, num_threads, knee,
                   tuple(llm_samples), tuple(ssm_samples))

    @classmethod
    def default(cls) -> "LatencyModel":
        """FOR UNIT TESTS ONLY: T_llm fitted to SmolLM2-135M figures measured on a 2-core CPU
        (fp32, 256-token context: 1 token ≈ 57-62 ms, 16 requests × 1 token ≈ 186 ms), one
        drafter ``ngram`` at 0.2 ms + 0.05 ms/request + 0.01 ms/token (n-gram lookups are that
        cheap, but these three are not measured). Servers call
        ``engine.profile.load_or_profile`` instead."""
        design_rows = [((256,), (k,), ms) for k, ms in ((1, 62), (4, 92), (8, 117), (16, 132), (64, 236))]
        design_rows += [((256,) * b, (1,) * b, ms) for b, ms in ((1, 57), (4, 106), (16, 186))]
        llm = [LlmSample(tuple(l), tuple(n), ms / 1e3) for l, n, ms in design_rows]
        ssm = [SsmSample("ngram", b, g, (0.2 + 0.05 * b + 0.01 * g) / 1e3)
               for b in (1, 2, 4, 8) for g in (b, 4 * b, 8 * b)]
        return cls.fit(llm, ssm, model_name="design-section-8", device="cpu", dtype="float32")

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model_name, "device": self.device, "dtype": self.dtype,
            "num_stages": self.num_stages, "num_threads": self.num_threads,
            "knee_tokens": self.knee_tokens,
            "llm": self.llm.to_dict(LLM_TERMS),
            "ssm": {name: fit.to_dict(SSM_TERMS) for name, fit in self.ssm.items()},
            "samples": {
                "llm": [{"context_lens": list(s.context_lens), "num_new_tokens": list(s.num_new_tokens),
                         "seconds": s.seconds} for s in self.llm_samples],
                "ssm": [{"drafter": s.drafter, "num_requests": s.num_requests,
                         "num_draft_tokens": s.num_draft_tokens, "seconds": s.seconds}
                        for s in self.ssm_samples],
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "LatencyModel":
        """Parse ``to_json`` output; ValueError (one line, names the bad field) otherwise."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, TypeError) as exc:
            raise ValueError(f"latency profile is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> "LatencyModel":
        if not isinstance(data, dict):
            raise ValueError("latency profile must be a JSON object")
        version = data.get("schema_version")
        if version not in (1, SCHEMA_VERSION) or isinstance(version, bool):
            raise ValueError(f"latency profile schema_version is {version!r}, this build reads "
                             f"1 and {SCHEMA_VERSION}; re-run `cosine-ray profile`")
        if version == 1:  # no knee yet: the same linear model, c_knee = 0
            llm_v1 = data.get("llm")
            if isinstance(llm_v1, dict) and isinstance(llm_v1.get("coefs"), dict) and "c_knee" not in llm_v1["coefs"]:
                data = {**data, "knee_tokens": 0, "llm": {**llm_v1, "coefs": {**llm_v1["coefs"], "c_knee": 0.0}}}
        knee = data.get("knee_tokens")
        if not isinstance(knee, int) or isinstance(knee, bool) or knee < 0:
            raise ValueError("latency profile field 'knee_tokens' must be an integer >= 0")
        for key in ("model", "device", "dtype"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"latency profile field {key!r} must be a string")
        if not isinstance(data.get("num_stages"), int) or data["num_stages"] < 1:
            raise ValueError("latency profile field 'num_stages' must be an integer >= 1")
        threads = data.get("num_threads")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ValueError("latency profile field 'num_threads' must be null or an integer >= 1")
        llm = LinearFit.from_dict(data.get("llm"), LLM_TERMS, "llm")
        ssm_data = data.get("ssm", {})
        if not isinstance(ssm_data, dict):
            raise ValueError("latency profile field 'ssm' must be an object of drafter fits")
        ssm = {str(k): LinearFit.from_dict(v, SSM_TERMS, f"ssm.{k}") for k, v in ssm_data.items()}
        samples = data.get("samples", {})
        if not isinstance(samples, dict):
            raise ValueError("latency profile field 'samples' must be an object")
        try:
            llm_samples = tuple(LlmSample(tuple(s["context_lens"]), tuple(s["num_new_tokens"]), float(s["seconds"]))
                                for s in samples.get("llm", []))
            ssm_samples = tuple(SsmSample(str(s["drafter"]), int(s["num_requests"]),
                                          int(s["num_draft_tokens"]), float(s["seconds"]))
                                for s in samples.get("ssm", []))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"latency profile has a malformed sample: {exc}") from None
        return cls(llm, ssm, data["model"], data["device"], data["dtype"], data["num_stages"], threads, knee,
                   llm_samples, ssm_samples)


def fit_llm(samples: Sequence[LlmSample], weights: Sequence[float] | None = None) -> tuple[int, LinearFit]:
    """(K, fit) of T_llm: no knee, or the candidate K that fits best (``LatencyModel.fit``)."""
    seconds = [s.seconds for s in samples]
    rows = [list(s.features()) for s in samples]  # the knee column (3) is 0 here, filled per K below
    best_knee, best = 0, LinearFit.fit(rows, seconds, weights)
    tokens = [row[2] for row in rows]
    ordered = sorted(tokens)
    if len(ordered) < 2 * KNEE_MIN_SIDE:
        return best_knee, best
    low, high = ordered[KNEE_MIN_SIDE - 1], ordered[-KNEE_MIN_SIDE]  # K in [low, high): enough on each side
    threshold = best.rel_sse * (1.0 - KNEE_MIN_GAIN)
    for knee in KNEE_CANDIDATES:
        if not low <= knee < high:
            continue
        for row, n_tok in zip(rows, tokens):
            row[3] = float(knee_excess(n_tok, knee))
        fit = LinearFit.fit(rows, seconds, weights)
        if fit.rel_sse < threshold and fit.coefs[3] > 0:
            best_knee, best, threshold = knee, fit, fit.rel_sse
    return best_knee, best
