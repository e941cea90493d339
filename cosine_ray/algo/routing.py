"""CoSine expertise routing (the CoSine paper §4.2, eq. 1-3): which k drafters serve a request.

After each step the drafters that took part are scored (eq. 1-2) and the score is folded into
the request's routing vector and its domain's prior (and the priors of its kind: grammar,
prediction, repetition, tenant, ``algo.request_kind``); each step eq. 3 picks k drafters per
request, exploring (a larger random share) when its last step accepted fewer than τ draft
tokens. Paper notation → names here:

    x[n,i], c[n,i]  drafter n's token at draft position i, its confidence   ``drafted``, ``confidences``
    x_i, H(·)       the target's token, its input embedding (unit rows)    ``accepted``, ``unit_embeddings``
    d[n,i], m[n]    eq. 1 verification accuracy, eq. 2 routing score       ``verification_accuracy``, ``routing_score``
    M_r, τ          request r's routing vector, eq. 3's threshold           ``RoutingVector`` (on the request), ``RoutingConfig.tau``

``accepted`` includes the bonus token. Where the paper is open or contradicts itself (the
clamp, calibrated c, exploration as the mode with the larger random share, priors, the
``random`` ablation) the choices are in docs/algorithms.md ("Expertise routing"). Randomness
comes from one seeded ``random.Random`` per ``ExpertiseRouting``, consumed in request order.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Collection, Literal, Mapping, Sequence

import torch

RouteMode = Literal["explore", "exploit", "random"]
KIND_PRIORS_KEPT = 4096
"""Kind priors kept (``ExpertiseRouting``), the least recently started kind dropped first: the
tenants in a kind's key are a server's API keys, but a bound keeps a stray one from growing it."""


# ---- eq. 1 and eq. 2: pure functions ----------------------------------------------------------

def normalise_embeddings(embeddings: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Rows L2-normalised in fp32 (``H`` of eq. 1 as unit vectors); an all-zero row stays zero."""
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be [vocab, hidden], got shape {tuple(embeddings.shape)}")
    emb = embeddings.detach().to(torch.float32)  # [vocab, hidden]
    return emb / emb.norm(dim=1, keepdim=True).clamp_min(eps)


def verification_accuracy(unit_embeddings: torch.Tensor, accepted: Sequence[int],
                          drafted: Sequence[int | None]) -> list[float]:
    """Eq. 1 for one drafter: ``d[i]`` for each of its draft positions (``len(drafted)`` values).

    ``unit_embeddings``: [vocab, hidden] with unit rows (``normalise_embeddings``).
    ``accepted``: the target's committed tokens this step, ``L_acc = len(accepted)``.
    ``drafted[i]``: the drafter's token at position i, or None where it proposed nothing.
    """
    return _verification_accuracies(unit_embeddings, accepted, [drafted])[0]


def _verification_accuracies(unit_embeddings: torch.Tensor, accepted: Sequence[int],
                             drafted_rows: Sequence[Sequence[int | None]]) -> list[list[float]]:
    """Eq. 1 for several drafters of one request with a single embedding gather."""
    if unit_embeddings.ndim != 2:
        raise ValueError(f"unit_embeddings must be [vocab, hidden], got {tuple(unit_embeddings.shape)}")
    vocab_size = unit_embeddings.shape[0]
    out = [[0.0] * len(row) for row in drafted_rows]
    slots: list[tuple[int, int]] = []  # (row, position) of each scored pair
    acc_ids: list[int] = []
    draft_ids: list[int] = []
    for r, row in enumerate(drafted_rows):
        for i, tok in enumerate(row):
            if tok is None or i >= len(accepted):
                continue
            acc, tok = int(accepted[i]), int(tok)
            if not (0 <= acc < vocab_size and 0 <= tok < vocab_size):
                raise ValueError(f"token id out of range [0, {vocab_size}): accepted {acc}, drafted {tok}")
            slots.append((r, i))
            acc_ids.append(acc)
            draft_ids.append(tok)
    if slots:
        cos = (unit_embeddings[torch.tensor(acc_ids)] * unit_embeddings[torch.tensor(draft_ids)]).sum(-1)  # [pairs]
        for (r, i), value in zip(slots, cos.clamp(0.0, 1.0).tolist()):
            out[r][i] = float(value)
    return out


def routing_score(confidences: Sequence[float | None], accuracies: Sequence[float],
                  eps: float = 1e-6) -> float:
    """Eq. 2: ``mean_i c·d / (c·d + (1-c)(1-d) + eps)`` over K = the longer input's length.

    A missing (or None) confidence counts as c = 0, a missing accuracy as d = 0; both give a
    zero term. Returns 0.0 when K = 0. Inputs must lie in [0, 1].
    """
    num_positions = max(len(confidences), len(accuracies))
    if num_positions == 0:
        return 0.0
    total = 0.0
    for i in range(num_positions):
        conf = confidences[i] if i < len(confidences) else None
        conf = 0.0 if conf is None else float(conf)
        acc = float(accuracies[i]) if i < len(accuracies) else 0.0
        if not (0.0 <= conf <= 1.0 and 0.0 <= acc <= 1.0):
            raise ValueError(f"position {i}: confidence {conf} and accuracy {acc} must be in [0, 1]")
        joint = conf * acc
        total += joint / (joint + (1.0 - conf) * (1.0 - acc) + eps)
    return total / num_positions


def drafter_scores(unit_embeddings: torch.Tensor, accepted: Sequence[int],
                   drafted_by: Mapping[str, Sequence[int | None]],
                   confidences_by: Mapping[str, Sequence[float | None]], eps: float = 1e-6) -> dict[str, float]:
    """m[n] (eq. 2 over eq. 1) of every drafter of one request's step: the input of ``update``.

    ``drafted_by[n]``/``confidences_by[n]``: drafter n's token and confidence per draft
    position (None where it proposed nothing); a drafter missing from ``confidences_by`` has
    c = 0 everywhere.
    """
    names = list(drafted_by)
    accuracies = _verification_accuracies(unit_embeddings, accepted, [drafted_by[n] for n in names])
    return {name: routing_score(confidences_by.get(name, ()), acc, eps) for name, acc in zip(names, accuracies)}


# ---- eq. 3: the stateful routing ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class RoutingConfig:
    drafters_per_request: int = 2
    """k: drafters chosen per request when ``choose`` gets no ``k`` (the paper uses 2-3)."""
    tau: float = 1.0
    """τ of eq. 3: a request whose last step accepted fewer than τ draft tokens explores."""
    explore_random_share: float = 0.25
    """Probability that a slot is filled uniformly at random in exploration mode (a larger share
    spends too many slots on drafters known to be useless: steps accepting nothing are common
    even with the right drafter)."""
    exploit_random_share: float = 0.05
    """Probability that a slot is filled uniformly at random in exploitation mode."""
    score_ema: float = 0.5
    """Weight of a new m[n] in the request's M_r[n] (1.0 = keep only the latest)."""
    prior_ema: float = 0.1
    """Weight of a new m[n] in the per-domain and global priors."""
    initial_score: float = 0.5
    """Score of a (domain, drafter) pair never observed; priors start their EMA here."""
    load_weight: float = 0.02
    """"System status" penalty: score minus load_weight × (drafter's load / batch size)."""
    mode: str = "expertise"
    """``expertise`` (eq. 1-3) or ``random`` (routing-off ablation: k drafters uniformly)."""

    def __post_init__(self) -> None:
        if self.drafters_per_request < 0:
            raise ValueError(f"drafters_per_request={self.drafters_per_request}: use 0 or more")
        if not math.isfinite(self.tau):
            raise ValueError(f"tau={self.tau}: use a finite threshold (e.g. 1.0)")
        for name in ("explore_random_share", "exploit_random_share", "initial_score"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value}: use a value in [0, 1]")
        for name in ("score_ema", "prior_ema"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name}={value}: use a rate in (0, 1]")
        if self.load_weight < 0:
            raise ValueError(f"load_weight={self.load_weight}: use 0 or more")
        if self.mode not in ("expertise", "random"):
            raise ValueError(f"mode={self.mode!r}: use 'expertise' or 'random'")


@dataclass(frozen=True, slots=True)
class RouteChoice:
    drafters: tuple[str, ...]
    """Chosen drafters, in the order the slots were filled."""
    mode: RouteMode
    """``explore``/``exploit`` (eq. 3) or ``random`` (routing off)."""
    num_random: int = 0
    """How many of the slots were filled by the random operator."""


@dataclass(slots=True)
class RoutingVector:
    """One request's M_r (drafter → score) and what eq. 3 needs of it; the caller keeps it
    (the engine on its ``Request``), so a finished request leaves nothing behind here."""

    request_id: str
    domain: str
    scores: dict[str, float]
    """M_r of the drafters scored so far; a drafter not in it scores its prior."""
    last_accepted_len: int | None = None
    kinds: tuple[str, ...] = ()
    """Its kind's prior keys, the most specific first (``RequestKind.prior_keys``): its steps
    teach those priors too, and a drafter it has not scored yet starts from the first of them
    that knows the drafter, else from the domain's."""


class ExpertiseRouting:
    """Per-domain priors and eq. 3's choice over the requests' routing vectors; see module doc."""

    def __init__(self, drafter_names: Sequence[str], config: RoutingConfig = RoutingConfig(), *,
                 seed: int | None = 0) -> None:
        self.config = config
        self._rng = random.Random(seed)
        self._drafters: list[str] = []
        self._domain_priors: dict[str, dict[str, float]] = {}
        self._kind_priors: dict[str, dict[str, float]] = {}
        self._global_prior: dict[str, float] = {}
        for name in drafter_names:
            self.add_drafter(name)

    # ---- pool -------------------------------------------------------------------------------
    @property
    def drafters(self) -> tuple[str, ...]:
        return tuple(self._drafters)

    def add_drafter(self, name: str) -> None:
        """Join the pool (last in tie order); live requests score it at its prior until they
        observe it."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"drafter name must be a non-empty string, got {name!r}")
        if name in self._drafters:
            raise ValueError(f"drafter {name!r} is already in the pool")
        self._drafters.append(name)

    def remove_drafter(self, name: str) -> None:
        """Leave the pool; it is never chosen again. Its learned priors are kept."""
        if name not in self._drafters:
            raise KeyError(f"drafter {name!r} is not in the pool {self._drafters}")
        self._drafters.remove(name)

    # ---- request lifecycle -------------------------------------------------------------------
    def start(self, request_id: str, domain: str, kinds: Sequence[str] = ()) -> RoutingVector:
        """A new request's routing vector: M_r starts from its kind's prior where one has
        learned, else its domain's (``kinds``: its kind's prior keys, the most specific first)."""
        kinds = tuple(kinds)
        for key in kinds:  # recently started kinds are kept longest
            self._kind_priors[key] = self._kind_priors.pop(key, {})
        while len(self._kind_priors) > KIND_PRIORS_KEPT:
            del self._kind_priors[next(iter(self._kind_priors))]
        vector = RoutingVector(request_id, domain, {}, kinds=kinds)
        vector.scores = {name: self._prior_score(vector, name) for name in self._drafters}
        return vector

    def update(self, vector: RoutingVector, scores: Mapping[str, float], accepted_len: int | None) -> None:
        """Fold this step's m[n] (eq. 2) into M_r and the priors; remember L_acc for eq. 3.

        ``scores``: m[n] of the drafters that drafted this step (others keep their M_r).
        ``accepted_len``: draft tokens accepted this step, bonus not counted; None when no draft
        was verified this step (the scheduler gave it γ = 0): eq. 3's mode stays as it was.
        """
        if accepted_len is not None and accepted_len < 0:
            raise ValueError(f"accepted_len={accepted_len}: must be 0 or more")
        cfg = self.config
        domain = RoutingVector("", vector.domain, {})
        kind_priors = [self._kind_priors[k] for k in vector.kinds if k in self._kind_priors]  # unless dropped
        for name, value in scores.items():
            value = float(value)
            if not 0.0 <= value <= 1.0:  # also rejects NaN
                raise ValueError(f"score of {name!r} is {value}; routing scores lie in [0, 1]")
            if name not in self._drafters:
                continue  # removed from the pool meanwhile
            old_score = self._score(vector, name)
            vector.scores[name] = old_score + cfg.score_ema * (value - old_score)
            start = self._prior_score(domain, name)  # a kind's EMA starts from its domain's, not from scratch
            for prior in kind_priors:
                old = prior.get(name, start)
                prior[name] = old + cfg.prior_ema * (value - old)
            for prior in (self._domain_priors.setdefault(vector.domain, {}), self._global_prior):
                old = prior.get(name, cfg.initial_score)
                prior[name] = old + cfg.prior_ema * (value - old)
        if accepted_len is not None:
            vector.last_accepted_len = int(accepted_len)

    # ---- eq. 3 ---------------------------------------------------------------------------------
    def choose(self, vectors: Sequence[RoutingVector], *, k: int | None = None,
               loads: Mapping[str, float] | None = None,
               available: Collection[str] | None = None) -> dict[str, RouteChoice]:
        """Drafters for every request of the batch (one call per step), by request id.

        ``k``: drafters per request (default ``config.drafters_per_request``), capped by the
        number available. ``loads``: external load per drafter (e.g. queued requests).
        ``available``: drafters that may be chosen (default: the whole pool); names not in the
        pool are ignored, and dead or slow drafters left out are never chosen.
        """
        k = self.config.drafters_per_request if k is None else int(k)
        if k < 0:
            raise ValueError(f"k={k}: use 0 or more drafters per request")
        allowed = set(self._drafters) if available is None else set(available)
        candidates = [name for name in self._drafters if name in allowed]  # pool order
        load = {name: float((loads or {}).get(name, 0.0)) for name in candidates}
        batch_size = max(len(vectors), 1)
        out: dict[str, RouteChoice] = {}
        for vector in vectors:
            request_id = vector.request_id
            if self.config.mode == "random":
                picked = tuple(self._rng.sample(candidates, min(k, len(candidates))))
                out[request_id] = RouteChoice(picked, "random", len(picked))
                continue
            mode = self.mode_of(vector)
            share = self.config.explore_random_share if mode == "explore" else self.config.exploit_random_share
            remaining = list(candidates)
            picked_list: list[str] = []
            num_random = 0
            for _ in range(min(k, len(candidates))):
                if self._rng.random() < share:
                    name = remaining[self._rng.randrange(len(remaining))]
                    num_random += 1
                else:  # max() keeps the first of equal values: pool order breaks ties
                    name = max(remaining, key=lambda n: self._score(vector, n)
                               - self.config.load_weight * load[n] / batch_size)
                remaining.remove(name)
                picked_list.append(name)
                load[name] += 1.0
            out[request_id] = RouteChoice(tuple(picked_list), mode, num_random)
        return out

    def mode_of(self, vector: RoutingVector) -> RouteMode:
        """Eq. 3's mode for the request's next step."""
        if self.config.mode == "random":
            return "random"
        last = vector.last_accepted_len
        return "explore" if last is not None and last < self.config.tau else "exploit"

    # ---- inspection ------------------------------------------------------------------------------
    def scores(self, vector: RoutingVector) -> dict[str, float]:
        """M_r (drafter → score) over the pool, for the request."""
        return {name: self._score(vector, name) for name in self._drafters}

    def prior(self, domain: str, kinds: Sequence[str] = ()) -> dict[str, float]:
        """The score a new request of ``domain`` (and of the kind with these prior keys) would
        start with, per drafter in the pool."""
        vector = RoutingVector("", domain, {}, kinds=tuple(kinds))
        return {name: self._prior_score(vector, name) for name in self._drafters}

    # ---- internals -------------------------------------------------------------------------------
    def _score(self, vector: RoutingVector, name: str) -> float:
        score = vector.scores.get(name)
        if score is None:  # joined the pool after the request started: its prior, from now on
            score = vector.scores[name] = self._prior_score(vector, name)
        return score

    def _prior_score(self, vector: RoutingVector, name: str) -> float:
        """The most specific prior that has observed ``name``: the request's kinds', its
        domain's, the global one, else the initial score."""
        for key in vector.kinds:
            kind_prior = self._kind_priors.get(key, {})
            if name in kind_prior:
                return kind_prior[name]
        domain_prior = self._domain_priors.get(vector.domain, {})
        if name in domain_prior:
            return domain_prior[name]
        return self._global_prior.get(name, self.config.initial_score)
