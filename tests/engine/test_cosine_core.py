"""CoSine's own step: expertise routing, confidence fusion, LP scheduling with adaptive γ, the
overlap of drafting and verification across lanes, and the ablation switches — all lossless.

Fakes only (tests/support/fakes.py): a lookup-table target and drafters whose skill is known,
so what routing, fusion and the scheduler should do can be stated exactly."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import pytest

from cosine_ray.algo.guard import SpeculationGuard
from cosine_ray.algo.scheduling.latency_model import LatencyModel
from cosine_ray.engine.drafters.base import DraftProposal
from cosine_ray.engine.request import SamplingParams
from cosine_ray.engine.core import EngineCore
from cosine_ray.engine.owners.economics import REFIT_EVERY
from cosine_ray.engine.owners.scheduler import PROBE_EVERY

from support.factories import Clock, engine_config
from support.fakes import VOCAB, AdversarialDrafter, FakeDrafter, OracleDrafter, TableTarget, drain  # noqa: E402

DOMAINS = ("code", "math", "chat", "instruction")


class MarkerClassifier:
    """Stands in for the embedding classifier: the prompt's first token names its domain."""

    def classify(self, token_ids):
        return DOMAINS[token_ids[0] % len(DOMAINS)], 1.0


class ExpertDrafter(FakeDrafter):
    """Right (the target's greedy token) on its own domain, wrong (the target's second choice)
    elsewhere — with the same confidence either way, so only routing can tell them apart."""

    def __init__(self, domain: str, target: TableTarget, confidence: float = 0.9) -> None:
        super().__init__(f"retrieval:{domain}", target)
        self.domain = domain
        self.confidence = confidence

    def draft(self, item):
        context = list(item.context_token_ids)
        mine = DOMAINS[context[0] % len(DOMAINS)] == self.domain
        path = []
        for _ in range(item.max_draft_tokens):
            ranked = self.target.logits(context + path).argsort(descending=True).tolist()
            path.append(ranked[0] if mine else ranked[1])
        return DraftProposal(item.request_id, [path], [[self.confidence] * len(path)])


class ParityDrafter(FakeDrafter):
    """Right with confidence 0.9 when the context length has parity ``parity``, else wrong with
    confidence 0.2: two of them are each right at every other position."""

    def __init__(self, name: str, target: TableTarget, parity: int) -> None:
        super().__init__(name, target)
        self.parity = parity

    def draft(self, item):
        context = list(item.context_token_ids)
        path, confs = [], []
        for _ in range(item.max_draft_tokens):
            ranked = self.target.logits(context + path).argsort(descending=True).tolist()
            right = len(context + path) % 2 == self.parity
            path.append(ranked[0] if right else ranked[1])
            confs.append(0.9 if right else 0.2)
        return DraftProposal(item.request_id, [path], [confs])


def make(target, drafters, *, clock=time.monotonic, **config) -> EngineCore:
    # budgets stay γ_max (no long drafts): the oracle drafter would otherwise finish these
    # requests in a handful of steps, too few for the drain, probes and refits measured here
    config.setdefault("long_draft_tokens", 0)
    return EngineCore(engine_config(**config), target, list(drafters), vocab_size=VOCAB,
                  domain_classifier=MarkerClassifier(), seed=0, clock=clock)


class TimedTarget(TableTarget):
    """A TableTarget whose every scoring call takes ``step_s`` on ``clock``, the engine's clock
    (nothing else moves it: the step times the engine measures are exactly the target's)."""

    def __init__(self, clock: Clock, step_s: float) -> None:
        super().__init__()
        self.clock, self.step_s = clock, step_s

    async def score(self, items):
        self.clock.now += self.step_s
        return await super().score(items)


def prompts_for(domain_index: int, n: int, start: int = 0) -> list[list[int]]:
    """Prompts whose first token marks the domain; the rest varies."""
    return [[domain_index + 4 * ((i + start) % 3), (7 * (i + start)) % VOCAB, (11 * (i + start) + 3) % VOCAB]
            for i in range(n)]


def run(core: EngineCore, prompts, max_tokens=16, prefix="r"):
    for i, p in enumerate(prompts):
        core.add_request(f"{prefix}{i}", p, SamplingParams(max_tokens=max_tokens))
    return asyncio.run(drain(core))


def test_expertise_routing_sends_each_domain_to_its_expert_and_stays_lossless():
    target = TableTarget()
    experts = [ExpertDrafter(d, target) for d in DOMAINS]
    core = make(target, experts, drafters_per_request=1, max_drafters_per_request=1)
    warm = [p for d in range(4) for p in prompts_for(d, 6)]
    run(core, warm, prefix="warm")
    measured = {d: prompts_for(i, 6, start=10) for i, d in enumerate(DOMAINS)}
    all_prompts = [p for d in DOMAINS for p in measured[d]]
    tokens, finals = run(core, all_prompts)
    assert [tokens[f"r{i}"] for i in range(len(all_prompts))] == [target.greedy(p, 16) for p in all_prompts]
    k = 0
    for domain in DOMAINS:
        routed, steps = 0, 0
        for _ in measured[domain]:
            stats = finals[f"r{k}"].stats
            routed += stats.routed_to.get(f"retrieval:{domain}", 0)
            steps += stats.num_routed_steps
            k += 1
        assert steps > 0 and routed / steps >= 0.7, (domain, routed, steps)
    for domain in DOMAINS:  # the learned per-domain prior ranks the domain's expert first
        prior = core.routing.expertise.prior(domain)
        assert max(prior, key=prior.get) == f"retrieval:{domain}", prior


def test_random_routing_ablation_spreads_requests_evenly():
    target = TableTarget()
    core = make(target, [ExpertDrafter(d, target) for d in DOMAINS], routing="random",
                  drafters_per_request=1, max_drafters_per_request=1)
    tokens, finals = run(core, prompts_for(0, 12))
    shares = defaultdict(int)
    for f in finals.values():
        for name, n in f.stats.routed_to.items():
            shares[name] += n
    total = sum(shares.values())
    assert total > 40 and shares["retrieval:code"] / total < 0.5  # uniform over 4 drafters: ~0.25


def test_fusion_combines_drafters_that_are_right_at_different_positions():
    target = TableTarget()
    common = dict(drafters_per_request=2, max_drafters_per_request=2, adaptive=False, num_speculative_tokens=4)
    results = {}
    for fusion in ("confidence", "single"):
        core = make(target, [ParityDrafter("even", target, 0), ParityDrafter("odd", target, 1)],
                      fusion=fusion, **common)
        prompts = prompts_for(0, 6)
        tokens, finals = run(core, prompts)
        assert [tokens[f"r{i}"] for i in range(6)] == [target.greedy(p, 16) for p in prompts]
        steps = sum(f.stats.num_verify_steps for f in finals.values())
        accepted = sum(f.stats.num_accepted_tokens for f in finals.values())
        results[fusion] = (accepted / steps, core)
    fused_len, core = results["confidence"]
    assert fused_len > 3.0  # the fused trunk is the target's path: nearly all 4 drafts accepted
    assert results["single"][0] < 1.5  # either drafter alone is wrong every other token
    picks = {d: core.metrics.get("cosine_ray:fusion_picks", drafter=d) for d in ("even", "odd")}
    accepted_picks = {d: core.metrics.get("cosine_ray:fusion_picks_accepted", drafter=d) for d in ("even", "odd")}
    assert min(picks.values()) > 0 and min(accepted_picks.values()) > 0  # both contribute


def test_speculation_turns_itself_off_when_drafts_never_pay():
    target = TableTarget()
    core = make(target, [AdversarialDrafter("liar", target, confidence=0.95)], drafters_per_request=1)
    tokens, finals = run(core, prompts_for(0, 3), max_tokens=120)
    assert [tokens[f"r{i}"] for i in range(3)] == [target.greedy(p, 120) for p in prompts_for(0, 3)]
    assert core.metrics.get("cosine_ray:speculation_enabled") == 0.0
    assert core.speculator.calibration("code")("liar", 0.95) < 0.15  # learned: confident but wrong
    fixed = make(target, [AdversarialDrafter("liar", target, confidence=0.95)], drafters_per_request=1,
                 adaptive=False, num_speculative_tokens=4)
    _, fixed_finals = run(fixed, prompts_for(0, 3), max_tokens=120)
    drafted = sum(f.stats.num_draft_tokens for f in finals.values())
    drafted_fixed = sum(f.stats.num_draft_tokens for f in fixed_finals.values())
    assert drafted < 0.3 * drafted_fixed, (drafted, drafted_fixed)


def test_speculation_stays_on_when_drafts_are_right():
    target = TableTarget()
    core = make(target, [OracleDrafter("oracle", target)], drafters_per_request=1)
    tokens, finals = run(core, prompts_for(0, 3), max_tokens=60)
    steps = sum(f.stats.num_verify_steps for f in finals.values())
    accepted = sum(f.stats.num_accepted_tokens for f in finals.values())
    assert accepted / steps > 3.0
    assert core.metrics.get("cosine_ray:speculation_enabled") == 1.0


def test_the_price_is_the_lps_lambda_over_the_measured_goodput_times_the_guards_level():
    """Tokens are worth the time per token at the operating point, not at plain decoding: once
    the guard has measured a goodput G > 1 for its level, TreeSelection prices at λ_LP·κ / G."""
    clock = Clock()
    target = TimedTarget(clock, 0.005)
    core = make(target, [OracleDrafter("oracle", target)], clock=clock, drafters_per_request=1)
    scheduler, guard = core.scheduler, core.scheduler.guard
    seen, decide, schedule = [], scheduler.policy.decide, scheduler.schedule
    lp_lams = []

    def spy_decide(*args, **kwargs):
        out = decide(*args, **kwargs)
        lp_lams.append(out.lam)
        return out

    def spy_schedule(lane):
        batch = schedule(lane)
        g = guard.operating_goodput(len(batch.requests))  # the step's batch-size bucket's (unchanged until it is verified)
        if batch.price is not None:
            seen.append((batch.price.lam, lp_lams[-1], guard.levels[batch.level], g))
        return batch

    scheduler.policy.decide, scheduler.schedule = spy_decide, spy_schedule
    tokens, _ = run(core, prompts_for(0, 3), max_tokens=300)  # enough steps at 3 rows for the bucket to measure
    assert [tokens[f"r{i}"] for i in range(3)] == [target.greedy(p, 300) for p in prompts_for(0, 3)]
    assert all(lam == pytest.approx(lp * kappa / g) for lam, lp, kappa, g in seen)
    # λ_LP as it is until the level has enough steps; then G of an oracle
    assert seen[0][3] == 1.0 and max(g for *_, g in seen) > 1.5


@pytest.mark.parametrize("config", [
    {}, {"routing": "random"}, {"fusion": "single"}, {"fusion": "union"}, {"scheduler": "fcfs"},
    {"adaptive": False}, {"adaptive": False, "scheduler": "fcfs", "fusion": "single", "routing": "random"},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "full")
def test_every_ablation_is_lossless(config):
    target = TableTarget()
    drafters = [OracleDrafter("oracle", target, max_len=2), AdversarialDrafter("adv", target, confidence=0.8),
                ParityDrafter("even", target, 0)]
    core = make(target, drafters, num_speculative_tokens=4, **config)
    prompts = [p for d in range(4) for p in prompts_for(d, 2)]
    tokens, finals = run(core, prompts, max_tokens=24)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == [target.greedy(p, 24) for p in prompts]
    assert all(f.finish_reason == "length" for f in finals.values())


async def turns(n: int) -> None:
    """Let the event loop run ``n`` times: a call that takes time, measured in what else can
    happen meanwhile rather than in seconds, so the interleavings do not depend on the
    machine's speed."""
    for _ in range(n):
        await asyncio.sleep(0)


class ExclusiveSlowTarget(TableTarget):
    """Verifies one batch at a time (like a pipeline stage), taking ``num_turns`` turns of the
    event loop per call; ``verifying`` is true while a call is in progress, ``num_started``
    counts calls begun."""

    def __init__(self, num_turns: int) -> None:
        super().__init__()
        self.num_turns = num_turns
        self._lock: asyncio.Lock | None = None
        self.verifying = False
        self.num_started = 0

    async def score(self, items):
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            self.verifying = True
            self.num_started += 1
            try:
                await turns(self.num_turns)
                return await super().score(items)
            finally:
                self.verifying = False


class SlowOracle(OracleDrafter):
    """Takes ``num_turns`` turns of the event loop per call; counts the calls during which the
    target verified (a verification was in progress, or began, while the call ran)."""

    def __init__(self, name, target, num_turns):
        super().__init__(name, target, max_len=1)
        self.num_turns = num_turns
        self.num_overlapping = 0

    async def propose(self, inputs):
        verifying, started = self.target.verifying, self.target.num_started
        await turns(self.num_turns)
        self.num_overlapping += verifying or self.target.verifying or self.target.num_started > started
        return await super().propose(inputs)


@pytest.mark.parametrize("num_lanes", [2, 1])
def test_drafting_of_one_lane_overlaps_verification_of_the_other(num_lanes):
    """Two lanes: while lane 0's batch is verified, lane 1 drafts (and vice versa): drafter
    calls begin while the (exclusive) target is verifying. One lane never overlaps: it drafts,
    then verifies (the control that shows the count can be 0)."""
    from cosine_ray.engine.loop import EngineLoop

    target = ExclusiveSlowTarget(20)
    drafter = SlowOracle("slow", target, 20)
    core = EngineCore(engine_config(num_lanes=num_lanes, fusion="single", adaptive=False, scheduler="fcfs",
                                   num_speculative_tokens=1, drafters_per_request=1),
                        target, [drafter], vocab_size=VOCAB)
    loop = EngineLoop(core)

    async def go():
        try:
            return await asyncio.gather(*(loop.generate_all(p, SamplingParams(max_tokens=20))
                                          for p in prompts_for(0, 2)))
        finally:
            await loop.shutdown()

    outs = asyncio.run(go())
    assert [o.new_token_ids for o in outs] == [target.greedy(p, 20) for p in prompts_for(0, 2)]
    calls = drafter.num_calls
    if num_lanes == 1:
        assert drafter.num_overlapping == 0 and calls > 5
    else:  # nearly every call of one lane falls inside the other lane's verification
        assert drafter.num_overlapping >= calls // 2 > 2, (drafter.num_overlapping, calls)


@pytest.mark.parametrize("mode,runs_async,overlaps", [("on", False, True), ("auto", True, True),
                                                       ("auto", False, False), ("off", True, False)])
def test_learning_from_a_step_overlaps_the_next_forward(mode, runs_async, overlaps):
    """``overlap_learning``: what step n teaches is absorbed while step n+1's forward is in
    flight (on, or auto with a target that runs asynchronously); off, never. Either way the
    text is the target's, every step is learned from by the time the loop is idle, and each
    response's own counts are complete (the same as without overlap, where learning cannot
    change the steps: one drafter, fixed γ, first come)."""
    from cosine_ray.engine.loop import EngineLoop

    def run_once(overlap_mode, target_async):
        target = ExclusiveSlowTarget(5)
        target.runs_async = target_async
        core = EngineCore(engine_config(fusion="single", adaptive=False, scheduler="fcfs", num_speculative_tokens=3,
                                       drafters_per_request=1, overlap_learning=overlap_mode),
                            target, [ParityDrafter("even", target, 0)],
                            vocab_size=VOCAB, domain_classifier=MarkerClassifier(), seed=0)
        during_forward, absorbed = [], []
        absorb = core.learner.absorb

        async def spying_absorb(pending):
            during_forward.append(target.verifying)
            absorbed.append(pending.stats.batch_size)
            return await absorb(pending)

        core.learner.absorb = spying_absorb
        loop = EngineLoop(core)
        prompts = [p for d in range(4) for p in prompts_for(d, 2)]

        async def go():
            try:
                return await asyncio.gather(*(loop.generate_all(p, SamplingParams(max_tokens=16))
                                              for p in prompts))
            finally:
                await loop.shutdown()

        outs = asyncio.run(go())
        assert [o.new_token_ids for o in outs] == [target.greedy(p, 16) for p in prompts]
        return core, outs, during_forward, absorbed

    core, outs, during_forward, absorbed = run_once(mode, runs_async)
    assert core.overlap_learning is overlaps
    assert not core._unlearned
    assert len(absorbed) > 5
    if overlaps:  # all but the last step before each idle spell are learned during a forward
        assert sum(during_forward) >= len(during_forward) - 2, during_forward
    else:
        assert not any(during_forward)
    _, plain, _, plain_absorbed = run_once("off", False)
    assert [n for n in absorbed if n] == [n for n in plain_absorbed if n]  # every step with trees, once
    for o, p in zip(outs, plain):
        assert (o.stats.num_verify_steps, o.stats.num_draft_tokens, o.stats.num_accepted_tokens,
                o.stats.drafted_by, o.stats.accepted_by) == (p.stats.num_verify_steps, p.stats.num_draft_tokens,
                                                             p.stats.num_accepted_tokens, p.stats.drafted_by,
                                                             p.stats.accepted_by)
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0


def test_a_lane_with_in_process_drafters_drafts_and_launches_its_forward_without_letting_another_lane_in():
    """Two lanes over an asynchronous target: the other lane's step may run while this one's
    forward is in flight, never between its schedule and its forward's launch (in-process
    drafting awaits no task: otherwise the lanes' host work interleaves, they draft together
    and verify together, and the GPU idles)."""
    from cosine_ray.engine.drafters.lookup.ngram import NgramDrafter
    from cosine_ray.engine.drafters.worker import DrafterWorker
    from cosine_ray.engine.worker.clients import LocalDrafterClient
    from cosine_ray.engine.loop import EngineLoop

    target = ExclusiveSlowTarget(1)
    drafters = [LocalDrafterClient(DrafterWorker(NgramDrafter(name=f"ngram{i}"))) for i in range(4)]
    core = EngineCore(engine_config(num_lanes=2, num_speculative_tokens=3, overlap_learning="on"), target, drafters,
                        vocab_size=VOCAB, domain_classifier=MarkerClassifier(), seed=0)
    events = []
    schedule, score = core.scheduler.schedule, target.score

    def spying_schedule(lane):
        batch = schedule(lane)
        if batch.requests:
            events.append(("schedule", lane))
        return batch

    async def spying_score(items):
        events.append(("score", None))
        return await score(items)

    core.scheduler.schedule, target.score = spying_schedule, spying_score
    loop = EngineLoop(core)
    prompts = [p for d in range(4) for p in prompts_for(d, 2)]

    async def go():
        try:
            return await asyncio.gather(*(loop.generate_all(p, SamplingParams(max_tokens=40)) for p in prompts))
        finally:
            await loop.shutdown()

    outs = asyncio.run(go())
    assert [o.new_token_ids for o in outs] == [target.greedy(p, 40) for p in prompts]
    lanes_seen = {lane for kind, lane in events if kind == "schedule"}
    assert lanes_seen == {0, 1}
    followed = [events[i + 1][0] == "score" for i, (kind, _) in enumerate(events[:-1]) if kind == "schedule"]
    assert len(followed) > 10 and all(followed), events


class AbortingOracle(OracleDrafter):
    """Aborts request ``victim`` from inside its first fusion round and records every request
    id it is asked about afterwards."""

    def __init__(self, target, victim: str) -> None:
        super().__init__("oracle", target)
        self.victim = victim
        self.core = None
        self.asked_after_abort: list[str] = []
        self.aborted = False

    async def propose(self, inputs):
        if self.aborted:
            self.asked_after_abort += [i.request_id for i in inputs]
        elif any(i.request_id == self.victim for i in inputs) and len(inputs[0].context_token_ids) > 5:
            self.aborted = self.core.abort(self.victim)
        return await super().propose(inputs)


def test_a_request_aborted_while_drafting_gets_no_further_drafter_calls():
    """Later fusion rounds would recreate the drafter state its release just freed."""
    target = TableTarget()
    drafter = AbortingOracle(target, "r0")
    core = make(target, [drafter], adaptive=False, num_speculative_tokens=4, shared_drafters=())
    drafter.core = core
    tokens, finals = run(core, prompts_for(0, 2), max_tokens=12)
    assert drafter.aborted and "r0" not in drafter.asked_after_abort and "r1" in drafter.asked_after_abort
    assert "r0" not in finals and finals["r1"].finish_reason == "length"
    assert tokens["r1"] == target.greedy(prompts_for(0, 2)[1], 12)


@pytest.mark.parametrize("drain_pricing", [True, False])
def test_while_the_pool_drains_only_the_request_finishing_last_drafts_at_the_full_price(drain_pricing):
    """Three requests start together; the short one finishes first and nothing replaces it:
    from then on a token of a request is worth (S_i / S_max)^p, 1 for the request with the
    most steps left; before that (and with drain pricing off)
    every request is worth 1. Output stays the target's greedy text."""
    target = TableTarget()
    core = make(target, [OracleDrafter("oracle", target)], drafters_per_request=1, drain_pricing=drain_pricing)
    scheduler = core.scheduler
    seen, schedule = [], scheduler.schedule

    def spy_schedule(lane):
        batch = schedule(lane)
        lefts = {r.request_id: r.params.max_tokens - len(r.output_token_ids) for r in batch.decodes}
        seen.append((len(core.pool.running), dict(batch.weights), lefts))
        return batch

    scheduler.schedule = spy_schedule
    prompts = prompts_for(0, 3)
    for i, (p, n) in enumerate(zip(prompts, (6, 60, 30))):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=n))
    tokens, _ = asyncio.run(drain(core))
    assert [tokens[f"r{i}"] for i in range(3)] == [target.greedy(p, n) for p, n in zip(prompts, (6, 60, 30))]
    assert all(not weights for running, weights, _ in seen if running == 3)
    drained = [(weights, lefts) for running, weights, lefts in seen if running < 3 and len(lefts) == 2]
    assert drained
    if not drain_pricing:
        assert all(not weights for weights, _ in drained)
        return
    for weights, lefts in drained:
        assert set(weights) == set(lefts) and all(0.0 <= w <= 1.0 for w in weights.values())
        assert sorted(weights.values())[-1] == 1.0  # the one with the most steps left


def drafted_per_step(core, drafter):
    """Spy on the core's scheduler and ``drafter``: per scheduled step, the batch, each
    decoding request's (context length, tokens left) then, and whom the drafter was asked for."""
    asked, seen, schedule, draft = [], [], core.scheduler.schedule, drafter.draft
    drafter.draft = lambda item: asked.append(item.request_id) or draft(item)

    def spy_schedule(lane):
        before = len(asked)
        batch = schedule(lane)
        now = {r.request_id: (r.num_tokens, r.params.max_tokens - len(r.output_token_ids)) for r in batch.decodes}
        seen.append((batch, before, now))
        return batch

    core.scheduler.schedule = spy_schedule

    def steps():
        for k, (batch, before, now) in enumerate(seen):
            after = seen[k + 1][1] if k + 1 < len(seen) else len(asked)
            yield batch, now, set(asked[before:after])
    return steps


def test_a_request_the_drain_rules_out_is_drafted_only_to_probe():
    """While the pool drains, a request far ahead of the last one is worth next to nothing:
    no draft node of it could pay, so it is not drafted at all (its budget is 0 before the
    drafters are asked) except on its probe steps. Output stays the target's greedy text."""
    target = TableTarget()
    oracle = OracleDrafter("oracle", target, max_len=2)  # slow enough to reach probe steps
    core = make(target, [oracle], drafters_per_request=1)
    steps = drafted_per_step(core, oracle)
    prompts, lengths = prompts_for(0, 3), (6, 200, 30)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=n))
    tokens, _ = asyncio.run(drain(core))
    assert [tokens[f"r{i}"] for i in range(3)] == [target.greedy(p, n) for p, n in zip(prompts, lengths)]
    skipped = probes = 0
    for batch, now, asked in steps():
        for rid, (context_len, left) in now.items():
            weight = batch.weights.get(rid, 1.0)
            if left <= 1:
                continue
            if batch.price.node_can_pay(context_len, weight):
                assert batch.budgets[rid] > 0 and rid in asked
            else:
                probe = batch.num_steps[rid] % PROBE_EVERY == 0
                assert (batch.budgets[rid] > 0) == probe and (rid in asked) == probe
                skipped += weight < 1.0 and not probe
                probes += weight < 1.0 and probe
    assert skipped > 0 and probes > 0


def test_the_price_tally_counts_what_the_scheduler_and_selection_decided():
    """``BatchScheduler.tally`` and the speculator's node counts, which ``cosine-ray bench``
    reports to tell which part of the price cut the trees: the decoding request-steps of priced
    steps, those in a drain, those held at γ = 0 before drafting (a budget the step would have
    had), and the nodes drafted and verified (Σ γ_i, the ``scheduler_gamma`` histogram's sum)."""
    target = TableTarget()
    oracle = OracleDrafter("oracle", target, max_len=2)
    core = make(target, [oracle], drafters_per_request=1)
    steps = drafted_per_step(core, oracle)
    prompts, lengths = prompts_for(0, 3), (6, 200, 30)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=n))
    asyncio.run(drain(core))
    priced = [(batch, now) for batch, now, _ in steps() if batch.price is not None]
    tally = core.scheduler.tally
    assert tally.request_steps == sum(len(batch.budgets) for batch, _ in priced) > 0
    assert tally.drained == sum(rid in batch.weights for batch, _ in priced for rid in batch.budgets) > 0
    assert tally.held_back == sum(batch.budgets[rid] == 0 and left >= 2
                                  for batch, now in priced for rid, (_, left) in now.items()) > 0
    speculator, gamma = core.speculator, core.metrics.get("cosine_ray:scheduler_gamma")
    assert speculator.verified_nodes == gamma.sum
    assert 0 < speculator.verified_nodes <= speculator.drafted_nodes
    from types import SimpleNamespace

    from cosine_ray.cli.bench import _price_figures
    figures = _price_figures(SimpleNamespace(core=core), (0, 0, 0, 0, 0), 2)
    assert figures["request_steps"] == tally.request_steps
    assert figures["drained_share"] == pytest.approx(tally.drained / tally.request_steps)
    assert figures["held_back_share"] == pytest.approx(tally.held_back / tally.request_steps)
    assert figures["verified_nodes_per_request_step"] == pytest.approx(speculator.verified_nodes / tally.request_steps)


def test_where_the_price_rules_every_node_out_only_probe_steps_draft(monkeypatch):
    """No drain: where even a certain node could not pay (here: ``node_can_pay`` says so),
    the request is drafted only on its probe steps, so calibration keeps measuring."""
    from cosine_ray.algo.tree_selection import TreePrice

    monkeypatch.setattr(TreePrice, "node_can_pay", lambda self, context_len, weight=1.0: False)
    target = TableTarget()
    oracle = OracleDrafter("oracle", target, max_len=1)
    core = make(target, [oracle], drafters_per_request=1)
    steps = drafted_per_step(core, oracle)
    prompt = prompts_for(0, 1)[0]
    core.add_request("r0", prompt, SamplingParams(max_tokens=40))
    tokens, _ = asyncio.run(drain(core))
    assert tokens["r0"] == target.greedy(prompt, 40)
    probes = 0
    for batch, now, asked in steps():
        if "r0" in now and now["r0"][1] > 1:
            probe = batch.num_steps["r0"] % PROBE_EVERY == 0
            assert (batch.budgets["r0"] > 0) == probe and ("r0" in asked) == probe
            probes += probe
    assert probes >= 2


def test_an_admission_ends_the_drain():
    target = TableTarget()
    core = make(target, [OracleDrafter("oracle", target)], drafters_per_request=1)
    scheduler, schedule, seen = core.scheduler, core.scheduler.schedule, []
    scheduler.schedule = lambda lane: seen.append(schedule(lane)) or seen[-1]
    prompts = prompts_for(0, 4)
    core.add_request("short", prompts[0], SamplingParams(max_tokens=4))
    core.add_request("short2", prompts[1], SamplingParams(max_tokens=4))
    core.add_request("long", prompts[2], SamplingParams(max_tokens=80))

    async def go():
        while not seen or not seen[-1].weights or len(core.pool.running) > 1:
            await core.step()
        # 1 of the 3 that ran last is left; one more makes 2, fewer than 3, yet no drain:
        # the admission is the new reference
        core.add_request("new", prompts[3], SamplingParams(max_tokens=8))
        await core.step()
        return await drain(core)

    asyncio.run(go())
    ran = [b for b in seen if b.requests]
    k = next(i for i, b in enumerate(ran) if "new" in {r.request_id for r in b.requests})
    assert ran[k - 1].weights == {"long": 1.0} and not ran[k].weights
    assert any(b.weights for b in ran[k + 1:])  # "new" finished first: the long one drains again


def test_every_part_of_a_step_is_timed_and_bench_reads_it_per_step():
    """``cosine_ray:step_phase_seconds{phase}`` splits each step that ran a batch into its
    parts (the order of ``EngineCore.step``); the parts add up to no more than the run, the
    verify phase holds the target's call, and bench's per-step split reads the same counters."""
    from types import SimpleNamespace

    from cosine_ray.cli.bench import _phase_seconds, _step_ms
    from cosine_ray.metrics.names import STEP_PHASES

    class SlowTarget(TableTarget):
        async def score(self, items):
            time.sleep(0.002)  # a forward that takes time: it must land in "verify"
            return await super().score(items)

    target = SlowTarget()
    core = make(target, [OracleDrafter("oracle", target)], drafters_per_request=1)
    engine = SimpleNamespace(core=core)
    before = _phase_seconds(engine)
    ran, schedule = [], core.scheduler.schedule
    core.scheduler.schedule = lambda lane: ran.append(schedule(lane)) or ran[-1]
    start = time.perf_counter()
    run(core, prompts_for(0, 3), max_tokens=24)
    wall = time.perf_counter() - start
    spent = {p: core.metrics.total("cosine_ray:step_phase_seconds", phase=p) for p in STEP_PHASES}
    steps = sum(1 for b in ran if b.requests)
    assert core.metrics.total("cosine_ray:engine_steps") == steps > 0
    assert all(s > 0 for s in spent.values()), spent
    assert spent["verify"] >= 0.002 * steps and sum(spent.values()) <= wall
    split = _step_ms(engine, before)
    assert split["steps"] == steps
    assert all(split[p] == pytest.approx(1e3 * spent[p] / steps) for p in STEP_PHASES)


def test_the_tree_bias_learns_every_verified_tree_and_scales_the_gains_and_the_expected_metric():
    """``TreeBias`` (``algo.calibration``): each verified tree adds its expected (the sum of its
    nodes' cumulative confidences) and its accepted draft tokens to its domain's sums; the
    gains the scheduler prices and the expected-accepted metric are scaled by the factor.
    Output stays the target's greedy text."""
    class HalfSureOracle(OracleDrafter):  # always right, says 0.5: calibration starts low
        def draft(self, item):
            proposal = super().draft(item)
            return DraftProposal(item.request_id, proposal.paths, [[0.5] * len(p) for p in proposal.paths])

    target = TableTarget()
    core = make(target, [HalfSureOracle("oracle", target, max_len=3)], drafters_per_request=1)
    core.speculator.bias.decay = 1.0
    seen = []
    record = core.learner.record

    def spy(batch, drafts, verified):
        domains = {r.request_id: r.domain for r in batch.requests}
        for rid, tree in drafts.trees.items():
            domain = domains[rid]
            f = core.speculator.bias.factor(domain)
            raw = tree.selected.node_acceptance()
            expected = [min(1.0, f * p) for p in raw]
            assert list(tree.full_gains[:len(raw) + 1]) == pytest.approx(
                [0.0] + [sum(sorted(expected, reverse=True)[:g]) for g in range(1, len(raw) + 1)])
            seen.append((domain, sum(raw)))
        pending = record(batch, drafts, verified)
        domains = {r.request_id: r.domain for r in batch.requests}
        scaled = sum(sum(core.speculator.node_acceptance(domains[rid], t.selected)) for rid, t in drafts.trees.items())
        assert pending.stats.expected_accepted == pytest.approx(scaled)
        return pending

    core.learner.record = spy
    prompts = prompts_for(0, 2) + prompts_for(1, 2)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=24))
    tokens, finals = asyncio.run(drain(core))
    assert [tokens[f"r{i}"] for i in range(4)] == [target.greedy(p, 24) for p in prompts]
    sums = core.speculator.bias._sums
    accepted = sum(f.stats.num_accepted_tokens for f in finals.values())
    assert accepted > 0 and sum(s[1] for s in sums.values()) == accepted
    drafted = [(d, e) for d, e in seen if e > 0]
    assert sum(s[0] for s in sums.values()) == pytest.approx(sum(e for _, e in drafted))
    assert set(sums) == {d for d, _ in drafted} and len(sums) == 2
    assert all(core.speculator.bias.factor(d) > 1.0 for d in sums)  # so the scaling above was tested


def test_the_guards_goodput_follows_the_refitted_cost_model():
    """The guard's step times are in plain-decode steps of the cost model of their time. An
    engine without a profile starts from the default model (a 2-core CPU's 57+ ms steps); once
    the model is refitted to this target (5 ms here, like a GPU), the times stored before are
    re-expressed in the new unit, so the goodput is what the final model says about the same
    steps, not the about 3× that the default's early steps made it here (without the rescale: 16.0
    against 4.8; on an H200 the 8-15 bucket's G read 30.9 and the guard fell to κ = 0)."""

    clock = Clock()
    target = TimedTarget(clock, 0.005)
    core = make(target, [OracleDrafter("oracle", target)], clock=clock, drafters_per_request=1)
    guard = SpeculationGuard(decay=1.0, explore_share=0.0, young_explore_share=0.0, seed=0)
    core.scheduler.guard = core.learner.guard = guard  # one level, every step weighs the same
    observed, observe_level = [], core.learner.levels.observe

    def spy(batch, verified, latency, step_s):
        if batch.level is not None and not any(o.is_prefill for o in verified.outcomes):
            tokens = sum(len(o.new_token_ids) for o in verified.outcomes) / len(verified.outcomes)
            observed.append((list(verified.context_lens), step_s, tokens))
        return observe_level(batch, verified, latency, step_s)

    core.learner.levels.observe = spy
    run(core, prompts_for(0, 3), max_tokens=120)
    assert len(observed) >= REFIT_EVERY
    final = core.learner.costs.latency
    assert final.c0 < 0.02 < LatencyModel.default().c0  # refitted to the 5 ms target
    reference = sum(y for *_, y in observed) / sum(s / final.predict_llm(c, [1] * len(c)) for c, s, _ in observed)
    assert guard.goodput(guard.start, 3) == pytest.approx(reference, rel=0.25)


def _select_one(cut: float, *, twin: bool) -> int:
    """γ the priced selection gives one request whose drafted chain has cumulative calibrated
    confidences 0.9, 0.54, 0.32, 0.19, 0.11, at a price under which every node pays."""
    from cosine_ray.algo.calibration import ConfidenceCalibrator
    from cosine_ray.algo.fusion import FusedPath
    from cosine_ray.algo.tree_selection import TreePrice
    from cosine_ray.engine.types import DraftingStats
    from cosine_ray.engine.request import Request
    from cosine_ray.engine.types import StepBatch
    from cosine_ray.engine.owners.speculator import PricedSelection, Speculator
    from cosine_ray.engine.types import Drafted

    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=64))
    r.output_token_ids = [4]
    tokens, confs = (5, 6, 7, 8, 9), (0.9, 0.6, 0.6, 0.6, 0.6)
    batch = StepBatch([r], {"a": 5}, TreePrice(lam=1.0, batch_size=1, c_tok=1e-6, c_attn=0.0), {"a": 1},
                      twins={"a": tokens} if twin else {})
    spec = Speculator(None, PricedSelection(cut), ConfidenceCalibrator(), total_gamma_max=64)
    drafted = {} if twin else {"a": Drafted([FusedPath(tokens, confs, ("ngram",) * 5)])}
    if twin:  # a twin's chain: calibrated as the "twin" drafter, whatever calibration says of it
        spec.calibration = lambda domain: (lambda drafter, c, depth=1, is_trunk=True: 0.5)
    return spec.select(batch, drafted, DraftingStats()).trees["a"].tree.num_draft_tokens


def test_the_price_picks_only_among_nodes_above_the_floor_and_a_twin_has_no_floor():
    assert _select_one(0.02, twin=False) == 5  # every node pays at this price
    assert _select_one(0.25, twin=False) == 3  # 0.19 and 0.11 are under the floor
    assert _select_one(0.6, twin=False) == 1
    assert _select_one(0.25, twin=True) == 5  # 0.5, 0.25, 0.125, ...: verified whole
    assert make(TableTarget(), []).speculator.selection.cut == 0.02  # the LP's floor


def test_nodes_are_priced_at_the_slope_their_batch_size_measures_once_it_has_one():
    target = TableTarget()
    core = make(target, [OracleDrafter("oracle", target)], drafters_per_request=1)
    scheduler, schedule, seen = core.scheduler, core.scheduler.schedule, []

    def spy(lane):
        batch = schedule(lane)
        if batch.price is not None and not batch.prefills:
            seen.append((batch.price.c_tok, batch.price.c_knee, scheduler.costs.token_slope(len(batch.requests)),
                         scheduler.costs.latency.c_tok))
        return batch

    scheduler.schedule = spy
    tokens, _ = run(core, prompts_for(0, 3), max_tokens=200)
    assert [tokens[f"r{i}"] for i in range(3)] == [target.greedy(p, 200) for p in prompts_for(0, 3)]
    measured = [(c_tok, slope) for c_tok, knee, slope, _ in seen if slope is not None]
    assert measured and all(c_tok == slope for c_tok, slope in measured)
    assert all(c_tok == fit for c_tok, _, slope, fit in seen if slope is None)  # until then: the fit's
