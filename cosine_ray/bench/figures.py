"""What the requests' stats say about speculation: mean accepted length, acceptance rate and
where routing sent each domain's steps."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence


def mean_accepted_length(accepted: int, steps: int) -> float:
    """Tokens committed a verify step, the bonus token included (0 without a step)."""
    return (accepted + steps) / steps if steps else 0.0


def spec_figures(stats: Iterable[Any]) -> dict[str, float]:
    """Mean accepted length, acceptance rate of the draft tokens and verify steps, over the
    ``RequestStats`` given (None entries are skipped)."""
    stats = [s for s in stats if s is not None]
    steps = sum(s.num_verify_steps for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    drafted = sum(s.num_draft_tokens for s in stats)
    return {"mean_accepted_length": mean_accepted_length(accepted, steps),
            "acceptance_rate": accepted / drafted if drafted else 0.0, "verify_steps": steps}


def routing_shares(records: Iterable[tuple[str, Mapping[str, int], int]],
                   domains: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per domain of ``domains`` (in that order) that had routed steps: the share of them each
    drafter got, to 3 decimals. ``records``: per request, (its domain, steps routed to each
    drafter, routed steps)."""
    routed: dict[str, dict[str, int]] = {}
    total: dict[str, int] = {}
    for domain, to, steps in records:
        total[domain] = total.get(domain, 0) + steps
        counts = routed.setdefault(domain, {})
        for name, n in to.items():
            counts[name] = counts.get(name, 0) + n
    return {d: {k: round(v / total[d], 3) for k, v in sorted(routed[d].items())} for d in domains if total.get(d)}
