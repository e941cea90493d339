"""Admission: which generation requests this ingress replica takes now, shared fairly between keys.

A request of n choices claims n *slots* (``max_pending_requests`` of them per replica) and each
choice's ``prompt + max_tokens`` tokens (``n × (prompt + max_tokens)`` for one prompt; a batch of
prompts claims every prompt's choices), each choice's until its engine stream is closed. ``admit``
decides at once (a refusal carries ``Retry-After``), in this order:

1. the key's own limits (``ApiKey``): past ``max_concurrent`` requests or ``max_tokens_in_flight``
   tokens → 429 ``rate_limit_exceeded``; a request that alone claims more tokens than that → 400;
2. a free slot for every choice → admitted (capacity nobody else asks for is anyone's);
3. the server full: a key within its *fair share* (``max_pending_requests`` / keys holding slots,
   itself included), or holding nothing while others hold slots, is admitted all the same, up to
   ``OVERCOMMIT`` × ``max_pending_requests`` slots in all: whatever one key holds, another gets in;
4. otherwise a key beyond its fair share gets 429 (it is the one to slow down), and a key within
   it (past the overcommit, or the only key) 503 ``server_overloaded``.

Fairness is between keys, per replica; the engine then shares its running slots between keys
the same way (``engine.owners.pool``; docs/api.md, Tenants). ``admit`` never awaits, so the
counts are exact under any concurrency; the per-key totals also feed the metrics
(``metrics_totals``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from cosine_ray.serve.errors import OVERLOADED_CODE, EngineUnavailable, InvalidRequest, RateLimited
from cosine_ray.serve.guards.tenants import ApiKey

OVERCOMMIT = 2
"""A full server still admits keys within their fair share, up to this many times
``max_pending_requests`` slots in all (the bound on the overshoot fairness may cause)."""
RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class TenantLoad:
    """What one key holds in this replica now, and its cumulative totals."""

    num_requests: int = 0
    num_slots: int = 0
    num_tokens: int = 0
    requests_admitted: int = 0
    requests_done: int = 0
    tokens_admitted: int = 0
    tokens_released: int = 0
    rate_limited: Counter = field(default_factory=Counter)
    """429s by reason: ``concurrency``, ``tokens``, ``fair_share``."""


class Admission:
    """Bounded, fair admission of generation requests (the module docstring has the rules)."""

    def __init__(self, max_pending: int | None) -> None:
        if max_pending is not None and max_pending < 1:
            raise ValueError("max_pending_requests must be >= 1")
        self.max_pending = max_pending
        self.num_pending = 0
        """Slots held now, all keys together."""
        self.num_rejected = 0
        """Requests refused with 503 (the server full)."""
        self.loads: dict[str, TenantLoad] = {}

    def _load(self, name: str) -> TenantLoad:
        load = self.loads.get(name)
        if load is None:
            load = self.loads[name] = TenantLoad()
        return load

    def num_active(self, name: str) -> int:
        """Keys holding slots now, counting ``name`` whether it holds any or not."""
        return sum(1 for n, load in self.loads.items() if load.num_slots and n != name) + 1

    def fair_share(self, name: str) -> int:
        """Slots a key may hold while the server is full: capacity / keys holding slots (it too)."""
        return max(1, (self.max_pending or 0) // self.num_active(name))

    def admit(self, tenant: ApiKey, choice_tokens: Sequence[int], *,
              param: str = "max_tokens") -> list[Callable[[], None]]:
        """``choice_tokens``: the tokens each choice claims (its prompt + max_tokens). One release
        callback per choice (each idempotent), or the refusal as an OpenAIError."""
        load = self._load(tenant.name)
        num_choices = len(choice_tokens)
        cost = sum(choice_tokens)
        self._check_limits(tenant, load, cost, param)
        total = self.num_pending + num_choices
        if self.max_pending is not None and total > self.max_pending:
            share = self.fair_share(tenant.name)
            is_shared = self.num_active(tenant.name) > 1  # other keys hold slots too
            within = load.num_slots + num_choices <= share or (is_shared and load.num_slots == 0)
            if not within and is_shared:
                self._limit(load, "fair_share")
                raise RateLimited(f"the server is busy and API key '{tenant.name}' holds {load.num_slots} of "
                                  f"its {self.max_pending} slots, its fair share while other keys wait is "
                                  f"{share}; retry later", retry_after=RETRY_AFTER_S)
            if not within or total > OVERCOMMIT * self.max_pending:
                self.num_rejected += 1
                raise EngineUnavailable(f"the server is at capacity ({self.max_pending} requests in flight); "
                                        "retry later", retry_after=RETRY_AFTER_S, code=OVERLOADED_CODE)
        return self._take(load, choice_tokens)

    def _check_limits(self, tenant: ApiKey, load: TenantLoad, cost: int, param: str) -> None:
        if tenant.max_concurrent is not None and load.num_requests >= tenant.max_concurrent:
            self._limit(load, "concurrency")
            raise RateLimited(f"API key '{tenant.name}' has {load.num_requests} requests in flight, its limit "
                              f"(max_concurrent={tenant.max_concurrent}); retry when one finishes",
                              retry_after=RETRY_AFTER_S)
        limit = tenant.max_tokens_in_flight
        if limit is not None and cost > limit:
            raise InvalidRequest(f"this request claims {cost} tokens (its choices' prompt + {param}), more than API key "
                                 f"'{tenant.name}' may have in flight ({limit}); lower {param} or n", param=param)
        if limit is not None and load.num_tokens + cost > limit:
            self._limit(load, "tokens")
            raise RateLimited(f"API key '{tenant.name}' has {load.num_tokens} tokens in flight and this request "
                              f"claims {cost} more, over its limit (max_tokens_in_flight={limit}); retry when "
                              "one finishes", retry_after=RETRY_AFTER_S)

    @staticmethod
    def _limit(load: TenantLoad, reason: str) -> None:
        load.rate_limited[reason] += 1

    def _take(self, load: TenantLoad, choice_tokens: Sequence[int]) -> list[Callable[[], None]]:
        num_choices, cost = len(choice_tokens), sum(choice_tokens)
        self.num_pending += num_choices
        load.num_slots += num_choices
        load.num_requests += 1
        load.requests_admitted += 1
        load.num_tokens += cost
        load.tokens_admitted += cost
        num_left = num_choices

        def release_factory(tokens: int) -> Callable[[], None]:
            is_released = False

            def release() -> None:
                nonlocal is_released, num_left
                if is_released:
                    return
                is_released = True
                num_left -= 1
                self.num_pending -= 1
                load.num_slots -= 1
                load.num_tokens -= tokens
                load.tokens_released += tokens
                if num_left == 0:
                    load.num_requests -= 1
                    load.requests_done += 1
            return release

        return [release_factory(tokens) for tokens in choice_tokens]

    def metrics_totals(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], Any]:
        """Per-key series for the engine's registry (``MetricsRegistry.add_http_totals``):
        counters as cumulative totals, gauges as cumulative (up, down) pairs."""
        out: dict[tuple[str, tuple[tuple[str, str], ...]], Any] = {}
        for name, load in self.loads.items():
            key = (("key", name),)
            out[("cosine_ray:tenant_tokens_in_flight", key)] = (load.tokens_admitted, load.tokens_released)
            out[("cosine_ray:tenant_requests_in_flight", key)] = (load.requests_admitted, load.requests_done)
            for reason, n in load.rate_limited.items():
                out[("cosine_ray:tenant_rate_limited", (("key", name), ("reason", reason)))] = n
        return out
