"""The drafting ceiling: a drafter set's measured turns replayed step by step against the
target's own greedy outputs, so what it *could* commit a step is counted without timing noise.

A step starts from the turn's prompt and the output committed so far (its last token is the
root); the chosen drafters ``propose``, and the step commits the longest proposed path that
equals the output, plus the bonus token. A *route* says which domain experts a turn asks:
``all``, ``own``, ``wrong``, ``random1``, ``random2``, ``own+random1`` (docs/benchmarks.md).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from cosine_ray.engine.drafters.base import DraftInput, Drafter, FinishedText
from cosine_ray.engine.worker.features import FeatureRecord

if TYPE_CHECKING:
    from cosine_ray.algo.scheduling.latency_model import LatencyModel
    from cosine_ray.models.checkpoint import Checkpoint

EXPERT_KINDS = ("suffix", "retrieval", "distilled")
ROUTES = ("all", "own", "wrong", "random1", "random2", "own+random1")


@dataclass(frozen=True)
class DecodedTurn:
    """A measured turn: its domain, prompt and the target's greedy output."""

    domain: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]


@dataclass
class Replay:
    """One policy's replay of the measured turns."""

    steps: int = 0
    tokens: int = 0
    nodes: int = 0
    oracle_nodes: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    """Predicted verify time of every step with all its nodes."""
    oracle_seconds: float = 0.0
    """Predicted verify time with only the accepted nodes."""
    plain_seconds: float = 0.0
    """Predicted time of plain decoding, one step per token."""
    domains: dict[str, list[int]] = field(default_factory=dict)
    """Domain → [steps, tokens] of its turns."""

    def figures(self) -> dict[str, Any]:
        per_step = 1 / self.steps if self.steps else 0.0
        out = {"steps": self.steps, "tokens": self.tokens, "tokens_per_step": self.tokens * per_step,
               "nodes_per_step": self.nodes * per_step, "oracle_nodes_per_step": self.oracle_nodes * per_step,
               "draft_ms_per_step": 1e3 * self.draft_seconds * per_step,
               "tokens_per_step_by_domain": {d: tokens / steps for d, (steps, tokens) in sorted(self.domains.items())
                                             if steps}}
        if self.plain_seconds:
            out["projected_speedup"] = self.plain_seconds / (self.verify_seconds + self.draft_seconds)
            out["oracle_speedup"] = self.plain_seconds / (self.oracle_seconds + self.draft_seconds)
        return out


def expert_domain(name: str) -> str | None:
    kind, _, source = name.partition(":")
    return source if kind in EXPERT_KINDS and source and not source.endswith(".parquet") else None


def choose(names: Sequence[str], route: str, domain: str, rng: random.Random) -> list[str]:
    """The drafters a step of a turn of ``domain`` asks under ``route``."""
    experts = [n for n in names if expert_domain(n) is not None]
    always = [n for n in names if expert_domain(n) is None]
    own = [n for n in experts if expert_domain(n) == domain]
    others = [n for n in experts if expert_domain(n) != domain]
    if route == "all":
        return list(names)
    if route == "own":
        return always + own
    if route == "wrong":
        return always + rng.sample(others, min(1, len(others)))
    if route in ("random1", "random2"):
        return always + rng.sample(experts, min(int(route[-1]), len(experts)))
    if route == "own+random1":
        return always + own + rng.sample(others, min(1, len(others)))
    raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")


def replay(warm: Sequence[DecodedTurn], measured: Sequence[DecodedTurn], drafters: Mapping[str, Drafter], route: str, *,
           budget: int, tree_budget: int = 0, seed: int = 0, latency: LatencyModel | None = None,
           features: Any = None) -> Replay:
    """Replay ``measured`` turn by turn with ``drafters`` (name → Drafter) after learning ``warm``.

    A step starts with the turn's prompt and the output committed so far (its last token is the
    step's root); it commits the longest proposed path that matches the output, plus the bonus
    token. ``tree_budget`` > 0 keeps only that many nodes of the union, the most confident
    first (cumulative confidence along the path, as the drafters reported it): the cap the
    engine's ``num_speculative_tokens`` puts on a request's tree. ``latency`` (an
    ``algo.scheduling.latency_model.LatencyModel``) prices the steps when given. ``features``: (a
    ``FeatureStore`` a feature head reads, the target's features [T, H] of each measured turn's
    prompt + output): each step hands the head the features of the positions committed since."""
    rng = random.Random(seed)
    names = list(drafters)
    out = Replay()

    def learn(turn: DecodedTurn, request_id: str) -> None:
        text = FinishedText(request_id, turn.domain, turn.prompt + turn.output, len(turn.prompt))
        for d in drafters.values():
            if hasattr(d, "learn"):
                d.learn([text])

    for i, turn in enumerate(warm):
        learn(turn, f"warm-{i}")
    for i, turn in enumerate(measured):
        request_id = f"turn-{i}"
        y = turn.output
        pos = 1  # the first output token comes from the prefill, as in the engine
        fed = 0  # positions whose features the store has had
        if latency is not None:
            # plain decoding's k-th step has the prompt and k - 1 output tokens cached
            out.plain_seconds += sum(latency.predict_llm([len(turn.prompt) + k - 1], [1]) for k in range(1, len(y)))
        while pos < len(y):
            context = turn.prompt + y[:pos]
            truth = y[pos:]
            value: dict[tuple[int, ...], float] = {}  # node (its path) → best cumulative confidence
            if features is not None:  # what the last stage would have returned: up to the root, exclusive
                store, per_turn = features
                end = len(context) - 1
                store.record(request_id, FeatureRecord(tuple(range(fed, end)), tuple(context[fed:end]), None,
                                                       per_turn[i][fed:end].float()))
                fed = end
            for name in choose(names, route, turn.domain, rng):
                start = time.thread_time()
                proposal = drafters[name].propose([DraftInput(request_id, context, budget)])[0]
                out.draft_seconds += time.thread_time() - start
                for path, confidences in zip(proposal.paths, proposal.confidences):
                    cumulative = 1.0
                    for k in range(1, len(path) + 1):
                        cumulative *= confidences[k - 1]
                        node = tuple(path[:k])
                        value[node] = max(value.get(node, 0.0), cumulative)
            trie = set(value)
            if tree_budget and len(trie) > tree_budget:
                # the most confident nodes. Confidences are at most 1, so no node's value exceeds its
                # parent's, and with ties going to the shorter path the kept nodes stay a tree.
                ranked = sorted(trie, key=lambda n: (-value[n], len(n)))
                trie = set(ranked[:tree_budget])
            best = 0
            while best < len(truth) and truth[:best + 1] in trie:
                best += 1
            best = min(best, len(truth) - 1)  # the last token is a bonus, never a draft
            out.steps += 1
            out.tokens += best + 1
            counts = out.domains.setdefault(turn.domain, [0, 0])
            counts[0] += 1
            counts[1] += best + 1
            out.nodes += len(trie)
            out.oracle_nodes += best
            if latency is not None:
                cached = len(context) - 1  # everything before the root
                out.verify_seconds += latency.predict_llm([cached], [1 + len(trie)])
                out.oracle_seconds += latency.predict_llm([cached], [1 + best])
            pos += best + 1
        for d in drafters.values():
            d.release(request_id)
        learn(turn, request_id)
    return out


def parse_policies(text: str) -> list[tuple[str, str]]:
    from cosine_ray.engine.config import parse_drafters
    policies = []
    for part in (p.strip() for p in text.split(";") if p.strip()):
        drafters, sep, route = part.rpartition("/")
        if not sep or route not in ROUTES:
            raise ValueError(f"a policy is DRAFTERS/ROUTE with ROUTE one of {', '.join(ROUTES)}, got {part!r}")
        parse_drafters(drafters)  # raises ValueError naming the accepted forms
        policies.append((drafters, route))
    if not policies:
        raise ValueError("--policies is empty")
    return policies


def build_drafters(text: str, checkpoint: Checkpoint, config: Any, features: Any = None) -> dict[str, Drafter]:
    """Name → drafter; ``features`` (a ``FeatureStore``) for a feature head."""
    from cosine_ray.engine.build import build_drafter
    from cosine_ray.engine.config import parse_drafters
    specs = parse_drafters(text)
    state = checkpoint.load_state_dict() if any(s.kind == "head" for s in specs) else {}
    return {s.name: build_drafter(s, target=checkpoint, target_state=state, target_tokenizer=None, config=config,
                                  features=features) for s in specs}


def turn_features(checkpoint: Checkpoint, turns: Sequence[DecodedTurn]) -> list[Any]:
    """The target's features (final-norm hidden states, fp16) [T, H] of each turn's prompt + output."""
    from cosine_ray.distill.teacher import load_hf_target, teacher_forward
    model = load_hf_target(checkpoint.path)
    return [teacher_forward(model, [t.prompt + t.output], 1, True)[0][2] for t in turns]


def decode_turns(engine: Any, items: Sequence[Any], tokenizer: Any, max_tokens: int) -> list[DecodedTurn]:
    """Every turn of every conversation (``loadgen.workload.WorkItem``), decoded greedily by
    ``engine`` (one with no drafters), 8 conversations at a time."""
    import asyncio

    from cosine_ray.bench.conversations import run_conversations
    from cosine_ray.engine.request import SamplingParams

    convs = asyncio.run(run_conversations(engine, [item.turns for item in items], SamplingParams(max_tokens=max_tokens),
                                          8, tokenizer))
    return [DecodedTurn(item.domain, turn.prompt_ids, tuple(turn.token_ids))
            for item, conv in zip(items, convs) for turn in conv]
